"""Decompose one engine step into kernels: family, FLOPs, bytes moved, tiles, η features.

A step runs one forward pass over a *batch composition*: prefill chunks (each with the number of tokens
already in the KV cache before it) and decodes (each attending its own context). Per layer of a dense
decoder with tensor-parallel degree T (all shapes per rank):

    norm → QKV GEMM → RoPE → KV-cache write → attention (prefill part, decode part) → O GEMM →
    [all-reduce] → norm → gate_up GEMM → SiLU·mul → down GEMM → [all-reduce]

MoE layers replace the MLP with a router GEMM and vLLM's FusedMoE layer (both grouped expert GEMMs and their
activation as one kernel model, in the experts' own format: ``expert_formats.py``; the busiest rank's load from the
routing distribution: ``moe_routing.py``). MLA models replace the attention block with ``mla.py``'s kernels.
Layers of different attention kinds (gpt-oss's sliding-window and full layers, Llama 4's chunked-local and full
layers) are priced as separate attention kernels. After the last layer: final norm, the LM head over the rows that
sample only, and the sampler. The primitives (Kernel, BatchShape, one GEMM / attention / FusedMoE kernel) live in
``kernel_shapes.py``.

η features per family (what calibration fits on):
    gemm, lm_head       (m, n, k, format code)    format code: GEMM_FORMAT_CODES (bf16 0, fp8 1, fp8_block 2,
                                                  nvfp4 4)
    moe_gemm            (token-slots per touched expert, hidden, inter per rank, touched experts, MoE format code)
    attn_prefill        (num_seqs, mean new tokens, mean context, q heads, kv heads, head_dim,
                         kv bytes per element, sliding window or 0)
    attn_decode         (num_seqs, mean context, q heads, kv heads, head_dim,
                         kv bytes per element, sliding window or 0)
    elementwise kinds   (bytes moved,)
"""


from __future__ import annotations

import math

