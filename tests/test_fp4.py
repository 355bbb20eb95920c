"""FP4 checkpoints (NVFP4, MXFP4): parsed from their quantization_config, dispatched to the kernel vLLM runs on each
GPU, priced with their packed bytes at the right peak, and NVFP4 η transferred to GPUs never measured in FP4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight.calibrate.evaluate import split_masks
from kernelsight.calibrate.fit.eta import fit_calibration
from kernelsight.calibrate.fit.transfer import NVFP4_KEY, cross_generation_calibration, transfer_fp4_variant
from kernelsight.calibrate.measurements import read_table
from kernelsight.calibrate.rows import predict_rows_s
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore import fp4_dispatch as F
from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.eta import EnsembleEta
from kernelsight.simcore.kernels import MOE_FORMAT_CODES, BatchShape, PrefillChunk, linear_kernel, moe_kernels
from kernelsight.simcore.memory import param_counts, weight_bytes_per_rank
from kernelsight.simcore.model_spec import model_spec_from_hf_config
from kernelsight.simcore.precision import resolve_precision
from kernelsight.simcore.roofline import kernel_roofline_s
from tests.conftest import make_config, needs_shared

MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                  "exclude_modules": ["lm_head"]}


# -- which kernel vLLM runs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cc", "kernel"), [
    ("10.0", F.FLASHINFER_CUTEDSL_NVFP4), ("10.3", F.FLASHINFER_CUTEDSL_NVFP4),   # B200/GB200, B300/GB300
    ("12.0", F.FLASHINFER_CUTLASS_NVFP4),                                        # RTX PRO 6000: what its rows ran
    ("9.0", F.MARLIN_NVFP4), ("8.9", F.MARLIN_NVFP4), ("8.0", F.MARLIN_NVFP4),   # no FP4 tensor cores: W4A16
    ("gfx942", F.EMULATION_NVFP4),
])
def test_nvfp4_linear_kernel_follows_vllms_priority_list(cc, kernel):
    assert F.nvfp4_linear_kernel(cc) == kernel
    assert F.fp4_priced_format(kernel) == ("nvfp4" if cc.startswith("1") else "bf16")


@pytest.mark.parametrize(("cc", "backend"), [
    ("10.0", F.FLASHINFER_TRTLLM_NVFP4_MOE), ("12.0", F.FLASHINFER_CUTLASS_NVFP4_MOE), ("9.0", F.MARLIN_MOE),
    ("gfx942", F.EMULATION_MOE),
])
def test_nvfp4_moe_backend_is_w4a4_only_with_fp4_tensor_cores(cc, backend):
    assert F.fp4_moe_backend("nvfp4", cc) == backend
    assert F.fp4_priced_format(backend) == ("nvfp4" if cc.startswith("1") else "bf16")


@pytest.mark.parametrize(("cc", "backend"), [
    ("10.0", F.TRTLLM_MXFP4_BF16), ("9.0", F.TRITON_MXFP4), ("8.0", F.MARLIN_MOE), ("12.0", F.MARLIN_MOE),
])
def test_mxfp4_moe_runs_weight_only_by_default(cc, backend):
    assert F.fp4_moe_backend("mxfp4", cc) == backend
    assert F.fp4_priced_format(backend) == "bf16"   # W4A16 everywhere unless VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8


# -- checkpoint configs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("quant", "fmt"), [
    (MODELOPT_NVFP4, "nvfp4"),
    ({"quant_method": "nvfp4", "quant_algo": "NVFP4"}, "nvfp4"),   # folded from an hf_quant_config.json
    ({"quant_method": "modelopt_fp4"}, "nvfp4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 4, "group_size": 16},
        "input_activations": {"type": "float", "num_bits": 4, "group_size": 16}}}}, "nvfp4"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}, "mxfp4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, None),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "int", "num_bits": 4, "group_size": 128}}}}, None),   # GPTQ-style int4: not FP4
])
def test_fp4_format_from_quantization_config(quant, fmt):
    assert F.fp4_format_from_quant_config(quant) == fmt


def _llama8b_config(quant: dict) -> dict:
    from kernelsight import profiles

    config = json.loads(profiles.model_config_path("meta-llama/Llama-3.1-8B").read_text())
    return {**config, "quantization_config": quant}


def test_modelopt_nvfp4_checkpoint_is_an_nvfp4_model_with_an_fp8_kv_cache():
    spec = model_spec_from_hf_config(_llama8b_config(MODELOPT_NVFP4), "nvidia/Llama-3.1-8B-Instruct-FP4")
    assert spec.quantization == "nvfp4" and spec.fp8_scheme is None and spec.kv_cache_dtype == "fp8"
    p = resolve_precision("bfloat16", spec.quantization, spec.kv_cache_dtype, compute_capability="10.0")
    assert (p.weight_dtype, p.gemm_compute_dtype, p.kv_dtype) == ("nvfp4", "fp4", "fp8")
    assert p.weight_bytes_per_param == pytest.approx(0.5 + 1 / 16)


def test_nvfp4_checkpoint_served_from_a_local_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama8b_config(MODELOPT_NVFP4)))
    cfg = make_config(model=str(tmp_path), hardware="b200")
    assert cfg.precision.weight_dtype == "nvfp4" and cfg.precision.kv_dtype == "fp8"
    bf16 = make_config(hardware="b200")
    # packed 4-bit weights (+ an FP8 scale per 16) for every linear layer; embeddings and LM head stay 16-bit
    linear, other = param_counts(cfg.model)
    assert cfg.memory.weight_bytes == pytest.approx(linear * 0.5625 + other * 2.0)
    assert cfg.memory.num_gpu_blocks > bf16.memory.num_gpu_blocks


def test_modelopt_hf_quant_config_beside_config_json_is_read_as_nvfp4(tmp_path):
    from kernelsight.profiles import load_model

    config = _llama8b_config({})
    config.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    spec = load_model(str(tmp_path))
    assert spec.quantization == "nvfp4" and spec.kv_cache_dtype == "fp8"


# -- roofline bytes and peaks -------------------------------------------------------------------------------------
def test_w4a4_gemm_moves_packed_operands_at_the_fp4_peak():
    p = resolve_precision("bfloat16", "modelopt_fp4", compute_capability="12.0")
    k = linear_kernel("qkv_proj", 8, 6144, 4096, p)
    assert k.impl == F.FLASHINFER_CUTLASS_NVFP4 and k.dtype == "fp4" and k.features[3] == 4.0
    assert k.bytes_moved == pytest.approx(8 * 4096 * 0.5625 + 4096 * 6144 * 0.5625 + 8 * 6144 * 2.0)
    hw = load_hardware("rtx-pro-6000")
    big = linear_kernel("gate_up_proj", 8192, 28672, 4096, p)
    compute_s = big.flops / hw.fp4_flops_per_s
    assert kernel_roofline_s(big.flops, big.bytes_moved, big.tiles, big.dtype, hw) == pytest.approx(
        compute_s, rel=0.05)   # compute-bound at 4x the bf16 peak (wave quantization aside)


def test_marlin_w4a16_on_hopper_reads_4bit_weights_but_computes_in_bf16():
    p = resolve_precision("bfloat16", "nvfp4", compute_capability="9.0")
    k = linear_kernel("down_proj", 1, 4096, 14336, p)
    assert k.impl == F.MARLIN_NVFP4 and k.dtype == "bf16" and k.features[3] == 0.0   # the bf16 η prices it
    assert k.bytes_moved == pytest.approx(14336 * 2.0 + 4096 * 14336 * 0.5625 + 4096 * 2.0)
    rocm = resolve_precision("bfloat16", "nvfp4", compute_capability="gfx942")
    emu = linear_kernel("down_proj", 1, 4096, 14336, rocm)
    assert emu.impl == F.EMULATION_NVFP4 and emu.bytes_moved > 4 * k.bytes_moved   # writes and re-reads bf16 weights


def test_mxfp4_quantizes_only_the_experts():
    spec = model_spec_from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960,
        "quantization_config": {"quant_method": "mxfp4"}}, "moe-mxfp4")
    assert spec.quantization == "mxfp4"
    p = resolve_precision("bfloat16", spec.quantization, compute_capability="10.0")
    assert p.weight_dtype == "bf16" and p.expert_weight_dtype == "mxfp4" and p.expert_compute_dtype == "bf16"
    assert linear_kernel("qkv_proj", 16, 5120, 2048, p).dtype == "bf16"
    experts_k = next(k for k in moe_kernels(spec, 16, 1, p, 4) if k.name == "moe_experts")
    bf16 = next(k for k in moe_kernels(spec, 16, 1, resolve_precision("bfloat16"), 4) if k.name == "moe_experts")
    # the same routed rows; each padded to its kernel's row block (Marlin's 8 rows here, Triton's 16)
    assert experts_k.dtype == "bf16"
    assert experts_k.flops / experts_k.features[7] == pytest.approx(bf16.flops / bf16.features[7])
    assert (experts_k.features[8], bf16.features[8]) == (8.0, 16.0) and experts_k.flops < bf16.flops
    assert experts_k.features[4] == MOE_FORMAT_CODES["w4a16_mxfp4"]
    weight_share = 0.5 + 1 / 32
    assert experts_k.bytes_moved < bf16.bytes_moved * 0.3
    assert experts_k.bytes_moved > bf16.bytes_moved * weight_share / 2.1
    linear, other = param_counts(spec)
    experts = 4 * 128 * 3 * 2048 * 768
    assert weight_bytes_per_rank(spec, p, 1) == pytest.approx((linear - experts) * 2.0 + experts * weight_share
                                                              + other * 2.0)
    nv = resolve_precision("bfloat16", "nvfp4", compute_capability="10.0")
    assert next(k for k in moe_kernels(spec, 16, 1, nv, 4) if k.name == "moe_experts").dtype == "fp4"   # W4A4
    hopper = resolve_precision("bfloat16", "nvfp4", compute_capability="9.0")   # Marlin W4A16 there
    assert next(k for k in moe_kernels(spec, 16, 1, hopper, 4) if k.name == "moe_experts").dtype == "bf16"


# -- cross-generation: NVFP4 η from the one GPU measured in FP4 ---------------------------------------------------
def test_bundled_blackwell_tables_take_nvfp4_from_the_pro_6000_and_the_rest_unchanged():
    pro, pro_hw = load_calibration("rtx-pro-6000"), load_hardware("rtx-pro-6000")
    for gpu in ("b200", "gb200", "b300", "gb300"):
        hw, calib = load_hardware(gpu), load_calibration(gpu)
        nvfp4 = calib.eta["gemm"].models[NVFP4_KEY]
        assert isinstance(nvfp4, EnsembleEta) and len(nvfp4.members) == 1
        member = nvfp4.members[0]
        assert member.grid is None and member.trees is None   # only the smooth part transfers
        assert member.device["balance"] == pytest.approx(hw.fp4_flops_per_s / hw.usable_mem_bytes_per_s)
        assert member.coef == pro.eta["gemm"].models[NVFP4_KEY].coef
        assert "nvfp4 GEMMs transferred from rtx-pro-6000" in calib.source
    sources = [(load_calibration(g), load_hardware(g)) for g in ("a100-sxm", "h100-sxm", "l40s")]
    b200 = load_hardware("b200")
    plain = cross_generation_calibration(b200, sources)
    with_fp4 = cross_generation_calibration(b200, sources, fp4_sources=[(pro, pro_hw)])
    for key, model in plain.eta["gemm"].models.items():   # no other format moves
        assert with_fp4.eta["gemm"].models[key].to_dict() == model.to_dict()
    assert with_fp4.eta_max == plain.eta_max
    # a GPU without FP4 tensor cores gets no nvfp4 variant: vLLM runs Marlin W4A16 there, priced by bf16 η
    h200 = cross_generation_calibration(load_hardware("h200"), sources)
    assert not transfer_fp4_variant(h200, load_hardware("h200"), [(pro, pro_hw)])
    assert NVFP4_KEY not in load_calibration("h100").eta["gemm"].models


# -- what a step costs ----------------------------------------------------------------------------------------------
def _step_s(tmp_path, hardware: str, quant: dict | None, batch: BatchShape) -> float:
    """Seconds the step's linear layers take (the GEMM family: a large decode batch's step is host-bound)."""
    if quant is None:
        cfg = make_config(hardware=hardware)
    else:
        (tmp_path / "config.json").write_text(json.dumps(_llama8b_config(quant)))
        cfg = make_config(model=str(tmp_path), hardware=hardware, kv_cache_dtype="auto")
    return build_step_model(cfg).breakdown_dict(batch)["gemm"]


FP8_STATIC = {"quant_method": "modelopt", "quant_algo": "FP8"}
DECODE_256 = BatchShape(num_decodes=256, decode_context_tokens=256 * 1024)
DECODE_1 = BatchShape(num_decodes=1, decode_context_tokens=1024)
PREFILL = BatchShape(prefills=(PrefillChunk(8192, 0, True),))


@pytest.mark.parametrize("gpu", ["b200", "gb300", "rtx-pro-6000"])
def test_nvfp4_steps_are_no_slower_than_fp8_where_fp4_tensor_cores_run_them(tmp_path, gpu):
    nv, fp8 = tmp_path / "nv", tmp_path / "fp8"
    nv.mkdir()
    fp8.mkdir()
    # prefill and a large decode batch: faster than fp8 (a quarter of the bf16 compute time, half fp8's bytes)
    for batch in (PREFILL, DECODE_256):
        assert _step_s(nv, gpu, MODELOPT_NVFP4, batch) < _step_s(fp8, gpu, FP8_STATIC, batch)
    # batch 1 on a transferred table: capped at fp8's time (the PRO 6000's k-loop floor is its own kernel's)
    if gpu != "rtx-pro-6000":
        assert _step_s(nv, gpu, MODELOPT_NVFP4, DECODE_1) <= _step_s(fp8, gpu, FP8_STATIC, DECODE_1) * 1.0001


def test_marlin_nvfp4_on_h100_speeds_up_decode_not_prefill(tmp_path):
    nv, bf = tmp_path / "nv", tmp_path / "bf"
    nv.mkdir()
    bf.mkdir()
    assert _step_s(nv, "h100", MODELOPT_NVFP4, DECODE_1) < 0.6 * _step_s(bf, "h100", None, DECODE_1)
    # W4A16 computes in bf16: a long prefill is compute-bound and gains (almost) nothing
    assert _step_s(nv, "h100", MODELOPT_NVFP4, PREFILL) > 0.8 * _step_s(bf, "h100", None, PREFILL)


def test_gemm_format_codes_cover_nvfp4():
    assert K.GEMM_FORMAT_CODES["nvfp4"] == 4 and K.GEMM_COMPUTE_DTYPE["nvfp4"] == "fp4"
    assert K.gemm_input_bytes("nvfp4", 2.0) == pytest.approx(0.5625)


# -- the accuracy target, on the shared rows (slow: one fit on ~9,000 rows) -----------------------------------------
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels" / "rtx_pro_6000_server"


@pytest.mark.slow
@needs_shared(DATA)
def test_nvfp4_target_tier_is_within_4_percent_on_held_out_rows():
    hw = load_hardware("rtx-pro-6000")
    table = read_table(DATA / "gemm.csv.gz", "gemm")
    train, test = split_masks({"gemm": table}, 0.25, 0)   # the split of kernel_accuracy.py / calibrate eval
    nv = table["dtype"] == "nvfp4"
    calib, _ = fit_calibration({"gemm": table.subset(train["gemm"] & nv).columns}, hw)
    held_out = table.subset(test["gemm"] & nv)
    pred = predict_rows_s("gemm", held_out.columns, hw, calib)
    mape = float(np.mean(np.abs(pred / (held_out["latency_us"] * 1e-6) - 1.0)))
    assert len(held_out) > 25_000 and mape < 0.04


def test_plan_takes_fp4_weight_formats():
    from kernelsight.plan.cli import _quant

    assert _quant("nvfp4") == _quant("modelopt_fp4") == "modelopt_fp4" and _quant("mxfp4") == "mxfp4"
    assert _quant("none") is None
    with pytest.raises(Exception, match="modelopt_fp4"):
        _quant("int4")
    cfg = make_config(hardware="b200", quantization=_quant("nvfp4"))   # what the plan's point builds
    assert cfg.precision.weight_dtype == "nvfp4" and cfg.precision.gemm_compute_dtype == "fp4"
