"""Decompose one engine step into kernels: family, FLOPs, bytes moved, tiles, η features.

A step runs one forward pass over a *batch composition*: prefill chunks (each with the number of tokens
already in the KV cache before it) and decodes (each attending its own context). Per layer of a dense
decoder with tensor-parallel degree T (all shapes per rank):

    norm → QKV GEMM → RoPE → KV-cache write → attention (prefill part, decode part) → O GEMM →
    [all-reduce] → norm → gate_up GEMM → SiLU·mul → down GEMM → [all-reduce]

MoE layers replace the MLP with a router GEMM and grouped expert GEMMs. After the last layer: final norm,
the LM head over the rows that sample only, and the sampler.

η features per family (what calibration fits on):
    gemm, lm_head       (m, n, k, format code)    format code: GEMM_FORMAT_CODES (bf16 0, fp8 1, fp8_block 2,
                                                  nvfp4 4)
    moe_gemm            (tokens per active expert, n, k, active experts)
    attn_prefill        (num_seqs, mean new tokens, mean context, q heads, kv heads, head_dim,
                         kv bytes per element, sliding window or 0)
    attn_decode         (num_seqs, mean context, q heads, kv heads, head_dim,
                         kv bytes per element, sliding window or 0)
    elementwise kinds   (bytes moved,)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kernelsight.simcore.fp4_dispatch import (
    NVFP4,
    NVFP4_BYTES_PER_ELEMENT,
    fp4_priced_format,
    fp4_weight_bytes_per_param,
    nvfp4_linear_kernel,
)
from kernelsight.simcore.gemm_dispatch import fp8_linear_kernel, priced_format
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision

GEMM = "gemm"
MOE_GEMM = "moe_gemm"
ATTN_PREFILL = "attn_prefill"
ATTN_DECODE = "attn_decode"
KV_WRITE = "kv_write"
ROPE = "rope"
NORM = "norm"
ACTIVATION = "activation"
EMBEDDING = "embedding"
SAMPLER = "sampler"
ALL_REDUCE = "all_reduce"
LAUNCH = "launch"
HOST = "host"

#: Every family a step breakdown reports, in a fixed order (GPU kernels, then communication, then CPU).
FAMILIES: tuple[str, ...] = (GEMM, MOE_GEMM, ATTN_PREFILL, ATTN_DECODE, KV_WRITE, ROPE, NORM, ACTIVATION,
                             EMBEDDING, SAMPLER, ALL_REDUCE, LAUNCH, HOST)
FAMILY_INDEX = {f: i for i, f in enumerate(FAMILIES)}

_GEMM_TILE = 128          # CUTLASS/cuBLAS-class tile edge for large GEMMs
_GEMM_TILE_SMALL_M = 64   # skinny GEMMs use shorter tiles along m
_GEMM_K_BLOCK = 64        # k-loop granularity split-K / stream-K schedule
_ATTN_Q_TILE = 128        # FlashAttention query tile
_FP32_BYTES = 4.0

#: GEMM weight/compute formats told apart by η (they run different kernels): 4th gemm feature. ``nvfp4`` is the
#: W4A4 GEMM (FP4 weights and activations with FP8 block scales); weight-only FP4 kernels are priced as bf16.
GEMM_FORMAT_CODES: dict[str, int] = {"bf16": 0, "fp16": 0, "fp8": 1, "fp8_block": 2, "int8": 3, NVFP4: 4}
#: Tensor-core dtype each format computes in (block-scaled fp8 runs the fp8 peak, NVFP4 the fp4 peak).
GEMM_COMPUTE_DTYPE: dict[str, str] = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "fp8_block": "fp8",
                                      "int8": "int8", NVFP4: "fp4"}


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel launch (``count`` identical launches, e.g. one per layer)."""

    name: str
    family: str
    flops: float
    bytes_moved: float
    tiles: int
    dtype: str
    features: tuple[float, ...]
    count: int = 1
    impl: str = ""   # the vLLM kernel an fp8 linear layer dispatches to (gemm_dispatch); "" for the rest


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A chunk of one request's prompt computed this step."""

    num_new_tokens: int
    num_cached_tokens: int   # tokens already in the KV cache before this chunk (prefix hits + earlier chunks)
    samples: bool            # the chunk completes the prompt, so a token is sampled for it


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What the forward pass of one step computes."""

    prefills: tuple[PrefillChunk, ...] = ()
    num_decodes: int = 0
    decode_context_tokens: int = 0   # Σ over decodes of the tokens each attends (incl. the new one)

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + sum(p.num_new_tokens for p in self.prefills)

    @property
    def num_sampling_rows(self) -> int:
        return self.num_decodes + sum(1 for p in self.prefills if p.samples)

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + len(self.prefills)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefills


def gemm_kernel(name: str, m: int, n: int, k: int, dtype: str, weight_bytes_per_param: float,
                act_bytes: float, count: int = 1, family: str = GEMM) -> Kernel:
    """y[m,n] = x[m,k]·W[k,n]: reads x and W once, writes y.

    ``dtype`` is the format (``bf16``, ``fp16``, ``fp8`` per-tensor W8A8, ``fp8_block`` block-scaled W8A8,
    ``int8``, ``nvfp4`` W4A4); the kernel's compute dtype is the tensor-core peak that format runs at.
    """
    flops = 2.0 * m * n * k
    in_bytes = gemm_input_bytes(dtype, act_bytes)
    bytes_moved = m * k * in_bytes + k * n * weight_bytes_per_param + m * n * act_bytes
    tiles = gemm_tiles(m, n, k)
    features = (float(m), float(n), float(k), float(GEMM_FORMAT_CODES.get(dtype, 0)))
    compute_dtype = GEMM_COMPUTE_DTYPE.get(dtype, dtype)
    return Kernel(name, family, flops, bytes_moved, tiles, compute_dtype, features, count)


def linear_kernel(name: str, m: int, n: int, k: int, precision: Precision, count: int = 1) -> Kernel:
    """One linear layer's GEMM in the format vLLM runs it: fp8 layers name the kernel vLLM dispatches for the
    checkpoint's scale type, this GPU and this m (``gemm_dispatch.fp8_linear_kernel``) and take the format that
    prices it (W8A8 on the fp8 peak; Marlin's weight-only FP8 on the bf16 peak with 1-byte weights)."""
    w, a = precision.weight_bytes_per_param, precision.act_bytes
    if precision.weight_dtype == NVFP4:
        return nvfp4_linear_kernel_priced(name, m, n, k, precision, count)
    if precision.weight_dtype != "fp8" or precision.fp8_scheme is None:
        return gemm_kernel(name, m, n, k, precision.gemm_dtype, w, a, count)
    impl = fp8_linear_kernel(precision.fp8_scheme, precision.compute_capability or "9.0", m, n, k)
    fmt = priced_format(impl)
    if fmt != "fp8":
        fmt = precision.act_dtype
    return replace(gemm_kernel(name, m, n, k, fmt, w, a, count), impl=impl)


def nvfp4_linear_kernel_priced(name: str, m: int, n: int, k: int, precision: Precision, count: int = 1) -> Kernel:
    """An NVFP4 linear layer as the kernel vLLM dispatches on this GPU (``fp4_dispatch.nvfp4_linear_kernel``): W4A4
    on the FP4 tensor cores (format ``nvfp4``), else a bf16 GEMM over the packed 4-bit weights (Marlin W4A16; ROCm's
    emulation also writes and reads back a dequantized copy)."""
    impl = nvfp4_linear_kernel(precision.compute_capability or "9.0")
    a = precision.act_bytes
    fmt = NVFP4 if fp4_priced_format(impl) == NVFP4 else precision.act_dtype
    w = fp4_weight_bytes_per_param(NVFP4, impl, a)
    return replace(gemm_kernel(name, m, n, k, fmt, w, a, count), impl=impl)


def gemm_input_bytes(dtype: str, act_bytes: float) -> float:
    """Bytes per input activation element: W8A8 formats quantize activations to 1 byte first, NVFP4 (W4A4) to
    4 bits plus an FP8 scale per 16."""
    if dtype == NVFP4:
        return NVFP4_BYTES_PER_ELEMENT
    return 1.0 if dtype in ("fp8", "fp8_block", "int8") else act_bytes


def gemm_tiles(m: int, n: int, k: int | None = None) -> int:
    """Schedulable work units: output tiles × k-blocks.

    cuBLAS/CUTLASS split the k loop (split-K / stream-K) when output tiles alone cannot fill the SMs, so
    a 128×4096×4096 GEMM does not idle 100 of 132 SMs: wave quantization applies to k-blocks too
    (fitting on H100/L40S GEMMs: 19% → 9% error of the smooth η form versus output tiles only).
    """
    tile_m = _GEMM_TILE_SMALL_M if m <= _GEMM_TILE_SMALL_M else _GEMM_TILE
    k_blocks = math.ceil(k / _GEMM_K_BLOCK) if k else 1
    return math.ceil(m / tile_m) * math.ceil(n / _GEMM_TILE) * k_blocks


def elementwise_kernel(name: str, family: str, bytes_moved: float, dtype: str, count: int = 1) -> Kernel:
    # Bandwidth-bound: FLOPs are negligible next to bytes; tiles only matter for the compute roof.
    return Kernel(name, family, 0.0, bytes_moved, 1, dtype, (float(bytes_moved),), count)


def attention_prefill_kernel(chunks: tuple[PrefillChunk, ...], q_heads: int, kv_heads: int, head_dim: int,
                             act_bytes: float, kv_bytes: float, window: int | None = None,
                             count: int = 1) -> Kernel:
    """Causal attention of each chunk's new queries over its cached prefix plus itself."""
    pairs = 0.0
    kv_tokens = 0
    tiles = 0
    new_tokens = 0
    for c in chunks:
        q, p = c.num_new_tokens, c.num_cached_tokens
        # query i (0-based) attends p + i + 1 keys (capped by the sliding window)
        full = q * p + q * (q + 1) / 2.0
        pairs += min(full, q * window) if window else full
        kv_tokens += p + q
        tiles += math.ceil(q / _ATTN_Q_TILE)
        new_tokens += q
    flops = 4.0 * q_heads * head_dim * pairs
    bytes_moved = (2.0 * new_tokens * q_heads * head_dim * act_bytes
                   + kv_tokens * 2.0 * kv_heads * head_dim * kv_bytes)
    n = max(len(chunks), 1)
    features = (float(len(chunks)), new_tokens / n, kv_tokens / n, float(q_heads), float(kv_heads),
                float(head_dim), float(kv_bytes), float(window or 0))
    return Kernel("attention_prefill", ATTN_PREFILL, flops, bytes_moved, max(tiles * q_heads, 1), "bf16",
                  features, count)


def attention_decode_kernel(num_decodes: int, context_tokens: int, q_heads: int, kv_heads: int,
                            head_dim: int, act_bytes: float, kv_bytes: float, count: int = 1,
                            window: int | None = None) -> Kernel:
    """One query per sequence over its own context: reads the whole KV of every sequence once.

    With a sliding window each sequence reads at most ``window`` keys (ragged contexts are approximated
    by their mean when capping).
    """
    features = (float(num_decodes), context_tokens / max(num_decodes, 1), float(q_heads), float(kv_heads),
                float(head_dim), float(kv_bytes), float(window or 0))
    if window and num_decodes:
        context_tokens = int(min(context_tokens, num_decodes * window))
    flops = 4.0 * q_heads * head_dim * context_tokens
    bytes_moved = (context_tokens * 2.0 * kv_heads * head_dim * kv_bytes
                   + 2.0 * num_decodes * q_heads * head_dim * act_bytes)
    return Kernel("attention_decode", ATTN_DECODE, flops, bytes_moved, max(num_decodes * q_heads, 1), "bf16",
                  features, count)


def expected_active_experts(num_experts: int, top_k: int, routed_tokens: int) -> float:
    """Experts hit at least once when ``routed_tokens`` tokens each pick top_k of num_experts uniformly."""
    if routed_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** routed_tokens)


