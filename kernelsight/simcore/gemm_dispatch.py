"""Which GEMM kernel vLLM runs for an FP8 linear layer: checkpoint scale type + GPU + shape → kernel.

vLLM picks an FP8 linear kernel from the checkpoint's quantization config (how weights and activations are
scaled), the GPU's compute capability and, for block-scaled weights, the token count m and the layer's n, k
(vLLM's ``Fp8LinearMethod`` / ``CompressedTensorsW8A8Fp8`` / ``ModelOptFp8LinearMethod`` with the kernel
priority lists of ``model_executor/kernels/linear``):

* **Weight and activation scales.** ``quant_method: fp8`` with ``weight_block_size [128, 128]`` (DeepSeek-V3,
  Qwen3-*-FP8) scales weights per 128×128 block and activations per token and 128-column group, always dynamic.
  Without a block size weights have one scale per tensor; activations are per-tensor when the checkpoint is
  ``activation_scheme: static`` and per-token when dynamic (vLLM prefers per-token with CUTLASS). ``--quantization
  fp8`` on a bf16 checkpoint quantizes online the same way (per-tensor weights, dynamic per-token activations).
  ModelOpt FP8 (``quant_algo: FP8``) is static per-tensor; compressed-tensors names weight (tensor / channel /
  block) and activation (static tensor / dynamic token / group) strategies itself.
* **Kernel.** No FP8 tensor cores (compute capability < 8.9): Marlin, weight-only FP8 (W8A16) on the bf16 tensor
  cores. Per-tensor / per-channel W8A8 on 8.9+: CUTLASS ``cutlass_scaled_mm``, except that Blackwell datacenter
  (10.x) runs FlashInfer's per-tensor GEMM when both scales are per-tensor. Block-scaled on Hopper: CUTLASS's
  block-scaled kernel when k is not a multiple of 128 (or n of 64), else FlashInfer's block-scale GEMM for m < 32 and
  DeepGEMM from 32 (``FlashInferFp8DeepGEMMDynamicBlockScaledKernel``; the shared H100 tables record exactly
  this split); Blackwell datacenter follows the same DeepGEMM rule; Ada (8.9) runs Triton's
  ``w8a8_block_fp8_matmul``; consumer/workstation Blackwell (12.x) CUTLASS's block-scaled kernel.

``fp8_linear_kernel`` is that choice as a pure function; ``priced_format`` says which measured GEMM format prices
it. Block-scaled kernels are priced from the per-tensor fp8 model times ``BLOCK_FP8_TIME_RATIO``: the shared
block-fp8 tables time vLLM's eager per-call path, whose host dispatch (55–300 µs per call) hides the GPU time of
every decode-sized GEMM and which CUDA graphs remove, so only their GPU-bound rows say how the block kernel
compares with the per-tensor one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# weight scale granularity
TENSOR = "tensor"
CHANNEL = "channel"
BLOCK = "block"
# activation scale granularity (all but STATIC_TENSOR are computed per call)
STATIC_TENSOR = "static_tensor"
DYNAMIC_TENSOR = "dynamic_tensor"
DYNAMIC_TOKEN = "dynamic_token"
DYNAMIC_GROUP = "dynamic_group"

# vLLM kernel class names (as the shared tables' ``kernel`` column records them)
CUTLASS_FP8 = "CutlassFP8ScaledMMLinearKernel"
FLASHINFER_FP8 = "FlashInferFP8ScaledMMLinearKernel"
MARLIN_FP8 = "MarlinFP8ScaledMMLinearKernel"
CUTLASS_BLOCK = "CutlassFp8BlockScaledMMKernel"
DEEPGEMM_BLOCK = "DeepGemmFp8BlockScaledMMKernel"
FLASHINFER_BLOCK = "FlashInferFp8BlockScaledMMKernel"
TRITON_BLOCK = "TritonFp8BlockScaledMMKernel"
ROCM_FP8 = "ROCmFP8ScaledMMLinearKernel"
ROCM_BLOCK = "AiterFp8BlockScaledMMKernel"

BLOCK_KERNELS = frozenset({CUTLASS_BLOCK, DEEPGEMM_BLOCK, FLASHINFER_BLOCK, TRITON_BLOCK, ROCM_BLOCK})

#: FlashInfer's block-scale GEMM takes m below this, DeepGEMM the rest (vLLM: the swap-AB kernel is accurate there).
FLASHINFER_BLOCK_MAX_M = 31
#: DeepGEMM and FlashInfer's block GEMM need k in whole 128-column scale groups and n in whole 64-row tiles;
#: CUTLASS's block kernel takes the rest (the H100 tables: every n = 32 or k % 128 != 0 shape ran CUTLASS).
BLOCK_K_ALIGN = 128
BLOCK_N_ALIGN = 64

#: GPU time of a block-scaled kernel ÷ the per-tensor CUTLASS kernel's at the same shape, (memory-bound,
#: compute-bound by the wave-quantized fp8 roofline): medians over the shared tables' shapes where the block row is
#: GPU-bound (latency > 3× the kernel's eager floor, so host dispatch no longer hides the kernel;
#: ``calibrate.fit.block_fp8``). H100: DeepGEMM 0.95 over 692 memory-bound / 0.90 over 4,181 compute-bound shapes,
#: FlashInfer 0.975 (322, all memory-bound: m < 32), CUTLASS's block kernel 0.98 (53, memory-bound only). L40S:
#: Triton 1.00 / 1.38 (its block-scaled main loop falls behind CUTLASS once compute binds). A regime without rows
#: takes 1 (the per-tensor model). Reproduced from the tables by tests/test_gemm_dispatch.py (slow).
BLOCK_FP8_TIME_RATIO: dict[str, tuple[float, float]] = {
    DEEPGEMM_BLOCK: (0.95, 0.90),
    FLASHINFER_BLOCK: (0.975, 0.975),
    CUTLASS_BLOCK: (0.98, 1.0),
    TRITON_BLOCK: (1.0, 1.38),
}


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How an FP8 checkpoint scales its linear layers' weights and activations."""

    weight: str = TENSOR            # TENSOR | CHANNEL | BLOCK
    activation: str = DYNAMIC_TOKEN  # STATIC_TENSOR | DYNAMIC_TENSOR | DYNAMIC_TOKEN | DYNAMIC_GROUP
    block_n: int = 0                # weight block (rows of W^T, i.e. output features) when weight == BLOCK
    block_k: int = 0

    @property
    def label(self) -> str:
        """Short name for reports, e.g. ``block128x128``, ``tensor/static_tensor``."""
        if self.weight == BLOCK:
            return f"block{self.block_n}x{self.block_k}"
        return f"{self.weight}/{self.activation}"


