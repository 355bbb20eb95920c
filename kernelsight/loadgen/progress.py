"""A tiny progress bar on stderr (no dependency): shown only on a terminal, redrawn at most 10×/s."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, label: str = "requests", *, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = max(total, 1)
        self.label = label
        self.width = width
        self.done = 0
        self.enabled = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = now - self._t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {self.label} "
                          f"{elapsed:6.1f} s {rate:7.1f}/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