def dense_layer_kernels(model: ModelSpec, m: int, tp: int, precision: Precision, n_layers: int) -> list[Kernel]:
    """The token-parallel (non-attention, non-MoE) kernels of ``n_layers`` layers over ``m`` rows."""
    h = model.hidden_size
    a = precision.act_bytes
    g = precision.gemm_compute_dtype
    q_heads = model.num_attention_heads // tp
    kv_heads = max(model.num_kv_heads // tp, 1)   # vLLM replicates KV heads when T > num_kv_heads
    d = model.head_dim
    qkv_n = (q_heads + 2 * kv_heads) * d
    out = [
        elementwise_kernel("input_norm", NORM, 3.0 * m * h * a, g, n_layers),
        linear_kernel("qkv_proj", m, qkv_n, h, precision, n_layers),
        elementwise_kernel("rope", ROPE, 2.0 * m * (q_heads + kv_heads) * d * a, g, n_layers),
        elementwise_kernel("kv_cache_write", KV_WRITE,
                           m * 2.0 * kv_heads * d * (a + precision.kv_bytes_per_element), g, n_layers),
        linear_kernel("o_proj", m, h, q_heads * d, precision, n_layers),
        elementwise_kernel("post_attention_norm", NORM, 3.0 * m * h * a, g, n_layers),
    ]
    return out


def mlp_kernels(model: ModelSpec, m: int, tp: int, precision: Precision, n_layers: int) -> list[Kernel]:
    a, g = precision.act_bytes, precision.gemm_compute_dtype
    inter = model.intermediate_size // tp
    h = model.hidden_size
    return [
        linear_kernel("gate_up_proj", m, 2 * inter, h, precision, n_layers),
        elementwise_kernel("silu_and_mul", ACTIVATION, 3.0 * m * inter * a, g, n_layers),
        linear_kernel("down_proj", m, h, inter, precision, n_layers),
    ]


def moe_kernels(model: ModelSpec, m: int, tp: int, precision: Precision, n_layers: int, ep_size: int = 1,
                load_imbalance: float = 1.0) -> list[Kernel]:
    """Router + grouped expert GEMMs: weight traffic scales with the experts actually hit.

    Expert parallelism over ``ep_size`` ranks: ``m`` is then the whole group's token count (every rank's rows
    gathered for dispatch), each rank holds ``num_experts / ep_size`` experts and the priced rank, the busiest,
    receives ``load_imbalance`` times the mean share of the routed tokens; the router and shared experts run on
    the rank's own ``m / ep_size`` rows. ``ep_size=1`` is the plain (TP-sharded) layer."""
    a, w, g = precision.act_bytes, precision.expert_weight_bytes_per_param, precision.expert_compute_dtype
    # W4A4 experts read their routed activations as FP4 (+ scales); everything else as the activations' dtype
    a_in = NVFP4_BYTES_PER_ELEMENT if g == "fp4" else a
    h = model.hidden_size
    e, k = model.num_experts, model.experts_per_token
    inter = model.moe_intermediate_size // tp
    routed = m * k
    active = expected_active_experts(e, k, routed)
    own_m = m
    if ep_size > 1:
        own_m = max(m // ep_size, 1)
        routed = routed / ep_size * load_imbalance
        active = min(e / ep_size, active / ep_size * load_imbalance)
    per_expert = routed / max(active, 1.0)
    tile_m = _GEMM_TILE_SMALL_M if per_expert <= _GEMM_TILE_SMALL_M else _GEMM_TILE
    m_tiles = math.ceil(per_expert / tile_m) * max(active, 1.0)
    out = [gemm_kernel("moe_router", own_m, e, h, "bf16", 2.0, a, n_layers)]
    for name, n_out, k_in in (("moe_gate_up", 2 * inter, h), ("moe_down", h, inter)):
        flops = 2.0 * routed * n_out * k_in
        bytes_moved = (active * k_in * n_out * w + routed * (k_in + n_out) * a if a_in == a
                       else active * k_in * n_out * w + routed * (k_in * a_in + n_out * a))
        tiles = int(m_tiles * math.ceil(n_out / _GEMM_TILE) * math.ceil(k_in / _GEMM_K_BLOCK))
        out.append(Kernel(name, MOE_GEMM, flops, bytes_moved, max(tiles, 1), g,
                          (per_expert, float(n_out), float(k_in), active), n_layers))
    out.append(elementwise_kernel("moe_silu_and_mul", ACTIVATION, 3.0 * routed * inter * a, g, n_layers))
    if model.shared_expert_intermediate_size:
        s = model.shared_expert_intermediate_size // tp
        out += [linear_kernel("shared_expert_gate_up", own_m, 2 * s, h, precision, n_layers),
                linear_kernel("shared_expert_down", own_m, h, s, precision, n_layers)]
    return out


def token_kernels(model: ModelSpec, m: int, sampling_rows: int, tp: int, precision: Precision) -> list[Kernel]:
    """All kernels whose shape depends only on the (padded) token count and the sampling rows."""
    return row_kernels(model, m, tp, precision) + sampling_kernels(model, sampling_rows, tp, precision)


def row_kernels(model: ModelSpec, m: int, tp: int, precision: Precision) -> list[Kernel]:
    """Kernels over every (padded) token row: embedding, the layers' non-attention work, final norm."""
    a = precision.act_bytes
    h = model.hidden_size
    n_moe = model.num_moe_layers if model.is_moe else 0
    n_dense_mlp = model.num_layers - n_moe
    out = [elementwise_kernel("embedding", EMBEDDING, 2.0 * m * h * a, "bf16")]
    out += dense_layer_kernels(model, m, tp, precision, model.num_layers)
    if n_dense_mlp:
        out += mlp_kernels(model, m, tp, precision, n_dense_mlp)
    if n_moe:
        out += moe_kernels(model, m, tp, precision, n_moe)
    out.append(elementwise_kernel("final_norm", NORM, 3.0 * m * h * a, "bf16"))
    return out


def sampling_kernels(model: ModelSpec, sampling_rows: int, tp: int, precision: Precision) -> list[Kernel]:
    """LM head and sampler: they run only over the rows that sample (one per request emitting a token)."""
    if not sampling_rows:
        return []
    # The LM head stays bf16 under fp8 quantization in vLLM.
    vocab = math.ceil(model.vocab_size / tp)
    return [gemm_kernel("lm_head", sampling_rows, vocab, model.hidden_size, "bf16", 2.0, precision.act_bytes),
            elementwise_kernel("sampler", SAMPLER, 3.0 * sampling_rows * model.vocab_size * _FP32_BYTES, "bf16")]


def attention_kernels(model: ModelSpec, batch: BatchShape, tp: int, precision: Precision) -> list[Kernel]:
    q_heads = model.num_attention_heads // tp
    kv_heads = max(model.num_kv_heads // tp, 1)
    out = []
    if batch.prefills:
        out.append(attention_prefill_kernel(batch.prefills, q_heads, kv_heads, model.head_dim, precision.act_bytes,
                                            precision.kv_bytes_per_element, model.sliding_window,
                                            model.num_layers))
    if batch.num_decodes:
        out.append(attention_decode_kernel(batch.num_decodes, batch.decode_context_tokens, q_heads, kv_heads,
                                           model.head_dim, precision.act_bytes, precision.kv_bytes_per_element,
                                           model.num_layers, window=model.sliding_window))
    return out


def decompose_step(model: ModelSpec, batch: BatchShape, tp: int, precision: Precision,
                   padded_tokens: int | None = None) -> list[Kernel]:
    """Every kernel of one step. ``padded_tokens`` is the CUDA-graph size the token rows are padded to."""
    m = padded_tokens if padded_tokens is not None else batch.num_tokens
    return token_kernels(model, m, batch.num_sampling_rows, tp, precision) + attention_kernels(
        model, batch, tp, precision)


def allreduce_message_bytes(model: ModelSpec, m: int, precision: Precision) -> float:
    """Bytes of one tensor-parallel all-reduce (the hidden states of every row)."""
    return float(m * model.hidden_size * precision.act_bytes)


def allreduces_per_step(model: ModelSpec) -> int:
    return 2 * model.num_layers
