"""Progress bars on stderr, drawn by tqdm (rate, ETA, terminal width, redraw throttling); shown only on a terminal.

tqdm is an optional extra (``pip install 'kernelsight[plan]'``): without it there is no bar and nothing else
changes.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, label: str = "requests", *, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = max(total, 1)
        self.done = 0
        self._bar: Any = None
        if enabled and bool(getattr(self.stream, "isatty", lambda: False)()):
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=self.total, unit=label.split()[0], desc=label, file=self.stream,
                             dynamic_ncols=True, leave=True)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def set_total(self, total: int) -> None:
        """A total known only as work goes on (a search that prunes): the ETA follows it."""
        self.total = max(total, self.done, 1)
        if self._bar is not None and self._bar.total != self.total:
            self._bar.total = self.total
            self._bar.refresh()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
