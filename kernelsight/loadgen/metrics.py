"""Benchmark metrics with the semantics of ``vllm bench serve`` (spec §7.4, result keys §7.5).

Input is one ``RequestRecord`` per request, measured client-side (or by the simulator in
fast-forward mode); output is the numeric part of the 0.33 result JSON, in its key order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RequestRecord",
    "PERCENTILE_METRICS",
    "GOODPUT_METRICS",
    "compute_bench_metrics",
    "assemble_result",
    "detailed_fields",
    "per_request_fields",
    "percentile_key",
]

# Canonical order in which vLLM emits the per-metric statistics (independent of the order the
# user listed them in). The last two exist only in 0.33.
PERCENTILE_METRICS: tuple[str, ...] = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "client_queue_time",
    "e2el_including_client_queue",
)
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    success: bool
    prompt_len: int
    output_len: int  # tokens generated
    ttft_s: float  # 0 when failed
    itl_s: np.ndarray | list[float]  # gaps between consecutive token-bearing chunks (excludes TTFT)
    latency_s: float  # e2el: last token-bearing chunk time - start
    start_s: float = 0.0  # send time (just before the POST), relative to the benchmark start
    queue_s: float = 0.0  # client-side wait (max-concurrency semaphore), before start_s
    error: str = ""
    generated_text: str = ""
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None: not reported)
    session: int | None = None  # multi-turn workloads: the session and the turn (0-based) this request was
    turn: int | None = None
    output_token_ids: list[int] | None = None  # bench: the answer's ids when the server returned them


def percentile_key(p: float, metric: str) -> str:
    """``p99_ttft_ms`` / ``p99.9_ttft_ms``: P is printed as an integer when it is whole."""
    p_word = str(int(p)) if float(p).is_integer() else str(p)
    return f"p{p_word}_{metric}_ms"


def order_stats(x: np.ndarray, percentiles: Sequence[float]) -> tuple[float, list[float]]:
    """(``np.median(x)``, ``[np.percentile(x, p) for p in percentiles]``) of a non-empty 1-d float array, the same
    values bit for bit (numpy's linear interpolation between the order statistics around ``(n - 1)·p/100``), from
    one partition instead of one per statistic, and without the masked-array module numpy's median and percentile
    import on first use (~7 ms of a ``simulate``'s start-up). ``x`` is left as it is."""
    n = x.size
    h = n // 2
    spots = []                        # per percentile: (lower index, upper index, weight of the upper)
    for p in percentiles:
        vi = (n - 1) * (p / 100)
        if vi >= n - 1:
            spots.append((n - 1, n - 1, 0.0))
        else:
            lo = math.floor(vi)
            spots.append((lo, lo + 1, vi - lo))
    kth = {h, n - 1} | ({h - 1} if n % 2 == 0 else set()) | {i for lo, hi, _ in spots for i in (lo, hi)}
    parted = np.partition(x, sorted(kth))
    part = {i: float(parted[i]) for i in kth}
    if math.isnan(part[n - 1]):          # NaNs sort last: numpy answers NaN for every statistic then
        return math.nan, [math.nan] * len(spots)
    med = (part[h - 1] + part[h]) / 2 if n % 2 == 0 else part[h]
    out = []
    for lo, hi, t in spots:
        a, b = part[lo], part[hi]
        d = b - a
        out.append(b - d * (1 - t) if t >= 0.5 else a + d * t)     # numpy's _lerp, exact at both ends
    return med, out


def _stats_ms(
    samples_s: np.ndarray, metric: str, percentiles: Sequence[float], out: dict[str, float]
) -> None:
    # vLLM computes np.mean(x or 0): an empty sample list reports 0.0 for every statistic.
    x = samples_s if samples_s.size else np.zeros(1)
    med, pcts = order_stats(x, percentiles)
    out[f"mean_{metric}_ms"] = float(np.mean(x)) * 1000.0
    out[f"median_{metric}_ms"] = med * 1000.0
    out[f"std_{metric}_ms"] = float(np.std(x)) * 1000.0  # population std (numpy default)
    for p, v in zip(percentiles, pcts, strict=True):
        out[percentile_key(p, metric)] = v * 1000.0


#: requests whose chunk stamps _peak_rates bins at once
_STAMP_REQUESTS = 4096


def _bin_counts(stamps_s: np.ndarray, n_bins: int) -> np.ndarray:
    """How many of ``stamps_s`` fall in each 1-s bin ``floor(t)`` of ``[0, n_bins)``."""
    bins = np.floor(stamps_s).astype(np.int64)
    return np.bincount(bins[(bins >= 0) & (bins < n_bins)], minlength=n_bins)


def _peak_rates(
    starts_s: np.ndarray,
    ttfts_s: np.ndarray,
    e2els_s: np.ndarray,
    itl_parts: Sequence[np.ndarray],
    itls_flat_s: np.ndarray,
) -> tuple[float, int]:
    """(max_output_tokens_per_s, max_concurrent_requests) over 1-s bins, successful requests only.

    Bins are anchored at the earliest send time ``t0`` among successful requests and span up to the
    last token of the latest-finishing one (``ceil(span) + 1`` bins, as in vLLM).

    * Tokens: each token-bearing chunk timestamp ``start + ttft + cumsum(itl)`` is counted in bin
      ``floor(t - t0)``; the value is the largest bin count (chunks, not tokens, as in vLLM).
    * Concurrency: a request counts in every bin from ``floor(start - t0)`` to
      ``floor(start + latency - t0)`` inclusive, i.e. "requests in flight at some moment of that
      second"; the value is the largest bin count. This can exceed the instantaneous peak when one
      request ends and another starts within the same second.
    """
    if starts_s.size == 0:
        return 0.0, 0
    t0 = float(starts_s.min())
    ends_s = starts_s + e2els_s
    n_bins = int(math.ceil(float(ends_s.max()) - t0)) + 1

    # Per-request cumulative ITL without a Python loop per request: one global cumsum, minus the
    # running total at each request's first gap. The float error is ~eps * total ITL (sub-ns).
    first_tok_s = starts_s + ttfts_s - t0
    lens = np.fromiter((p.size for p in itl_parts), dtype=np.int64, count=len(itl_parts))
    counts = _bin_counts(first_tok_s, n_bins)
    if itls_flat_s.size:
        cum = np.cumsum(itls_flat_s)
        seg_first = np.cumsum(lens) - lens
        before = np.where(seg_first > 0, cum[np.maximum(seg_first - 1, 0)], 0.0)
        # the later chunks' stamps a slice of requests at a time (the same sum per element): a 1,000,000-request
        # fleet's 10^8 chunks would otherwise need several token-sized temporaries at once
        for a in range(0, lens.size, _STAMP_REQUESTS):
            b = min(a + _STAMP_REQUESTS, lens.size)
            lo, hi = int(seg_first[a]), int(seg_first[b - 1] + lens[b - 1])
            later_s = np.repeat(first_tok_s[a:b], lens[a:b]) + (cum[lo:hi] - np.repeat(before[a:b], lens[a:b]))
            counts += _bin_counts(later_s, n_bins)
    max_tok = float(counts.max())

    # Difference array: +1 at a request's first bin, -1 after its last, then a running sum.
    first = np.floor(starts_s - t0).astype(np.int64)
    last = np.floor(ends_s - t0).astype(np.int64)
    delta = np.bincount(first, minlength=n_bins + 1) - np.bincount(last + 1, minlength=n_bins + 1)
    max_conc = int(np.cumsum(delta)[:n_bins].max())
    return max_tok, max_conc


def compute_bench_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: Sequence[float] = (99,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """Numeric part of the ``vllm bench serve`` 0.33 result JSON, in its key order.

    ``duration_s`` is the benchmark wall time (from just before the first dispatch to the end).
    Only successful requests contribute tokens, latencies and throughput. Stats keys follow the
    canonical metric order ttft, tpot, itl, e2el(, client_queue_time, e2el_including_client_queue),
    for the metrics selected in ``percentile_metrics``.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    unknown = [m for m in percentile_metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"unknown percentile metric(s) {unknown}; allowed: {list(PERCENTILE_METRICS)}")
    for p in percentiles:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {p}")
    if goodput_slos_ms:
        bad = [k for k in goodput_slos_ms if k not in GOODPUT_METRICS]
        if bad:
            raise ValueError(f"unknown goodput SLO(s) {bad}; allowed: {list(GOODPUT_METRICS)}")

    ok = [r for r in records if r.success]
    n_ok = len(ok)

    def arr(values) -> np.ndarray:
        return np.fromiter(values, dtype=np.float64, count=n_ok)

    ttfts_s = arr(r.ttft_s for r in ok)
    e2els_s = arr(r.latency_s for r in ok)
    queues_s = arr(r.queue_s for r in ok)
    out_lens = np.fromiter((r.output_len for r in ok), dtype=np.int64, count=n_ok)
    in_lens = np.fromiter((r.prompt_len for r in ok), dtype=np.int64, count=n_ok)

    # TPOT excludes the first token, so it only exists for > 1 output tokens; for goodput the
    # others count as TPOT 0 (always within SLO).
    multi = out_lens > 1
    all_tpots_s = np.zeros(n_ok)
    all_tpots_s[multi] = (e2els_s[multi] - ttfts_s[multi]) / (out_lens[multi] - 1)
    tpots_s = all_tpots_s[multi]

    itl_parts = [np.asarray(r.itl_s, dtype=np.float64) for r in ok]
    itls_s = np.concatenate(itl_parts) if itl_parts else np.zeros(0)  # pooled across requests

    total_in = int(in_lens.sum())
    total_out = int(out_lens.sum())

    goodput: float | None = None
    if goodput_slos_ms:  # an empty dict means "no SLOs", as in vLLM
        good = np.ones(n_ok, dtype=bool)
        per_req = {"ttft": ttfts_s, "tpot": all_tpots_s, "e2el": e2els_s}
        for name, slo_ms in goodput_slos_ms.items():
            good &= per_req[name] <= slo_ms / 1000.0
        goodput = int(good.sum()) / duration_s

    starts_s = arr(r.start_s for r in ok)
    max_tok_per_s, max_conc = _peak_rates(starts_s, ttfts_s, e2els_s, itl_parts, itls_s)

    result: dict = {
        "duration": float(duration_s),
        "completed": n_ok,
        "failed": len(records) - n_ok,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": n_ok / duration_s,
        "request_goodput": goodput,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": max_tok_per_s,
        "max_concurrent_requests": max_conc,
    }
    samples = {
        "ttft": ttfts_s,
        "tpot": tpots_s,
        "itl": itls_s,
        "e2el": e2els_s,
        "client_queue_time": queues_s,
        "e2el_including_client_queue": e2els_s + queues_s,
    }
    selected = set(percentile_metrics)
    for m in PERCENTILE_METRICS:
        if m in selected:
            _stats_ms(samples[m], m, percentiles, result)
    return result


def detailed_fields(records: Sequence[RequestRecord]) -> dict:
    """Per-request lists that ``--save-detailed`` adds (one entry per request, failed included;
    a failed request has output_len 0 and ttft 0, as vLLM records them)."""
    return {
        "input_lens": [int(r.prompt_len) for r in records],
        "output_lens": [int(r.output_len) if r.success else 0 for r in records],
        "ttfts": [float(r.ttft_s) for r in records],
        "itls": [np.asarray(r.itl_s, dtype=np.float64).tolist() for r in records],
        "start_times": [float(r.start_s) for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }


def per_request_fields(records: Sequence[RequestRecord]) -> dict:
    """Per-request lists that 0.33 writes even without ``--save-detailed``: ``latencies`` and
    ``queue_times`` (seconds)."""
    return {
        "latencies": [float(r.latency_s) for r in records],
        "queue_times": [float(r.queue_s) for r in records],
    }


# Keys of compute_bench_metrics() that come before the per-request arrays in the 0.33 result JSON.
_HEAD_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
              "request_goodput", "output_throughput", "total_token_throughput")
_PEAK_KEYS = ("max_output_tokens_per_s", "max_concurrent_requests")


def assemble_result(header: dict, stats: dict, records: Sequence[RequestRecord], *, detailed: bool,
                    extra: dict | None = None) -> dict:
    """The whole result JSON in ``vllm bench serve`` 0.33 key order (spec §7.5).

    ``header`` holds date .. max_concurrency; ``stats`` is ``compute_bench_metrics``' output; ``extra``
    (kernelsight's own keys, e.g. the engine config or scraped server gauges) goes after ``rtfx`` and
    before the per-metric statistics, where vLLM puts its optional blocks. Without ``detailed`` the
    starred keys (input_lens, output_lens, ttfts, itls, start_times, generated_texts, errors) are left
    out, as vLLM does.
    """
    out = dict(header)
    for k in _HEAD_KEYS:
        out[k] = stats[k]
    det = detailed_fields(records) if detailed else {}
    per = per_request_fields(records)
    for k in ("input_lens", "output_lens", "ttfts", "itls"):
        if k in det:
            out[k] = det[k]
    out["latencies"] = per["latencies"]
    if "start_times" in det:
        out["start_times"] = det["start_times"]
    out["queue_times"] = per["queue_times"]
    for k in ("generated_texts", "errors"):
        if k in det:
            out[k] = det[k]
    for k in _PEAK_KEYS:
        out[k] = stats[k]
    out["rtfx"] = 0.0  # real-time factor of audio requests: none here
    out.update(extra or {})
    for k, v in stats.items():
        if k not in out:
            out[k] = v
    return out
