"""Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2) as kernels, the way vLLM's MLA backends run it.

Per layer and tensor-parallel rank (H/T query heads; the latent is replicated on every rank, as in vLLM):

    fused_qkv_a_proj (h → q_lora + kv_lora + rope, replicated) → q_a / kv_a norms → q_b_proj (q_lora → H/T·192)
    → RoPE → KV-cache write of one 576-wide latent per token → attention → o_proj (H/T·128 → h)

Attention takes one of two paths per token, as vLLM's ``MLACommonImpl`` splits the batch:

* prefill (up-projected): ``kv_b_proj`` turns every context token's latent into per-head K_nope and V, then plain
  MHA with query/key width 192 and value width 128 (FlashAttention);
* decode (absorbed, FlashMLA-style): ``q_nope`` times W_UK (a per-head bmm) lands the query in the latent space,
  attention runs as MQA over the 576-wide latent (one KV "head", values the 512-wide latent), and W_UV (another
  bmm) maps the result back to 128 per head. W_UK/W_UV are bf16 (vLLM dequantizes ``kv_b_proj`` for them).

η mapping (no MLA kernels in the measured tables): the up-projected prefill is the ``attn_prefill`` family at its
own shape (H/T heads, head_dim 192, 16-bit K/V: the tables hold head_dim 192); the absorbed decode is
``attn_decode`` at (batch, context, min(H/T, 64) query heads, 1 KV head, head_dim 256): MQA, as FlashMLA runs,
at the widest head dim the tables time with FlashAttention-3 (their largest group is 64 query heads per KV head).
Their head_dim-512 rows time FA4's path, a kernel MLA never runs (η 0.3 against 0.5 at head_dim 256 for 32
sequences of 1k tokens on H100/H200), while FlashMLA is a Hopper-tuned kernel of FA3's class. The roofline of every
kernel uses its true FLOPs and bytes (576-wide keys, 512-wide values, all H/T heads). The two
bmms and ``kv_b_proj`` are GEMMs (η of the ``gemm`` family) timed inside the attention parts, since vLLM runs them
inside its MLA attention op and their shapes follow the decode rows / the prefill context, not the padded rows.

Measured families (a calibration fitted on the shared ``mla_*`` module tables, ``calibrate/mla_tables.py``): the
attention op is then one kernel of its own family, its η and fixed latency fitted on the module rows minus the
module's other kernels. ``mla_decode`` is the absorbed decode whole (both bmms and the MQA, as vLLM runs them in one
op), features in ``attn_decode``'s layout (batch, context per sequence, H/T heads, 1 KV head, head_dim 288 so that
the basis's K+V bytes per token are the 576-wide latent, KV bytes, no window); ``mla_prefill`` is the up-projected
MHA (``kv_b_proj`` stays a GEMM of the checkpoint's format: a linear layer like the other projections), features in
``attn_prefill``'s layout with the KV-cache bytes as its variant.
"""

from __future__ import annotations

import math

from kernelsight.simcore.kernel_shapes import (
    ATTN_DECODE,
    ATTN_PREFILL,
    KV_WRITE,
    MLA_DECODE,
    MLA_PREFILL,
    NORM,
    ROPE,
    Kernel,
    PrefillChunk,
    elementwise_kernel,
    gemm_kernel,
    linear_kernel,
)
from kernelsight.simcore.model_spec import MLASpec, ModelSpec
from kernelsight.simcore.precision import Precision

_ATTN_Q_TILE = 128
#: The measured attention tables hold up to 64 query heads per KV head: the decode η is looked up there.
_MAX_MEASURED_GROUP = 64
#: The widest head dim the tables time with FlashAttention-3 (MQA rows): where the decode η is looked up.
_DECODE_ETA_HEAD_DIM = 256
#: head_dim of the measured decode family's features: K + V bytes per token of a head_dim-d head (2·d) equal the
#: latent's 576 elements, so the decode basis's KV-cache-vs-L2 term sees the latent's real bytes.
_MLA_DECODE_FEATURE_HEAD_DIM = 288