#: ``--quantization fp8`` on a 16-bit checkpoint: per-tensor weight scales, activations dynamic per token.
ONLINE_FP8 = Fp8Scheme(TENSOR, DYNAMIC_TOKEN)


def _strategy(args: Any) -> str:
    return str(args.get("strategy", "")).lower() if isinstance(args, dict) else ""


def _compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme | None:
    """The first config group's FP8 weight/activation strategies (compressed-tensors ``config_groups``)."""
    groups = config.get("config_groups") or {}
    for group in groups.values() if isinstance(groups, dict) else ():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if w.get("type", "float") != "float" or int(w.get("num_bits", 0) or 0) != 8:
            continue
        weight = {"tensor": TENSOR, "channel": CHANNEL, "block": BLOCK}.get(_strategy(w), TENSOR)
        block = w.get("block_structure") or [0, 0]
        if not a:
            activation = DYNAMIC_TOKEN
        elif not a.get("dynamic", False):
            activation = STATIC_TENSOR
        else:
            activation = {"group": DYNAMIC_GROUP, "tensor": DYNAMIC_TENSOR}.get(_strategy(a), DYNAMIC_TOKEN)
        if weight == BLOCK:
            return Fp8Scheme(BLOCK, DYNAMIC_GROUP, int(block[0]), int(block[1]))
        return Fp8Scheme(weight, activation)
    return None


