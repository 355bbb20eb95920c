"""Model architecture specs parsed from a HuggingFace ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.simcore.fp4_dispatch import fp4_format_from_quant_config
from kernelsight.simcore.gemm_dispatch import Fp8Scheme, fp8_scheme_from_quant_config, kv_cache_dtype_from_quant_config


class UnsupportedArchitectureError(ValueError):
    """The config describes an architecture the kernel model does not implement (e.g. MLA)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the kernel model needs of a decoder-only transformer.

    Dense models have ``num_experts == 0``. MoE models replace the MLP of MoE layers with
    ``num_experts`` experts of width ``moe_intermediate_size``, ``experts_per_token`` routed per token.
    """

    name: str                      # HF id, e.g. "meta-llama/Llama-3.1-8B"
    architecture: str              # e.g. "LlamaForCausalLM"
    model_type: str                # e.g. "llama", "qwen3_moe"
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int         # dense MLP width (0 if every layer is MoE and no dense width)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0        # layers whose MLP is MoE (the rest dense)
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quantization: str | None = None  # from the config's quantization_config: "fp8", "nvfp4", "mxfp4", ...
    fp8_scheme: Fp8Scheme | None = None  # an fp8 checkpoint's weight/activation scale types (picks vLLM's kernel)
    kv_cache_dtype: str | None = None    # the KV-cache dtype the checkpoint asks for ("fp8"): --kv-cache-dtype auto

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# Architectures whose attention is standard MHA/GQA and whose MLP is SwiGLU (dense or MoE):
# exactly what the kernel model implements.
_DENSE_ARCHS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
_MOE_ARCHS = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_DENSE_ARCHS | _MOE_ARCHS))
# Qwen gates its sliding window behind use_sliding_window; Mistral-family uses it whenever it is set.
_QWEN_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})


def _unsupported(name: str, arch: str, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"model {name!r}: architecture {arch!r} is not supported ({why}); "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _int(config: dict, key: str, name: str, arch: str, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise _unsupported(name, arch, f"config.json lacks required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _unsupported(name, arch, f"config key {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def model_spec_from_hf_config(config: dict, name: str) -> ModelSpec:
    """Parse a HuggingFace ``config.json`` dict into a ModelSpec. Pure: no I/O.

    Raises UnsupportedArchitectureError for anything the kernel model does not implement (MLA,
    unknown architectures, missing keys) rather than guessing: a wrong spec gives plausible-looking
    but wrong timings, which is worse than a loud failure.
    """
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else str(config.get("model_type", "<none>"))
    if config.get("kv_lora_rank") is not None:
        # MLA (DeepSeek-V2/V3, Kimi K2 ...) compresses KV into a latent: other kernels, other KV size.
        raise _unsupported(name, arch, "multi-head latent attention (kv_lora_rank) is not modelled")
    if not (isinstance(archs, list) and archs):
        raise _unsupported(name, arch, "config.json has no 'architectures' entry")
    if arch not in _DENSE_ARCHS and arch not in _MOE_ARCHS:
        raise _unsupported(name, arch, "unknown architecture")

    hidden = _int(config, "hidden_size", name, arch)
    num_layers = _int(config, "num_hidden_layers", name, arch)
    heads = _int(config, "num_attention_heads", name, arch)
    kv_heads = _int(config, "num_key_value_heads", name, arch, default=heads)  # HF default: MHA
    if heads % kv_heads:
        raise _unsupported(name, arch, f"{heads} attention heads not a multiple of {kv_heads} kv heads")
    if config.get("head_dim") is not None:
        head_dim = _int(config, "head_dim", name, arch)
    elif hidden % heads == 0:
        head_dim = hidden // heads
    else:
        raise _unsupported(name, arch, f"no head_dim and hidden_size {hidden} not divisible by {heads} heads")
    vocab = _int(config, "vocab_size", name, arch)
    max_pos = _int(config, "max_position_embeddings", name, arch)
    intermediate = _int(config, "intermediate_size", name, arch)

    num_experts = experts_per_token = moe_inter = shared_inter = num_moe_layers = 0
    if arch == "MixtralForCausalLM":
        num_experts = _int(config, "num_local_experts", name, arch)
        experts_per_token = _int(config, "num_experts_per_tok", name, arch)
        moe_inter = intermediate       # Mixtral's intermediate_size is the expert width ...
        intermediate = 0               # ... and it has no dense MLP layers.
        num_moe_layers = num_layers
    elif arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        num_experts = _int(config, "num_experts", name, arch)
        experts_per_token = _int(config, "num_experts_per_tok", name, arch)
        moe_inter = _int(config, "moe_intermediate_size", name, arch)
        if arch == "Qwen2MoeForCausalLM":
            shared_inter = _int(config, "shared_expert_intermediate_size", name, arch, default=0, minimum=0)
        step = _int(config, "decoder_sparse_step", name, arch, default=1)
        mlp_only = set(config.get("mlp_only_layers") or [])
        # Same rule as HF/vLLM Qwen*MoE decoder layers: layer i is sparse unless listed in mlp_only_layers
        # and only every `decoder_sparse_step`-th layer is sparse.
        num_moe_layers = sum(1 for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
    if experts_per_token > num_experts:
        raise _unsupported(name, arch, f"num_experts_per_tok {experts_per_token} > num_experts {num_experts}")

    sliding_window = config.get("sliding_window")
    if arch in _QWEN_ARCHS and not config.get("use_sliding_window", False):
        sliding_window = None
    if arch == "LlamaForCausalLM":
        sliding_window = None          # Llama attention has no window even if a config carries the key
    if sliding_window is not None:
        sliding_window = _int(config, "sliding_window", name, arch)

    quant = config.get("quantization_config")
    # The checkpoint's scale types (per-tensor, per-channel/token, 128x128 blocks) decide which GEMM kernel vLLM
    # runs for it (simcore.gemm_dispatch); any FP8 scheme vLLM runs (fp8, ModelOpt, compressed-tensors, fbgemm) is
    # quantization "fp8" here; ModelOpt / compressed-tensors NVFP4 is "nvfp4", gpt-oss's experts "mxfp4"
    # (simcore.fp4_dispatch).
    quantization = None
    fp8_scheme = fp8_scheme_from_quant_config(quant)
    fp4_format = fp4_format_from_quant_config(quant)
    if fp8_scheme is not None:
        quantization = "fp8"
    elif fp4_format is not None:
        quantization = fp4_format
    elif isinstance(quant, dict) and quant.get("quant_method"):
        quantization = str(quant["quant_method"]).lower()

    return ModelSpec(
        name=name,
        architecture=arch,
        model_type=str(config.get("model_type", "")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        num_moe_layers=num_moe_layers,
        sliding_window=sliding_window,
        eos_token_ids=_token_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id") if isinstance(config.get("bos_token_id"), int) else None,
        # Newer transformers write "dtype" instead of "torch_dtype".
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        quantization=quantization,
        fp8_scheme=fp8_scheme,
        kv_cache_dtype=kv_cache_dtype_from_quant_config(quant),
    )
