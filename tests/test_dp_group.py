"""Data and expert parallelism: the DP group's router, independent ranks, the MoE lockstep and its all-to-all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.loadgen.validate import format_validation, validate_run
from kernelsight.simcore import kernels as K
from kernelsight.simcore.comm import comm_bus_factor
from kernelsight.simcore.dp_group import DUMMY_BATCH, DPGroup, GroupMoEStepModel, LockstepStepModel
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN
from kernelsight.simcore.engine_config import EngineArgs, build_dp_group, build_engine
from kernelsight.simcore.expert_parallel import ALL2ALL_BACKENDS, all2all_s, dispatch_combine_messages
from kernelsight.simcore.step_model import StepModel

DENSE = dict(model="meta-llama/Llama-3.1-8B", hardware="h100", max_model_len=4096, max_num_seqs=16,
             max_num_batched_tokens=1024)
MOE = dict(model="Qwen/Qwen3-30B-A3B-Instruct-2507", hardware="rtx-pro-6000", max_model_len=8192, max_num_seqs=64,
           max_num_batched_tokens=2048)


def _requests(n: int, seed: int = 0) -> list[tuple[str, list[int], int, float]]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.05, n))
    return [(f"r{i}", rng.integers(1, 30000, int(rng.integers(20, 400))).tolist(), int(rng.integers(5, 60)),
             float(t[i])) for i in range(n)]


def _drive_group(group: DPGroup) -> dict[str, tuple[float, float]]:
    """{request id: (first token time, finish time)} of a group stepped one step at a time."""
    ends: list[list[float]] = [[] for _ in range(group.size)]
    first: dict[str, tuple[int, int]] = {}
    done: dict[str, tuple[int, int]] = {}
    while (step := group.step(1)) is not None:
        for rank, res in step:
            ends[rank].extend(res.step_end_s)
            for ev in res.events:
                if ev.kind == FIRST_TOKEN:
                    first[ev.request_id] = (rank, ev.step_index)
                elif ev.kind == FINISHED:
                    done[ev.request_id] = (rank, ev.step_index)
    return {rid: (ends[r][i], ends[done[rid][0]][done[rid][1]]) for rid, (r, i) in first.items()}


def _drive_engine(engine) -> dict[str, tuple[float, float]]:
    ends: list[float] = []
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    while (res := engine.step(1)) is not None:
        ends.extend(res.step_end_s)
        for ev in res.events:
            if ev.kind == FIRST_TOKEN:
                first[ev.request_id] = ev.step_index
            elif ev.kind == FINISHED:
                done[ev.request_id] = ev.step_index
    return {rid: (ends[i], ends[done[rid]]) for rid, i in first.items()}


def test_dense_ranks_are_independent_engines_each_timed_as_one_engine_with_its_share():
    cfg = create_engine_config(EngineArgs(**DENSE, data_parallel_size=2))
    group = build_dp_group(cfg, per_token_events=False)
    assert group.moe is None
    reqs = _requests(40)
    for rid, prompt, max_tokens, t in reqs:
        group.add_request(rid, prompt, max_tokens, arrival_s=t, ignore_eos=True)
    grouped = _drive_group(group)
    assert len(grouped) == 40
    shares = [[r for r in reqs if group.rank_of[r[0]] == rank] for rank in (0, 1)]
    assert min(len(s) for s in shares) >= 12          # the load was split, not sent to one rank
    for share in shares:
        alone = build_engine(cfg, per_token_events=False)
        for rid, prompt, max_tokens, t in share:
            alone.add_request(rid, prompt, max_tokens, arrival_s=t, ignore_eos=True)
        for rid, times in _drive_engine(alone).items():
            assert grouped[rid] == pytest.approx(times, rel=1e-12, abs=1e-12)


def test_the_router_picks_the_lowest_four_times_waiting_plus_running_and_honours_a_named_rank():
    cfg = create_engine_config(EngineArgs(**DENSE, data_parallel_size=3))
    group = build_dp_group(cfg)
    prompt = list(range(1, 50))
    # rank 0: one waiting (score 4); rank 1: three running after a step (score 3); rank 2 gets a named request
    for i in range(3):
        group.add_request(f"a{i}", prompt, 100, arrival_s=0.0, rank=1)
    group.add_request("b", prompt, 100, arrival_s=0.0, rank=2)
    group.step()          # routes the four, steps rank 1 (furthest behind, lowest index among equals)
    assert group.rank_of == {"a0": 1, "a1": 1, "a2": 1, "b": 2}
    e0, e1, e2 = group.engines
    assert (e1.num_running, e1.num_waiting, e2.num_waiting) == (3, 0, 1)
    assert group.pick_rank() == 0          # scores 0, 3, 4
    e0.add_request("c", prompt, 100)       # rank 0 now scores 4 (waiting), rank 1 scores 3
    assert group.pick_rank() == 1
    with pytest.raises(ValueError, match="rank 3 out of range"):
        group.add_request("d", prompt, 10, arrival_s=0.0, rank=3)


def test_a_burst_is_spread_evenly_over_the_ranks():
    cfg = create_engine_config(EngineArgs(**DENSE, data_parallel_size=4))
    group = build_dp_group(cfg)
    for i in range(40):
        group.add_request(f"r{i}", list(range(1, 100)), 20, arrival_s=0.0)
    group.step()
    counts = [sum(1 for r in group.rank_of.values() if r == k) for k in range(4)]
    assert counts == [10, 10, 10, 10]


def _moe_group(**kw):
    cfg = create_engine_config(EngineArgs(**MOE, data_parallel_size=2, enable_expert_parallel=True, **kw))
    return cfg, build_dp_group(cfg, per_token_events=False)


def test_an_expert_parallel_step_lasts_the_slowest_rank_plus_the_all_to_all():
    cfg, group = _moe_group()
    assert cfg.expert_parallel and group.moe is not None
    assert all(isinstance(e.step_model, LockstepStepModel) for e in group.engines)
    for i in range(6):    # rank 0: a long prefill; rank 1: short prompts
        group.add_request(f"r{i}", list(range(1, (1500 if i == 0 else 30) + 1)), 8, arrival_s=0.0,
                          rank=0 if i == 0 else 1)
    step = group.step()
    assert [r for r, _ in step] == [0, 1]
    (_, r0), (_, r1) = step
    assert r0.end_s == r1.end_s == group.now_s > 0
    rows = max(e.step_model.padded_rows(e.step_model.last_batch) for e in group.engines)
    assert rows >= 1500     # both ranks run the larger rank's padded rows
    moe_s, comm_s = group.moe.moe_and_comm_s(group.engines[0].step_model, rows)
    own = [e.step_model.priced(e.step_model.last_batch, rows)[1] for e in group.engines]
    own = [t - bd for t, bd in zip(own, (e.step_model.priced(e.step_model.last_batch, rows)[0][
        K.FAMILIES.index(K.MOE_GEMM)] for e in group.engines), strict=True)]
    duration = r0.end_s
    assert duration == pytest.approx(max(o + moe_s for o in own) + comm_s, rel=1e-12)
    assert duration > max(o + moe_s for o in own) and comm_s > 0
    st = group.stats
    assert st[1].sync_wait_s > 0 and st[0].sync_wait_s == pytest.approx(0, abs=1e-12)   # rank 1 waited for rank 0
    assert st[0].all2all_s == st[1].all2all_s == comm_s


def test_a_lockstep_ranks_token_parallel_kernels_run_at_the_groups_padded_rows():
    """vLLM pads every DP rank's forward pass to the largest rank's tokens: the short rank's GEMMs cost the long
    rank's, not its own (a regression: StepModel.step reached the unpadded graph-mode hook)."""
    cfg, group = _moe_group()
    group.add_request("long", list(range(1, 1501)), 8, arrival_s=0.0, rank=0)
    group.add_request("short", list(range(1, 31)), 8, arrival_s=0.0, rank=1)
    group.step()
    (m0, b0), (m1, b1) = [(e.step_model, e.step_model.last_batch) for e in group.engines]
    rows = max(m0.padded_rows(b0), m1.padded_rows(b1))
    assert m1.padded_rows(b1) < rows
    gemm = K.FAMILIES.index(K.GEMM)
    padded_short = m1.priced(b1, rows)[0][gemm]
    assert padded_short == pytest.approx(m0.priced(b0, rows)[0][gemm], rel=1e-12)
    assert padded_short > m1.priced(b1, 1)[0][gemm]       # its own rows alone cost less


