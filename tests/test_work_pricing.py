"""validate's work pricing: a run the simulator produced prices at 1.0; a run 10% slower than the model, at 1/1.1."""

from __future__ import annotations

import numpy as np
import pytest

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.loadgen.validate import MeasuredRequest
from kernelsight.loadgen.work_pricing import clock_offset_s, price_run_work, tick_work
from kernelsight.simcore.engine_config import EngineArgs, build_step_model

MAX_SEQS, BUDGET, TICK_S = 32, 1024, 0.25


@pytest.fixture(scope="module")
def simulated_run():
    """A saturated H100 run recorded as the e2e schema records one: per request its queue, first and last token
    times; per tick the generated tokens and the prompt tokens (counted in the tick of each first token)."""
    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100-sxm", max_num_seqs=MAX_SEQS,
                                          max_num_batched_tokens=BUDGET, seed=3))
    rng = np.random.default_rng(5)
    n = 120
    samples = [SampleRequest(None, int(p), int(o), token_array=rng.integers(100, 30000, int(p)))
               for p, o in zip(rng.integers(200, 800, n), rng.integers(100, 400, n), strict=True)]
    arrivals = np.cumsum(rng.exponential(1 / 40, n)).tolist()
    res = run_fast_forward(cfg, samples, arrivals, ignore_eos=True)
    requests, token_times = [], []
    for i, r in enumerate(res.records):
        t = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        requests.append(MeasuredRequest(f"r{i}", r.prompt_len, r.output_len, r.start_s, float(t[0]), float(t[-1])))
        token_times.append(t)
    return cfg, requests, token_times


def recorded(requests, token_times, stretch: float = 1.0, shift_s: float = 0.0):
    """The run as recorded, every time stretched by ``stretch`` (a GPU that slow), by a scraper that reads each tick
    ``shift_s`` after its label: counters over (label − tick, label] + shift_s, gauges at label + shift_s."""
    reqs = [MeasuredRequest(r.request_id, r.input_toks, r.output_toks, stretch * r.queued_s, stretch * r.first_token_s,
                            stretch * r.last_token_s) for r in requests]
    t0 = min(r.queued_s for r in reqs)
    tokens = stretch * np.concatenate(token_times) - t0
    edges = np.arange(TICK_S, tokens.max() + 2 * TICK_S, TICK_S)
    bins = np.r_[0.0, edges] + shift_s
    firsts = np.array([r.first_token_s - t0 for r in reqs])
    lasts = np.array([r.last_token_s - t0 for r in reqs])
    queued = np.array([r.queued_s - t0 for r in reqs])
    at = edges + shift_s
    ts = {"t": edges, "gen_throughput": np.histogram(tokens, bins=bins)[0] / TICK_S,
          "prompt_throughput": np.histogram(firsts, bins=bins, weights=[r.input_toks for r in reqs])[0] / TICK_S,
          "running": np.array([((firsts <= x) & (lasts > x)).sum() for x in at], dtype=float),
          "waiting": np.array([((queued <= x) & (firsts > x)).sum() for x in at], dtype=float)}
    return reqs, ts


def test_a_run_the_step_model_produced_is_priced_at_one(simulated_run):
    cfg, requests, token_times = simulated_run
    reqs, ts = recorded(requests, token_times)
    out = price_run_work(reqs, ts, TICK_S, build_step_model(cfg), MAX_SEQS, BUDGET)
    groups = {g["ticks"]: g for g in out["groups"]}
    assert groups["busy, all"]["count"] >= 20
    assert groups["busy, decode only"]["count"] >= 5 and groups["busy, with prefill"]["count"] >= 5
    for g in ("busy, all", "busy, decode only", "busy, with prefill"):
        assert abs(groups[g]["median"] - 1.0) < 0.03, groups[g]
    # the split's prefill part is the coarser one: prompts admitted in the same step (async scheduling defers an
    # arrival a step, so they bunch) are priced as separate chunks, each beside the whole decode batch
    assert abs(out["split"]["decode_scale"] - 1.0) < 0.05 and abs(out["split"]["prefill_scale"] - 1.0) < 0.15
    # ticks before the first decode and after the last are not busy: they are left out of the groups
    assert not out["ticks"][0]["busy"] and not out["ticks"][-1]["busy"]
    # decode-only ticks, one step each: the model's own steps, sorted by batch
    steps = out["decode_steps"]
    assert len(steps) == groups["busy, decode only"]["count"]
    assert [r["batch"] for r in steps] == sorted(r["batch"] for r in steps)
    assert abs(np.median([r["priced_over_measured"] for r in steps]) - 1.0) < 0.03
    # each beside the batch its CUDA graph pads to (the GEMMs' m): the least captured size that holds it
    capture = sorted(cfg.cudagraph_capture_sizes)
    assert capture and all(r["graph_batch"] == min(c for c in capture if c >= round(r["batch"])) for r in steps)
    assert any(r["graph_batch"] > round(r["batch"]) for r in steps)


