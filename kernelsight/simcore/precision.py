"""Numeric formats: which tensor-core peak a GEMM uses and how many bytes weights and KV take."""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.simcore.gemm_dispatch import ONLINE_FP8, Fp8Scheme

_BYTES_PER_ELEMENT = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5, "fp32": 4.0}

SUPPORTED_QUANTIZATION = (None, "fp8")
#: Formats vLLM runs that the kernel model does not price yet, with what is missing.
_UNPRICED_QUANTIZATION = {
    "nvfp4": "NVFP4 (W4A4, FP8 block scales) linear layers need FP4 GEMM pricing (FP4 tensor-core peaks and an η "
             "for the nvfp4 format), which is not modelled yet",
    "mxfp4": "MXFP4 on every linear layer is not modelled (gpt-oss checkpoints, whose MXFP4 covers the experts only, "
             "are)",
}
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class Precision:
    """Weight/activation format of the linear layers and the KV-cache element format."""

    weight_dtype: str = "bf16"   # "bf16" | "fp16" | "fp8" (W8A8)
    act_dtype: str = "bf16"      # activations between kernels (fp8 GEMMs still emit bf16)
    kv_dtype: str = "bf16"
    #: how an fp8 checkpoint scales weights and activations (None unless weight_dtype is fp8): with the GPU's
    #: compute capability it picks the GEMM kernel vLLM runs (``gemm_dispatch.fp8_linear_kernel``)
    fp8_scheme: Fp8Scheme | None = None
    compute_capability: str = ""   # of the GPU the linear layers run on ("9.0"); "" = unknown (Hopper assumed)

    @property
    def gemm_dtype(self) -> str:
        """Tensor-core dtype the linear layers run in (W8A8 runs the fp8 peak)."""
        return self.weight_dtype

    @property
    def weight_bytes_per_param(self) -> float:
        return _BYTES_PER_ELEMENT[self.weight_dtype]

    @property
    def act_bytes(self) -> float:
        return _BYTES_PER_ELEMENT[self.act_dtype]

    @property
    def kv_bytes_per_element(self) -> float:
        return _BYTES_PER_ELEMENT[self.kv_dtype]


def resolve_precision(
    model_dtype: str = "bfloat16", quantization: str | None = None, kv_cache_dtype: str = "auto",
    fp8_scheme: Fp8Scheme | None = None, compute_capability: str = "",
) -> Precision:
    """Map vLLM's ``--dtype/--quantization/--kv-cache-dtype`` onto a Precision.

    ``fp8_scheme`` is the checkpoint's own (its ``quantization_config``); without one, fp8 is vLLM's online
    quantization of a 16-bit checkpoint (per-tensor weights, dynamic per-token activations).

    Raises ValueError for formats the kernel model does not implement, rather than guessing.
    """
    base = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
            "auto": "bf16"}.get(model_dtype)
    if base is None:
        raise ValueError(f"unsupported dtype {model_dtype!r}: expected bfloat16 or float16")
    if quantization in _UNPRICED_QUANTIZATION:
        raise ValueError(f"unsupported quantization {quantization!r}: {_UNPRICED_QUANTIZATION[quantization]}; "
                         "supported are none and 'fp8'")
    if quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"unsupported quantization {quantization!r}: supported are none and 'fp8'")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv-cache-dtype {kv_cache_dtype!r}: choose from {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    kv = base if kv_cache_dtype in ("auto", "bf16", "fp16") else "fp8"
    if kv_cache_dtype in ("bf16", "fp16"):
        kv = kv_cache_dtype
    weight = "fp8" if quantization == "fp8" else base
    scheme = (fp8_scheme or ONLINE_FP8) if weight == "fp8" else None
    return Precision(weight_dtype=weight, act_dtype=base, kv_dtype=kv, fp8_scheme=scheme,
                     compute_capability=compute_capability)