def test_an_idle_rank_runs_dummy_batches_and_slows_a_lone_request_by_the_group_overhead():
    cfg, group = _moe_group()
    group.add_request("solo", list(range(1, 200)), 40, arrival_s=0.0)
    lockstep = _drive_group(group)["solo"]
    st = group.stats
    assert st[0].num_requests == 1 and st[1].num_requests == 0
    assert st[1].num_dummy_steps == st[0].num_steps == 40
    # the same request on one GPU holding every expert: no all-to-all, but all 128 experts' weights
    alone_cfg = create_engine_config(EngineArgs(**MOE))
    e = build_engine(alone_cfg, per_token_events=False)
    e.add_request("solo", list(range(1, 200)), 40, arrival_s=0.0)
    single = _drive_engine(e)["solo"]
    comm_per_step = st[0].all2all_s / st[0].num_steps
    assert comm_per_step > 0
    # the dummy batch's rows are priced too: the lockstep time is the rank's own + all-to-all, never below it
    assert lockstep[1] == pytest.approx(st[0].own_s + st[0].all2all_s + st[0].sync_wait_s, rel=1e-9)
    assert lockstep != single
    assert group.engines[1].step_model.padded_rows(DUMMY_BATCH) == 1


@pytest.mark.parametrize("backend", ALL2ALL_BACKENDS)
def test_all_to_all_time_is_never_below_its_bus_bytes_over_the_link(backend):
    cfg = create_engine_config(EngineArgs(**MOE, data_parallel_size=2, enable_expert_parallel=True))
    m, hw = cfg.model, cfg.hardware
    for rows in (1, 64, 2048):
        t = all2all_s(backend, m, rows, 2, hw, cfg.calibration.comm, cfg.precision)
        (op_d, b_d), (op_c, b_c) = dispatch_combine_messages(backend, m, rows, 2, cfg.precision)
        floor = m.num_moe_layers * (comm_bus_factor(op_d, 2) * b_d + comm_bus_factor(op_c, 2) * b_c)
        assert t >= floor / hw.intra_node_bytes_per_s > 0
    big = all2all_s(backend, m, 4096, 2, hw, cfg.calibration.comm, cfg.precision)
    assert big > all2all_s(backend, m, 16, 2, hw, cfg.calibration.comm, cfg.precision)