def mla_decode_backend(compute_capability: str, kv_dtype: str) -> str:
    """The MLA backend vLLM (0.19-0.24) picks by default for a GPU of ``compute_capability`` and a KV cache of
    ``kv_dtype``: its CUDA platform walks a priority list per compute capability (SM 10.x: FlashInfer-MLA and
    CUTLASS-MLA first; elsewhere FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA) and takes the first that
    supports the GPU and the KV dtype: FLASH_ATTN_MLA is SM 9.0 with a 16-bit cache, FlashMLA SM 9.0 / 10.x (fp8
    too), FlashInfer-MLA SM 10.x, Triton MLA any GPU (and the only one off CUDA's list here)."""
    try:
        major, minor = (int(x) for x in compute_capability.split(".")[:2])
    except ValueError:
        return "TRITON_MLA"
    if major == 10:
        return "FLASHINFER_MLA"
    if (major, minor) == (9, 0):
        return "FLASH_ATTN_MLA" if kv_dtype in ("bf16", "fp16", "auto") else "FLASHMLA"
    return "TRITON_MLA"


def _mla(model: ModelSpec) -> MLASpec:
    if model.mla is None:
        raise ValueError(f"{model.name} has no multi-head latent attention")
    return model.mla


def mla_attention_params(model: ModelSpec) -> int:
    """Linear-layer parameters of one MLA attention block (all heads)."""
    a = _mla(model)
    h, heads = model.hidden_size, model.num_attention_heads
    q = (h * a.q_lora_rank + a.q_lora_rank * heads * a.qk_head_dim) if a.q_lora_rank else h * heads * a.qk_head_dim
    kv = h * a.latent_dim + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + heads * a.v_head_dim * h


def mla_row_kernels(model: ModelSpec, m: int, tp: int, precision: Precision, n_layers: int) -> list[Kernel]:
    """The token-parallel part of MLA layers over ``m`` rows (norms, projections, RoPE, latent write)."""
    a = _mla(model)
    h, act, g = model.hidden_size, precision.act_bytes, precision.gemm_compute_dtype
    heads = model.num_attention_heads // tp
    out = [elementwise_kernel("input_norm", NORM, 3.0 * m * h * act, g, n_layers)]
    if a.q_lora_rank:
        out += [linear_kernel("fused_qkv_a_proj", m, a.q_lora_rank + a.latent_dim, h, precision, n_layers),
                elementwise_kernel("q_a_layernorm", NORM, 3.0 * m * a.q_lora_rank * act, g, n_layers),
                linear_kernel("q_b_proj", m, heads * a.qk_head_dim, a.q_lora_rank, precision, n_layers)]
    else:
        out += [linear_kernel("q_proj", m, heads * a.qk_head_dim, h, precision, n_layers),
                linear_kernel("kv_a_proj_with_mqa", m, a.latent_dim, h, precision, n_layers)]
    out += [
        elementwise_kernel("kv_a_layernorm", NORM, 3.0 * m * a.kv_lora_rank * act, g, n_layers),
        elementwise_kernel("rope", ROPE, 2.0 * m * (heads + 1) * a.qk_rope_head_dim * act, g, n_layers),
        elementwise_kernel("kv_cache_write", KV_WRITE, m * a.latent_dim * (act + precision.kv_bytes_per_element),
                           g, n_layers),
        linear_kernel("o_proj", m, h, heads * a.v_head_dim, precision, n_layers),
        elementwise_kernel("post_attention_norm", NORM, 3.0 * m * h * act, g, n_layers),
    ]
    return out


def mla_prefill_attention_kernel(a: MLASpec, chunks: tuple[PrefillChunk, ...], heads: int, act_bytes: float,
                                 kv_bytes: float, measured: bool = False, count: int = 1) -> Kernel:
    """The up-projected prefill's MHA (qk 192, v 128) over ``heads`` heads: the ``attn_prefill`` kernel at its own
    shape, or (``measured``) one kernel of the ``mla_prefill`` family (the KV-cache bytes as its variant)."""
    pairs = 0.0
    kv_tokens = tiles = new_tokens = 0
    for c in chunks:
        q, p = c.num_new_tokens, c.num_cached_tokens
        pairs += q * p + q * (q + 1) / 2.0
        kv_tokens += p + q
        tiles += math.ceil(q / _ATTN_Q_TILE)
        new_tokens += q
    dqk, dv = a.qk_head_dim, a.v_head_dim
    flops = 2.0 * heads * pairs * (dqk + dv)
    # queries in, outputs out; the up-projected K (nope part per head + the shared rope part) and V in 16-bit
    bytes_moved = (new_tokens * heads * (dqk + dv) * act_bytes
                   + kv_tokens * (heads * (a.qk_nope_head_dim + dv) + a.qk_rope_head_dim) * act_bytes)
    n = max(len(chunks), 1)
    features = (float(len(chunks)), new_tokens / n, kv_tokens / n, float(heads), float(heads), float(dqk),
                float(kv_bytes if measured else act_bytes), 0.0)
    family, name = (MLA_PREFILL, "mla_prefill") if measured else (ATTN_PREFILL, "mla_attention_prefill")
    return Kernel(name, family, flops, bytes_moved, max(tiles * heads, 1), "bf16", features, count)


