"""Speculative decoding on a data-parallel MoE group (DP attention + EP + MTP, today's DeepSeek deployment): each
rank drafts and verifies its own batch, the group steps in lockstep, and every forward pass of a step (the target's
verify pass, each of the drafter's passes) is a group pass with its own MoE dispatch/combine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.datasets import random_dataset
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.simcore.dp_group import DUMMY_BATCH, GroupMoESpecStepModel, LockstepSpecStepModel
from kernelsight.simcore.engine_config import EngineArgs, build_dp_group, build_engine, build_step_model
from kernelsight.simcore.expert_parallel import all2all_s
from kernelsight.simcore.kernels import FAMILY_INDEX, BatchShape
from kernelsight.simcore.spec_decode_step import SpecStepModel

# DP2 × TP4 with EP: the 8 GPUs of one H200 node, the MTP module of the checkpoint as the drafter
DEEPSEEK = dict(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=4, data_parallel_size=2,
                enable_expert_parallel=True, max_model_len=4096)
MTP2 = {"method": "mtp", "num_speculative_tokens": 2}
_I_MOE = FAMILY_INDEX["moe_gemm"]


def _run(seed: int = 0, **kw):
    cfg = create_engine_config(EngineArgs(**{**DEEPSEEK, "seed": seed, **kw}))
    samples = random_dataset(40, 500, 100, 0.5, cfg.model.vocab_size, seed=0)
    arrivals = (np.arange(40) * 0.25).tolist()
    return run_fast_forward(cfg, samples, arrivals, ignore_eos=True)


def _tokens_per_rank_step(res) -> float:
    return sum(r.output_len for r in res.records) / sum(rank["steps"] for rank in res.ranks)


def test_mtp_on_a_dp2_ep_group_makes_more_tokens_per_step_and_lowers_tpot():
    plain, mtp = _run(), _run(speculative_config=MTP2)
    assert all(r.success for r in mtp.records)
    assert sum(r.output_len for r in mtp.records) == sum(r.output_len for r in plain.records)
    spec = mtp.spec_decode
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] > 1.5
    # both ranks drafted (their counters are summed over the group's engines)
    assert all(rank["requests"] > 0 and rank["steps"] > 0 for rank in mtp.ranks)
    # (1.25× with the MoE layers priced from their own tables, above 1.3× when the dense GEMM η priced them: the run
    # is arrival-bound, so shorter steps leave more of them prefill-only or nearly empty; TPOT below is the payoff)
    assert _tokens_per_rank_step(mtp) > 1.2 * _tokens_per_rank_step(plain)
    # the report's verify and drafting seconds are the group's: each rank's own work with the MoE GEMMs at the
    # group's size, plus every pass's dispatch/combine (not the rank's MoE at its own rows)
    assert spec["verify_s"] + spec["draft_s"] == pytest.approx(
        sum(rank["own_step_s"] + rank["all2all_s"] for rank in mtp.ranks), rel=1e-5)
    assert 1.0 < spec["estimated_decode_speedup"] < spec["mean_acceptance_length"]

    def median_tpot(res):
        return np.median([(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in res.records])
    assert median_tpot(mtp) < median_tpot(plain)


def test_a_seed_fixes_the_run_and_another_seed_draws_other_acceptances():
    def times(res):
        return [(r.ttft_s, r.latency_s, tuple(r.itl_s)) for r in res.records]
    a, b = _run(seed=3, speculative_config=MTP2), _run(seed=3, speculative_config=MTP2)
    assert times(a) == times(b) and a.ranks == b.ranks
    assert times(_run(seed=4, speculative_config=MTP2)) != times(a)


def _group(spec: dict | None):
    cfg = create_engine_config(EngineArgs(**DEEPSEEK, speculative_config=spec))
    return cfg, build_dp_group(cfg, per_token_events=False)


def _step_deltas(group):
    """One group step: (rank results, duration, each rank's own seconds, the step's all-to-all seconds)."""
    before = [(st.own_s, st.all2all_s) for st in group.stats]
    results = group.step(1)
    if results is None:
        return None, 0.0, [], 0.0
    own = [st.own_s - b[0] for st, b in zip(group.stats, before, strict=True)]
    comm = group.stats[0].all2all_s - before[0][1]
    start, end = results[0][1].start_s, results[0][1].end_s
    return results, end - start, own, comm


def test_each_lockstep_step_lasts_at_least_every_ranks_own_verify_and_draft_work_plus_all_passes_all2all():
    cfg, group = _group(MTP2)
    rng = np.random.default_rng(1)
    for i in range(6):         # uneven: rank 0 gets four requests, rank 1 two
        group.add_request(f"r{i}", rng.integers(1, 30000, 300 + 100 * i).tolist(), 30, arrival_s=0.0,
                          rank=0 if i < 4 else 1)
    standalone = build_step_model(cfg)        # a rank's own verify + draft work, MoE at its own rows
    assert type(standalone) is SpecStepModel
    assert all(type(e.step_model) is LockstepSpecStepModel for e in group.engines)
    drafter = standalone.drafter
    assert drafter.model.num_moe_layers == 1          # the MTP module's decoder layer is a MoE layer

    def all2all(model, rows):
        return all2all_s(cfg.args.all2all_backend, model, rows, 2, cfg.hardware, cfg.calibration.comm, cfg.precision)
    steps = 0
    while (step := _step_deltas(group))[0] is not None:
        results, duration, own, comm = step
        assert len({res.end_s for _, res in results}) == 1                  # the ranks step together
        active = dict(results)
        batches = [e.step_model.last_batch if i in active else DUMMY_BATCH for i, e in enumerate(group.engines)]
        for i in active:
            bd, total = standalone.step(batches[i])
            # the group's step covers this rank's whole step (verify and its k draft passes) apart from the MoE
            # GEMMs, which run at the group's size, plus one dispatch/combine per pass
            assert duration >= total - bd[_I_MOE] + comm - 1e-12
            assert own[i] <= duration - comm + 1e-12
        # one dispatch/combine for the target's MoE layers at the largest rank's rows, and one for the MTP module's
        # MoE layer in each draft pass (every rank drafts, an idle one in its dummy run), at that pass's largest rows
        drafts = [standalone.draft_passes(b) for b in batches]
        assert all(len(d) == MTP2["num_speculative_tokens"] for d in drafts)
        expected = all2all(cfg.model, max(standalone.graph_mode(b)[1] for b in batches))
        expected += sum(all2all(drafter.model, max(d[j][1] for d in drafts)) for j in range(len(drafts[0])))
        assert comm == pytest.approx(expected, rel=1e-12)
        assert comm > all2all(cfg.model, max(standalone.graph_mode(b)[1] for b in batches))
        steps += 1
    assert steps >= 10 and group.stats[1].num_dummy_steps > 0     # rank 1 ran out of work before rank 0


def test_an_idle_rank_runs_the_drafters_dummy_passes_too():
    own_idle = {}
    for name, spec in (("plain", None), ("mtp", MTP2)):
        _, group = _group(spec)
        group.add_request("r", list(range(1, 400)), 20, arrival_s=0.0, rank=0)
        idle = []
        while (step := _step_deltas(group))[0] is not None:
            results, _, own, _ = step
            assert [i for i, _ in results] == [0]
            idle.append(own[1])
        assert group.stats[1].num_dummy_steps == len(idle) and group.stats[1].num_steps == 0
        own_idle[name] = idle[1]              # a decode step of rank 0: rank 1 runs a dummy batch
    _, group = _group(MTP2)
    sm = group.engines[1].step_model
    drafter = sm.drafter
    # with MTP the dummy batch also runs the drafter's k passes (vLLM's drafter dummy_run), each a group pass
    assert own_idle["mtp"] > own_idle["plain"]
    assert len(sm.draft_passes(DUMMY_BATCH)) == MTP2["num_speculative_tokens"]
    assert all(m is drafter for m, _ in sm.draft_passes(DUMMY_BATCH))


def test_serves_per_rank_engine_prices_the_drafters_moe_as_the_groups():
    cfg = create_engine_config(EngineArgs(**DEEPSEEK, speculative_config=MTP2))
    eng = build_engine(cfg)
    sm = eng.step_model
    assert type(sm) is GroupMoESpecStepModel and eng.spec_decoder is not None
    own = build_step_model(cfg)
    batch = BatchShape((), 32, 32 * 900, num_spec_tokens=64)
    (bd, total), (bd_own, total_own) = sm.step(batch), own.step(batch)
    passes = [(sm, sm.graph_mode(batch)[1]), *sm.draft_passes(batch)]
    assert len(passes) == 1 + MTP2["num_speculative_tokens"]
    moe_s = sum(sm.moe.moe_and_comm_s(m, r)[0] for m, r in passes)
    comm_s = sum(all2all_s(cfg.args.all2all_backend, m.model, r, 2, cfg.hardware, cfg.calibration.comm,
                           cfg.precision) for m, r in passes)
    assert bd[_I_MOE] == pytest.approx(moe_s, rel=1e-12)
    assert total == pytest.approx(total_own - bd_own[_I_MOE] + moe_s + comm_s, rel=1e-12)


def test_ngram_on_a_dp_ep_qwen_group_has_no_draft_passes():
    cfg = create_engine_config(EngineArgs(model="Qwen/Qwen3-30B-A3B-Instruct-2507", hardware="h100",
                                          data_parallel_size=2, enable_expert_parallel=True, max_model_len=8192,
                                          speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    group = build_dp_group(cfg)
    sm = group.engines[0].step_model
    assert type(sm) is LockstepSpecStepModel and sm.draft_passes(BatchShape((), 8, 8000, 24)) == []
    res = run_fast_forward(cfg, random_dataset(30, 300, 60, 0.5, cfg.model.vocab_size, seed=0),
                           (np.arange(30) * 0.1).tolist(), ignore_eos=True)
    assert all(r.success for r in res.records) and res.spec_decode["num_accepted_tokens"] > 0
    assert dataclasses.asdict(cfg.args)["speculative_config"]["method"] == "ngram"


def test_serve_dp2_ep_with_ngram_drafts_on_both_ranks():
    pytest.importorskip("fastapi")
    import re

    import httpx

    from kernelsight.server.runner import ServerThread

    model = "Qwen/Qwen3-30B-A3B-Instruct-2507"
    args = ["--model", model, "-dp", "2", "--enable-expert-parallel", "--max-model-len", "2048", "--time-scale", "20",
            "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
    with ServerThread(args) as srv:
        # one lockstep group: every rank's engine is the group's, its step model the lockstep one that drafts
        assert srv.state.lockstep is not None
        assert all(type(b.engine.step_model) is LockstepSpecStepModel for b in srv.state.bridges)
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            for rank in ("0", "1"):
                r = c.post("/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 40,
                                                    "ignore_eos": True}, headers={"X-data-parallel-rank": rank})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
            metrics = c.get("/metrics").text
    drafts = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^vllm:spec_decode_num_drafts_total\{engine="(\d)",[^}]*\} ([0-9.]+)$', metrics, re.M)}
    # each rank verified its own drafts: fewer verify steps than the 39 tokens after the first
    assert set(drafts) == {"0", "1"} and all(0 < n < 39 for n in drafts.values())