from kernelsight.simcore.expert_formats import moe_expert_format
from kernelsight.simcore.kernel_shapes import (  # noqa: F401 (re-exported: callers use kernels.X)
    _FP32_BYTES,
    _GEMM_K_BLOCK,
    _GEMM_TILE,
    _GEMM_TILE_SMALL_M,
    ACTIVATION,
    ALL_REDUCE,
    ATTN_DECODE,
    ATTN_ENCODER,
    ATTN_PREFILL,
    EMBEDDING,
    ENCODER,
    FAMILIES,
    FAMILY_INDEX,
    GEMM,
    GEMM_COMPUTE_DTYPE,
    GEMM_FORMAT_CODES,
    HOST,
    KV_WRITE,
    LAUNCH,
    MLA_DECODE,
    MLA_PREFILL,
    MOE_FORMAT_CODES,
    MOE_FORMATS,
    MOE_GEMM,
    NORM,
    ROPE,
    SAMPLER,
    BatchShape,
    Kernel,
    PrefillChunk,
    attention_decode_kernel,
    attention_encoder_kernel,
    attention_prefill_kernel,
    elementwise_kernel,
    expected_active_experts,
    fused_moe_kernel,
    gemm_input_bytes,
    gemm_kernel,
    gemm_tiles,
    linear_kernel,
    moe_block_m,
)
from kernelsight.simcore.mla import mla_decode_kernels, mla_prefill_kernels, mla_row_kernels
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING
from kernelsight.simcore.precision import Precision


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
                load_imbalance: float | None = None, routing: str = DEFAULT_EXPERT_ROUTING) -> list[Kernel]:
    """Router GEMM, the FusedMoE layer (``kernel_shapes.fused_moe_kernel``: both grouped expert GEMMs and their
    activation, weight traffic of the experts actually touched), shared experts.

    Expert parallelism over ``ep_size`` ranks: ``m`` is then the whole group's token count (every rank's rows
    gathered for dispatch), each rank holds ``num_experts / ep_size`` experts and the priced rank is the busiest
    under the ``routing`` distribution (``moe_routing.routing_load``), or receives ``load_imbalance`` times the
    mean share of the routed tokens when that override is given; the router and shared experts run on the rank's
    own ``m / ep_size`` rows. ``ep_size=1`` is the plain (TP-sharded) layer."""
    h = model.hidden_size
    own_m = max(m // ep_size, 1) if ep_size > 1 else m
    out = [gemm_kernel("moe_router", own_m, model.num_experts, h, "bf16", 2.0, precision.act_bytes, n_layers)]
    out.append(fused_moe_kernel(m, h, model.moe_intermediate_size // tp, model.experts_per_token, model.num_experts,
                                moe_expert_format(model, precision), ep_size, routing, precision.act_bytes,
                                n_layers, load_imbalance if ep_size > 1 else None))
    if model.shared_expert_intermediate_size:
        s = model.shared_expert_intermediate_size // tp
        out += [linear_kernel("shared_expert_gate_up", own_m, 2 * s, h, precision, n_layers),
                linear_kernel("shared_expert_down", own_m, h, s, precision, n_layers)]
    return out


def token_kernels(model: ModelSpec, m: int, sampling_rows: int, tp: int, precision: Precision) -> list[Kernel]:
    """All kernels whose shape depends only on the (padded) token count and the sampling rows."""
    return row_kernels(model, m, tp, precision) + sampling_kernels(model, sampling_rows, tp, precision)


def row_kernels(model: ModelSpec, m: int, tp: int, precision: Precision,
                routing: str = DEFAULT_EXPERT_ROUTING, moe_ep_size: int = 1,
                load_imbalance: float | None = None) -> list[Kernel]:
    """Kernels over every (padded) token row: embedding, the layers' non-attention work, final norm.

    ``moe_ep_size`` > 1: the experts are split whole over the TP group (``--enable-expert-parallel`` at one
    data-parallel rank): every rank holds all ``m`` rows already (the attention's all-reduce replicated them), runs
    the tokens routed to its own experts, and the TP all-reduce combines them, so the priced rank is the group's
    busiest (``moe_kernels`` with ``ep_size``)."""
    a = precision.act_bytes
    h = model.hidden_size
    n_moe = model.num_moe_layers if model.is_moe else 0
    n_dense_mlp = model.num_layers - n_moe
    out = [elementwise_kernel("embedding", EMBEDDING, 2.0 * m * h * a, "bf16")]
    if model.mla is not None:
        out += mla_row_kernels(model, m, tp, precision, model.num_layers)
    else:
        out += dense_layer_kernels(model, m, tp, precision, model.num_layers)
    if n_dense_mlp:
        out += mlp_kernels(model, m, tp, precision, n_dense_mlp)
    if n_moe and moe_ep_size > 1:
        out += moe_kernels(model, m, 1, precision, n_moe, moe_ep_size, load_imbalance, routing)
    elif n_moe:
        out += moe_kernels(model, m, tp, precision, n_moe, routing=routing)
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


def attention_kernels(model: ModelSpec, batch: BatchShape, tp: int, precision: Precision,
                      measured: frozenset[str] = frozenset()) -> list[Kernel]:
    """The attention of every layer: MLA's two paths, or standard attention with sliding-window layers (every
    layer for Mistral-style configs, some for gpt-oss) and full-attention layers priced apart. ``measured``: the MLA
    families (``MLA_PREFILL``, ``MLA_DECODE``) the calibration fitted, priced as one kernel of their own."""
    if model.mla is not None:
        out = []
        if batch.prefills:
            out += mla_prefill_kernels(model, batch.prefills, tp, precision, model.num_layers,
                                       MLA_PREFILL in measured)
        if batch.num_decodes:
            out += mla_decode_kernels(model, batch.num_decodes, batch.decode_context_tokens, tp, precision,
                                      model.num_layers, MLA_DECODE in measured)
        return out
    q_heads = model.num_attention_heads // tp
    kv_heads = max(model.num_kv_heads // tp, 1)
    n_sliding = model.num_window_layers
    n_chunked = model.num_chunked_layers
    out = []
    if n_chunked and model.attention_chunk_size:
        out += _chunked_attention_kernels(model, batch, q_heads, kv_heads, precision, n_chunked)
    groups = [(model.sliding_window, n_sliding), (None, model.num_layers - n_sliding - n_chunked)]
    for window, n_layers in groups:
        if not n_layers:
            continue
        if batch.prefills:
            out.append(attention_prefill_kernel(batch.prefills, q_heads, kv_heads, model.head_dim,
                                                precision.act_bytes, precision.kv_bytes_per_element, window,
                                                n_layers))
        if batch.num_decodes:
            out.append(attention_decode_kernel(batch.num_decodes, batch.decode_context_tokens, q_heads, kv_heads,
                                               model.head_dim, precision.act_bytes, precision.kv_bytes_per_element,
                                               n_layers, window=window))
    return out


def chunked_local_prefills(chunks: tuple[PrefillChunk, ...], chunk_size: int) -> tuple[PrefillChunk, ...]:
    """Llama 4's chunked local attention as vLLM runs it (``make_local_attention_virtual_batches``): each prefill
    chunk splits at the attention-chunk boundaries into virtual sequences that attend only within their chunk."""
    out = []
    for c in chunks:
        start, end = c.num_cached_tokens, c.num_cached_tokens + c.num_new_tokens
        pos = start
        while pos < end:
            boundary = (pos // chunk_size + 1) * chunk_size
            stop = min(end, boundary)
            out.append(PrefillChunk(stop - pos, pos % chunk_size, c.samples and stop == end))
            pos = stop
    return tuple(out)


def chunked_local_decode_context(num_decodes: int, context_tokens: int, chunk_size: int) -> int:
    """Keys a decode step's chunked-local layer reads: each sequence only its current chunk (ragged contexts taken
    at their mean, as sliding windows are)."""
    if not num_decodes:
        return 0
    mean = context_tokens / num_decodes
    return int(round(num_decodes * (((math.ceil(mean) - 1) % chunk_size) + 1)))


def _chunked_attention_kernels(model: ModelSpec, batch: BatchShape, q_heads: int, kv_heads: int,
                               precision: Precision, n_layers: int) -> list[Kernel]:
    c = model.attention_chunk_size or 0
    out = []
    if batch.prefills:
        out.append(attention_prefill_kernel(chunked_local_prefills(batch.prefills, c), q_heads, kv_heads,
                                            model.head_dim, precision.act_bytes, precision.kv_bytes_per_element,
                                            None, n_layers))
    if batch.num_decodes:
        ctx = chunked_local_decode_context(batch.num_decodes, batch.decode_context_tokens, c)
        out.append(attention_decode_kernel(batch.num_decodes, ctx, q_heads, kv_heads, model.head_dim,
                                           precision.act_bytes, precision.kv_bytes_per_element, n_layers))
    return out


def decompose_step(model: ModelSpec, batch: BatchShape, tp: int, precision: Precision,
                   padded_tokens: int | None = None, measured: frozenset[str] = frozenset()) -> list[Kernel]:
    """Every kernel of one step. ``padded_tokens`` is the CUDA-graph size the token rows are padded to; ``measured``:
    as in :func:`attention_kernels` (``StepModel.mla_families``)."""
    m = padded_tokens if padded_tokens is not None else batch.num_tokens
    return token_kernels(model, m, batch.num_sampling_rows, tp, precision) + attention_kernels(
        model, batch, tp, precision, measured)


def allreduce_message_bytes(model: ModelSpec, m: int, precision: Precision) -> float:
    """Bytes of one tensor-parallel all-reduce (the hidden states of every row)."""
    return float(m * model.hidden_size * precision.act_bytes)


def allreduces_per_step(model: ModelSpec) -> int:
    return 2 * model.num_layers
