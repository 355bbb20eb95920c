"""Numeric formats: which tensor-core peak a GEMM uses and how many bytes weights and KV take."""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.simcore.fp4_dispatch import (
    FP4_BYTES_PER_ELEMENT,
    MXFP4,
    NVFP4,
    fp4_moe_backend,
    fp4_priced_format,
    has_fp4_tensor_cores,
)
from kernelsight.simcore.gemm_dispatch import ONLINE_FP8, Fp8Scheme

_BYTES_PER_ELEMENT = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5, "fp32": 4.0,
                      **FP4_BYTES_PER_ELEMENT}

SUPPORTED_QUANTIZATION = (None, "fp8", NVFP4, MXFP4)
#: vLLM's ``--quantization`` names of the FP4 methods → the format here (``modelopt_fp4``: ModelOpt NVFP4)
QUANTIZATION_ALIASES = {"modelopt_fp4": NVFP4}
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class Precision:
    """Weight/activation format of the linear layers and the KV-cache element format."""

    weight_dtype: str = "bf16"   # linear layers: "bf16" | "fp16" | "fp8" (W8A8) | "nvfp4"
    act_dtype: str = "bf16"      # activations between kernels (fp8 GEMMs still emit bf16)
    kv_dtype: str = "bf16"
    #: how an fp8 checkpoint scales weights and activations (None unless weight_dtype is fp8): with the GPU's
    #: compute capability it picks the GEMM kernel vLLM runs (``gemm_dispatch.fp8_linear_kernel``)
    fp8_scheme: Fp8Scheme | None = None
    compute_capability: str = ""   # of the GPU the linear layers run on ("9.0"); "" = unknown (Hopper assumed)
    #: the MoE experts' weight format when it differs from the linear layers' (gpt-oss: "mxfp4" experts, bf16
    #: attention); "" = the same as ``weight_dtype``
    expert_dtype: str = ""

    @property
    def gemm_dtype(self) -> str:
        """Format of the linear layers (``kernels.GEMM_FORMAT_CODES`` key, or ``nvfp4``)."""
        return self.weight_dtype

    @property
    def gemm_compute_dtype(self) -> str:
        """Tensor-core dtype the linear layers compute in: W8A8 runs the fp8 peak, NVFP4 the fp4 peak where the GPU
        has FP4 tensor cores (else vLLM's Marlin W4A16 computes in the activations' dtype)."""
        return self._compute_dtype(self.weight_dtype)

    @property
    def expert_weight_dtype(self) -> str:
        return self.expert_dtype or self.weight_dtype

    @property
    def expert_compute_dtype(self) -> str:
        """Tensor-core dtype of the MoE expert GEMMs (FP4 experts: W4A4 on Blackwell for NVFP4, W4A16 for MXFP4)."""
        fmt = self.expert_weight_dtype
        if fmt in FP4_BYTES_PER_ELEMENT:
            backend = fp4_moe_backend(fmt, self.compute_capability or "9.0")
            return "fp4" if fp4_priced_format(backend) == NVFP4 else self.act_dtype
        return self._compute_dtype(fmt)

    def _compute_dtype(self, fmt: str) -> str:
        if fmt == NVFP4:
            return "fp4" if has_fp4_tensor_cores(self.compute_capability or "9.0") else self.act_dtype
        if fmt == MXFP4:
            return self.act_dtype
        return fmt

    @property
    def weight_bytes_per_param(self) -> float:
        return _BYTES_PER_ELEMENT[self.weight_dtype]

    @property
    def expert_weight_bytes_per_param(self) -> float:
        return _BYTES_PER_ELEMENT[self.expert_weight_dtype]

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
    quantization of a 16-bit checkpoint (per-tensor weights, dynamic per-token activations). ``nvfp4``
    (``modelopt_fp4``) makes every linear layer but the LM head NVFP4; ``mxfp4`` (gpt-oss) only the MoE experts.

    Raises ValueError for formats the kernel model does not implement, rather than guessing.
    """
    base = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
            "auto": "bf16"}.get(model_dtype)
    if base is None:
        raise ValueError(f"unsupported dtype {model_dtype!r}: expected bfloat16 or float16")
    quantization = QUANTIZATION_ALIASES.get(quantization or "", quantization)
    if quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"unsupported quantization {quantization!r}: supported are none, 'fp8', "
                         "'modelopt_fp4' (NVFP4) and 'mxfp4'")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv-cache-dtype {kv_cache_dtype!r}: choose from {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    kv = base if kv_cache_dtype in ("auto", "bf16", "fp16") else "fp8"
    if kv_cache_dtype in ("bf16", "fp16"):
        kv = kv_cache_dtype
    weight = quantization if quantization in ("fp8", NVFP4) else base
    scheme = (fp8_scheme or ONLINE_FP8) if weight == "fp8" else None
    return Precision(weight_dtype=weight, act_dtype=base, kv_dtype=kv, fp8_scheme=scheme,
                     compute_capability=compute_capability, expert_dtype=MXFP4 if quantization == MXFP4 else "")
