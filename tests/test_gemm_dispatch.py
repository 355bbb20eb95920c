"""FP8 GEMMs as vLLM runs them: the checkpoint's scale type and the GPU pick the kernel, the kernel prices it."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest

from kernelsight import profiles
from kernelsight.simcore import gemm_dispatch as D
from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.gemm_dispatch import Fp8Scheme, fp8_linear_kernel, fp8_scheme_from_quant_config
from kernelsight.simcore.kernels import BatchShape
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.step_model import eta_lookup_features
from tests.conftest import make_config

BLOCK128 = Fp8Scheme(D.BLOCK, D.DYNAMIC_GROUP, 128, 128)
STATIC = Fp8Scheme(D.TENSOR, D.STATIC_TENSOR)


# -- checkpoint quantization_config → scale types --------------------------------------------------------------
@pytest.mark.parametrize(("config", "scheme"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, BLOCK128),
    ({"quant_method": "fp8", "activation_scheme": "static"}, STATIC),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, D.ONLINE_FP8),
    ({"quant_method": "fp8", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, STATIC),   # ModelOpt, merged
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, STATIC),
    ({"quant_method": "fbgemm_fp8"}, Fp8Scheme(D.CHANNEL, D.DYNAMIC_TOKEN)),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}},
     Fp8Scheme(D.CHANNEL, D.DYNAMIC_TOKEN)),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}}, STATIC),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, None),
    ({"quant_method": "awq", "bits": 4}, None),
    (None, None),
])
def test_scheme_from_quant_config(config, scheme) -> None:
    assert fp8_scheme_from_quant_config(config) == scheme


def test_model_specs_carry_the_checkpoint_scale_type() -> None:
    assert profiles.load_model("Qwen/Qwen3-32B-FP8").fp8_scheme == BLOCK128
    assert profiles.load_model("nvidia/Llama-3.1-70B-Instruct-FP8").fp8_scheme == STATIC
    assert profiles.load_model("meta-llama/Llama-3.1-8B").fp8_scheme is None
    # --quantization fp8 on a bf16 checkpoint is vLLM's online quantization; an fp8 checkpoint keeps its own
    assert make_config(quantization="fp8").precision.fp8_scheme == D.ONLINE_FP8
    cfg = make_config(model="Qwen/Qwen3-32B-FP8", quantization="fp8", tensor_parallel_size=2)
    assert cfg.precision.fp8_scheme == BLOCK128 and cfg.precision.compute_capability == "9.0"
    assert cfg.summary()["fp8_scheme"] == "block128x128"


# -- scale type + capability + shape → kernel ------------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "cc", "m", "k", "kernel"), [
    (D.ONLINE_FP8, "8.0", 1, 4096, D.MARLIN_FP8),          # Ampere: no FP8 tensor cores
    (BLOCK128, "8.6", 64, 4096, D.MARLIN_FP8),
    (D.ONLINE_FP8, "8.9", 1, 4096, D.CUTLASS_FP8),         # Ada: FP8 tensor cores, CUTLASS per-tensor ...
    (BLOCK128, "8.9", 1, 4096, D.TRITON_BLOCK),            # ... but Triton for blocks
    (STATIC, "9.0", 1, 4096, D.CUTLASS_FP8),               # Hopper per-tensor, static or dynamic
    (D.ONLINE_FP8, "9.0", 8192, 4096, D.CUTLASS_FP8),
    (BLOCK128, "9.0", 31, 4096, D.FLASHINFER_BLOCK),       # FlashInfer below m = 32 ...
    (BLOCK128, "9.0", 32, 4096, D.DEEPGEMM_BLOCK),         # ... DeepGEMM from 32 ...
    (BLOCK128, "9.0", 1, 4160, D.CUTLASS_BLOCK),           # ... CUTLASS when k is not whole 128-groups
    (BLOCK128, "9.0", 64, 4160, D.CUTLASS_BLOCK),
    (STATIC, "10.0", 1, 4096, D.FLASHINFER_FP8),           # Blackwell: FlashInfer when both scales per-tensor
    (D.ONLINE_FP8, "10.0", 1, 4096, D.CUTLASS_FP8),        # per-token activations: CUTLASS
    (Fp8Scheme(D.CHANNEL, D.DYNAMIC_TOKEN), "10.3", 1, 4096, D.CUTLASS_FP8),
    (BLOCK128, "10.0", 32, 4096, D.DEEPGEMM_BLOCK),
    (STATIC, "12.0", 1, 4096, D.CUTLASS_FP8),              # RTX PRO 6000 / RTX 50xx
    (BLOCK128, "12.0", 64, 4096, D.CUTLASS_BLOCK),
    (BLOCK128, "gfx942", 64, 4096, D.ROCM_BLOCK),
])
def test_kernel_at_each_boundary(scheme, cc, m, k, kernel) -> None:
    assert fp8_linear_kernel(scheme, cc, m, 4096, k) == kernel


def test_narrow_block_gemms_run_cutlass_on_hopper() -> None:
    assert fp8_linear_kernel(BLOCK128, "9.0", 64, 32, 4096) == D.CUTLASS_BLOCK
    assert fp8_linear_kernel(BLOCK128, "9.0", 64, 64, 4096) == D.DEEPGEMM_BLOCK


def _block_rows(path: Path) -> list[tuple[int, int, int, str]]:
    with gzip.open(path, "rt") as f:
        return [(int(r["m"]), int(r["n"]), int(r["k"]), r["kernel"]) for r in csv.DictReader(f)
                if r["dtype"] == "fp8_block"]


@pytest.mark.parametrize(("gpu", "hardware"), [("h100_sxm", "h100"), ("l40s", "l40s"),
                                               ("rtx_pro_6000_server", "rtx-pro-6000")])
def test_dispatch_reproduces_the_measured_kernel_column(shared_data: Path, gpu: str, hardware: str) -> None:
    """Every block-fp8 row the tables recorded ran the kernel the rule names for its shape on its GPU."""
    cc = profiles.load_hardware(hardware).compute_capability
    rows = _block_rows(shared_data / "kernels" / gpu / "gemm.csv.gz")
    wrong = [(m, n, k, kern) for m, n, k, kern in rows if fp8_linear_kernel(BLOCK128, cc, m, n, k) != kern]
    assert rows and not wrong, wrong[:5]


@pytest.mark.slow
def test_block_ratios_are_the_tables(shared_data: Path) -> None:
    """BLOCK_FP8_TIME_RATIO is what the GPU-bound rows of the H100 and L40S tables give (within 0.01)."""
    from kernelsight.calibrate.fit.block_fp8 import block_fp8_time_ratios
    from kernelsight.calibrate.measurements import read_table

    for gpu, hardware in (("h100_sxm", "h100"), ("l40s", "l40s")):
        table = read_table(shared_data / "kernels" / gpu / "gemm.csv.gz")
        fitted = block_fp8_time_ratios(table.columns, profiles.load_hardware(hardware))
        for kernel, by_regime in fitted.items():
            for i, regime in enumerate(("memory", "compute")):
                if regime in by_regime:
                    assert D.BLOCK_FP8_TIME_RATIO[kernel][i] == pytest.approx(by_regime[regime][0], abs=0.01)


# -- the kernel prices the GEMM --------------------------------------------------------------------------------
def test_linear_layers_name_the_kernel_and_its_format() -> None:
    qwen = profiles.load_model("Qwen/Qwen3-32B-FP8")
    for hw, m, kernel, dtype in (("h100", 8, D.FLASHINFER_BLOCK, "fp8"), ("h100", 64, D.DEEPGEMM_BLOCK, "fp8"),
                                 ("l40s", 64, D.TRITON_BLOCK, "fp8"), ("a100", 64, D.MARLIN_FP8, "bf16")):
        p = make_config(model="Qwen/Qwen3-32B-FP8", hardware=hw, tensor_parallel_size=2).precision
        qkv = next(k for k in K.row_kernels(qwen, m, 2, p) if k.name == "qkv_proj")
        assert (qkv.impl, qkv.dtype) == (kernel, dtype)
        n, k = int(qkv.features[1]), int(qkv.features[2])
        # Marlin reads 16-bit activations; W8A8 kernels quantize them to one byte first; weights are one byte
        a_bytes = 2.0 if kernel == D.MARLIN_FP8 else 1.0
        assert qkv.bytes_moved == pytest.approx(m * k * a_bytes + k * n * 1.0 + m * n * 2.0)


def _gemm_s(sm, kernels) -> float:
    return sum(sm.kernel_time_s(k) for k in kernels if k.family == K.GEMM)


@pytest.mark.parametrize("hardware", ["h100", "h200", "b200", "l40s"])
@pytest.mark.parametrize(("fp8_model", "bf16_model", "quant", "tp"), [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "fp8", 1),
    ("Qwen/Qwen3-32B-FP8", "Qwen/Qwen3-32B", None, 2),
])
def test_fp8_decode_step_not_slower_than_bf16_twin(hardware, fp8_model, bf16_model, quant, tp) -> None:
    """On GPUs with FP8 tensor cores an FP8 checkpoint's decode step is at most its bf16 twin's."""
    fp8 = build_step_model(make_config(model=fp8_model, quantization=quant, hardware=hardware,
                                       tensor_parallel_size=tp))
    bf16 = build_step_model(make_config(model=bf16_model, hardware=hardware, tensor_parallel_size=tp))
    for batch in (1, 8, 32, 128, 256):
        shape = BatchShape((), batch, batch * 2048)
        assert fp8.step_time_s(shape) <= bf16.step_time_s(shape)


@pytest.mark.parametrize("hardware", ["h200", "b200"])
def test_unmeasured_fp8_gemms_are_capped_at_bf16(hardware) -> None:
    """A transferred table carries the H100 CUTLASS kernel's slow tile step (m 129-256) to no other GPU's GEMMs."""
    model = profiles.load_model("meta-llama/Llama-3.1-70B")
    fp8 = build_step_model(make_config(model="meta-llama/Llama-3.1-70B", quantization="fp8", hardware=hardware,
                                       tensor_parallel_size=4))
    bf16 = build_step_model(make_config(model="meta-llama/Llama-3.1-70B", hardware=hardware, tensor_parallel_size=4))
    for m in (1, 16, 64, 192, 256, 512, 2048):
        for kf, kb in zip(K.row_kernels(model, m, 4, fp8.precision), K.row_kernels(model, m, 4, bf16.precision),
                          strict=True):
            if kf.family == K.GEMM:
                assert fp8.kernel_time_s(kf) <= bf16.kernel_time_s(kb) * (1 + 1e-12), (kf.name, m)


def test_measured_cutlass_step_is_kept_on_h100() -> None:
    """The H100 tables time the per-tensor CUTLASS kernel slower than bf16 at m 129-256, n 2560 (29 vs 20 µs):
    vLLM runs that kernel there, so its fp8 GEMM keeps the measured step."""
    model = profiles.load_model("meta-llama/Llama-3.1-70B")
    fp8 = build_step_model(make_config(model="meta-llama/Llama-3.1-70B", quantization="fp8",
                                       tensor_parallel_size=4))
    bf16 = build_step_model(make_config(model="meta-llama/Llama-3.1-70B", tensor_parallel_size=4))
    qkv_f = next(k for k in K.row_kernels(model, 192, 4, fp8.precision) if k.name == "qkv_proj")
    qkv_b = next(k for k in K.row_kernels(model, 192, 4, bf16.precision) if k.name == "qkv_proj")
    assert qkv_f.impl == D.CUTLASS_FP8
    assert fp8.kernel_time_s(qkv_f) > 1.2 * bf16.kernel_time_s(qkv_b)


@pytest.mark.parametrize("hardware", ["h100", "b200", "l40s", "a100"])
@pytest.mark.parametrize("model", ["Qwen/Qwen3-32B-FP8", "nvidia/Llama-3.1-70B-Instruct-FP8"])
def test_fp8_gemm_time_at_least_its_roofline(hardware, model) -> None:
    cfg = make_config(model=model, hardware=hardware, tensor_parallel_size=4, max_model_len=4096)
    sm = build_step_model(cfg)
    for m in (1, 8, 31, 32, 100, 256, 1024, 8192):
        for k in K.row_kernels(cfg.model, m, 4, cfg.precision):
            if k.family == K.GEMM and k.impl:
                roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware) * k.count
                assert sm.kernel_time_s(k) >= roof, (k.name, k.impl, m)


def test_gpu_bound_block_gemms_priced_from_their_own_rows(shared_data: Path) -> None:
    """Prefill-sized block GEMMs on H100 (m = 8192, well above the eager floor) take DeepGEMM's measured time."""
    hw = profiles.load_hardware("h100")
    qwen = profiles.load_model("Qwen/Qwen3-32B-FP8")
    cfg = make_config(model="Qwen/Qwen3-32B-FP8", tensor_parallel_size=2)
    sm = build_step_model(cfg)
    with gzip.open(shared_data / "kernels" / "h100_sxm" / "gemm.csv.gz", "rt") as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] == "fp8_block" and r["m"] == "8192"
                and r["kernel"] == D.DEEPGEMM_BLOCK and int(r["n"]) >= 4096 and int(r["k"]) >= 4096]
    assert len(rows) > 50 and qwen.fp8_scheme == BLOCK128
    errors = []
    for r in rows:
        k = K.linear_kernel("gemm", 8192, int(r["n"]), int(r["k"]), cfg.precision)
        errors.append(abs(sm.kernel_time_s(k) * 1e6 / float(r["latency_us"]) - 1.0))
        assert kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, hw) <= sm.kernel_time_s(k)
    assert sum(errors) / len(errors) < 0.05


