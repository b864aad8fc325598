"""The messages a test's process logs, kept for its assertions (a spawned rank returns
them: its log records do not reach the test's ``caplog``)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """A handler keeping every message at ``level`` or above in :attr:`lines`."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
