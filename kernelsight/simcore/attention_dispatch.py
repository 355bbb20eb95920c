"""Which attention kernel and which generation of GEMM kernels vLLM runs on a GPU by default: the kernels whose η a
calibration describes, so what a cross-generation calibration borrows can be named.

Attention (vLLM's default backend per compute capability): 8.x (Ampere, Ada) FlashAttention-2; 9.0 (Hopper)
FlashAttention-3; 10.x (datacenter Blackwell) FlashInfer with its TRT-LLM-generated kernels; 12.x (RTX / workstation
Blackwell) FlashAttention-2 (the RTX PRO 6000's tables time ``vllm_flash_attn_fa2``); AMD: ROCm's AITER / Triton
kernels. A release may route some shapes elsewhere (the PRO 6000 under vLLM 0.24 decodes with FlashInfer and runs
Triton attention on some; under 0.19 FlashInfer and FlashAttention): the measured tables record the kernel per row.

GEMMs: the tensor-core instruction the libraries' kernels (cuBLAS, CUTLASS) are built on — ``mma.sync`` (8.x, 12.x),
``wgmma`` (9.0), ``tcgen05`` (10.x), MFMA (AMD): kernels of one generation share tiling and pipelining.
"""

from __future__ import annotations

from kernelsight.simcore.hardware import HardwareSpec

FLASH_ATTN_2 = "FlashAttention-2"
FLASH_ATTN_3 = "FlashAttention-3"
FLASHINFER_TRTLLM = "FlashInfer (TRT-LLM)"
ROCM_AITER = "ROCm AITER/Triton"
TRITON = "Triton"      # vLLM's portable fallback (GPUs older than Ampere)

_ATTENTION_BY_MAJOR = {"8": FLASH_ATTN_2, "9": FLASH_ATTN_3, "10": FLASHINFER_TRTLLM, "12": FLASH_ATTN_2}
_GEMM_BY_MAJOR = {"8": "mma.sync", "9": "wgmma", "10": "tcgen05", "12": "mma.sync"}


def _major(hw: HardwareSpec) -> str:
    return hw.compute_capability.split(".")[0]


def attention_kernel(hw: HardwareSpec) -> str:
    """The attention kernel vLLM's default backend runs on ``hw``."""
    if hw.vendor != "nvidia":
        return ROCM_AITER
    return _ATTENTION_BY_MAJOR.get(_major(hw), TRITON)


def gemm_generation(hw: HardwareSpec) -> str:
    """The tensor-core instruction ``hw``'s GEMM kernels are built on."""
    if hw.vendor != "nvidia":
        return "MFMA"
    return _GEMM_BY_MAJOR.get(_major(hw), "mma.sync")


def kernel_lineage(hw: HardwareSpec) -> str:
    """``FlashAttention-3, wgmma GEMMs``: the kernels a calibration of ``hw`` describes."""
    return f"{attention_kernel(hw)}, {gemm_generation(hw)} GEMMs"


__all__ = ["FLASHINFER_TRTLLM", "FLASH_ATTN_2", "FLASH_ATTN_3", "ROCM_AITER", "TRITON", "attention_kernel",
           "gemm_generation", "kernel_lineage"]