@pytest.mark.parametrize(("config", "kv"), [
    ({"quant_method": "fp8", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "fp8"),        # ModelOpt
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}},
     "fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None),
    (None, None),
])
def test_checkpoint_kv_cache_dtype(config, kv) -> None:
    assert D.kv_cache_dtype_from_quant_config(config) == kv


def test_kv_cache_dtype_auto_is_the_checkpoints() -> None:
    """vLLM's --kv-cache-dtype auto resolves to a ModelOpt checkpoint's FP8 KV cache; an explicit dtype wins."""
    nvidia = "nvidia/Llama-3.1-70B-Instruct-FP8"
    assert make_config(model=nvidia, tensor_parallel_size=4).precision.kv_dtype == "fp8"
    assert make_config(model=nvidia, tensor_parallel_size=4, kv_cache_dtype="bf16").precision.kv_dtype == "bf16"
    assert make_config(model="Qwen/Qwen3-32B-FP8", tensor_parallel_size=2).precision.kv_dtype == "bf16"


def test_compiled_models_fuse_the_activation_quant() -> None:
    """Under torch.compile the quant of qkv/gate_up/down inputs rides in the norm/SiLU kernel: those fp8 GEMMs lose
    the fp8 rows' extra fixed latency over bf16 (one quant launch, ~2 µs on H100); o_proj keeps it; eager keeps all."""
    model = profiles.load_model("meta-llama/Llama-3.1-8B")
    compiled = build_step_model(make_config(quantization="fp8"))
    eager = build_step_model(make_config(quantization="fp8", enforce_eager=True))
    kernels = {k.name: k for k in K.row_kernels(model, 8, 1, compiled.precision) if k.family == K.GEMM}
    calib = compiled.calib
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        k = kernels[name]
        saved_us = (eager.kernel_time_s(k) - compiled.kernel_time_s(k)) / k.count * 1e6
        # exactly the fp8 fixed latency in excess of the bf16 GEMM's at the same shape: the quant launch, no more
        f_fp8 = eta_lookup_features(K.GEMM, k.features)
        f_bf16 = f_fp8[:3] + (float(K.GEMM_FORMAT_CODES["bf16"]),)
        excess_us = (calib.kernel_overhead_s(K.GEMM, f_fp8) - calib.kernel_overhead_s(K.GEMM, f_bf16)) * 1e6
        assert saved_us == pytest.approx(excess_us, rel=1e-9), (name, saved_us, excess_us)
        assert 1.0 < saved_us < 3.0, (name, saved_us)      # one launch on H100 (the tables' ~2.4 µs gap)
    assert eager.kernel_time_s(kernels["o_proj"]) == compiled.kernel_time_s(kernels["o_proj"])
