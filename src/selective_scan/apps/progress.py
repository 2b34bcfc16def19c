"""A one-line progress bar for training loops, with no dependency beyond the standard library."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``step/total [#####.....] name value ... it/s``, redrawn in place with ``\\r`` on a
    terminal. Elsewhere (a log file, a captured stream) a carriage return would pile every
    redraw onto one line, so it writes one plain line per tenth of the run instead.

    Reading a metric may synchronize the device: ask ``due(step)`` before computing them.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24,
                 interval_s: float = 0.25):  # fmt: skip
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.interval_s = interval_s
        self.in_place = self.stream.isatty()
        self.last_draw = time.perf_counter()
        self.last_tenth = self.last_step = 0

    def due(self, step: int) -> bool:
        """Whether update(step, ...) would draw: on the last step, and otherwise every
        interval_s seconds on a terminal or at each new tenth of the run elsewhere."""
        if step >= self.total:
            return True
        if self.in_place:
            return time.perf_counter() - self.last_draw >= self.interval_s
        return 10 * step // self.total > self.last_tenth

    def update(self, step: int, **metrics: float) -> None:
        """Draw the bar at ``step`` (1-based) with the given metrics (e.g. loss=0.31)."""
        now = time.perf_counter()
        filled = self.width * step // self.total
        # Over the steps since the last draw: the first ones include any compilation.
        rate = (step - self.last_step) / max(now - self.last_draw, 1e-9)
        shown = " ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        line = (
            f"{step:>{len(str(self.total))}}/{self.total} "
            f"[{'#' * filled}{'.' * (self.width - filled)}] {shown} {rate:.1f} it/s"
        )
        if self.in_place:
            end = "\n" if step >= self.total else ""
            self.stream.write(f"\r{line}{end}")
        else:
            self.stream.write(f"{line}\n")
        self.stream.flush()
        self.last_draw, self.last_step = now, step
        self.last_tenth = 10 * step // self.total
