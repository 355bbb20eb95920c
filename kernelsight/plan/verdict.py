"""Deciding a point's verdict before its simulation ends, and only where it is decided beyond doubt.

While a run goes on, every request has a *lower bound* on each latency that the rest of the run cannot lower: a
request still without its first token at engine time ``now`` has TTFT > ``now - send``; one still decoding has
E2EL > ``now - send`` and TPOT ≥ ``(now - first token) / (its max tokens - 1)``; a finished request has its exact
values. A percentile over the N requests is at least the percentile of those bounds, so once more than
``N - floor((N - 1) · p / 100)`` requests are certainly over a limit, the ``p`` statistic is over it whatever the
rest of the run does (numpy's linear interpolation then reads two values over the limit). Means likewise. If a
request does not finish the point fails anyway. So the verdict "fails" is exact.

A point that fails may still be on the Pareto front (cost vs goodput), and a front point's numbers must be exact.
Goodput has bounds too: requests finished within every goodput limit are certainly good, requests over a limit
certainly bad, the rest undecided. The watch stops a run only when the verdict is "fails" *and* fewer requests can
still be good than a no-costlier point is already known to serve well (as many, when that point sorts first on a
tie: ``StopRule.hint_good``): such a point can never be on the front. The search re-runs in full any cut-short
point that the final bounds leave a chance.

ITL statistics are pooled over every token and never decided early.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelsight.plan.slo import Slo

__all__ = ["StopRule", "SloWatch", "percentile_needs"]

#: Margin on every comparison with a limit (seconds): per-request numbers are stored rounded to 1 µs, and a bound
#: this close to its limit is left undecided rather than decided by a rounding.
_MARGIN_S = 2e-6
#: Checks per engine (spread over the arrivals' span): each is a few numpy passes over the requests, ~10% of a
#: 10,000-request run's CPU at 256, ~4% at 128.
_CHECKS_PER_SPAN = 128


@dataclass(frozen=True, slots=True)
class StopRule:
    """What a point's watch judges against, sent with the task: the SLO, and how many requests the point must be
    able to serve within the goodput limits to stay a front candidate, from the points no costlier already
    simulated (search.py's hint; -1: none known, so never stop)."""

    slo: Slo
    hint_good: int = -1
    stop: bool = True          # False: watch only (the verdict's time is recorded, the run is never cut)

    def key_part(self) -> str:
        """What a cut-short entry depends on beyond the point: its facts hold for this SLO, whatever the hint."""
        return self.slo.text()


def percentile_needs(n: int, p: float) -> int:
    """Requests over a limit that put numpy's (linear) ``p``-th percentile of ``n`` values over it."""
    if n <= 0:
        return 1
    return n - math.floor((n - 1) * p / 100.0)


class SloWatch:
    """Follows a run (``loadgen.fastforward.RunWatch``) and stops it once the point provably fails and provably
    cannot be on the front (see the module doc). Indices are the workload's request order."""

    def __init__(self, rule: StopRule, send_s: Sequence[float], max_tokens: Sequence[int], ignore_eos: bool) -> None:
        self.rule = rule
        self.send = np.asarray(send_s, dtype=np.float64)
        self.max_tokens = np.asarray(max_tokens, dtype=np.int64)
        self.ignore_eos = ignore_eos
        n = self.n = len(self.send)
        self.first = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.ntok = np.zeros(n, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)
        self.failed = np.zeros(n, dtype=bool)
        self.engine = np.zeros(0, dtype=np.int64)       # indices of the engine running now
        self.running = np.zeros(n, dtype=bool)          # the same as a mask
        self.engines_started = 0
        span = float(self.send.max() - self.send.min()) if n else 0.0
        self.every_s = max(span / _CHECKS_PER_SPAN, 0.05)
        self.next_check_s = -math.inf
        # TPOT exists for requests of more than one token: with ignore_eos exactly those whose max is > 1
        self.tpot_member = self.max_tokens > 1
        self.n_tpot = int(self.tpot_member.sum()) if ignore_eos else n
        self.verdict: dict[str, Any] | None = None
        self.stop: dict[str, Any] | None = None

    # --- RunWatch ---
    def engine_start(self, indices: Sequence[int]) -> None:
        self.engine = np.fromiter(indices, dtype=np.int64)
        self.running = np.zeros(self.n, dtype=bool)
        self.running[self.engine] = True
        self.engines_started += 1
        self.next_check_s = -math.inf

    def first_token(self, index: int, time_s: float) -> None:
        self.first[index] = time_s

    def finished(self, index: int, last_token_s: float, num_tokens: int) -> None:
        self.done[index] = True
        self.ntok[index] = num_tokens
        if num_tokens == 0:
            self.failed[index] = True
        else:
            self.last[index] = last_token_s

    def engine_end(self) -> None:
        idx = self.engine
        self.failed[idx[~self.done[idx]]] = True       # the engine is idle: what did not finish never will
        self.engine = np.zeros(0, dtype=np.int64)
        self.running = np.zeros(self.n, dtype=bool)

    def check(self, now_s: float) -> bool:
        if now_s < self.next_check_s:
            return False
        self.next_check_s = now_s + self.every_s
        lb = self._bounds(now_s)
        if self.verdict is None:
            violations = self._decided_violations(lb)
            if violations:
                self.verdict = {"at_s": round(now_s, 4), "engine": self.engines_started - 1,
                                "violations": violations}
        if self.verdict is None or not self.rule.stop or self.rule.hint_good < 0:
            return False
        lo, hi = self._goodput_bounds(lb)
        if hi >= self.rule.hint_good:
            return False
        self.stop = {"at_s": round(now_s, 4), "engine": self.engines_started - 1, "good_lo": lo, "good_hi": hi,
                     "hint_good": self.rule.hint_good, "stats_lb": self._stats(lb)}
        return True

    # --- bounds ---
    def _bounds(self, now_s: float) -> dict[str, np.ndarray]:
        """Per-request lower bounds (seconds) on TTFT, TPOT, E2EL at engine time ``now_s``, and the failed ones."""
        send, first, last, done = self.send, self.first, self.last, self.done
        has_first = ~np.isnan(first)
        running = self.running
        waited = np.maximum(now_s - send, 0.0)            # 0 for requests not yet sent
        finished = done & ~self.failed
        ttft = np.where(has_first, first - send, np.where(running, waited, 0.0))
        e2el = np.where(finished, last - send, np.where(running, waited, 0.0))
        tpot = np.zeros(self.n)
        multi = finished & (self.ntok > 1)
        tpot[multi] = ((last[multi] - send[multi]) - (first[multi] - send[multi])) / (self.ntok[multi] - 1)
        if self.ignore_eos:
            # still decoding at now: its last token comes later, and it makes exactly max_tokens tokens
            dec = running & has_first & ~done & self.tpot_member
            tpot[dec] = (now_s - first[dec]) / (self.max_tokens[dec] - 1)
        return {"ttft": ttft, "tpot": tpot, "e2el": e2el, "failed": self.failed}

    def _decided_violations(self, lb: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        out = []
        if lb["failed"].any():
            out.append({"slo": "requests", "value_ms": float(lb["failed"].sum()), "limit_ms": 0.0,
                        "text": f"{int(lb['failed'].sum())} requests did not finish"})
        for lim in self.rule.slo.limits:
            if lim.metric == "itl":
                continue
            limit_s = lim.limit_ms / 1000.0
            vals = lb[lim.metric][self.tpot_member] if lim.metric == "tpot" and self.ignore_eos else lb[lim.metric]
            n = self.n_tpot if lim.metric == "tpot" else self.n
            over = vals > limit_s * (1 + 1e-9) + _MARGIN_S
            if lim.stat == "mean":
                decided = n > 0 and float(vals.sum()) / n > limit_s * (1 + 1e-9) + _MARGIN_S
            else:
                p = 50.0 if lim.stat == "median" else float(lim.stat[1:])
                decided = int(np.count_nonzero(over)) >= percentile_needs(n, p)
            if decided:     # the statistic of the bounds is a lower bound on the statistic
                value_ms = 1000.0 * (float(vals.sum()) / max(n, 1) if lim.stat == "mean" else
                                     float(np.percentile(vals, p)) if vals.size else 0.0)
                out.append({"slo": lim.name, "value_ms": round(value_ms, 2), "limit_ms": lim.limit_ms,
                            "over": int(np.count_nonzero(over)), "of": n})
        return out

    def _goodput_bounds(self, lb: dict[str, np.ndarray]) -> tuple[int, int]:
        """(requests certainly good, requests that can still be good) under the SLO's goodput limits."""
        bad = lb["failed"].copy()
        good = self.done & ~self.failed
        for metric, limit_ms in self.rule.slo.goodput_ms().items():
            limit_s = limit_ms / 1000.0
            bad |= lb[metric] > limit_s + _MARGIN_S
            good &= lb[metric] <= limit_s - _MARGIN_S     # finished: the bound is the value
        return int(good.sum()), int(self.n - bad.sum())

    def _stats(self, lb: dict[str, np.ndarray]) -> dict[str, float]:
        """Lower bounds on the reported statistics (ms): a percentile of lower bounds is one."""
        out: dict[str, float] = {}
        tp = lb["tpot"][self.tpot_member] if self.ignore_eos else lb["tpot"]
        for metric, vals in (("ttft", lb["ttft"]), ("tpot", tp), ("e2el", lb["e2el"])):
            for p in (50, 99):
                out[f"p{p}_{metric}_ms"] = round(1000.0 * float(np.percentile(vals, p)), 3) if vals.size else 0.0
        out["p99_itl_ms"] = 0.0          # pooled per token: nothing certain before the run ends
        return out
