"""Model architecture specs parsed from a HuggingFace ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.simcore.fp4_dispatch import fp4_format_from_quant_config
from kernelsight.simcore.gemm_dispatch import Fp8Scheme, fp8_scheme_from_quant_config, kv_cache_dtype_from_quant_config
from kernelsight.simcore.multimodal import VisionSpec, vision_spec_from_hf_config


class UnsupportedArchitectureError(ValueError):
    """The config describes an architecture the kernel model does not implement (e.g. Llama 4's chunked attention)."""


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2): K and V are cached as one latent per token.

    ``q_lora_rank`` 0 means queries are projected straight from the hidden state (DeepSeek-V2-Lite)."""

    q_lora_rank: int
    kv_lora_rank: int          # width of the compressed KV latent (512)
    qk_nope_head_dim: int      # per-head query/key width without RoPE (128)
    qk_rope_head_dim: int      # the shared RoPE key width, cached beside the latent (64)
    v_head_dim: int            # per-head value width (128)

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the latent plus the RoPE key (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the up-projected (prefill) attention (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    mla: MLASpec | None = None           # multi-head latent attention (then num_kv_heads is 1: one latent "head")
    num_mtp_layers: int = 0              # multi-token-prediction layers (num_nextn_predict_layers): spec decode's
    #: layers that use ``sliding_window`` (the rest attend everything); None: every layer when a window is set
    #: (configs without per-layer ``layer_types``, e.g. Mistral)
    num_sliding_layers: int | None = None
    attention_sinks: bool = False        # gpt-oss: a learned sink logit per head (one extra score, no KV)
    #: the routed experts' checkpoint format when it differs from the rest ("mxfp4": gpt-oss)
    expert_quantization: str | None = None
    #: Llama 4's chunked local attention: RoPE layers attend only within their ``attention_chunk_size``-token
    #: chunk of the sequence, NoPE layers (every 4th: iRoPE) attend everything
    attention_chunk_size: int | None = None
    num_chunked_layers: int = 0
    # the vision tower of a vision-language model (None: text only; simcore/multimodal.py)
    vision: VisionSpec | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_window_layers(self) -> int:
        """Layers that attend only the last ``sliding_window`` tokens."""
        if not self.sliding_window:
            return 0
        return self.num_layers if self.num_sliding_layers is None else self.num_sliding_layers

    @property
    def is_hybrid_attention(self) -> bool:
        """Some layers slide a window and others attend everything (gpt-oss): vLLM's hybrid KV allocator."""
        return 0 < self.num_window_layers < self.num_layers

    @property
    def has_mixed_attention(self) -> bool:
        """Layers of more than one attention kind (sliding + full, chunked + full) or MLA: priced kernel by kernel."""
        return self.mla is not None or self.is_hybrid_attention or self.num_chunked_layers > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# Architectures whose attention is standard MHA/GQA and whose MLP is SwiGLU (dense or MoE):
# exactly what the kernel model implements.
_DENSE_ARCHS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
_MOE_ARCHS = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                        "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM",
                        "Llama4ForConditionalGeneration", "Llama4ForCausalLM"})
