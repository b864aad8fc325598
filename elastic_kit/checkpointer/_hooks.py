"""What a checkpointer installs into the process and the optimizer, removed once.

A checkpointer closes once: collectively at the end of training, or on one rank
alone while an exception propagates; whichever comes first removes the SIGTERM
handler and the optimizer's staging pre-hook, and the other finds nothing to do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from elastic_kit.state import TerminationFlag

__all__ = ["Hooks"]


class Hooks:
    """The SIGTERM flag, the optimizer pre-hook, and whether they were removed."""

    def __init__(self) -> None:
        #: set by SIGTERM (when installed) or by a request to stop
        self.stop = TerminationFlag()
        self._step_hook: Any = None
        self.closed = False

    def install(self, *, signals: bool, optimizer: torch.optim.Optimizer | None,
                wait_staged: Callable[..., None]) -> None:
        """Catch SIGTERM when ``signals``; run ``wait_staged`` before every step of
        ``optimizer`` (the only place the parameters a background save reads change)."""
        if signals:
            self.stop.install()
        if optimizer is not None and self._step_hook is None:
            self._step_hook = optimizer.register_step_pre_hook(wait_staged)

    def close(self) -> bool:
        """Remove the hooks; False when they were already removed (nothing to do)."""
        if self.closed:
            return False
        self.closed = True
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.stop.uninstall()
        return True