def fp8_scheme_from_quant_config(config: dict[str, Any] | None) -> Fp8Scheme | None:
    """The FP8 scheme of a HF ``quantization_config`` (None: not an FP8 checkpoint vLLM runs as W8A8/W8A16)."""
    if not isinstance(config, dict):
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method == "fbgemm_fp8":                       # per-channel weights, dynamic per-token activations
        return Fp8Scheme(CHANNEL, DYNAMIC_TOKEN)
    if method == "modelopt" or config.get("quant_algo") is not None:
        algo = str(config.get("quant_algo", "")).upper()
        return Fp8Scheme(TENSOR, STATIC_TENSOR) if algo == "FP8" else None
    if method != "fp8":
        return None
    block = config.get("weight_block_size")
    if block:
        return Fp8Scheme(BLOCK, DYNAMIC_GROUP, int(block[0]), int(block[1]))
    static = str(config.get("activation_scheme", "dynamic")).lower() == "static"
    return Fp8Scheme(TENSOR, STATIC_TENSOR if static else DYNAMIC_TOKEN)


def kv_cache_dtype_from_quant_config(config: dict[str, Any] | None) -> str | None:
    """The KV-cache dtype a checkpoint asks for (``"fp8"``), which vLLM's ``--kv-cache-dtype auto`` resolves to
    (``resolve_kv_cache_dtype_string``): ModelOpt's ``kv_cache_quant_algo: FP8`` or a compressed-tensors
    ``kv_cache_scheme`` of static 8-bit floats. None when it asks for none."""
    if not isinstance(config, dict):
        return None
    algo = config.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo.upper().startswith("FP8"):
        return "fp8"
    scheme = config.get("kv_cache_scheme")
    if (isinstance(scheme, dict) and scheme.get("type") == "float" and int(scheme.get("num_bits", 0) or 0) == 8
            and not scheme.get("dynamic", False)):
        return "fp8"
    return None


def capability_number(compute_capability: str) -> int | None:
    """``"9.0"`` → 90, ``"12.0"`` → 120; None for a non-CUDA device (``"gfx942"``)."""
    major, _, minor = compute_capability.partition(".")
    if not major.isdigit():
        return None
    return int(major) * 10 + (int(minor) if minor.isdigit() else 0)


def fp8_linear_kernel(scheme: Fp8Scheme, compute_capability: str, m: int, n: int, k: int) -> str:
    """The vLLM kernel (class name) an FP8 linear layer y[m,n] = x[m,k]·W[k,n] runs on this GPU."""
    cc = capability_number(compute_capability)
    if cc is None:                                   # ROCm: hipBLASLt / AITER paths
        return ROCM_BLOCK if scheme.weight == BLOCK else ROCM_FP8
    if cc < 89:                                      # no FP8 tensor cores: weight-only FP8 on the bf16 units
        return MARLIN_FP8
    if scheme.weight != BLOCK:
        both_per_tensor = scheme.weight == TENSOR and scheme.activation in (STATIC_TENSOR, DYNAMIC_TENSOR)
        return FLASHINFER_FP8 if 100 <= cc < 120 and both_per_tensor else CUTLASS_FP8
    if cc < 90:                                      # Ada
        return TRITON_BLOCK
    if cc >= 120:                                    # RTX PRO 6000 / RTX 50xx: no DeepGEMM
        return CUTLASS_BLOCK
    if k % BLOCK_K_ALIGN or n % BLOCK_N_ALIGN:
        return CUTLASS_BLOCK
    return FLASHINFER_BLOCK if m <= FLASHINFER_BLOCK_MAX_M else DEEPGEMM_BLOCK


