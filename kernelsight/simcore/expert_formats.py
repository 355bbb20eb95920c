"""The routed experts' GEMM format when a checkpoint quantizes them apart from the rest (gpt-oss: MXFP4).

``expert_gemm_format`` is the one hook the MoE kernels ask; the formats themselves live in ``precision`` and
``fp4_dispatch``. MXFP4 experts run as vLLM runs them by default (triton ``matmul_ogs``, Marlin): weights stream as
4-bit values plus one 8-bit scale per 32 (4.25 bits), dequantized to bf16 and multiplied on the bf16 peak.
"""

from __future__ import annotations

from kernelsight.simcore.fp4_dispatch import FP4_BYTES_PER_ELEMENT, MXFP4, NVFP4, W4A4_KERNELS, fp4_moe_backend
from kernelsight.simcore.gemm_dispatch import BLOCK
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision

#: MXFP4 (OCP microscaling): e2m1 values, one e8m0 scale per 32-element block.
MXFP4_WEIGHT_BYTES_PER_PARAM = 0.5 + 1.0 / 32.0


def mxfp4_bf16_fallback(precision: Precision) -> tuple[str, float]:
    """MXFP4 weights dequantized in the kernel and multiplied in the activation dtype (bf16)."""
    return precision.act_dtype, MXFP4_WEIGHT_BYTES_PER_PARAM


def expert_gemm_format(model: ModelSpec, precision: Precision) -> tuple[str, float]:
    """(compute dtype, weight bytes per parameter) of the routed experts' grouped GEMMs: the precision's expert
    format (FP4 experts as ``fp4_dispatch`` picks their MoE backend for this GPU), else MXFP4 experts the config
    names but the precision does not carry (e.g. ``--quantization fp8`` on gpt-oss) as the bf16 fallback."""
    if precision.expert_weight_dtype in FP4_BYTES_PER_ELEMENT:
        return precision.expert_compute_dtype, precision.expert_weight_bytes_per_param
    if model.expert_quantization == "mxfp4":
        return mxfp4_bf16_fallback(precision)
    return precision.expert_compute_dtype, precision.expert_weight_bytes_per_param


def expert_weight_bytes_per_param(model: ModelSpec, precision: Precision) -> float:
    return expert_gemm_format(model, precision)[1]


def moe_expert_format(model: ModelSpec, precision: Precision) -> str:
    """The routed experts' format as the MoE kernel tables name it (``kernel_shapes.MOE_FORMAT_CODES``): the kernel
    family vLLM's FusedMoE runs for the checkpoint on this GPU. FP8 experts: block-scaled or per-tensor as the
    checkpoint scales them; NVFP4: W4A4 where vLLM picks an FP4 tensor-core backend (Blackwell), else Marlin's
    weight-only path (priced as the measured weight-only int4 Marlin kernel); MXFP4 (gpt-oss): W4A16."""
    fmt = precision.expert_weight_dtype
    if fmt == MXFP4 or (fmt not in FP4_BYTES_PER_ELEMENT and model.expert_quantization == MXFP4):
        return "w4a16_mxfp4"
    if fmt == NVFP4:
        backend = fp4_moe_backend(NVFP4, precision.compute_capability or "9.0")
        return NVFP4 if backend in W4A4_KERNELS else "int4_wo"
    if fmt == "fp8":
        scheme = precision.fp8_scheme
        return "fp8_block" if scheme is not None and scheme.weight == BLOCK else "fp8"
    return "bf16"
