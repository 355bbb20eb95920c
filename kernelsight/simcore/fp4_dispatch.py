"""FP4 checkpoints: which kernel vLLM runs for an NVFP4 linear layer or an MXFP4 / NVFP4 MoE layer, and its bytes.

Two 4-bit formats (E2M1 values, two per byte) differ in their block scales:

* **NVFP4** (``nvidia/*-FP4`` ModelOpt checkpoints, ``quant_algo: NVFP4``; compressed-tensors ``nvfp4``): one FP8
  E4M3 scale per 16 elements plus one FP32 global scale per tensor, weights *and* activations (W4A4): 0.5 + 1/16
  bytes per element.
* **MXFP4** (gpt-oss, ``quant_method: mxfp4``): one E8M0 (power-of-two) scale per 32 elements, the MoE experts'
  weights only: 0.5 + 1/32 bytes per element.

Kernel choice (vLLM's ``_POSSIBLE_NVFP4_KERNELS`` priority list, ``init_nvfp4_linear_kernel``; the MoE oracles
``select_mxfp4_moe_backend`` / NVFP4 MoE): a kernel is taken when the GPU passes its gate, first in list order.

* NVFP4 linear. Datacenter Blackwell (compute capability 10.x): FlashInfer's CuTe-DSL W4A4 GEMM (gated to the
  sm_10x family). Workstation/consumer Blackwell (12.x: RTX PRO 6000, RTX 50xx): FlashInfer's CUTLASS W4A4 GEMM
  (gated on ≥ sm_100; the shared RTX PRO 6000 tables record exactly this kernel). No FP4 tensor cores (Ampere, Ada,
  Hopper): Marlin, weight-only (W4A16): 4-bit weights dequantized in registers, bf16 tensor cores. ROCm: software
  emulation (weights dequantized to bf16, then a bf16 GEMM).
* NVFP4 MoE (``select_nvfp4_moe_backend``): W4A4 grouped GEMMs on Blackwell — FlashInfer TRT-LLM on sm_10x,
  FlashInfer CUTLASS on 12.x —, Marlin W4A16 without FP4 tensor cores, emulation on ROCm.
* MXFP4 MoE: W4A16 by default everywhere — FlashInfer TRT-LLM with bf16 activations on sm_10x, OpenAI's Triton
  ``matmul_ogs`` on Hopper, Marlin on Ampere/Ada and 12.x; MXFP8 activations (W4A8) only behind
  ``VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8``, which is not the default and not modelled.

Pricing: a W4A4 kernel is a GEMM of format ``nvfp4`` (the FP4 tensor-core peak, 4-bit operands with their scales,
its own η); a W4A16 kernel is a bf16 GEMM whose weights are the packed 4-bit bytes (as Marlin's weight-only FP8 is
priced, ``gemm_dispatch.priced_format``); emulation is a bf16 GEMM that also writes and re-reads a bf16 copy of the
weights. MoE expert GEMMs keep the ``moe_gemm`` η (the bf16 GEMM model, as fp8 experts do) at their backend's peak
and bytes: no grouped FP4 GEMM was measured to fit one.
"""

from __future__ import annotations

from typing import Any

from kernelsight.simcore.gemm_dispatch import capability_number

NVFP4 = "nvfp4"
MXFP4 = "mxfp4"
FP4_FORMATS = (NVFP4, MXFP4)

#: elements per block scale and the scale's bytes
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
_NVFP4_SCALE_BYTES = 1.0   # FP8 E4M3
_MXFP4_SCALE_BYTES = 1.0   # E8M0
#: stored bytes per element: two E2M1 values per byte plus the block's scale (the FP32 per-tensor global scale of
#: NVFP4 is negligible)
NVFP4_BYTES_PER_ELEMENT = 0.5 + _NVFP4_SCALE_BYTES / NVFP4_BLOCK
MXFP4_BYTES_PER_ELEMENT = 0.5 + _MXFP4_SCALE_BYTES / MXFP4_BLOCK
FP4_BYTES_PER_ELEMENT = {NVFP4: NVFP4_BYTES_PER_ELEMENT, MXFP4: MXFP4_BYTES_PER_ELEMENT}

# vLLM kernel class names (NVFP4 linear layers)
FLASHINFER_CUTEDSL_NVFP4 = "FlashInferCuteDslNvFp4LinearKernel"
FLASHINFER_CUTLASS_NVFP4 = "FlashInferCutlassNvFp4LinearKernel"
MARLIN_NVFP4 = "MarlinNvFp4LinearKernel"
EMULATION_NVFP4 = "EmulationNvFp4LinearKernel"
# vLLM MoE backends (the oracles' enum values)
FLASHINFER_TRTLLM_NVFP4_MOE = "FLASHINFER_TRTLLM"
FLASHINFER_CUTLASS_NVFP4_MOE = "FLASHINFER_CUTLASS"
EMULATION_MOE = "EMULATION"
MARLIN_MOE = "MARLIN"
TRTLLM_MXFP4_BF16 = "FLASHINFER_TRTLLM_MXFP4_BF16"
TRITON_MXFP4 = "TRITON"

