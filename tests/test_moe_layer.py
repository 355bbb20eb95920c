"""The FusedMoE layer: the routing relation (experts touched, busiest rank's load), its kernel, its η family."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight import profiles
from kernelsight.calibrate.fit.transfer import cross_generation_calibration
from kernelsight.calibrate.measurements import read_measurements
from kernelsight.calibrate.rows import kernel_rows, roofline_rows_s, rows_time_s
from kernelsight.engine_args import create_engine_config
from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import LEGACY_MOE_ETA, calibration_from_dict, default_calibration
from kernelsight.simcore.engine_config import EngineArgs, build_step_model
from kernelsight.simcore.eta import ConstantEta, SwitchEta
from kernelsight.simcore.moe_dispatch import (
    FLASHINFER_CUTLASS,
    MARLIN,
    OAI_TRITON,
    TRITON,
    moe_kernel,
    moe_kernel_class,
)
from kernelsight.simcore.moe_routing import (
    DEFAULT_EXPERT_ROUTING,
    ROUTING_DISTRIBUTIONS,
    load_imbalance,
    padded_slots,
    power_law_alpha,
    routing_load,
)
from kernelsight.simcore.roofline import kernel_roofline_s

QWEN3_30B = dict(model="Qwen/Qwen3-30B-A3B-Instruct-2507", hardware="h100", max_model_len=8192, max_num_seqs=64)


@pytest.mark.parametrize("dist", ROUTING_DISTRIBUTIONS)
@pytest.mark.parametrize(("tokens", "top_k", "experts", "ep"), [(1, 8, 128, 1), (64, 8, 128, 2), (512, 8, 128, 8),
                                                                (4096, 4, 128, 4), (300, 2, 8, 1)])
def test_the_busiest_rank_gets_at_least_its_share_and_touches_at_most_its_experts(dist, tokens, top_k, experts, ep):
    load = routing_load(tokens, top_k, experts, ep, dist)
    assert load.mean_slots == pytest.approx(tokens * top_k / ep)
    assert load.slots >= load.mean_slots - 1e-9          # the busiest rank: never below the mean share
    assert load.slots <= tokens * top_k
    assert 1 <= load.active_experts <= experts // ep
    assert load.active_experts <= load.slots            # an expert is touched by at least one slot
    assert load.max_expert_slots <= tokens              # a token picks an expert at most once
    if ep == 1:                                         # one rank computes every slot
        assert load.slots == pytest.approx(tokens * top_k)


def test_the_relation_is_deterministic_and_skew_grows_with_the_ranks_and_the_exponent():
    routing_load.cache_clear()
    a = routing_load(256, 8, 128, 8, "power_law_1.2")
    routing_load.cache_clear()
    assert routing_load(256, 8, 128, 8, "power_law_1.2") == a
    assert load_imbalance(256, 8, 128, 8, "balanced") == pytest.approx(1.0)
    two, eight = load_imbalance(256, 8, 128, 2, "power_law_1.01"), load_imbalance(256, 8, 128, 8, "power_law_1.01")
    assert 1.0 < two < eight
    assert load_imbalance(4096, 8, 128, 8, "power_law_1.2") > load_imbalance(4096, 8, 128, 8, "power_law_1.01")
    # a power law leaves some experts idle that a balanced spread would touch: less weight traffic
    assert routing_load(64, 4, 128, 1, "power_law_1.01").active_experts < routing_load(64, 4, 128, 1,
                                                                                       "balanced").active_experts


def test_unknown_routing_is_refused():
    assert power_law_alpha("power_law_1.5") == 1.5 and power_law_alpha("balanced") is None
    for bad in ("uniform", "power_law_0.9", "power_law_x"):
        with pytest.raises(ValueError, match="unknown expert routing"):
            power_law_alpha(bad)
    with pytest.raises(ValueError, match="unknown expert routing"):
        create_engine_config(EngineArgs(**QWEN3_30B, expert_routing="zipf"))


def test_the_expert_load_imbalance_is_derived_unless_given():
    model = profiles.load_model("Qwen/Qwen3-30B-A3B")
    prec = create_engine_config(EngineArgs(**QWEN3_30B)).precision
    derived = next(k for k in K.moe_kernels(model, 256, 1, prec, 1, ep_size=2) if k.name == "moe_experts")
    load = routing_load(256, 8, 128, 2, DEFAULT_EXPERT_ROUTING)
    assert derived.features[0] * derived.features[3] == pytest.approx(load.slots)
    flat = next(k for k in K.moe_kernels(model, 256, 1, prec, 1, ep_size=2, load_imbalance=1.5)
                if k.name == "moe_experts")
    assert flat.features[0] * flat.features[3] == pytest.approx(256 * 8 / 2 * 1.5)
    assert flat.flops > derived.flops


@pytest.mark.parametrize("hw_name", ["h100-sxm", "b200", "a100-sxm"])
def test_no_moe_layer_is_priced_below_its_roofline(hw_name):
    cfg = create_engine_config(EngineArgs(**{**QWEN3_30B, "hardware": hw_name}))
    sm = build_step_model(cfg)
    calib = default_calibration(cfg.hardware.name)
    calib.eta["moe_gemm"], calib.eta_max = ConstantEta(5.0), 5.0   # an η that claims 5× the roofline
    sm.calib = calib
    for m in (1, 16, 256, 4096):
        for dist in ROUTING_DISTRIBUTIONS:
            k = next(k for k in K.moe_kernels(cfg.model, m, 1, cfg.precision, 1, routing=dist)
                     if k.family == K.MOE_GEMM)
            roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware)
            assert sm.kernel_time_s(k) >= roof > 0


def test_a_calibration_file_from_before_the_moe_family_falls_back_to_the_default():
    calib = default_calibration("h100-sxm")
    d = calib.to_dict()
    d["eta"]["moe_gemm"] = {"form": "logpoly", "basis": "gemm", "device": {}, "center": [0.0], "scale": [1.0],
                            "coef": [0.0, 0.0]}
    assert calibration_from_dict(json.loads(json.dumps(d))).eta["moe_gemm"] is LEGACY_MOE_ETA
    # a MoE model of the basis before it counted the block padding (9 columns, not 10): its coefficients mean
    # other columns, so the file prices with the default until rebuilt
    old = {"form": "logpoly", "basis": "moe", "device": {}, "center": [0.0] * 9, "scale": [1.0] * 9,
           "coef": [0.0] * 55}
    d["eta"]["moe_gemm"] = {"form": "switch", "index": 4, "default": "0", "models": {"0": old}}
    assert calibration_from_dict(json.loads(json.dumps(d))).eta["moe_gemm"] is LEGACY_MOE_ETA
    d["eta"]["moe_gemm"]["models"]["0"] = {**old, "center": [0.0] * 10, "scale": [1.0] * 10, "coef": [0.0] * 66}
    assert calibration_from_dict(json.loads(json.dumps(d))).eta["moe_gemm"] is not LEGACY_MOE_ETA


def test_the_shared_moe_rows_map_onto_the_step_models_kernel(shared_data: Path):
    tables = read_measurements(shared_data / "kernels" / "h100_sxm")
    t = tables["moe_gemm"]
    sel = np.flatnonzero((t["num_tokens"] <= 64) & (t["moe_ep_size"] <= 8))[:400]
    sub = t.subset(sel)
    rows = kernel_rows("moe_gemm", sub.columns)
    hw = profiles.load_hardware("h100-sxm")
    roof = roofline_rows_s(rows, hw)
    assert (roof > 0).all() and set(rows.variant) <= {str(c) for c in K.MOE_FORMAT_CODES.values()}
    # measured layers are slower than their roofline (the relation does not overstate the work)
    assert np.mean(sub["latency_us"] * 1e-6 >= roof) > 0.95   # a few small ones run from L2
    # the tables time L2-warm repeats: the row predictor may go below the DRAM roofline where they did (η > 1)
    calib = default_calibration(hw.name)
    calib.eta["moe_gemm"], calib.eta_max = ConstantEta(3.0), 3.0
    assert (rows_time_s(calib, "moe_gemm", rows, roof, hw) < roof).any()


def test_each_experts_rows_are_padded_to_the_block_the_grouped_gemm_computes():
    # balanced, 64 tokens × 8 picks over 128 experts: every expert gets 4 slots, each padded to a whole block
    assert routing_load(64, 8, 128, 1, "balanced").slots == 512
    assert padded_slots(64, 8, 128, 1, "balanced", 16) == 128 * 16
    assert padded_slots(64, 8, 128, 1, "balanced", 1) == 512
    for dist in ROUTING_DISTRIBUTIONS:
        for tokens, ep in ((1, 1), (48, 4), (3000, 8)):
            load = routing_load(tokens, 8, 128, ep, dist)
            p16, p64 = (padded_slots(tokens, 8, 128, ep, dist, bm) for bm in (16, 64))
            assert load.slots <= p16 <= p64 <= load.slots + 64 * load.active_experts + 1e-9


def test_the_block_rows_follow_vllms_default_moe_config():
    assert K.moe_block_m(128, 8, 128, "bf16") == 16 and K.moe_block_m(129, 8, 128, "bf16") == 64
    assert K.moe_block_m(8, 8, 128, "fp8_block") == 64
    # Marlin: the first of 8/16/32/48/64 with tokens·top_k/E/block < 0.9
    assert K.moe_block_m(1, 8, 128, "int4_wo") == 8 and K.moe_block_m(512, 8, 128, "int4_wo") == 48
    k16 = K.fused_moe_kernel(100, 2048, 768, 8, 128, "bf16", distribution="balanced")
    k64 = K.fused_moe_kernel(200, 2048, 768, 8, 128, "bf16", distribution="balanced")
    pad16 = padded_slots(100, 8, 128, 1, "balanced", 16) / 800
    assert k16.features[7] == pytest.approx(pad16) and k16.features[8] == 16 and k64.features[8] == 64
    assert k16.flops == pytest.approx(6.0 * 800 * 2048 * 768 * pad16)   # the padded rows are computed


def test_vllms_moe_kernel_per_format_gpu_and_release():
    # what the shared tables' kernel column shows
    assert moe_kernel("bf16", "9.0") == TRITON and moe_kernel("bf16", "8.9") == TRITON
    assert moe_kernel("bf16", "12.0") == FLASHINFER_CUTLASS and moe_kernel("bf16", "12.0", (0, 19)) == TRITON
    assert moe_kernel("fp8", "9.0") == FLASHINFER_CUTLASS and moe_kernel("fp8", "8.9") == TRITON
    assert moe_kernel("fp8", "12.0", (0, 19)) == TRITON and moe_kernel("int4_wo", "9.0") == MARLIN
    assert moe_kernel("w4a16_mxfp4", "9.0") == OAI_TRITON and moe_kernel("w4a16_mxfp4", "8.9") == MARLIN
    names = {"vllm_fused_moe": TRITON, "vllm_unquantizedfusedmoe_triton_tritonexperts": TRITON,
             "vllm_modeloptfp8moe_flashinfer_cutlass_flashinferexperts": FLASHINFER_CUTLASS,
             "vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic": OAI_TRITON,
             "vllm_gptossmxfp4moe_marlin_marlinexperts": MARLIN, "vllm_marlin_int4_moe": MARLIN}
    assert {n: moe_kernel_class(n) for n in names} == names


def test_moe_eta_transfers_by_kernel_where_the_kernel_is_one_code_on_every_gpu():
    bf16, int4, mxfp4 = (str(K.MOE_FORMAT_CODES[f]) for f in ("bf16", "int4_wo", "w4a16_mxfp4"))
    l40s, h100, pro, h200, a100, b200 = (profiles.load_hardware(n)
                                         for n in ("l40s", "h100-sxm", "rtx-pro-6000", "h200", "a100-pcie", "b200"))

    def source(hw, etas):
        c = default_calibration(hw.name)
        c.software = {"vllm": "0.24.0"}
        c.eta["moe_gemm"] = SwitchEta(4, {k: ConstantEta(v) for k, v in etas.items()}, bf16)
        return c, hw

    # the L40S ran int4 by Marlin; the H100 ran MXFP4 by OpenAI's Triton kernels (Hopper)
    sources = [source(l40s, {bf16: 0.6, int4: 0.5}), source(h100, {bf16: 0.3, mxfp4: 0.2})]
    row = {f: K.fused_moe_kernel(256, 2048, 768, 8, 128, f).features for f in ("bf16", "w4a16_mxfp4")}
    # MXFP4 runs Marlin on SM 12.0: the L40S's Marlin model (of int4), not the H100's MXFP4 one of another kernel
    assert cross_generation_calibration(pro, sources).kernel_eta("moe_gemm", row["w4a16_mxfp4"]) == pytest.approx(0.5)
    # on Hopper it runs OpenAI's Triton kernels, not portable: the format's model of the same architecture
    assert cross_generation_calibration(h200, sources).kernel_eta("moe_gemm", row["w4a16_mxfp4"]) == pytest.approx(0.2)
    # both ran bf16 by Triton: of the same kernel the target architecture's where one ran it (Hopper's from the
    # H100, an Ampere GPU's from the L40S, SM 8.x); a B200 runs FlashInfer's (built per SM): from both
    assert cross_generation_calibration(h200, sources).kernel_eta("moe_gemm", row["bf16"]) == pytest.approx(0.3)
    assert cross_generation_calibration(a100, sources).kernel_eta("moe_gemm", row["bf16"]) == pytest.approx(0.6)
    assert 0.3 < cross_generation_calibration(b200, sources).kernel_eta("moe_gemm", row["bf16"]) < 0.6


QWEN3_235B_FP8 = dict(model="Qwen/Qwen3-235B-A22B-FP8", hardware="h200", max_model_len=8192)


def test_a_block_fp8_moe_whose_tp_shards_split_a_block_is_refused_as_vllm_does():
    # 1536 / 8 = 192 is not a multiple of the 128-wide weight block: vLLM refuses to load it without EP
    with pytest.raises(ValueError, match=r"^The output_size of gate's and up's weight = 192 is not divisible by "
                                         r"weight quantization block_n = 128\.$"):
        create_engine_config(EngineArgs(**QWEN3_235B_FP8, tensor_parallel_size=8))
    create_engine_config(EngineArgs(**QWEN3_235B_FP8, tensor_parallel_size=4))                   # 384: whole blocks
    create_engine_config(EngineArgs(**QWEN3_235B_FP8, tensor_parallel_size=8, enable_expert_parallel=True))
    create_engine_config(EngineArgs(model="deepseek-ai/DeepSeek-V3", hardware="h200", tensor_parallel_size=8,
                                    max_model_len=8192))                                         # 2048 / 8 = 256


def _moe_s(cfg, tokens: int) -> float:
    sm = build_step_model(cfg)
    return sum(sm.kernel_time_s(k) for k in K.row_kernels(cfg.model, tokens, cfg.args.tensor_parallel_size,
                                                          cfg.precision, cfg.args.expert_routing,
                                                          cfg.tp_expert_parallel_size, cfg.args.expert_load_imbalance)
               if k.family == K.MOE_GEMM)


def test_expert_parallel_at_one_dp_rank_splits_whole_experts_over_the_tp_group():
    """TP 8 + EP with one DP rank: vLLM's ep_size is the TP group; the priced rank holds 16 whole experts and the
    busiest one's routed tokens, so the layer's time follows the load imbalance (TP-sharded experts do not)."""
    base = dict(model="Qwen/Qwen3-235B-A22B", hardware="h200", max_model_len=8192, tensor_parallel_size=8)
    tp_only = create_engine_config(EngineArgs(**base))
    ep = create_engine_config(EngineArgs(**base, enable_expert_parallel=True))
    assert tp_only.tp_expert_parallel_size == 1 and ep.tp_expert_parallel_size == 8
    assert create_engine_config(EngineArgs(**QWEN3_30B, enable_expert_parallel=True)).tp_expert_parallel_size == 1
    skewed = create_engine_config(EngineArgs(**base, enable_expert_parallel=True, expert_load_imbalance=2.0))
    flat = create_engine_config(EngineArgs(**base, enable_expert_parallel=True, expert_load_imbalance=1.0))
    for tokens in (64, 2048):
        assert _moe_s(ep, tokens) != pytest.approx(_moe_s(tp_only, tokens), rel=1e-3)
        # the busiest rank's tokens: a little more weight traffic at 64 tokens, more math at 2,048
        assert _moe_s(skewed, tokens) > (1.1 if tokens > 1000 else 1.0) * _moe_s(flat, tokens)
        tp_flat = create_engine_config(EngineArgs(**base, expert_load_imbalance=2.0))   # ignored without EP
        assert _moe_s(tp_flat, tokens) == pytest.approx(_moe_s(tp_only, tokens))
    # the step model prices it so: a decode step of 64 sequences costs more under a 2x-loaded rank
    batch = K.BatchShape(num_decodes=64, decode_context_tokens=64 * 1000)
    assert build_step_model(skewed).step(batch)[1] > build_step_model(flat).step(batch)[1]