def test_expert_parallel_splits_the_experts_and_the_imbalance_flag_slows_the_busiest_rank():
    base = create_engine_config(EngineArgs(**MOE))
    ep = create_engine_config(EngineArgs(**MOE, data_parallel_size=2, enable_expert_parallel=True))
    assert ep.memory.weight_bytes < 0.6 * base.memory.weight_bytes     # experts are ~95% of Qwen3-30B-A3B
    assert ep.num_gpu_blocks > base.num_gpu_blocks
    _, even = _moe_group(expert_load_imbalance=1.0)
    _, skew = _moe_group(expert_load_imbalance=1.5)
    sm = even.engines[0].step_model
    assert skew.moe.moe_and_comm_s(sm, 512)[0] > even.moe.moe_and_comm_s(sm, 512)[0]
    assert skew.moe.moe_and_comm_s(sm, 512)[1] == even.moe.moe_and_comm_s(sm, 512)[1]


@pytest.mark.parametrize("bad, msg", [(dict(data_parallel_rank=2), "data_parallel_rank must be in"),
                                      (dict(all2all_backend="nope"), "all2all_backend must be one of"),
                                      (dict(expert_load_imbalance=0.5), "expert_load_imbalance must be")])
def test_bad_parallel_arguments_are_one_line_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        create_engine_config(EngineArgs(**MOE, **{"data_parallel_size": 2, **bad}))


def _samples(n: int) -> tuple[list[SampleRequest], list[float]]:
    reqs = _requests(n, seed=3)
    return ([SampleRequest(p, len(p), k) for _, p, k, _ in reqs], [t for *_, t in reqs])


