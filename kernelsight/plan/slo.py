"""Service-level objectives: ``ttft_p99_ms=500,tpot_p99_ms=50`` → limits on the run's statistics, plus the
per-request thresholds of ``vllm bench serve --goodput`` (a request is good when its TTFT, TPOT and E2EL are each
within the limit named for that metric)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Slo", "SloLimit", "parse_slo", "SLO_METRICS"]

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
_GOODPUT_METRICS = ("ttft", "tpot", "e2el")          # what vllm bench serve's --goodput accepts
#: Percentiles a cached point holds for ITL (plan/point.py's STORED_PERCENTILES; slo.py stays free of imports)
ITL_PERCENTILES = (50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9)
_KEY = re.compile(r"^(ttft|tpot|itl|e2el)_(mean|median|p\d+(?:\.\d+)?)_ms$")


@dataclass(frozen=True, slots=True)
class SloLimit:
    metric: str          # ttft | tpot | itl | e2el
    stat: str            # mean | median | p99 | p90.5 ...
    limit_ms: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}_ms"

    @property
    def result_key(self) -> str:
        """The key of ``compute_bench_metrics``' result that holds this statistic (``p99_ttft_ms``)."""
        stat = self.stat
        if stat.startswith("p"):       # as metrics.percentile_key spells it: p99, p99.9 (p99.0 → p99)
            stat = f"p{float(stat[1:]):g}"
        return f"{stat}_{self.metric}_ms"

    @property
    def percentile(self) -> float | None:
        return float(self.stat[1:]) if self.stat.startswith("p") else None


@dataclass(frozen=True, slots=True)
class Slo:
    limits: tuple[SloLimit, ...]

    def percentiles(self) -> list[float]:
        """Percentiles the metrics must be computed at for these limits (plus 50/90/99 for the reports)."""
        ps = {50.0, 90.0, 99.0} | {lim.percentile for lim in self.limits if lim.percentile is not None}
        return sorted(ps)

    def goodput_ms(self) -> dict[str, float]:
        """Per-request thresholds as ``--goodput`` takes them: the tightest limit named for each metric."""
        out: dict[str, float] = {}
        for lim in self.limits:
            if lim.metric in _GOODPUT_METRICS:
                out[lim.metric] = min(out.get(lim.metric, lim.limit_ms), lim.limit_ms)
        return out

    def violations(self, stats: dict[str, Any]) -> list[dict[str, Any]]:
        """Every limit the run's statistics break: name, measured value, limit."""
        out = []
        for lim in self.limits:
            value = float(stats[lim.result_key])
            if value > lim.limit_ms:
                out.append({"slo": lim.name, "value_ms": round(value, 2), "limit_ms": lim.limit_ms})
        return out

    def text(self) -> str:
        return ",".join(f"{lim.name}={lim.limit_ms:g}" for lim in self.limits)


def parse_slo(text: str) -> Slo:
    """``ttft_p99_ms=500,tpot_p99_ms=50`` (metrics ttft, tpot, itl, e2el; statistics mean, median, pNN)."""
    limits = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        m = _KEY.match(key.strip())
        if not sep or m is None:
            raise ValueError(f"--slo takes METRIC_STAT_ms=LIMIT (metric ttft, tpot, itl or e2el; stat mean, median "
                             f"or pNN), e.g. ttft_p99_ms=500; got {item!r}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
        if not limit > 0:
            raise ValueError(f"--slo {item!r}: the limit must be > 0 ms")
        stat = m.group(2)
        if stat.startswith("p") and not 0 < float(stat[1:]) <= 100:
            raise ValueError(f"--slo {item!r}: percentile must be in (0, 100]")
        if m.group(1) == "itl" and stat.startswith("p") and float(stat[1:]) not in ITL_PERCENTILES:
            raise ValueError(f"--slo {item!r}: ITL is kept at p{', p'.join(f'{p:g}' for p in ITL_PERCENTILES)} only")
        limits.append(SloLimit(m.group(1), stat, limit))
    if not limits:
        raise ValueError("--slo names no limit")
    return Slo(tuple(limits))