_LLAMA4_ARCHS = frozenset({"Llama4ForConditionalGeneration", "Llama4ForCausalLM"})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_DENSE_ARCHS | _MOE_ARCHS | {
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration"}))
_DEEPSEEK_ARCHS = frozenset({"DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"})
# Qwen gates its sliding window behind use_sliding_window; Mistral-family uses it whenever it is set.
_QWEN_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
# Vision-language wrappers whose language model is one of the text architectures above: the LM is parsed as that
# architecture (from the nested text_config where the wrapper has one) and the vision tower into ModelSpec.vision.
_VL_TEXT_ARCHS = {"Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
                  "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                  "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
                  "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM"}


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

    Raises UnsupportedArchitectureError for anything the kernel model does not implement (unknown
    architectures or layer types, MLA outside the DeepSeek family, missing keys) rather than guessing: a
    wrong spec gives plausible-looking but wrong timings, which is worse than a loud failure.
    """
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else str(config.get("model_type", "<none>"))
    reported_arch = arch
    try:
        vision = vision_spec_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise _unsupported(name, arch, f"vision_config: {exc}") from None
    if (arch in _LLAMA4_ARCHS or arch in _VL_TEXT_ARCHS) and isinstance(config.get("text_config"), dict):
        # the multimodal config nests the language model's; the vision tower is parsed apart (``vision``)
        text = config["text_config"]
        config = {**text, "architectures": archs,
                  "torch_dtype": config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
                  or text.get("dtype"),
                  "quantization_config": config.get("quantization_config")}
    arch = _VL_TEXT_ARCHS.get(arch, arch)
    if not (isinstance(archs, list) and archs):
        raise _unsupported(name, arch, "config.json has no 'architectures' entry")
    if arch not in _DENSE_ARCHS and arch not in _MOE_ARCHS:
        raise _unsupported(name, arch, "unknown architecture")
    if config.get("kv_lora_rank") is not None and arch not in _DEEPSEEK_ARCHS:
        raise _unsupported(name, arch, "multi-head latent attention outside the DeepSeek architectures")

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
    mla: MLASpec | None = None
    num_mtp = 0
    num_sliding: int | None = None
    expert_quant: str | None = None
    chunk_size: int | None = None
    num_chunked = 0

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
    elif arch in _DEEPSEEK_ARCHS:
        mla = MLASpec(q_lora_rank=_int(config, "q_lora_rank", name, arch, default=0, minimum=0)
                      if config.get("q_lora_rank") is not None else 0,
                      kv_lora_rank=_int(config, "kv_lora_rank", name, arch),
                      qk_nope_head_dim=_int(config, "qk_nope_head_dim", name, arch),
                      qk_rope_head_dim=_int(config, "qk_rope_head_dim", name, arch),
                      v_head_dim=_int(config, "v_head_dim", name, arch))
        kv_heads, head_dim = 1, mla.latent_dim    # one latent "head" per token: what the KV cache holds
        num_experts = _int(config, "n_routed_experts", name, arch)
        experts_per_token = _int(config, "num_experts_per_tok", name, arch)
        moe_inter = _int(config, "moe_intermediate_size", name, arch)
        shared_inter = moe_inter * _int(config, "n_shared_experts", name, arch, default=0, minimum=0)
        first_dense = _int(config, "first_k_dense_replace", name, arch, default=0, minimum=0)
        freq = _int(config, "moe_layer_freq", name, arch, default=1)
        # vLLM's DeepseekV2DecoderLayer: MoE where layer_idx >= first_k_dense_replace and layer_idx % freq == 0
        num_moe_layers = sum(1 for i in range(num_layers) if i >= first_dense and i % freq == 0)
        num_mtp = _int(config, "num_nextn_predict_layers", name, arch, default=0, minimum=0)
    elif arch == "GptOssForCausalLM":
        num_experts = _int(config, "num_local_experts", name, arch)
        experts_per_token = _int(config, "num_experts_per_tok", name, arch,
                                 default=config.get("experts_per_token"))
        moe_inter = intermediate       # gpt-oss's intermediate_size is the expert width; every layer is MoE
        intermediate = 0
        num_moe_layers = num_layers
        quant_cfg = config.get("quantization_config")
        if isinstance(quant_cfg, dict) and str(quant_cfg.get("quant_method", "")).lower() == "mxfp4":
            expert_quant = "mxfp4"     # modules_to_not_convert: attention, router, embeddings, LM head stay bf16
    elif arch in _LLAMA4_ARCHS:
        num_experts = _int(config, "num_local_experts", name, arch)
        experts_per_token = _int(config, "num_experts_per_tok", name, arch)
        moe_inter = intermediate                  # Llama4MoE: experts and the shared expert are intermediate_size wide
        shared_inter = intermediate
        intermediate = _int(config, "intermediate_size_mlp", name, arch)   # the dense layers' MLP
        moe_layers = config.get("moe_layers")
        if isinstance(moe_layers, list) and moe_layers:
            num_moe_layers = sum(1 for i in set(moe_layers) if 0 <= i < num_layers)
        else:
            step = _int(config, "interleave_moe_layer_step", name, arch, default=1)
            num_moe_layers = sum(1 for i in range(num_layers) if (i + 1) % step == 0)
        chunk_size = config.get("attention_chunk_size")
        if chunk_size is not None:
            chunk_size = _int(config, "attention_chunk_size", name, arch)
            # no_rope_layers[i] == 1: RoPE layer, chunked local attention; 0: NoPE layer, full attention
            no_rope = config.get("no_rope_layers")
            if isinstance(no_rope, list) and len(no_rope) == num_layers:
                num_chunked = sum(1 for v in no_rope if v)
            else:   # vLLM's default: every 4th layer is NoPE
                num_chunked = sum(1 for i in range(num_layers) if (i + 1) % 4 != 0)
    if experts_per_token > num_experts:
        raise _unsupported(name, arch, f"num_experts_per_tok {experts_per_token} > num_experts {num_experts}")

    sliding_window = config.get("sliding_window")
    if arch in _QWEN_ARCHS and not config.get("use_sliding_window", False):
        sliding_window = None
    if arch == "LlamaForCausalLM" or arch in _LLAMA4_ARCHS:
        sliding_window = None          # Llama attention has no window even if a config carries the key
    if sliding_window is not None:
        sliding_window = _int(config, "sliding_window", name, arch)
        layer_types = config.get("layer_types")
        if isinstance(layer_types, list) and layer_types:
            if len(layer_types) != num_layers:
                raise _unsupported(name, arch, f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            unknown = sorted({t for t in layer_types if t not in ("sliding_attention", "full_attention")})
            if unknown:
                raise _unsupported(name, arch, f"layer types {unknown} are not modelled")
            num_sliding = sum(1 for t in layer_types if t == "sliding_attention")
            if num_sliding == 0:
                sliding_window = None

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
        architecture=reported_arch,
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
        mla=mla,
        num_mtp_layers=num_mtp,
        num_sliding_layers=num_sliding,
        attention_sinks=arch == "GptOssForCausalLM",
        expert_quantization=expert_quant,
        attention_chunk_size=chunk_size,
        num_chunked_layers=num_chunked,
        vision=vision,
    )