#: kernels that run W4A4 on the FP4 tensor cores; every other FP4 kernel computes in bf16
W4A4_KERNELS = frozenset({FLASHINFER_CUTEDSL_NVFP4, FLASHINFER_CUTLASS_NVFP4, FLASHINFER_TRTLLM_NVFP4_MOE,
                          FLASHINFER_CUTLASS_NVFP4_MOE})


def fp4_format_from_quant_config(config: dict[str, Any] | None) -> str | None:
    """The FP4 format of a HF ``quantization_config`` (None: not an FP4 checkpoint).

    ModelOpt writes ``quant_method: modelopt`` + ``quant_algo: NVFP4`` (or, folded from an ``hf_quant_config.json``,
    ``quant_method: nvfp4``; vLLM's name for it is ``modelopt_fp4``); gpt-oss ``quant_method: mxfp4``;
    compressed-tensors a config group of 4-bit float weights in groups of 16."""
    if not isinstance(config, dict):
        return None
    method = str(config.get("quant_method", "")).lower()
    algo = str(config.get("quant_algo", "")).upper()
    if method == MXFP4:
        return MXFP4
    if method in ("modelopt_fp4", NVFP4) or (method == "modelopt" and algo == "NVFP4"):
        return NVFP4
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, dict) else ():
            w = group.get("weights") or {} if isinstance(group, dict) else {}
            if (w.get("type") == "float" and int(w.get("num_bits", 0) or 0) == 4
                    and int(w.get("group_size", 0) or 0) == NVFP4_BLOCK):
                return NVFP4
    return None


def has_fp4_tensor_cores(compute_capability: str) -> bool:
    """NVIDIA Blackwell (10.x datacenter, 12.x workstation/consumer) has FP4 tensor cores; nothing older does."""
    cc = capability_number(compute_capability)
    return cc is not None and cc >= 100


def nvfp4_linear_kernel(compute_capability: str) -> str:
    """The vLLM kernel an NVFP4 linear layer runs on this GPU (first supported entry of vLLM's priority list)."""
    cc = capability_number(compute_capability)
    if cc is None:                    # ROCm: only the emulation kernel is registered
        return EMULATION_NVFP4
    if 100 <= cc < 110:               # the CuTe-DSL kernel is gated to the sm_10x family
        return FLASHINFER_CUTEDSL_NVFP4
    if cc >= 110:
        return FLASHINFER_CUTLASS_NVFP4
    return MARLIN_NVFP4               # is_fp4_marlin_supported: sm_75 and newer


def fp4_moe_backend(fmt: str, compute_capability: str) -> str:
    """The MoE backend vLLM picks for FP4 experts of format ``fmt`` (``nvfp4`` / ``mxfp4``) on this GPU."""
    cc = capability_number(compute_capability)
    if fmt == NVFP4:
        if cc is None:
            return EMULATION_MOE
        if 100 <= cc < 110:
            return FLASHINFER_TRTLLM_NVFP4_MOE
        return FLASHINFER_CUTLASS_NVFP4_MOE if cc >= 110 else MARLIN_MOE
    if cc is None:
        return TRITON_MXFP4           # ROCm without gfx950's CK kernels: triton_kernels, W4A16
    if 100 <= cc < 110:
        return TRTLLM_MXFP4_BF16
    if 90 <= cc < 110:
        return TRITON_MXFP4           # triton_kernels matmul_ogs: sm_90 up to (not incl.) 11.0
    return MARLIN_MOE


def fp4_priced_format(kernel: str) -> str:
    """``nvfp4`` for a W4A4 kernel (the FP4 peak and the NVFP4 η), else ``bf16`` (W4A16 / emulation)."""
    return NVFP4 if kernel in W4A4_KERNELS else "bf16"


def fp4_weight_bytes_per_param(fmt: str, kernel: str, act_bytes: float) -> float:
    """Weight bytes one GEMM call moves per parameter: the packed 4-bit weights and their scales; emulation also
    writes a dequantized 16-bit copy and reads it back."""
    packed = FP4_BYTES_PER_ELEMENT[fmt]
    return packed + 2.0 * act_bytes if kernel == EMULATION_NVFP4 else packed


__all__ = [
    "EMULATION_NVFP4",
    "FLASHINFER_CUTEDSL_NVFP4",
    "FLASHINFER_CUTLASS_NVFP4",
    "EMULATION_MOE",
    "FLASHINFER_CUTLASS_NVFP4_MOE",
    "FLASHINFER_TRTLLM_NVFP4_MOE",
    "FP4_BYTES_PER_ELEMENT",
    "FP4_FORMATS",
    "MARLIN_MOE",
    "MARLIN_NVFP4",
    "MXFP4",
    "MXFP4_BLOCK",
    "MXFP4_BYTES_PER_ELEMENT",
    "NVFP4",
    "NVFP4_BLOCK",
    "NVFP4_BYTES_PER_ELEMENT",
    "TRITON_MXFP4",
    "TRTLLM_MXFP4_BF16",
    "W4A4_KERNELS",
    "fp4_format_from_quant_config",
    "fp4_moe_backend",
    "fp4_priced_format",
    "fp4_weight_bytes_per_param",
    "has_fp4_tensor_cores",
    "nvfp4_linear_kernel",
]
