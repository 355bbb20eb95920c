"""The event engine: exactness of the fast paths, determinism, aborts, fan-out and output lengths."""

from __future__ import annotations

import random

import pytest

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, SCHEDULED, TOKENS
from tests.conftest import make_config, make_engine


def token_times(engine, max_steps: int) -> dict[str, list[float]]:
    """Per request, the virtual time of every token, from whatever events the engine emits."""
    ends: list[float] = []
    out: dict[str, list[float]] = {}
    while (res := engine.step(max_steps=max_steps)) is not None:
        ends.extend(res.step_end_s)
        for ev in res.events:
            if ev.kind in (TOKENS, FIRST_TOKEN):
                out.setdefault(ev.request_id, []).extend(ends[ev.step_index:ev.step_index + ev.num_tokens])
    return out


def load(engine, n=60, seed=1, max_prompt=900, **kw):
    rng = random.Random(seed)
    for i in range(n):
        prompt = [rng.randrange(100, 50000) for _ in range(rng.randint(5, max_prompt))]
        engine.add_request(f"r{i}", prompt, rng.randint(1, 200), ignore_eos=True, arrival_s=i * 0.02, **kw)


@pytest.mark.parametrize("blocks", [None, 90])
def test_decode_group_is_exact(blocks):
    """The decode-group bookkeeping changes nothing: same tokens at the same times as per-request stepping."""
    kw = {"num_gpu_blocks_override": blocks, "max_model_len": 1440} if blocks else {}
    ref = make_engine(use_decode_group=False, **kw)
    fast = make_engine(use_decode_group=True, **kw)
    n, max_prompt = (40, 300) if blocks else (60, 900)     # a small cache forces preemptions
    load(ref, n, max_prompt=max_prompt)
    load(fast, n, max_prompt=max_prompt)
    a, b = token_times(ref, 1), token_times(fast, 1)
    assert a.keys() == b.keys() and len(a) == n
    if blocks:
        assert fast.scheduler.num_preemptions > 0
    for rid in a:
        assert a[rid] == b[rid], rid


def test_windows_match_single_steps_and_emit_runs():
    single = make_engine(per_token_events=True)
    windowed = make_engine(per_token_events=False)
    load(single)
    load(windowed)
    a, b = token_times(single, 1), token_times(windowed, 128)
    assert a.keys() == b.keys()
    for rid in a:
        assert len(a[rid]) == len(b[rid])
        # a window interpolates attention between its first and last step; the target tier's decode η can step
        # on the batch's KV token count inside a window, which moves a token time by a few parts in 1e4
        assert b[rid] == pytest.approx(a[rid], rel=3e-4, abs=1e-6)
    assert windowed.stats.num_steps == single.stats.num_steps


def test_same_seed_same_report_and_seed_matters_without_ignore_eos():
    cfg = make_config(seed=3)
    samples = [SampleRequest(list(range(i, i + 300)), 300, 400) for i in range(0, 8000, 100)]
    arrivals = [i * 0.05 for i in range(len(samples))]
    r1 = run_fast_forward(cfg, samples, arrivals, ignore_eos=False)
    r2 = run_fast_forward(cfg, samples, arrivals, ignore_eos=False)
    assert [(x.output_len, x.ttft_s, x.latency_s) for x in r1.records] == \
           [(x.output_len, x.ttft_s, x.latency_s) for x in r2.records]
    r3 = run_fast_forward(make_config(seed=4), samples, arrivals, ignore_eos=False)
    assert [x.output_len for x in r1.records] != [x.output_len for x in r3.records]
    assert all(1 <= x.output_len <= 400 for x in r1.records)
    assert len({x.output_len for x in r1.records}) > 10     # lengths come from a distribution


def test_output_length_model_respects_min_and_max_tokens():
    engine = make_engine(seed=0)
    for i in range(200):
        engine.add_request(f"r{i}", [1, 2, 3, i], 50, min_tokens=20)
    lengths = [engine.get_request(f"r{i}").target_output_len for i in range(200)]
    assert min(lengths) >= 20 and max(lengths) <= 50
    reasons = {engine.get_request(f"r{i}").finish_reason_at_target.value for i in range(200)}
    assert reasons == {"stop", "length"}


def test_abort_anywhere_frees_everything():
    engine = make_engine()
    load(engine, n=30)
    engine.add_request("future", [5] * 50, 10, arrival_s=100.0)
    assert engine.abort("future")
    for _ in range(12):
        engine.step()
    running = [r.request_id for r in engine.scheduler.running]
    waiting = [r.request_id for r in engine.scheduler.waiting]
    assert running
    for rid in running[:3] + waiting[:3]:
        assert engine.abort(rid)
    assert not engine.abort("no-such-request")
    finished = []
    while (res := engine.step(max_steps=16)) is not None:
        finished += [(e.request_id, e.finish_reason) for e in res.events if e.kind == FINISHED]
    aborted = {rid for rid, why in finished if why == "abort"}
    assert set(running[:3] + waiting[:3]) <= aborted
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1
    assert not engine.has_unfinished()


