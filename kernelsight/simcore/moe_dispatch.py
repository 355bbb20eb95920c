"""Which kernel vLLM's FusedMoE layer runs, per expert format, GPU and vLLM release: the kernel class η transfers by.

The shared MoE tables name the kernel that ran (their ``kernel`` column); what they show, per format:

* ``bf16``: the Triton ``fused_moe`` kernel on Ampere, Ada and Hopper (0.14, 0.24) and on the RTX PRO 6000 (SM 12.0)
  under 0.19; FlashInfer's CUTLASS MoE on that GPU under 0.24 (Blackwell, vLLM ≥ 0.20 assumed: no table between).
* ``fp8`` (per-tensor W8A8): FlashInfer CUTLASS on Hopper and Blackwell under 0.24, Triton on Ada (no FlashInfer
  fp8 MoE below SM 9.0) and on the PRO 6000 under 0.19.
* ``fp8_block``: Triton on Ada and under 0.19; on Hopper under 0.24 FlashInfer CUTLASS or Triton by shape (the
  table holds both; η per kernel tells them apart in the target tier): FlashInfer CUTLASS is the class it transfers
  as on SM ≥ 9.0 under ≥ 0.20.
* ``int4_wo``: Marlin everywhere. ``w4a16_mxfp4`` and ``nvfp4``: the FP4 MoE backend of ``fp4_dispatch`` (OpenAI's
  Triton kernels on Hopper, FlashInfer TRT-LLM on SM 10.x, CUTLASS for NVFP4 on SM ≥ 11, Marlin elsewhere).

A class groups the kernels one code path runs (a table's several Triton names, the compressed-tensors and gpt-oss
Marlin wrappers). Pure functions, no I/O.
"""

from __future__ import annotations

from kernelsight.simcore.fp4_dispatch import (
    FLASHINFER_CUTLASS_NVFP4_MOE,
    FLASHINFER_TRTLLM_NVFP4_MOE,
    MARLIN_MOE,
    NVFP4,
    TRITON_MXFP4,
    TRTLLM_MXFP4_BF16,
    fp4_moe_backend,
)
from kernelsight.simcore.gemm_dispatch import capability_number

TRITON = "triton"
FLASHINFER_CUTLASS = "flashinfer_cutlass"
FLASHINFER_TRTLLM = "flashinfer_trtllm"
MARLIN = "marlin"
OAI_TRITON = "oai_triton"
MOE_KERNEL_CLASSES: tuple[str, ...] = (TRITON, FLASHINFER_CUTLASS, FLASHINFER_TRTLLM, MARLIN, OAI_TRITON)
#: The first release taken to run FlashInfer's CUTLASS MoE for 16-bit and fp8 experts where the 0.24 tables show it
#: (0.19 ran Triton on the same GPU; no table times a release between).
FLASHINFER_MOE_RELEASE: tuple[int, ...] = (0, 20)


def moe_kernel_class(kernel: str) -> str:
    """The class of a kernel name as the tables' ``kernel`` column gives it (``vllm_fused_moe``,
    ``vllm_fp8moe_flashinfer_cutlass_flashinferexperts``, ...); ``""`` when none matches."""
    k = kernel.lower()
    if "marlin" in k:
        return MARLIN
    if "oaitriton" in k or "gptossmxfp4moe_triton" in k:
        return OAI_TRITON
    if "trtllm" in k:
        return FLASHINFER_TRTLLM
    if "flashinfer" in k or "cutlass" in k:
        return FLASHINFER_CUTLASS
    if "triton" in k or k == "vllm_fused_moe":
        return TRITON
    return ""


def moe_kernel(fmt: str, compute_capability: str, vllm_release: tuple[int, ...] | None = None) -> str:
    """The class of the kernel vLLM's FusedMoE layer runs for experts of format ``fmt`` (the MoE tables' ``dtype``
    names) on a GPU of this compute capability under this release (None: the newest the tables time, 0.24)."""
    cc = capability_number(compute_capability)
    new = vllm_release is None or vllm_release >= FLASHINFER_MOE_RELEASE
    if fmt == "int4_wo":
        return MARLIN
    if fmt in ("w4a16_mxfp4", NVFP4):
        backend = fp4_moe_backend("mxfp4" if fmt == "w4a16_mxfp4" else NVFP4, compute_capability)
        return {TRITON_MXFP4: OAI_TRITON, TRTLLM_MXFP4_BF16: FLASHINFER_TRTLLM,
                FLASHINFER_TRTLLM_NVFP4_MOE: FLASHINFER_TRTLLM, FLASHINFER_CUTLASS_NVFP4_MOE: FLASHINFER_CUTLASS,
                MARLIN_MOE: MARLIN}.get(backend, TRITON)
    if cc is None or not new:
        return TRITON
    if fmt in ("bf16", "fp16"):
        return FLASHINFER_CUTLASS if cc >= 100 else TRITON
    if fmt in ("fp8", "fp8_block"):
        return FLASHINFER_CUTLASS if cc >= 90 else TRITON
    return TRITON


__all__ = [
    "FLASHINFER_CUTLASS",
    "FLASHINFER_MOE_RELEASE",
    "FLASHINFER_TRTLLM",
    "MARLIN",
    "MOE_KERNEL_CLASSES",
    "OAI_TRITON",
    "TRITON",
    "moe_kernel",
    "moe_kernel_class",
]