def test_a_run_ten_percent_slower_than_the_model_is_priced_at_one_over_one_point_one(simulated_run):
    cfg, requests, token_times = simulated_run
    reqs, ts = recorded(requests, token_times, stretch=1.1)
    out = price_run_work(reqs, ts, TICK_S, build_step_model(cfg), MAX_SEQS, BUDGET)
    busy = next(g for g in out["groups"] if g["ticks"] == "busy, all")
    assert busy["median"] == pytest.approx(1 / 1.1, abs=0.03)
    assert out["split"]["decode_scale"] == pytest.approx(1.1, abs=0.06)
    assert np.median([r["priced_over_measured"] for r in out["decode_steps"]]) == pytest.approx(1 / 1.1, abs=0.03)


@pytest.mark.parametrize("shift_s", [-0.1, 0.06])
def test_ticks_read_off_their_labels_are_placed_where_the_counts_match(simulated_run, shift_s):
    cfg, requests, token_times = simulated_run
    reqs, ts = recorded(requests, token_times, shift_s=shift_s)
    assert clock_offset_s(reqs, ts, TICK_S) == pytest.approx(shift_s, abs=0.01 * TICK_S + 1e-9)
    out = price_run_work(reqs, ts, TICK_S, build_step_model(cfg), MAX_SEQS, BUDGET)
    assert out["clock_offset_s"] == pytest.approx(shift_s, abs=0.01 * TICK_S + 1e-9)
    steps = [r["priced_over_measured"] for r in out["decode_steps"]]
    assert abs(np.median(steps) - 1.0) < 0.03
    # read at the labels instead, the draining ticks' batches are off and so are their steps
    off = price_run_work(reqs, {**ts, "running": None}, TICK_S, build_step_model(cfg), MAX_SEQS, BUDGET)
    assert off["clock_offset_s"] == 0.0
    spread = lambda rows: float(np.mean([abs(r["priced_over_measured"] - 1.0) for r in rows]))  # noqa: E731
    assert spread(off["decode_steps"]) > spread(out["decode_steps"])


def test_without_gauges_the_ticks_stay_on_their_labels():
    reqs = [MeasuredRequest("a", 100, 10, 0.0, 0.5, 2.5)]
    assert clock_offset_s(reqs, {"t": np.array([1.0, 2.0]), "gen_throughput": np.array([2.0, 5.0])}, 1.0) == 0.0


def test_tick_work_reads_batch_context_and_chunk_from_the_requests():
    # two requests decode across the whole 1 s tick (1,2]: at its middle, 100 + 50% of 10 and 300 + 12.5% of 20 tokens
    reqs = [MeasuredRequest("a", 100, 10, 0.0, 0.5, 2.5), MeasuredRequest("b", 300, 20, 0.0, 1.0, 5.0),
            MeasuredRequest("c", 64, 5, 1.2, 1.4, 1.6)]
    ts = {"t": np.array([1.0, 2.0]), "gen_throughput": np.array([3.0, 40.0]),
          "prompt_throughput": np.array([400.0, 64.0])}
    w = tick_work(reqs, ts, 1.0, 512)
    assert [x.busy for x in w] == [False, True]          # (0, 1]: nothing decodes before 0.5 s
    assert w[1].decoding == pytest.approx(2.2)           # a and b all tick, c for 0.2 s
    assert w[1].gen_tokens == 40 and w[1].prompt_tokens == 64
    assert w[1].chunk_tokens == 64                        # c's prompt: its first token falls in the tick
    ctx = (1 * (100 + 0.5 * 10) + 1 * (300 + 0.125 * 20) + 0.2 * (64 + 0.5 * 5)) / 2.2
    assert w[1].mean_context_tokens == pytest.approx(ctx)