def test_n_fans_out_and_siblings_share_the_prompt_blocks():
    engine = make_engine()
    ids = engine.add_request("p", list(range(320)), 8, ignore_eos=True, n=3)
    assert ids == ["0_p", "1_p", "2_p"]
    res = engine.step()
    assert [e.request_id for e in res.events if e.kind == SCHEDULED] == ids
    cached = [engine.get_request(i).num_cached_tokens for i in ids]
    assert cached[0] == 0 and cached[1] == cached[2] == 304        # 19 full blocks, last one recomputed
    assert engine.abort("p")                                        # the parent id aborts all children
    assert engine.get_request("0_p") is None


def test_max_model_len_ends_generation_with_length():
    engine = make_engine(max_model_len=256)
    engine.add_request("r", list(range(200)), 1000)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", list(range(300)), 10)
    reasons = []
    count = 0
    while (res := engine.step(max_steps=64)) is not None:
        for e in res.events:
            if e.kind == FINISHED:
                reasons.append(e.finish_reason)
            if e.kind in (TOKENS, FIRST_TOKEN):
                count += e.num_tokens
    assert count == 56 and reasons == ["length"]


def test_closed_loop_concurrency_is_respected():
    cfg = make_config()
    samples = [SampleRequest(list(range(i * 7, i * 7 + 500)), 500, 64) for i in range(40)]
    res = run_fast_forward(cfg, samples, [0.0] * 40, max_concurrency=4, ignore_eos=True)
    intervals = sorted((r.start_s, r.start_s + r.latency_s) for r in res.records)
    for t, _ in intervals:
        in_flight = sum(1 for s, e in intervals if s <= t < e)
        assert in_flight <= 4
    assert all(r.output_len == 64 for r in res.records)
    # closed loop: each client sends its next request when the previous finishes
    assert sum(1 for s, _ in intervals if s == 0.0) == 4


def _scheduled_step(engine, rid: str) -> int:
    """Step (global index) at which ``rid`` is first scheduled, running the engine one step at a time."""
    while (res := engine.step()) is not None:
        for e in res.events:
            if e.kind == SCHEDULED and e.request_id == rid:
                return e.step_index
    raise AssertionError(f"{rid} never scheduled")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_takes_a_request_arriving_mid_step_a_step_later(async_scheduling):
    # vLLM's engine core schedules step k+1 as step k starts on the GPU: a request that comes in while step k runs
    # misses k+1 (a synchronous engine's next step) and starts in k+2
    engine = make_engine(async_scheduling=async_scheduling)
    engine.add_request("a", list(range(200)), 50, ignore_eos=True)
    for _ in range(5):
        res = engine.step()
    k, end_k = res.first_step_index, res.end_s
    engine.add_request("b", list(range(1000, 1300)), 5, ignore_eos=True, arrival_s=end_k - 1e-4)   # during step k
    assert _scheduled_step(engine, "b") == k + (2 if async_scheduling else 1)


def test_async_scheduling_starts_at_once_on_an_idle_engine():
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", list(range(200)), 3, ignore_eos=True)
    while engine.step() is not None:
        pass
    engine.add_request("b", list(range(1000, 1300)), 3, ignore_eos=True, arrival_s=engine.now_s + 0.5)
    res = engine.step()
    assert res.start_s == pytest.approx(engine.get_request("b").arrival_s)
    assert [e.request_id for e in res.events if e.kind == SCHEDULED] == ["b"]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_frees_a_finished_requests_seat_a_step_later(async_scheduling):
    # max_num_seqs 2: "c" waits for a seat; "b" takes its last token in step f. vLLM frees b's seat when it processes
    # step f's output, after step f+1 was scheduled: c starts in f+2 (f+1 synchronously)
    engine = make_engine(max_num_seqs=2, async_scheduling=async_scheduling)
    engine.add_request("a", list(range(100)), 40, ignore_eos=True)
    engine.add_request("b", list(range(500, 600)), 4, ignore_eos=True)
    engine.add_request("c", list(range(900, 1000)), 4, ignore_eos=True)
    finished = scheduled = None
    while (res := engine.step()) is not None and scheduled is None:
        for e in res.events:
            if e.kind == FINISHED and e.request_id == "b":
                finished = e.step_index
            if e.kind == SCHEDULED and e.request_id == "c":
                scheduled = e.step_index
    assert finished is not None and scheduled == finished + (2 if async_scheduling else 1)


def test_a_request_held_back_by_async_scheduling_and_aborted_leaves_nothing_behind():
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", list(range(200)), 2, ignore_eos=True)
    engine.step()                                       # a's prefill: its first token
    engine.add_request("b", list(range(1000, 1300)), 5, ignore_eos=True)      # mid-run: held back a step
    res = engine.step()                                 # a's last token; b not taken in yet
    assert [e.request_id for e in res.events if e.kind == FINISHED] == ["a"] and engine.num_waiting == 0
    free = engine.kv.num_free_blocks
    assert engine.abort("b")
    assert not engine.has_unfinished() and engine.step() is None   # a server would stop stepping here
    assert engine.kv.num_free_blocks == free
