"""Speculative decoding: config checks, seeded acceptance, step pricing, bursts on the stream, /metrics counters."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kernelsight.loadgen.datasets import random_dataset
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.simcore.engine_config import EngineArgs, build_engine, build_step_model, resolve_engine_config
from kernelsight.simcore.kernels import FAMILIES, BatchShape, PrefillChunk
from kernelsight.simcore.spec_decode import (
    DEFAULT_CONDITIONAL_ACCEPTANCE,
    SpecDecoder,
    resolve_speculative_config,
)
from kernelsight.simcore.spec_decode_step import SpecStepModel, verify_step
from kernelsight.simcore.step_model import StepModel
from tests.conftest import make_config

MODEL_8B = "meta-llama/Llama-3.1-8B"
EAGLE = {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}


def synthetic(rates: list[float], base: dict | None = None) -> dict:
    return {**(base or EAGLE), "num_speculative_tokens": len(rates), "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates}


def _ff(spec: dict | None, n: int = 40, out_len: int = 96, seed: int = 0, **kw):
    cfg = make_config(speculative_config=spec, seed=seed, max_num_seqs=16, **kw)
    samples = random_dataset(n, 256, out_len, 0.0, cfg.model.vocab_size, seed=1)
    arrivals = [0.05 * i for i in range(n)]
    return run_fast_forward(cfg, samples, arrivals, ignore_eos=True)


def _mean_tpot_s(res) -> float:
    return float(np.mean([(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in res.records]))


# -- acceptance ------------------------------------------------------------------------------------------------
def test_draws_reproduce_the_configured_per_position_rates():
    """20,000 drafts: each position's empirical rate is within 4 binomial standard deviations (≤ 0.0142 at p=0.5)
    of its configured rate, a bound a correct sampler misses with probability ~6e-5 per position."""
    rates = (0.9, 0.7, 0.45, 0.2)
    spec = resolve_speculative_config(synthetic(list(rates)), 1)
    dec = SpecDecoder(spec, seed=7)
    n = 20_000
    for i in range(n):
        dec.accept(i, 5, 4)
    st = dec.stats
    assert st.num_drafts == n and st.num_draft_tokens == 4 * n
    for p, got in zip(rates, st.acceptance_rates(), strict=True):
        assert abs(got - p) <= 4 * math.sqrt(p * (1 - p) / n), (p, got)
    assert st.mean_acceptance_length == pytest.approx(1 + sum(rates), abs=4 * math.sqrt(4 / n))


def test_default_rates_are_geometric_in_the_documented_conditional_acceptance():
    for method, c in DEFAULT_CONDITIONAL_ACCEPTANCE.items():
        raw = {"method": method, "num_speculative_tokens": 3}
        if method in ("eagle", "eagle3", "draft_model"):
            raw["model"] = "some/draft"
        if method == "mtp":
            continue                                  # needs an MTP-capable target: see the MTP test
        spec = resolve_speculative_config(raw, 1)
        assert spec.acceptance_rates == pytest.approx((c, c * c, c ** 3))


def test_acceptance_length_resolves_to_vllms_minimum_variance_rates():
    spec = resolve_speculative_config({**EAGLE, "num_speculative_tokens": 4, "rejection_sample_method": "synthetic",
                                       "synthetic_acceptance_length": 2.5}, 1)
    assert spec.acceptance_rates == (1.0, 0.5, 0.0, 0.0)


def test_a_whole_run_accepts_at_the_configured_rates_and_is_deterministic():
    rates = [0.8, 0.5, 0.3]
    a = _ff(synthetic(rates))
    sd = a.spec_decode
    n = sd["num_drafts"]
    assert n > 1000                               # 40 requests × 95 decode tokens / 2.6 per draft
    for p, got in zip(rates, sd["acceptance_rate_per_pos"], strict=True):
        assert abs(got - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-4, (p, got)   # + the summary's rounding
    # every request still gets exactly its tokens
    assert all(r.output_len == 96 for r in a.records)
    b = _ff(synthetic(rates))
    assert [(r.ttft_s, r.latency_s, list(r.itl_s)) for r in a.records] == \
        [(r.ttft_s, r.latency_s, list(r.itl_s)) for r in b.records]
    assert b.spec_decode == sd
    c = _ff(synthetic(rates), seed=1)
    assert c.spec_decode["num_accepted_tokens_per_pos"] != sd["num_accepted_tokens_per_pos"]


def test_tpot_falls_as_acceptance_rises():
    tpots = [_mean_tpot_s(_ff(synthetic(r), n=16)) for r in ([0.2, 0.05, 0.01], [0.6, 0.35, 0.2],
                                                              [0.95, 0.9, 0.85])]
    assert tpots[0] > tpots[1] > tpots[2]
    # all drafts accepted with k=3: four tokens per step, so TPOT is well under half of the low-acceptance one
    assert tpots[2] < 0.5 * tpots[0]


def test_bursts_reach_the_tracker_as_one_chunk_per_step():
    """With every draft accepted, a request of 1 + 4m tokens gets its first token, then m chunks of 4 (one ITL each)."""
    res = _ff(synthetic([1.0, 1.0, 1.0]), n=4, out_len=41)
    for r in res.records:
        assert r.output_len == 41 and len(r.itl_s) == 10


# -- pricing ----------------------------------------------------------------------------------------------------
def _spec_sm(spec: dict, **kw) -> SpecStepModel:
    sm = build_step_model(make_config(speculative_config=spec, **kw))
    assert isinstance(sm, SpecStepModel)
    return sm


def test_draft_cost_is_linear_in_k_and_zero_on_the_gpu_for_ngram():
    batch = BatchShape((), 120, 120 * 1500, 0)     # 120 rows: a CUDA-graph size for every k (multiples of 1 + k)
    draft_s = {}
    for k in (1, 2, 4):
        sm = _spec_sm({"model": "meta-llama/Llama-3.1-8B", "num_speculative_tokens": k},
                      model="meta-llama/Llama-3.1-70B", tensor_parallel_size=4)
        draft_s[k] = sm.draft(batch)[1]
    # one pass over the step's rows, then k-1 equal decode passes
    assert draft_s[1] < draft_s[2] < draft_s[4]
    assert draft_s[4] - draft_s[2] == pytest.approx(2 * (draft_s[2] - draft_s[1]), rel=1e-9)
    ngram = _spec_sm({"method": "ngram", "num_speculative_tokens": 4})
    out, t = ngram.draft(batch)
    assert t > 0 and out.sum() == pytest.approx(t) and out[-1] == pytest.approx(t)   # host time only


def test_verification_is_priced_on_one_plus_k_rows_per_decode():
    sm = _spec_sm(EAGLE)
    plain = StepModel.step(sm, BatchShape((), 64, 64 * 2000))
    verify = [verify_step(sm, BatchShape((), 64, 64 * (2000 + k), 64 * k), 64 * (1 + k)) for k in (1, 3, 7)]
    assert plain[1] < verify[0][1] < verify[1][1] < verify[2][1]
    # the GEMMs are those of 64·(1+k) rows, as a plain step of that many decodes prices them
    for k, (out, _) in zip((1, 3, 7), verify, strict=True):
        assert out[FAMILIES.index("gemm")] == pytest.approx(
            StepModel.step(sm, BatchShape((), 64 * (1 + k), 64 * (1 + k) * 2000))[0][FAMILIES.index("gemm")])
    # attention reads each request's KV once: more than a decode's, far less than 1+k decodes'
    attn = FAMILIES.index("attn_decode")
    assert plain[0][attn] < verify[2][0][attn] < 2 * plain[0][attn]


def test_eagle_reserves_lookahead_slots_ngram_does_not():
    def blocks_after_first_step(spec: dict) -> int:
        eng = build_engine(make_config(speculative_config=spec))
        eng.add_request("r", list(range(1, 15)), 8)       # 14 prompt tokens: one block, 17 with 3 lookahead
        eng.step()
        return len(eng.get_request("r").block_ids)
    assert blocks_after_first_step(EAGLE) == 2
    assert blocks_after_first_step({"method": "ngram", "num_speculative_tokens": 3}) == 1


def test_draft_weights_and_kv_take_memory():
    base = make_config()
    eagle = make_config(speculative_config=EAGLE)
    layer_bytes = eagle.memory.weight_bytes - base.memory.weight_bytes
    assert 0.3e9 < layer_bytes < 0.6e9                           # one Llama-3.1-8B decoder layer in bf16
    assert eagle.num_gpu_blocks < base.num_gpu_blocks
    assert make_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).num_gpu_blocks == \
        base.num_gpu_blocks


def test_an_mtp_module_holds_its_norms_and_bf16_eh_proj_beside_its_decoder_layer():
    # vLLM's deepseek_mtp: enorm, hnorm and shared_head.norm (RMSNorms of h) and eh_proj (nn.Linear 2h → h, no bias),
    # built in the model dtype outside the quantization config and replicated on every TP rank; the decoder layer
    # is the one an EAGLE head of the target's shape has (the embedding and LM head are the target's)
    from kernelsight.profiles import _package_dir
    from kernelsight.simcore.engine_config import _draft_memory

    config = json.loads((_package_dir("models") / "deepseek-ai--DeepSeek-V3.json").read_text())
    h, experts, inter = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    assert config["num_nextn_predict_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    extra = (3 * h + 2 * h * h) * 2
    mtp, eagle = {"method": "mtp", "num_speculative_tokens": 1}, {**EAGLE, "num_speculative_tokens": 1}
    for parallel in (dict(tensor_parallel_size=8), dict(tensor_parallel_size=4, data_parallel_size=2,
                                                        enable_expert_parallel=True)):
        kw = dict(model="deepseek-ai/DeepSeek-V3", hardware="h200", max_model_len=4096, **parallel)
        with_mtp, with_eagle = make_config(speculative_config=mtp, **kw), make_config(speculative_config=eagle, **kw)
        assert with_mtp.memory.weight_bytes - with_eagle.memory.weight_bytes == extra     # not divided by TP
    # the module's MoE layer splits its experts over a data-parallel group's ranks as the target's layers do
    # (DeepSeek-V3's experts are fp8: one byte per parameter)
    split = [_draft_memory(with_mtp.speculative, with_mtp.draft_model, with_mtp.model, with_mtp.precision,
                           ep)["draft_weight_bytes"] for ep in (1, 2)]
    assert split[0] - split[1] == experts * 3 * h * inter * 1.0 / 4 / 2


def test_the_mtp_hook_reads_the_models_mtp_modules(llama8b):
    from kernelsight.simcore.spec_decode_step import mtp_layers

    assert mtp_layers(llama8b) == 0
    assert mtp_layers(dataclasses.replace(llama8b, num_mtp_layers=2)) == 2


def test_mtp_uses_the_targets_mtp_layers(llama8b, h100):
    from kernelsight import profiles

    calib = profiles.load_calibration(h100.name)
    mtp_model = dataclasses.replace(llama8b, num_mtp_layers=1)
    cfg = resolve_engine_config(EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                                           max_model_len=8192), mtp_model, h100, calib)
    assert cfg.speculative.method == "mtp" and cfg.draft_model.num_layers == 1
    assert cfg.speculative.acceptance_rates[0] == DEFAULT_CONDITIONAL_ACCEPTANCE["mtp"]
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        resolve_engine_config(EngineArgs(speculative_config={"method": "mtp"}), llama8b, h100, calib)
    cfg = resolve_engine_config(EngineArgs(speculative_config={"method": "deepseek_mtp"}, max_model_len=8192),
                                mtp_model, h100, calib)
    assert cfg.speculative.method == "mtp" and cfg.speculative.num_speculative_tokens == 1


# -- bad configs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, says", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "num_speculative_tokens was provided but without speculative"),
    ({"method": "foo", "num_speculative_tokens": 3}, "Unsupported speculative method: 'foo'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer greater"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
    ({**EAGLE, "tensor_parallel_size": 2}, "Please pass 'draft_tensor_parallel_size' instead"),
    ({**EAGLE, "draft_tensor_parallel_size": 2}, "cannot be other value than 1 or target model"),
    ({"model": "x/eagle", "method": "eagle"}, "`num_speculative_tokens` was not provided"),
    (synthetic([0.5, 0.6]), "synthetic_acceptance_rates must be non-increasing"),
    ({**EAGLE, "synthetic_acceptance_rates": [0.5, 0.4, 0.3]}, "only valid when rejection_sample_method"),
    ({**EAGLE, "bogus": 1}, "Unexpected keyword argument"),
])
def test_bad_configs_fail_with_vllms_messages(raw, says):
    with pytest.raises(ValueError, match=None) as exc:
        resolve_speculative_config(raw, 1)
    assert says in str(exc.value)


@pytest.mark.parametrize("cmd, flags, says", [
    ("serve", ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
     "num_speculative_tokens was provided but without speculative model."),
    ("simulate", ["--speculative-config", '{"method": "eagle"'], "invalid JSON"),
    ("simulate", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                  "--speculative-acceptance-rates", "0.5"], "--speculative-acceptance-rates must have length 2"),
])
def test_bad_config_stops_the_command_at_start(cmd, flags, says):
    proc = subprocess.run([sys.executable, "-m", "kernelsight.cli", cmd, *flags, *(
        ["--num-prompts", "2"] if cmd == "simulate" else [])], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert says in lines[0]


def test_eagle_drops_the_last_prefix_hit_block_as_vllm_does():
    def hit_tokens(spec: dict | None) -> int:
        eng = build_engine(make_config(speculative_config=spec))
        prompt = list(range(1, 66))                        # 4 full blocks + 1 token
        eng.add_request("a", prompt, 2)
        while eng.has_unfinished():
            eng.step()
        eng.add_request("b", prompt, 2)
        eng.step()
        return eng.get_request("b").num_cached_tokens
    assert hit_tokens(None) == 64
    assert hit_tokens({"method": "ngram", "num_speculative_tokens": 2}) == 64
    assert hit_tokens(EAGLE) == 48


def test_a_runs_speculative_config_comes_from_its_engine_kwargs():
    from kernelsight.loadgen.vllm_run import engine_args_from_run

    args = engine_args_from_run({"engine_kwargs": {"model": MODEL_8B, "speculative_config": json.dumps(EAGLE)}})
    assert args.speculative_config == EAGLE
    args = engine_args_from_run({"engine_kwargs": {"model": MODEL_8B, "speculative_config": EAGLE}})
    assert args.speculative_config == EAGLE


def test_preemption_under_kv_pressure_keeps_every_token_and_frees_every_block():
    """A KV cache too small for the batch: drafts' slots and lookahead push requests out (recompute), yet each
    request ends with exactly its tokens and the cache is empty afterwards."""
    for spec in (EAGLE, {"method": "ngram", "num_speculative_tokens": 4}):
        cfg = make_config(speculative_config=spec, num_gpu_blocks_override=80, max_num_seqs=16, max_model_len=1024)
        eng = build_engine(cfg, per_token_events=False)
        samples = random_dataset(24, 300, 120, 0.0, cfg.model.vocab_size, seed=3)
        tokens: dict[str, int] = {}
        for i, s in enumerate(samples):
            eng.add_request(f"r{i}", s.prompt_token_ids, 120, ignore_eos=True)
        while eng.has_unfinished():
            res = eng.step()
            for ev in res.events:
                if ev.kind in ("tokens", "first_token"):
                    tokens[ev.request_id] = tokens.get(ev.request_id, 0) + ev.num_tokens
        assert eng.stats.num_preemptions > 0
        assert tokens == {f"r{i}": 120 for i in range(24)}
        assert eng.kv.usage == 0.0 and eng.kv.num_free_blocks == cfg.num_gpu_blocks - 1


def test_drafts_stop_at_max_model_len():
    """vLLM caps a step's tokens at max_model_len - 1 - computed: near the end fewer drafts are verified, and a
    request that runs into the context limit gets exactly the tokens left."""
    cfg = make_config(speculative_config=synthetic([1.0, 1.0, 1.0, 1.0]), max_model_len=300)
    eng = build_engine(cfg)
    eng.add_request("r", list(range(1, 281)), 100, ignore_eos=True)     # 20 tokens fit the context
    bursts = []
    while eng.has_unfinished():
        for ev in eng.step().events:
            if ev.kind in ("tokens", "first_token"):
                bursts.append(ev.num_tokens)
    # first token, three steps of 1 + 4, then 3 drafts only (300 - 1 - 296 computed = 4 tokens may be scheduled)
    assert bursts == [1, 5, 5, 5, 4]
    st = eng.spec_decoder.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (4, 15, 15)


def test_cuda_graph_sizes_follow_vllms_spec_decode_rule():
    base = make_config(max_num_seqs=32).cudagraph_capture_sizes
    sizes = make_config(max_num_seqs=32, speculative_config=EAGLE).cudagraph_capture_sizes
    assert base[-1] == 64                                   # min(2 · 32, 512)
    assert sizes[-1] == 256 and all(s % 4 == 0 for s in sizes)   # min(2 · 32 · 4, 512), multiples of 1 + k
    assert sizes[:4] == (4, 8, 16, 24)


def test_an_mtp_draft_pass_costs_the_one_layer_draft_plus_exactly_the_mtp_input_kernels():
    # method 'mtp' drafts with DeepSeek's MTP module (simcore/mtp.py): the one decoder layer an EAGLE head is, plus
    # enorm, hnorm and eh_proj over the same rows
    from kernelsight.simcore.kernels import FAMILY_INDEX
    from kernelsight.simcore.mtp import MTPStepModel, mtp_input_kernels, mtp_step_kernels

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    cfg = make_config(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=8,
                      speculative_config=spec)
    drafter = build_step_model(cfg).drafter
    assert type(drafter) is MTPStepModel and drafter.model is cfg.draft_model
    plain = StepModel(cfg.draft_model, cfg.hardware, cfg.calibration, cfg.precision, drafter.config)
    kernel_families = [i for f, i in FAMILY_INDEX.items() if f not in ("launch", "host")]
    for batch in (BatchShape((), 32, 32 * 3000), BatchShape((PrefillChunk(700, 0, True),), 5, 5 * 900)):
        m_padded = plain._graph_mode(batch.num_tokens, batch.is_decode_only)[1]
        extra = np.zeros(len(FAMILIES))
        for k in mtp_input_kernels(cfg.model, m_padded, cfg.precision):
            extra[FAMILY_INDEX[k.family]] += plain.kernel_time_s(k)
        assert extra[FAMILY_INDEX["gemm"]] > 0 and extra[FAMILY_INDEX["norm"]] > 0
        (mtp_out, mtp_s), (one_out, one_s) = drafter.step(batch), plain.step(batch)
        assert (mtp_out - one_out)[kernel_families] == pytest.approx(extra[kernel_families], rel=1e-12, abs=1e-15)
        # the drafter's passes run inside the target's step (SpecStepModel.draft drops their host time): on the GPU a
        # decode batch replays a full CUDA graph and the extra kernels add to it; a piecewise (mixed) step may hide
        # them under its exposed launch time
        host = FAMILY_INDEX["host"]
        gpu = (mtp_s - mtp_out[host], one_s - one_out[host])
        assert gpu[0] - gpu[1] == pytest.approx(extra.sum(), rel=1e-9) if batch.is_decode_only else gpu[0] >= gpu[1]
        # the kernels it adds are the ones mtp_step_kernels has beyond a plain layer's
        names = {k.name for k in mtp_step_kernels(cfg.model, batch, 8, cfg.precision, m_padded)}
        assert {k.name for k in mtp_input_kernels(cfg.model, m_padded, cfg.precision)} <= names
        # eh_proj is vLLM's plain nn.Linear: bf16 even in the fp8 checkpoint whose layer GEMMs run fp8
        by_name = {k.name: k for k in mtp_step_kernels(cfg.model, batch, 8, cfg.precision, m_padded)}
        assert by_name["mtp_eh_proj"].dtype == "bf16" and by_name["q_b_proj"].dtype == "fp8"
    eagle = make_config(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=8,
                        speculative_config={"method": "eagle", "model": "x/eagle", "num_speculative_tokens": 1})
    assert type(build_step_model(eagle).drafter) is StepModel


def test_deepseek_v3_with_mtp_runs_end_to_end_in_simulate(capsys):
    from kernelsight.cli import main

    rc = main(["simulate", "--model", "deepseek-ai/DeepSeek-V3", "--hardware", "h200", "-tp", "8",
               "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}', "--num-prompts", "20",
               "--request-rate", "5", "--random-input-len", "600", "--random-output-len", "40", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0 and "Successful requests:                     20" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("Speculative decoding (mtp, k=1)"))
    assert "drafting 0.00 s" not in line