def priced_format(kernel: str) -> str:
    """The GEMM format whose η model prices a kernel: ``fp8`` (W8A8 on the fp8 peak) or ``bf16`` (Marlin's
    weight-only FP8 computes in bf16; only its weight bytes shrink)."""
    return "bf16" if kernel == MARLIN_FP8 else "fp8"


def block_time_ratio(kernel: str, compute_bound: bool) -> float:
    """GPU time of a block-scaled kernel relative to the per-tensor model (1 for every other kernel)."""
    ratios = BLOCK_FP8_TIME_RATIO.get(kernel)
    if ratios is None:
        return 1.0
    return ratios[1] if compute_bound else ratios[0]


__all__ = [
    "BLOCK",
    "BLOCK_FP8_TIME_RATIO",
    "BLOCK_KERNELS",
    "CHANNEL",
    "CUTLASS_BLOCK",
    "CUTLASS_FP8",
    "DEEPGEMM_BLOCK",
    "DYNAMIC_GROUP",
    "DYNAMIC_TENSOR",
    "DYNAMIC_TOKEN",
    "FLASHINFER_BLOCK",
    "FLASHINFER_FP8",
    "MARLIN_FP8",
    "ONLINE_FP8",
    "STATIC_TENSOR",
    "TENSOR",
    "TRITON_BLOCK",
    "Fp8Scheme",
    "block_time_ratio",
    "capability_number",
    "fp8_linear_kernel",
    "fp8_scheme_from_quant_config",
    "kv_cache_dtype_from_quant_config",
    "priced_format",
]


def block_shape_error(scheme: Fp8Scheme | None, *, q_heads: int, kv_heads: int, head_dim: int,
                      intermediate: int, moe_intermediate: int, tp: int, moe_tp: int) -> str | None:
    """vLLM's refusal to load a block-quantized FP8 checkpoint whose TP shards split a weight block, or None.

    Every rank must hold whole ``block_n × block_k`` blocks (``Fp8LinearMethod.create_weights`` /
    ``validate_fp8_block_shape`` for the linear layers, ``Fp8MoEMethod.create_weights`` for the experts), checked
    in load order: QKV (column-parallel, merged), O (row-parallel), the dense MLP, the experts. ``moe_tp`` is the
    experts' TP degree: TP × DP without expert parallelism, 1 with it (whole experts per rank). The classic case is
    Qwen3-235B-A22B-FP8 at TP 8 (1536 / 8 = 192): vLLM needs ``--enable-expert-parallel`` there."""
    if scheme is None or scheme.weight != BLOCK or not scheme.block_n or not scheme.block_k:
        return None
    bn, bk = scheme.block_n, scheme.block_k
    if tp > 1 and q_heads and head_dim:
        kv = max(kv_heads // tp, 1) * head_dim
        for part in (q_heads // tp * head_dim, kv, kv):          # merged: checked at any TP (len(partitions) > 1)
            if part % bn:
                return f"Weight output_partition_size = {part} is not divisible by weight quantization block_n = {bn}."
        if (q_heads // tp * head_dim) % bk:
            return (f"Weight input_size_per_partition = {q_heads // tp * head_dim} is not divisible by weight "
                    f"quantization block_k = {bk}.")
    if intermediate and tp > 1:
        part = intermediate // tp
        if part % bn:
            return f"Weight output_partition_size = {part} is not divisible by weight quantization block_n = {bn}."
        if part % bk:
            return f"Weight input_size_per_partition = {part} is not divisible by weight quantization block_k = {bk}."
    if moe_intermediate:
        part = moe_intermediate // moe_tp
        if part % bn:
            return (f"The output_size of gate's and up's weight = {part} is not divisible by weight quantization "
                    f"block_n = {bn}.")
        if tp > 1 and part % bk:
            return f"The input_size of down's weight = {part} is not divisible by weight quantization block_k = {bk}."
    return None