def test_fast_forward_reports_every_rank_and_is_deterministic():
    cfg = create_engine_config(EngineArgs(**MOE, data_parallel_size=2, enable_expert_parallel=True))
    samples, arrivals = _samples(40)
    a = run_fast_forward(cfg, samples, arrivals, record_timeline=True)
    b = run_fast_forward(cfg, samples, arrivals, record_timeline=True)
    assert [r.ttft_s for r in a.records] == [r.ttft_s for r in b.records]
    assert all(r.success for r in a.records)
    ranks = a.simulator_stats()["data_parallel_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and sum(r["requests"] for r in ranks) == 40
    for r in ranks:
        assert r["all2all_s"] > 0 and r["peak_kv_usage"] > 0 and r["breakdown_s"]["moe_gemm"] > 0
    json.dumps(a.simulator_stats())      # plain numbers (the result JSON)
    times = [row[0] for row in a.timeline]
    assert times == sorted(times) and max(row[1] for row in a.timeline) > 1


def test_a_run_directory_of_a_dp2_ep_run_validates(tmp_path):
    reqs = [(300, 20, 10.0 + 0.1 * i, 10.2 + 0.1 * i, 10.6 + 0.1 * i) for i in range(12)]
    meta = {"model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "vllm_version": "0.19.0", "tick_seconds": 1.0,
            "engine_kwargs": {"model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "tensor_parallel_size": 1,
                              "data_parallel_size": 2, "enable_expert_parallel": True, "max_num_seqs": 64,
                              "max_num_batched_tokens": 2048, "max_model_len": 8192, "seed": 42},
            "hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps(meta))
    (run / "requests.jsonl").write_text("".join(
        json.dumps({"request_id": f"r{i}", "input_toks": a, "output_toks": b, "queued_ts": q, "first_token_ts": f,
                    "last_token_ts": e}) + "\n" for i, (a, b, q, f, e) in enumerate(reqs)))
    (run / "timeseries.csv").write_text("t,prompt_throughput,gen_throughput,running,waiting,kv_cache_pct\n"
                                        "1.0,3600,200,4,0,0.5\n2.0,0,40,1,0,0.1\n")
    v = validate_run(run)
    c = v.result["config"]
    assert (c["data_parallel_size"], c["enable_expert_parallel"], c["all2all_backend"]) == \
        (2, True, "allgather_reducescatter")
    ranks = v.result["simulator"]["data_parallel_ranks"]
    counts = [r["requests"] for r in ranks]
    assert sum(counts) == 12 and min(counts) >= 4         # a steady stream is shared between the ranks
    assert all(r.success for r in v.sim.records)
    report = format_validation(v.result)
    assert "simulated data-parallel ranks" in report and "(TP 1, DP 2, EP, " in report.splitlines()[0]
    assert v.result["work_pricing"] is None      # one engine's pricing of a tick's work does not apply


def test_one_rank_stepped_alone_prices_its_moe_as_the_groups_and_equals_a_lockstep_of_equal_ranks():
    cfg, group = _moe_group()
    alone = build_engine(cfg, per_token_events=False)
    assert isinstance(alone.step_model, GroupMoEStepModel)
    prompt = list(range(1, 301))
    for rank in (0, 1):
        group.add_request(f"r{rank}", prompt, 4, arrival_s=0.0, rank=rank)
    alone.add_request("r", prompt, 4, arrival_s=0.0)
    (_, lock), _ = group.step()
    solo = alone.step()
    assert solo.end_s == pytest.approx(lock.end_s, rel=1e-12)
    plain = create_engine_config(EngineArgs(**MOE))      # one GPU: every expert local, no all-to-all
    assert build_engine(plain).step_model.__class__ is StepModel


def test_the_router_sees_counts_published_every_100_ms_plus_its_own_assignments():
    cfg = create_engine_config(EngineArgs(**DENSE, data_parallel_size=2))
    group = build_dp_group(cfg)
    prompt = list(range(1, 20))
    for rid, t in (("a", 0.0), ("b", 0.05), ("c", 0.15)):
        group.add_request(rid, prompt, 1, arrival_s=t)
    times = _drive_group(group)
    assert times["a"][1] < 0.05              # "a" was done before "b" arrived ...
    # ... but the front end still counted it waiting on rank 0 until the 0.1 s publication
    assert group.rank_of == {"a": 0, "b": 1, "c": 0}


def test_requests_submitted_straight_to_a_rank_step_as_routed_ones_and_until_bounds_an_idle_jump():
    """The real-time server picks a rank itself and submits to its engine (a future arrival the engine holds): the
    lockstep is the same as for requests the group routes, and an idle group never jumps past ``until_s``."""
    _, routed = _moe_group()
    _, direct = _moe_group()
    prompt = list(range(1, 400))
    routed.add_request("a", prompt, 6, arrival_s=0.25, rank=1)
    direct.engines[1].add_request("a", prompt, 6, arrival_s=0.25)
    assert direct.next_event_s() == 0.25
    assert direct.step(until_s=0.2) is None and direct.now_s == 0.0      # not arrived by then: no clock jump
    assert _drive_group(direct) == _drive_group(routed)
    assert [(s.num_steps, s.num_dummy_steps) for s in direct.stats] == [(0, 6), (6, 0)]
    direct.idle_until(5.0)
    assert direct.now_s == 5.0 and all(e.now_s == 5.0 for e in direct.engines)


def test_a_step_time_factor_slows_every_part_of_a_lockstep_step_alike():
    _, base = _moe_group()
    _, slow = _moe_group()
    slow.step_time_factor = 3.0
    for g in (base, slow):
        g.add_request("a", list(range(1, 300)), 4, arrival_s=0.0, rank=0)
    (_, r_base), = base.step()
    (_, r_slow), = slow.step()
    assert r_slow.end_s == pytest.approx(3 * r_base.end_s, rel=1e-12)
    assert r_slow.breakdown_s == pytest.approx(3 * r_base.breakdown_s, rel=1e-12)
    assert slow.stats[0].all2all_s == pytest.approx(3 * base.stats[0].all2all_s, rel=1e-12)
    assert slow.stats[1].num_dummy_steps == 1
