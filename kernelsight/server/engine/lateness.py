"""Release lateness: the warning a server logs when its token timings stop following the simulated GPU.

A step's tokens are due at ``wall0 + virtual_end_s / time_scale``; the engine loop releases them as soon as it can
after that. When the process does not get the CPU it needs (other jobs on its cores, a container CPU limit, VM
steal) releases go out late, and client-observed TTFT/ITL stop being the simulated GPU's. ``LatenessWatch`` keeps the
lateness of recent releases and logs a rate-limited warning when their p99 passes a threshold; the histogram of
every release is ``kernelsight:release_lateness_seconds`` in /metrics (``server/integrations/metrics.py``).
"""

from __future__ import annotations

import logging
import math
from collections import deque

log = logging.getLogger("kernelsight.server")

#: The p99 is taken over the releases of the last this many (wall) seconds ...
WINDOW_S = 10.0
#: ... at most this many of them (a 10 s window of ~5 ms steps) ...
WINDOW_MAX_RELEASES = 4096
#: ... and only once there are this many (a lone late release after an idle gap is not a trend).
MIN_RELEASES = 10
#: The window is evaluated at most this often (only when a release itself passes the threshold): under
#: starvation every release is late, and sorting the window on each would add to the load that causes it.
EVAL_INTERVAL_S = 1.0
#: At most one warning per engine this often.
WARN_INTERVAL_S = 30.0


def p99_nearest_rank(values: list[float]) -> float:
    """The nearest-rank 99th percentile (the smallest value at or above 99 % of them); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


class LatenessWatch:
    """Recent release lateness of one engine, and the warning when its p99 passes ``warn_s`` (0: never)."""

    __slots__ = ("warn_s", "engine", "_recent", "_next_eval_s", "_next_warn_s", "warnings")

    def __init__(self, warn_s: float, engine: str = "0") -> None:
        self.warn_s = warn_s
        self.engine = engine
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW_MAX_RELEASES)   # (wall time, lateness)
        self._next_eval_s = -math.inf
        self._next_warn_s = -math.inf
        self.warnings = 0                     # warnings logged (tests; the log is what users see)

    def observe(self, late_s: float, now_s: float) -> None:
        """One step release ``late_s`` wall seconds after its deadline, at ``now_s`` (perf_counter seconds)."""
        if self.warn_s <= 0:
            return
        self._recent.append((now_s, late_s))
        # cheap on the on-time path: only a release past the threshold can make the p99 pass it
        if late_s > self.warn_s and now_s >= self._next_eval_s and now_s >= self._next_warn_s:
            self._next_eval_s = now_s + EVAL_INTERVAL_S
            self._evaluate(now_s)

    def recent_p99_s(self, now_s: float) -> tuple[float, int, float]:
        """(p99, number, max) of the lateness of the releases in the window ending at ``now_s``."""
        recent = self._recent
        while recent and recent[0][0] < now_s - WINDOW_S:
            recent.popleft()
        values = [late for _, late in recent]
        return p99_nearest_rank(values), len(values), max(values, default=0.0)

    def _evaluate(self, now_s: float) -> None:
        p99, n, worst = self.recent_p99_s(now_s)
        if n < MIN_RELEASES or p99 <= self.warn_s:
            return
        self._next_warn_s = now_s + WARN_INTERVAL_S
        self.warnings += 1
        log.warning(
            "engine %s: token releases are running late: p99 %.1f ms, max %.1f ms after their deadlines over the "
            "last %d releases (%.0f s; warning threshold %.0f ms). Token timings no longer follow the simulated GPU: "
            "the likely cause is CPU starvation (other processes on these cores, a container CPU limit, VM steal). "
            "See kernelsight:release_lateness_seconds and kernelsight:virtual_clock_lag_seconds in /metrics.",
            self.engine, p99 * 1e3, worst * 1e3, n, WINDOW_S, self.warn_s * 1e3)
