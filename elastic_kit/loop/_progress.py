"""Progress reporting on rank 0: a line every ``log_every`` steps, tqdm on a tty.

A user who hands the loop to :class:`~elastic_kit.ElasticLoop` loses the prints of
their own loop, so progress must be visible without configuring :mod:`logging`:
:func:`~elastic_kit._console.say` goes through the ``elastic_kit`` logger when the application configured
logging (a handler anywhere up the logger tree) and to stderr otherwise.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from elastic_kit._console import say

__all__ = ["ProgressReporter", "format_eta"]

log = logging.getLogger("elastic_kit.loop")


def format_eta(seconds: float | None) -> str:
    """``1h02m03s`` style; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(max(seconds, 0))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


#: Seconds between two reads of the loss for the progress bar's postfix.
POSTFIX_EVERY_S = 0.5
#: Seconds of the window the throughput is measured over when no log line ends one.
WINDOW_S = 10.0


class ProgressReporter:
    """Samples/s, loss and ETA of the loop, printed by the main rank only.

    Args:
        enabled: False on every rank but 0.
        log_every: a log line every this many optimizer steps (0: never).
        total_samples: samples left to train on when the reporter starts (for ETA).
        progress_bar: ``None``: a tqdm bar when stderr is a terminal.
    """

    def __init__(self, *, enabled: bool, log_every: int, total_samples: int,
                 total_steps: int | None = None, progress_bar: bool | None = None) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.total_samples = max(total_samples, 0)
        self.done_samples = 0
        self.window_samples = 0
        self.window_start = time.monotonic()
        self.start = self.window_start
        self.samples_per_second = 0.0
        self._bar: Any = None
        self._postfix_at = float("-inf")  # when the bar's loss was last read
        if progress_bar is None:
            progress_bar = sys.stderr.isatty()
        if enabled and progress_bar:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
            except ImportError:  # tqdm is optional
                self._bar = None

    def eta(self) -> float | None:
        if self.samples_per_second <= 0:  # (recent: over the last window)
            return None
        return (self.total_samples - self.done_samples) / self.samples_per_second

    def update(self, *, step: int, epoch: int, samples: int, loss: Any, lr: float | None,
               world_size: int) -> None:
        """Account one optimizer step of ``samples`` real samples (all ranks).

        ``loss`` (a float or 0-dim tensor) is read only when a log line shows it,
        or for the bar at most every :data:`POSTFIX_EVERY_S` seconds.
        """
        self.done_samples += samples
        self.window_samples += samples
        now = time.monotonic()
        if now > self.window_start and self.window_samples:
            self.samples_per_second = self.window_samples / (now - self.window_start)
        logs = bool(self.log_every) and step % self.log_every == 0
        # every rank's window ends alike (``StepInfo.samples_per_second`` is recent
        # throughput on every rank, not only on the one that logs)
        window_ends = logs or (not self.log_every and now - self.window_start >= WINDOW_S)
        if self.enabled:
            self._show(step, epoch, loss, lr, world_size, now, logs)
        if window_ends:
            self.window_samples = 0
            self.window_start = now

    def _show(self, step: int, epoch: int, loss: Any, lr: float | None, world_size: int,
              now: float, logs: bool) -> None:
        if self._bar is not None:
            self._bar.update(1)
            # Reading the loss waits for the device (a CUDA sync): at most every
            # POSTFIX_EVERY_S, not every step.
            if now - self._postfix_at >= POSTFIX_EVERY_S:
                self._postfix_at = now
                self._bar.set_postfix(epoch=epoch, loss=f"{float(loss):.4f}",
                                      sps=f"{self.samples_per_second:.1f}", refresh=False)
        if logs:
            lr_txt = f" lr {lr:.4g}" if lr is not None else ""
            say(log, "step %d epoch %d rank-0 loss %.4f%s %.1f samples/s (W=%d) eta %s",
                     step, epoch, float(loss), lr_txt, self.samples_per_second, world_size,
                     format_eta(self.eta()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