def mla_prefill_kernels(model: ModelSpec, chunks: tuple[PrefillChunk, ...], tp: int, precision: Precision,
                        n_layers: int, measured: bool = False) -> list[Kernel]:
    """Up-projected prefill: kv_b_proj over every context token's latent, then MHA (qk 192, v 128); ``measured``:
    the MHA as the calibration's ``mla_prefill`` family."""
    a = _mla(model)
    heads = model.num_attention_heads // tp
    attn = mla_prefill_attention_kernel(a, chunks, heads, precision.act_bytes, precision.kv_bytes_per_element,
                                        measured, n_layers)
    kv_tokens = sum(c.num_cached_tokens + c.num_new_tokens for c in chunks)
    up = linear_kernel("kv_b_proj", max(kv_tokens, 1), heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank,
                       precision, n_layers)
    return [up, attn]


def mla_decode_kernels(model: ModelSpec, num_decodes: int, context_tokens: int, tp: int, precision: Precision,
                       n_layers: int, measured: bool = False) -> list[Kernel]:
    """Absorbed decode: W_UK bmm, MQA over the latent (FlashMLA), W_UV bmm; ``measured``: the three as one kernel of
    the calibration's ``mla_decode`` family (:func:`mla_decode_attention_kernel`).

    The bmms are priced as one GEMM each with the per-head weights side by side (same FLOPs and weight bytes as
    the batched product; bf16 weights)."""
    a = _mla(model)
    heads = model.num_attention_heads // tp
    act, kv = precision.act_bytes, precision.kv_bytes_per_element
    if measured:
        return [mla_decode_attention_kernel(a, num_decodes, context_tokens, heads, act, kv, n_layers)]
    lat, lora = a.latent_dim, a.kv_lora_rank
    flops = 2.0 * heads * context_tokens * (lat + lora)
    bytes_moved = context_tokens * lat * kv + num_decodes * heads * (lat + lora) * act
    features = (float(num_decodes), context_tokens / max(num_decodes, 1), float(min(heads, _MAX_MEASURED_GROUP)),
                1.0, float(_DECODE_ETA_HEAD_DIM), float(kv), 0.0)
    attn = Kernel("flash_mla_decode", ATTN_DECODE, flops, bytes_moved, max(num_decodes * heads, 1), "bf16",
                  features, n_layers)
    n = max(num_decodes, 1)
    w_uk = gemm_kernel("mla_w_uk_bmm", n, heads * lora, a.qk_nope_head_dim, "bf16", 2.0, act, n_layers)
    w_uv = gemm_kernel("mla_w_uv_bmm", n, heads * a.v_head_dim, lora, "bf16", 2.0, act, n_layers)
    return [w_uk, attn, w_uv]


def mla_decode_attention_kernel(a: MLASpec, num_decodes: int, context_tokens: int, heads: int, act_bytes: float,
                                kv_bytes: float, count: int = 1) -> Kernel:
    """vLLM's absorbed MLA decode op as one kernel of the ``mla_decode`` family: the W_UK bmm, the MQA over the
    576-wide latent (values the 512-wide latent) and the W_UV bmm, with their summed FLOPs and bytes (latent KV
    cache read once, both bf16 per-head weights, queries and outputs)."""
    lat, lora, nope, dv = a.latent_dim, a.kv_lora_rank, a.qk_nope_head_dim, a.v_head_dim
    n = max(num_decodes, 1)
    flops = 2.0 * heads * context_tokens * (lat + lora) + 2.0 * n * heads * lora * (nope + dv)
    bytes_moved = (context_tokens * lat * kv_bytes + num_decodes * heads * (lat + lora) * act_bytes
                   + heads * lora * (nope + dv) * 2.0 + n * heads * (nope + dv) * act_bytes)
    features = (float(num_decodes), context_tokens / n, float(heads), 1.0, float(_MLA_DECODE_FEATURE_HEAD_DIM),
                float(kv_bytes), 0.0)
    return Kernel("mla_decode", MLA_DECODE, flops, bytes_moved, max(num_decodes * heads, 1), "bf16", features, count)
