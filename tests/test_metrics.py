"""Tests for kernelsight.loadgen.metrics and kernelsight.loadgen.report."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kernelsight.loadgen.metrics import (
    RequestRecord,
    compute_bench_metrics,
    detailed_fields,
    per_request_fields,
)
from kernelsight.loadgen.report import format_report, format_table


def _records() -> list[RequestRecord]:
    # Hand-built: latency = ttft + sum(itl) for each successful request.
    return [
        RequestRecord(True, 10, 3, 0.1, [0.05, 0.15], 0.3, start_s=0.0),
        # 5 tokens in 4 chunks (one chunk carried two tokens): TPOT uses tokens, ITL uses chunks.
        RequestRecord(True, 20, 5, 0.2, np.array([0.1, 0.1, 0.4]), 0.8, start_s=0.5, queue_s=0.25),
        RequestRecord(True, 5, 1, 0.4, [], 0.4, start_s=0.9),  # single token: no TPOT
        RequestRecord(False, 7, 0, 0.0, [], 0.0, start_s=1.5, error="boom"),
    ]


def test_hand_computed_example():
    r = compute_bench_metrics(_records(), 2.0, percentile_metrics=("ttft", "tpot", "itl", "e2el"))
    assert r["duration"] == 2.0
    assert r["completed"] == 3
    assert r["failed"] == 1
    assert r["total_input_tokens"] == 35  # failed request's prompt excluded
    assert r["total_output_tokens"] == 9
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["request_goodput"] is None
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(22.0)

    # TTFT samples [0.1, 0.2, 0.4]
    assert r["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(np.sqrt(0.046666666 / 3) * 1000, rel=1e-6)
    assert r["p99_ttft_ms"] == pytest.approx(396.0)  # 0.2 + 0.98 * (0.4 - 0.2)
    # TPOT samples [(0.3-0.1)/2, (0.8-0.2)/4] = [0.1, 0.15]; the 1-token request is excluded.
    assert r["mean_tpot_ms"] == pytest.approx(125.0)
    assert r["median_tpot_ms"] == pytest.approx(125.0)
    assert r["p99_tpot_ms"] == pytest.approx(149.5)
    # ITL pooled [0.05, 0.15, 0.1, 0.1, 0.4]
    assert r["mean_itl_ms"] == pytest.approx(160.0)
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["p99_itl_ms"] == pytest.approx(390.0)  # 0.15 + 0.96 * 0.25
    # E2EL [0.3, 0.8, 0.4]
    assert r["mean_e2el_ms"] == pytest.approx(500.0)
    assert r["median_e2el_ms"] == pytest.approx(400.0)
    assert r["p99_e2el_ms"] == pytest.approx(792.0)

    # Chunk stamps: A .1 .15 .3 | B .7 .8 .9 1.3 | C 1.3  -> bins [6, 2]
    assert r["max_output_tokens_per_s"] == 6.0
    # In-flight per second: bin0 {A, B, C}, bin1 {B, C}
    assert r["max_concurrent_requests"] == 3


def test_key_order_matches_vllm_033():
    r = compute_bench_metrics(_records(), 2.0, percentile_metrics=("e2el", "ttft"), percentiles=(50, 99))
    assert list(r) == [
        "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
        "max_output_tokens_per_s", "max_concurrent_requests",
        # canonical metric order, not the order given
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
        "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p50_e2el_ms", "p99_e2el_ms",
    ]


def test_default_metrics_and_percentile_naming():
    r = compute_bench_metrics(_records(), 2.0, percentiles=(90, 99.0, 99.9))
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert f"p90_{m}_ms" in r and f"p99_{m}_ms" in r and f"p99.9_{m}_ms" in r
    assert "p99.0_ttft_ms" not in r
    assert r["p99.9_ttft_ms"] == pytest.approx((0.2 + 0.998 * 0.2) * 1000)


def test_goodput():
    recs = _records()
    # A good; B fails TPOT (150 > 120 ms); C fails TTFT.
    r = compute_bench_metrics(recs, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 120})
    assert r["request_goodput"] == pytest.approx(0.5)
    # E2EL SLO: A (300) and C (400) good.
    r = compute_bench_metrics(recs, 2.0, goodput_slos_ms={"e2el": 500})
    assert r["request_goodput"] == pytest.approx(1.0)
    # A 1-token request counts as TPOT 0 for goodput: only C passes a tight TPOT SLO.
    r = compute_bench_metrics(recs, 2.0, goodput_slos_ms={"tpot": 50})
    assert r["request_goodput"] == pytest.approx(0.5)
    # SLO equal to the value is good (slo >= value).
    r = compute_bench_metrics(recs, 2.0, goodput_slos_ms={"ttft": 200})
    assert r["request_goodput"] == pytest.approx(1.0)
    assert compute_bench_metrics(recs, 2.0, goodput_slos_ms={})["request_goodput"] is None


def test_queue_metrics():
    r = compute_bench_metrics(
        _records(), 2.0, percentile_metrics=("client_queue_time", "e2el_including_client_queue")
    )
    assert r["mean_client_queue_time_ms"] == pytest.approx(250 / 3)
    assert r["median_e2el_including_client_queue_ms"] == pytest.approx(400.0)  # [0.3, 1.05, 0.4]
    assert "mean_ttft_ms" not in r


def test_all_failed_gives_zero_stats():
    recs = [RequestRecord(False, 10, 0, 0.0, [], 0.0, error="x")] * 3
    r = compute_bench_metrics(recs, 1.0)
    assert r["completed"] == 0 and r["failed"] == 3
    assert r["total_input_tokens"] == 0
    assert r["mean_ttft_ms"] == 0.0 and r["p99_itl_ms"] == 0.0 and r["std_tpot_ms"] == 0.0
    assert r["max_output_tokens_per_s"] == 0.0 and r["max_concurrent_requests"] == 0


def test_only_single_token_outputs_give_zero_tpot():
    recs = [RequestRecord(True, 4, 1, 0.05, [], 0.05), RequestRecord(True, 4, 1, 0.07, [], 0.07)]
    r = compute_bench_metrics(recs, 1.0)
    assert r["mean_tpot_ms"] == 0.0 and r["p99_tpot_ms"] == 0.0
    assert r["mean_itl_ms"] == 0.0
    assert r["mean_ttft_ms"] == pytest.approx(60.0)


def test_validation():
    with pytest.raises(ValueError, match="duration"):
        compute_bench_metrics(_records(), 0.0)
    with pytest.raises(ValueError, match="percentile metric"):
        compute_bench_metrics(_records(), 1.0, percentile_metrics=("ttfb",))
    with pytest.raises(ValueError, match="goodput"):
        compute_bench_metrics(_records(), 1.0, goodput_slos_ms={"itl": 5})
    with pytest.raises(ValueError, match="percentile"):
        compute_bench_metrics(_records(), 1.0, percentiles=(101,))


def test_fast_on_10k_records():
    rng = np.random.default_rng(0)
    recs = []
    for i in range(10_000):
        itl = rng.uniform(0.005, 0.03, size=200)
        ttft = float(rng.uniform(0.05, 0.5))
        recs.append(RequestRecord(True, 500, 201, ttft, itl, ttft + float(itl.sum()), start_s=i * 0.01))
    t0 = time.perf_counter()
    r = compute_bench_metrics(recs, 110.0, percentiles=(50, 90, 99))
    elapsed = time.perf_counter() - t0
    assert r["completed"] == 10_000 and r["total_output_tokens"] == 2_010_000
    assert elapsed < 1.0, f"compute_bench_metrics took {elapsed:.3f} s"
    # Cross-check peak tokens/s against a straightforward per-request computation.
    counts: dict[int, int] = {}
    for rec in recs:
        stamps = rec.start_s + rec.ttft_s + np.concatenate(([0.0], np.cumsum(rec.itl_s)))
        for b, c in zip(*np.unique(np.floor(stamps).astype(int), return_counts=True), strict=True):
            counts[int(b)] = counts.get(int(b), 0) + int(c)
    assert r["max_output_tokens_per_s"] == pytest.approx(max(counts.values()), abs=2)


def test_detailed_and_per_request_fields():
    d = detailed_fields(_records())
    assert list(d) == ["input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"]
    assert d["input_lens"] == [10, 20, 5, 7]
    assert d["output_lens"] == [3, 5, 1, 0]
    assert d["itls"][1] == [0.1, 0.1, 0.4] and d["itls"][3] == []
    assert d["errors"] == ["", "", "", "boom"]
    assert d["start_times"] == [0.0, 0.5, 0.9, 1.5]
    p = per_request_fields(_records())
    assert p["latencies"] == [0.3, 0.8, 0.4, 0.0] and p["queue_times"] == [0.0, 0.25, 0.0, 0.0]


def test_report_contains_key_lines():
    r = compute_bench_metrics(
        _records(), 2.0, percentiles=(90, 99), goodput_slos_ms={"ttft": 250},
        percentile_metrics=("ttft", "tpot", "itl"),
    )
    text = format_report(r)
    lines = text.splitlines()
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0] and len(lines[0]) == 50
    assert lines[-1] == "=" * 50
    assert any(ln.startswith("Successful requests:") and ln.split()[-1] == "3" for ln in lines)
    assert any(ln.startswith("Failed requests:") and ln.split()[-1] == "1" for ln in lines)
    assert any(ln.startswith("Benchmark duration (s):") and ln.endswith("2.00") for ln in lines)
    assert "Total input tokens:" in text and "Total generated tokens:" in text
    assert "Request goodput (req/s):" in text
    assert "Output token throughput (tok/s):" in text
    assert "Peak output token throughput (tok/s):" in text
    assert "Time to First Token" in text and "Inter-token Latency" in text
    assert any(ln.startswith("Mean TTFT (ms):") and ln.endswith("233.33") for ln in lines)
    assert "P90 TTFT (ms):" in text and "P99 ITL (ms):" in text
    assert "End-to-end Latency" not in text  # e2el not selected -> section skipped
    # No goodput configured -> no goodput line
    assert "goodput" not in format_report(compute_bench_metrics(_records(), 2.0))


def test_report_e2el_section_not_confused_with_queue_metric():
    r = compute_bench_metrics(
        _records(), 2.0, percentile_metrics=("e2el", "e2el_including_client_queue")
    )
    text = format_report(r, title="Fast-forward")
    assert "Fast-forward" in text.splitlines()[0]
    assert text.count("P99 E2EL (ms):") == 1
    assert "P99 E2EL+queue (ms):" in text


def test_format_table_alignment():
    rows = [{"name": "a", "ttft_ms": 1.5, "n": 10}, {"name": "longer", "ttft_ms": 123.456}]
    out = format_table(rows, ["name", "ttft_ms", "n"]).splitlines()
    assert len(out) == 4
    assert out[0].split() == ["name", "ttft_ms", "n"]
    assert set(out[1].replace(" ", "")) == {"-"}
    assert out[2].split() == ["a", "1.50", "10"]
    assert out[3].split() == ["longer", "123.46"]
    # Numbers right-aligned: the decimal columns end at the same offset.
    assert out[2].index("1.50") + 4 == out[3].index("123.46") + 6


def test_order_stats_are_numpys_median_and_percentiles_bit_for_bit():
    """One partition gives np.median and np.percentile's values exactly (odd and even sizes, ties, one element, the
    0th and 100th percentiles, integer and fractional ones, NaN), leaves the input as it was, and a report no longer
    imports numpy.ma for them."""
    import subprocess
    import sys

    from kernelsight.loadgen.metrics import order_stats

    rng = np.random.default_rng(7)
    ps = [0, 1, 25, 50, 90, 99, 99.9, 99.99, 100, 33.3]
    for n in (1, 2, 3, 4, 5, 10, 11, 101, 1000, 1001, 65536, 65537):
        for x in (rng.random(n), rng.exponential(0.01, n) + 1e3, np.round(rng.random(n), 2), np.full(n, 0.1)):
            before = x.copy()
            med, pcts = order_stats(x, ps)
            assert med == float(np.median(x)) and pcts == [float(np.percentile(x, p)) for p in ps], n
            assert np.array_equal(x, before)
    med, pcts = order_stats(np.array([1.0, np.nan, 3.0, 2.0]), [50])
    assert np.isnan(med) and np.isnan(pcts[0])
    probe = ("import sys, numpy as np; from kernelsight.loadgen.metrics import compute_bench_metrics, RequestRecord; "
             "compute_bench_metrics([RequestRecord(True, 5, 3, 0.1, np.array([0.01, 0.02]), 0.13)], 1.0, "
             "percentiles=(50, 99.9)); print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_peak_output_rate_is_the_same_whatever_the_stamp_chunks(monkeypatch):
    """_peak_rates bins the chunk stamps a slice of requests at a time (bounded memory): slices of one request, a few
    or all of them give the same peak, and the peak counts every token-bearing chunk of the busiest second."""
    from kernelsight.loadgen import metrics

    rng = np.random.default_rng(3)
    recs = []
    for i in range(300):
        itl = rng.exponential(0.02, int(rng.integers(0, 40)))
        ttft = float(rng.exponential(0.1))
        recs.append(RequestRecord(True, 10, itl.size + 1, ttft, itl, ttft + float(itl.sum()), start_s=i * 0.01))
    peaks = []
    for n in (1, 7, 4096):
        monkeypatch.setattr(metrics, "_STAMP_REQUESTS", n)
        peaks.append(compute_bench_metrics(recs, 10.0)["max_output_tokens_per_s"])
    stamps = np.concatenate([r.start_s + r.ttft_s + np.concatenate(([0.0], np.cumsum(r.itl_s))) for r in recs])
    assert peaks == [float(np.bincount(np.floor(stamps).astype(int)).max())] * 3
