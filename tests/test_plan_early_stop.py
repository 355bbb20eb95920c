"""``kernelsight plan``'s early stop: a run is cut short only once its point provably fails and provably cannot be
on the front, so the search with it gives the chosen deployment and the front of the search without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight.cli import main
from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.arrivals import arrival_times_s
from kernelsight.loadgen.datasets import random_dataset
from kernelsight.loadgen.fastforward import run_replicas
from kernelsight.loadgen.metrics import compute_bench_metrics
from kernelsight.plan.slo import parse_slo
from kernelsight.plan.verdict import SloWatch, StopRule, percentile_needs
from kernelsight.simcore.engine_config import EngineArgs

# Llama-3.1-8B, 300 random requests at 40 req/s on L40S and A100 (bf16 and fp8, two batch limits): one L40S is
# far past its capacity, so every cheap point fails, and the A100 pair meets the SLO.
SPACE = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--dataset-name", "random", "--num-prompts", "300",
         "--random-input-len", "512", "--random-output-len", "64", "--request-rate", "40",
         "--slo", "ttft_p99_ms=200,tpot_p99_ms=30", "--gpus", "l40s,a100", "--tp", "1", "--replicas", "1-4",
         "--max-num-seqs", "default,32", "--quantization", "none,fp8", "--curve-loads", "1", "--no-progress",
         "--no-cache", "--workers", "1"]


def plan(tmp: Path, *extra: str, name: str) -> dict:
    out = tmp / name
    assert main([*SPACE, *extra, "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_early_stop_gives_the_full_searchs_choice_and_front(tmp_path):
    early = plan(tmp_path, name="early.json")
    full = plan(tmp_path, "--no-early-stop", name="full.json")
    assert early["search"]["stopped_early"] >= 2, "the watch cut runs short on this space"
    assert full["search"]["stopped_early"] == full["search"]["rerun_in_full"] == 0
    # the probes follow verdicts only: the same points are simulated either way
    assert {p["key"] for p in early["points"]} == {p["key"] for p in full["points"]}
    assert early["chosen"] == full["chosen"]
    assert early["front"] == full["front"]
    by_key = {p["key"]: p for p in full["points"]}
    for p in early["points"]:
        exact = by_key[p["key"]]
        if p["cut_short_at_s"] is None:
            assert p == exact
            continue
        # a cut-short point fails in the full run too, on a statistic it named, and its bounds hold
        assert not exact["meets_slo"] and p["key"] not in early["front"]
        named = {v["slo"] for v in p["violations"]}
        assert named & {v["slo"] for v in exact["violations"]} == named
        for v in p["violations"]:
            full_value = {w["slo"]: w["value_ms"] for w in exact["violations"]}[v["slo"]]
            assert v["value_ms"] <= full_value + 0.01
        assert p["good_lo"] <= exact["good_lo"] <= p["good_hi"]
        assert p["p99_ttft_ms"] <= exact["p99_ttft_ms"] + 1e-3
        assert "cut short at" in p["why"]


def _workload(n: int, rate: float):
    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="l40s", max_num_seqs=32))
    samples = random_dataset(n, 512, 64, 0.5, cfg.model.vocab_size, seed=1)
    return cfg, samples, arrival_times_s(n, rate, 1.0, seed=1).tolist()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_watch_that_never_stops_changes_nothing_and_its_verdict_holds(replicas):
    cfg, samples, arrivals = _workload(240, 40.0)
    slo = parse_slo("ttft_p99_ms=200,tpot_median_ms=20,e2el_mean_ms=1500")
    watch = SloWatch(StopRule(slo, hint_good=10**9, stop=False), arrivals,
                     [s.expected_output_len for s in samples], True)
    watched = run_replicas(cfg, samples, arrivals, replicas, watch=watch)
    plain = run_replicas(cfg, samples, arrivals, replicas)
    assert watched.stopped_at_s is None and watch.stop is None
    assert [(r.ttft_s, r.latency_s) for r in watched.records] == [(r.ttft_s, r.latency_s) for r in plain.records]
    # overloaded: the watch proved the failure long before the end, and the full run's statistics agree
    m = compute_bench_metrics(plain.records, plain.duration_s, percentile_metrics=("ttft", "tpot", "e2el"),
                              percentiles=(50, 99))
    assert watch.verdict is not None and watch.verdict["at_s"] < 0.5 * plain.duration_s
    for v in watch.verdict["violations"]:
        lim = next(lim for lim in slo.limits if lim.name == v["slo"])
        assert m[lim.result_key] > lim.limit_ms
        assert v["value_ms"] <= m[lim.result_key] + 1e-6


def test_a_stopped_run_bounds_the_goodput_of_the_full_run():
    cfg, samples, arrivals = _workload(240, 40.0)
    slo = parse_slo("ttft_p99_ms=200,tpot_p99_ms=30")
    plain = run_replicas(cfg, samples, arrivals, 1)
    good = sum(r.success and r.ttft_s <= 0.2 and (r.output_len <= 1 or (r.latency_s - r.ttft_s) /
                                                   (r.output_len - 1) <= 0.03) for r in plain.records)
    hint = good + 40          # a point no costlier serving 40 more requests well than this one does
    watch = SloWatch(StopRule(slo, hint_good=hint), arrivals, [s.expected_output_len for s in samples], True)
    stopped = run_replicas(cfg, samples, arrivals, 1, watch=watch)
    assert stopped.stopped_at_s is not None and stopped.stopped_at_s < plain.duration_s
    assert watch.stop["good_lo"] <= good <= watch.stop["good_hi"] < hint
    assert len(stopped.records) < len(samples) or not all(r.success for r in stopped.records)


def test_percentile_needs_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 100, 101, 999, 10_000):
        for p in (50.0, 90.0, 99.0, 99.9, 100.0):
            k = percentile_needs(n, p)
            assert 1 <= k <= n
            for _ in range(5):
                vals = rng.uniform(0.0, 1.0, n)
                vals[rng.choice(n, k, replace=False)] = 1.0 + rng.uniform(1e-9, 1.0, k)
                assert np.percentile(vals, p) > 1.0     # k values over the limit: the percentile is over it
            if k > 1:     # one fewer is not enough: the percentile can still sit under the limit
                vals = np.zeros(n)
                vals[n - k + 1:] = 2.0
                assert np.percentile(vals, p) <= 1.0 or (n - 1) * p / 100.0 % 1 > 0.5


def test_a_cut_short_point_from_the_cache_that_may_be_on_the_front_is_simulated_in_full(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    wide = [a for a in SPACE if a != "--no-cache"]
    first = main([*wide, *cache, "--result-json", str(tmp_path / "wide.json")])
    assert first == 0
    cut = [p for p in json.loads((tmp_path / "wide.json").read_text())["points"]
           if p["cut_short_at_s"] is not None and p["hardware"] == "a100-sxm"]
    assert cut, "some A100 points were cut short against the cheaper L40S points"
    # without the L40S points nothing cheaper bounds the A100 ones: the cached cut-short runs are front candidates
    narrow = [*[a if a != "l40s,a100" else "a100" for a in wide], *cache]
    out = tmp_path / "narrow.json"
    assert main([*narrow, "--result-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["search"]["rerun_in_full"] >= 1
    full = plan(tmp_path, "--gpus", "a100", "--no-early-stop", name="narrow_full.json")    # the last --gpus wins
    assert res["chosen"] == full["chosen"] and res["front"] == full["front"]
    assert all(p["cut_short_at_s"] is None for p in res["points"] if p["key"] in res["front"])
