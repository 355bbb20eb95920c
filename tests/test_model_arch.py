"""MLA (DeepSeek-V3/R1, Kimi K2), gpt-oss (sliding + full layers, MXFP4 experts) and vLLM's hybrid KV allocator."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from kernelsight.profiles import load_model
from kernelsight.server.integrations.kv_events.translate import HashTranslator
from kernelsight.server.integrations.kv_events.wire import _as_map
from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine import FINISHED
from kernelsight.simcore.engine_config import build_engine
from kernelsight.simcore.expert_formats import MXFP4_WEIGHT_BYTES_PER_PARAM
from kernelsight.simcore.hybrid_kv_cache import HybridKVCacheManager, sliding_group_key
from kernelsight.simcore.kernels import BatchShape, PrefillChunk, decompose_step
from kernelsight.simcore.kv_events import BlockRemoved, BlockStored
from kernelsight.simcore.memory import kv_bytes_per_token, plan_memory, weight_bytes_per_rank
from kernelsight.simcore.precision import Precision
from kernelsight.simcore.request import FinishReason, Request
from kernelsight.simcore.roofline import kernel_roofline_s
from tests.conftest import make_config

BS, WINDOW = 16, 128


# -- config arithmetic ------------------------------------------------------------------------------
def test_deepseek_v3_spec_from_its_config() -> None:
    m = load_model("deepseek-ai/DeepSeek-R1")
    assert m.mla is not None and m.mla.latent_dim == 512 + 64 and m.mla.qk_head_dim == 128 + 64
    assert (m.num_kv_heads, m.head_dim) == (1, 576)                     # one latent "head" per token
    assert m.num_moe_layers == 61 - 3                                   # first_k_dense_replace = 3
    assert (m.num_experts, m.experts_per_token, m.shared_expert_intermediate_size) == (256, 8, 2048)
    assert m.num_mtp_layers == 1 and m.quantization == "fp8"
    assert m.fp8_scheme is not None and m.fp8_scheme.block_n == 128 and m.fp8_scheme.block_k == 128
    kimi = load_model("moonshotai/Kimi-K2-Instruct")
    assert (kimi.num_moe_layers, kimi.num_experts, kimi.num_attention_heads, kimi.num_mtp_layers) == (60, 384, 64, 0)


def test_kv_bytes_per_token_per_architecture() -> None:
    bf16, fp8 = Precision(), Precision(kv_dtype="fp8")
    ds = load_model("deepseek-ai/DeepSeek-V3")
    # MLA: one 576-wide latent per layer, whole on every TP rank (nothing to split by heads)
    assert kv_bytes_per_token(ds, bf16, 1) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(ds, bf16, 8) == 61 * 576 * 2
    assert kv_bytes_per_token(ds, fp8, 8) == 61 * 576
    oss = load_model("openai/gpt-oss-20b")
    assert kv_bytes_per_token(oss, bf16, 1) == 24 * 8 * 64 * 2 * 2
    assert kv_bytes_per_token(oss, bf16, 2) == 24 * 4 * 64 * 2 * 2
    big = load_model("openai/gpt-oss-120b")
    assert (big.num_window_layers, big.sliding_window, big.num_layers) == (18, 128, 36)
    assert big.is_hybrid_attention and big.attention_sinks and big.expert_quantization == "mxfp4"


def test_mxfp4_experts_weigh_four_and_a_quarter_bits() -> None:
    oss = load_model("openai/gpt-oss-120b")
    p = Precision()
    experts = oss.num_layers * oss.num_experts * 3 * oss.hidden_size * oss.moe_intermediate_size
    bf16_twin = dataclasses.replace(oss, expert_quantization=None)
    saved = weight_bytes_per_rank(bf16_twin, p, 1) - weight_bytes_per_rank(oss, p, 1)
    assert saved == pytest.approx(experts * (2.0 - MXFP4_WEIGHT_BYTES_PER_PARAM), rel=1e-12)
    # ~117B parameters at 4.25 bits for the experts: fits one 80 GB GPU (as openai ships it for)
    assert 55e9 < weight_bytes_per_rank(oss, p, 1) < 70e9


def test_chunked_local_attention_splits_at_chunk_boundaries() -> None:
    """Llama 4's RoPE layers attend within their 8192-token chunk (vLLM's virtual batches)."""
    from kernelsight.simcore.kernels import chunked_local_decode_context, chunked_local_prefills
    parts = chunked_local_prefills((PrefillChunk(3000, 7000, True),), 8192)
    assert parts == (PrefillChunk(1192, 7000, False), PrefillChunk(1808, 0, True))
    assert chunked_local_decode_context(4, 4 * 9000, 8192) == 4 * (9000 - 8192)
    assert chunked_local_decode_context(4, 4 * 5000, 8192) == 4 * 5000
    cfg = make_config(model="meta-llama/Llama-4-Scout-17B-16E", hardware="h100", tensor_parallel_size=4,
                      max_model_len=32768)
    long = [k for k in decompose_step(cfg.model, BatchShape((), 8, 8 * 20000), 4, cfg.precision)
            if k.family == "attn_decode"]
    assert sorted(k.count for k in long) == [12, 36]
    full = next(k for k in long if k.count == 12)
    chunked = next(k for k in long if k.count == 36)
    assert chunked.flops / full.flops == pytest.approx((20000 - 2 * 8192) / 20000)


def test_nvfp4_checkpoint_runs_the_kernel_vllm_dispatches_for_the_gpu() -> None:
    assert load_model("nvidia/DeepSeek-R1-FP4").quantization == "nvfp4"
    b200 = make_config(model="nvidia/Llama-3.1-8B-Instruct-FP4", hardware="b200").precision
    h100 = make_config(model="nvidia/Llama-3.1-8B-Instruct-FP4", hardware="h100").precision
    assert b200.weight_dtype == h100.weight_dtype == "nvfp4"
    # W4A4 on Blackwell's FP4 tensor cores; Hopper has none, so vLLM's Marlin W4A16 computes in bf16
    assert K.linear_kernel("qkv_proj", 64, 6144, 4096, b200).dtype == "fp4"
    assert K.linear_kernel("qkv_proj", 64, 6144, 4096, h100).dtype == "bf16"


# -- capacity -----------------------------------------------------------------------------------------
def test_hybrid_capacity_vs_dense_twin() -> None:
    """A hybrid block holds one group (half of gpt-oss's layers): twice the blocks of the all-full twin."""
    oss = load_model("openai/gpt-oss-20b")
    twin = dataclasses.replace(oss, sliding_window=None, num_sliding_layers=None)
    cfg = make_config(model="openai/gpt-oss-20b")
    kw = dict(tp=1, block_size=BS, gpu_memory_utilization=0.9, max_model_len=8192,
              max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, max_num_seqs=cfg.scheduler.max_num_seqs)
    hyb = plan_memory(oss, cfg.hardware, cfg.precision, **kw)
    dense = plan_memory(twin, cfg.hardware, cfg.precision, **kw)
    assert hyb.kv_cache_bytes == dense.kv_cache_bytes
    assert hyb.block_bytes * 2 == dense.block_bytes
    assert hyb.num_gpu_blocks == int(hyb.kv_cache_bytes // (dense.block_bytes / 2))
    # tokens a long request costs: every block of the full group, the window's of the sliding group
    length = 8000
    full_blocks = math.ceil(length / BS)
    sw_blocks = math.ceil(length / BS) - (length - WINDOW + 1) // BS
    hybrid_tokens = hyb.num_gpu_blocks // (full_blocks + sw_blocks) * length
    dense_tokens = dense.num_gpu_blocks // full_blocks * length
    # half-size blocks, and the sliding group holds only the window's: 2 x full / (full + window) the requests
    # (up to whole-request rounding: 298 vs 151 requests of 8,000 tokens fit on the H100)
    assert hybrid_tokens / dense_tokens == pytest.approx(2 * full_blocks / (full_blocks + sw_blocks), rel=5e-3)
    # vLLM's "Maximum concurrency" counts the sliding group's window (+ one chunk), not max_model_len, blocks
    sw_tokens = min(WINDOW - 1 + cfg.scheduler.max_num_batched_tokens, 8192)
    per_request = math.ceil(8192 / BS) + math.ceil(sw_tokens / BS) + 1
    assert hyb.max_concurrency(8192, BS) == pytest.approx(hyb.num_gpu_blocks / per_request)
    assert dense.max_concurrency(8192, BS) == pytest.approx(dense.num_gpu_blocks * BS / 8192)


# -- the hybrid allocator ------------------------------------------------------------------------------
def _req(rid: str, n: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, tuple(rng.randrange(1000) for _ in range(n)), 100, 100, FinishReason.LENGTH, 0.0)


def test_sliding_window_blocks_outside_the_window_are_freed() -> None:
    kv = HybridKVCacheManager(400, BS, WINDOW)
    req = _req("a", 1000)
    assert kv.allocate_slots(req, 1000)
    n_blocks = math.ceil(1000 / BS)
    assert len(req.block_ids) == n_blocks and len(kv.sliding_blocks(req)) == n_blocks
    assert kv.num_free_blocks == 399 - 2 * n_blocks          # the whole chunk was written in both groups
    req.num_computed_tokens = 1000
    assert kv.allocate_slots(req, 1)
    skipped = (1000 - WINDOW + 1) // BS                      # blocks wholly before the next token's window
    table = kv.sliding_blocks(req)
    assert table[:skipped] == [0] * skipped and 0 not in table[skipped:]
    assert kv.num_free_blocks == 399 - n_blocks - (n_blocks - skipped)
    # decoding on keeps at most the window's blocks (+1 partly filled) in the sliding group
    for _ in range(300):
        req.num_computed_tokens += 1
        assert kv.allocate_slots(req, 1)
        live = [b for b in kv.sliding_blocks(req) if b]
        assert len(live) <= math.ceil(WINDOW / BS) + 1
    kv.free(req)
    assert kv.num_free_blocks == 399


def test_hybrid_prefix_hit_needs_the_window_cached() -> None:
    kv = HybridKVCacheManager(400, BS, WINDOW)
    a = _req("a", 1000)
    assert kv.allocate_slots(a, 1000)
    a.num_computed_tokens = 1000
    kv.free(a)
    b = Request("b", a.prompt_token_ids + (7,) * 200, 10, 10, FinishReason.LENGTH, 0.0)
    hits, tokens = kv.get_computed_blocks(b)
    assert tokens == (1000 // BS) * BS and len(hits) == 1000 // BS      # every block of a is still cached
    # evict one sliding-window block near the end: the hit ends before it unless 8 contiguous blocks remain
    kv.pool.block_hash[kv.pool.lookup(sliding_group_key(b.block_hashes[60]))] = 0
    hits, tokens = kv.get_computed_blocks(b)
    need = math.ceil((WINDOW - 1) / BS)
    assert need == 8 and tokens == 60 * BS and len(hits) == 60 and len(hits.sw) == 60
    # the sliding group takes only the window's blocks from the hit: null (0) before it, as vLLM's table has
    assert all(x == 0 for x in hits.sw[:60 - need]) and all(x != 0 for x in hits.sw[60 - need:])
    # the hit is usable: the request starts from it and only the window's sliding blocks are taken
    free0 = kv.num_free_blocks
    assert kv.allocate_slots(b, b.num_tokens - tokens, hits, tokens)
    assert kv.num_free_blocks < free0
    kv.free(b)
    assert kv.num_free_blocks == 399


def test_sliding_group_events_carry_group_idx_and_window() -> None:
    kv = HybridKVCacheManager(40, BS, WINDOW)
    kv.enable_events()
    a = _req("a", 200)
    assert kv.allocate_slots(a, 200)
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert {e.group_idx for e in stored} == {0, 1}
    sw = next(e for e in stored if e.group_idx == 1)
    assert sw.sliding_window == WINDOW and sw.keys[0] == sliding_group_key(a.block_hashes[0])
    wire = HashTranslator().translate(stored)
    maps = [_as_map(w) for w in wire]
    full = next(m for m in maps if m["group_idx"] == 0)
    slid = next(m for m in maps if m["group_idx"] == 1)
    assert slid["kv_cache_spec_kind"] == "sliding_window" and slid["kv_cache_spec_sliding_window"] == WINDOW
    assert full["kv_cache_spec_kind"] == "full_attention"
    assert slid["block_hashes"] == full["block_hashes"]      # one content hash, announced once per group
    # evicting the sliding-window copies reports group 1
    a.num_computed_tokens = 200
    kv.free(a)
    tr = HashTranslator()
    tr.translate(stored)
    kv.pool.allocate(kv.num_free_blocks)
    removed = tr.translate([e for e in kv.take_events() if isinstance(e, BlockRemoved)])
    assert {r.group_idx for r in removed} == {0, 1}


# -- physics and end to end ------------------------------------------------------------------------------
NEW_MODELS = [("deepseek-ai/DeepSeek-V3", "h200", 8), ("moonshotai/Kimi-K2-Instruct", "b200", 8),
              ("meta-llama/Llama-4-Scout-17B-16E", "h100", 4),
              ("openai/gpt-oss-20b", "h100", 1), ("openai/gpt-oss-120b", "mi300x", 1),
              ("openai/gpt-oss-120b", "h100", 2)]
BATCHES = [BatchShape((), 1, 1000), BatchShape((), 32, 32 * 3000), BatchShape((), 256, 256 * 700),
           BatchShape((PrefillChunk(2048, 1000, True),)), BatchShape((PrefillChunk(500, 0, True),), 64, 64 * 900)]


@pytest.mark.parametrize(("model", "hw", "tp"), NEW_MODELS)
def test_every_kernel_is_at_or_above_its_roofline(model: str, hw: str, tp: int) -> None:
    from kernelsight.simcore.engine_config import build_step_model
    cfg = make_config(model=model, hardware=hw, tensor_parallel_size=tp, max_model_len=4096)
    sm = build_step_model(cfg)
    for batch in BATCHES:
        kernels = decompose_step(cfg.model, batch, tp, cfg.precision, measured=sm.mla_families)
        assert kernels
        for k in kernels:
            roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware) * k.count
            assert sm.kernel_time_s(k) >= roof * (1 - 1e-9), (model, k.name)
        # the step prices exactly these kernels' attention (no second path); a measured MLA op's host work is the
        # launch term's
        attn = sum(sm.kernel_time_s(k) for k in kernels if k.family.startswith("attn") or k.name.startswith("mla_")
                   or k.name == "kv_b_proj")
        bd = sm.breakdown_dict(batch)
        host = sm.mla_host_s(batch.prefills, batch.num_decodes, batch.decode_context_tokens)
        assert bd["attn_prefill"] + bd["attn_decode"] == pytest.approx(attn - host, rel=1e-9)


def test_mla_decode_reads_the_latent_once_for_all_heads() -> None:
    """Decode attention bytes grow by the latent (576 × kv bytes) per context token, not per head."""
    cfg = make_config(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=8, max_model_len=4096)
    def flash_mla(ctx: int):
        return next(k for k in decompose_step(cfg.model, BatchShape((), 4, ctx), 8, cfg.precision)
                    if k.name == "flash_mla_decode")
    per_token = 576 * cfg.precision.kv_bytes_per_element
    assert flash_mla(8000).bytes_moved - flash_mla(4000).bytes_moved == pytest.approx(4000 * per_token)


def _run(model: str, hw: str, tp: int, seed: int) -> tuple[dict[str, float], int, int]:
    cfg = make_config(model=model, hardware=hw, tensor_parallel_size=tp, max_model_len=4096, seed=seed)
    eng = build_engine(cfg, per_token_events=False)
    rng = random.Random(5)
    shared = [rng.randrange(50000) for _ in range(600)]        # a shared prefix longer than the window
    for i in range(24):
        prompt = shared + [rng.randrange(50000) for _ in range(rng.randint(10, 900))]
        eng.add_request(f"r{i}", prompt, rng.randint(20, 300), ignore_eos=True, arrival_s=i * 0.03)
    done: dict[str, float] = {}
    ends: list[float] = []
    while (res := eng.step(max_steps=64)) is not None:
        ends.extend(res.step_end_s)
        for ev in res.events:
            if ev.kind == FINISHED:
                done[ev.request_id] = ends[ev.step_index]
    return done, eng.kv.num_free_blocks - (eng.kv.pool.num_blocks - 1), eng.kv.prefix_hits_tokens


@pytest.mark.parametrize(("model", "hw", "tp"), [("openai/gpt-oss-20b", "h100", 1),
                                                 ("deepseek-ai/DeepSeek-V3", "h200", 8)])
def test_simulate_end_to_end_is_deterministic_and_frees_every_block(model: str, hw: str, tp: int) -> None:
    done, leaked, hit_tokens = _run(model, hw, tp, seed=3)
    assert len(done) == 24 and leaked == 0
    assert hit_tokens >= 20 * (600 // BS) * BS     # the shared 600-token prefix hits (hybrid rules included)
    again, _, _ = _run(model, hw, tp, seed=3)
    assert again == done


def test_profiles_lists_supported_and_names_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelsight.cli import main
    assert main(["profiles"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")}
    assert "MLA" in lines["deepseek-ai/DeepSeek-V3"] and "MTP x1" in lines["deepseek-ai/DeepSeek-V3"]
    assert "sliding 128 x12 + full x12" in lines["openai/gpt-oss-20b"] and "mxfp4" in lines["openai/gpt-oss-20b"]
    assert "not supported" not in lines["nvidia/Llama-3.1-8B-Instruct-FP4"]
    assert "nvfp4" in lines["nvidia/Llama-3.1-8B-Instruct-FP4"] and "nvfp4" in lines["nvidia/DeepSeek-R1-FP4"]
    assert "chunked 8192 x36 + full x12" in lines["meta-llama/Llama-4-Scout-17B-16E"]
    # Llama 4 Scout takes images and has its offline tokenizer (Meta's llama4 tokenizer.model)
    assert lines["meta-llama/Llama-4-Scout-17B-16E"].endswith("images (llama4 ViT 34x1408)  tokenizer: bundled llama4")
    # each GPU's calibration tier, with the vLLM its kernels were timed under
    assert "calibration: target-measured (vLLM 0.24.0, default); target-measured (vLLM 0.19.0)" in lines["rtx-pro-6000"]
    assert "calibration: target-measured (vLLM 0.19.0)" in lines["rtx-4090"]   # from its layer profile
    assert "calibration: cross-generation (vLLM 0.14.0 / 0.24.0)" in lines["h200-sxm"]


def test_the_calibration_summary_profiles_lists_is_the_loaded_tables() -> None:
    """``kernelsight profiles`` reads each bundled table's tier and software without building its η models: the same
    as the loaded calibration's."""
    from kernelsight import profiles

    names = profiles.list_calibrations()
    assert len(names) > 5
    for name in names:
        stacks = profiles.calibration_stacks(name)
        loaded = [profiles.load_calibration(name, vllm_version=v or None) for v, _ in stacks]
        assert profiles.bundled_calibration_summaries(name) == [(c.tier, c.software) for c in loaded], name
    assert len(profiles.bundled_calibration_summaries("rtx-pro-6000")) == 2


def test_hybrid_preemption_frees_everything_and_events_stay_chained() -> None:
    """Under KV pressure requests are preempted and recomputed; every block comes back and every stored
    sliding-window block's parent hash is known to the publisher (no orphans)."""
    cfg = make_config(model="openai/gpt-oss-20b", max_model_len=2048, num_gpu_blocks_override=300)
    eng = build_engine(cfg, per_token_events=False)
    eng.kv.enable_events()
    rng = random.Random(9)
    shared = [rng.randrange(50000) for _ in range(400)]
    for i in range(24):
        prompt = shared + [rng.randrange(50000) for _ in range(rng.randint(100, 1200))]
        n_out = rng.randint(50, 400)
        # known output ids (as the server has): generated blocks are registered, and published, on preemption
        eng.add_request(f"r{i}", prompt, n_out, ignore_eos=True, arrival_s=0.0,
                        output_token_ids=[rng.randrange(50000) for _ in range(n_out)])
    tr = HashTranslator()
    finished = 0
    while (res := eng.step(max_steps=16)) is not None:
        finished += sum(1 for ev in res.events if ev.kind == FINISHED)
        tr.translate(eng.kv.take_events())
    assert finished == 24 and eng.scheduler.num_preemptions > 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks - 1
    assert tr.orphans == 0


def test_mtp_module_is_one_moe_mla_layer_plus_eh_proj() -> None:
    from kernelsight.simcore.mtp import mtp_step_kernels
    cfg = make_config(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=8, max_model_len=4096)
    batch = BatchShape((), 16, 16 * 2000)
    mtp = mtp_step_kernels(cfg.model, batch, 8, cfg.precision)
    full = decompose_step(cfg.model, batch, 8, cfg.precision)
    by_name = {k.name: k for k in mtp}
    assert by_name["mtp_eh_proj"].features[:3] == (16.0, 7168.0, 2 * 7168.0)
    assert all(k.count == 1 for k in mtp)                     # one layer
    # the MTP layer is a MoE + MLA layer: the same launch as each of the model's MoE layers (count is per layer)
    for name in ("moe_experts", "flash_mla_decode", "q_b_proj", "lm_head"):
        ref = next(k for k in full if k.name == name)
        assert (by_name[name].flops, by_name[name].bytes_moved) == (ref.flops, ref.bytes_moved)
        assert ref.count == {"moe_experts": 58, "lm_head": 1}.get(name, 61)
    with pytest.raises(ValueError, match="no MTP"):
        mtp_step_kernels(load_model("moonshotai/Kimi-K2-Instruct"), batch, 8, cfg.precision)


def test_gpt_oss_accepts_its_own_quantization_flag_and_reports_it() -> None:
    own = make_config(model="openai/gpt-oss-20b", quantization="mxfp4")
    plain = make_config(model="openai/gpt-oss-20b")
    assert own.precision == plain.precision and own.memory == plain.memory
    summary = plain.summary()
    assert summary["quantization"] == "mxfp4"
    assert summary["kv_cache_tokens"] == plain.num_gpu_blocks // 2 * BS   # per group, as vLLM logs it
    with pytest.raises(ValueError, match="MXFP4"):
        make_config(model="Qwen/Qwen3-8B", quantization="mxfp4")
