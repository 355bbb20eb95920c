"""Kernel primitives: the Kernel record, the batch shape of a step, and the FLOPs/bytes/tiles of one GEMM,
elementwise or attention kernel. ``kernels.py`` composes them into a model's layers (and re-exports them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kernelsight.simcore.fp4_dispatch import (
    NVFP4,
    NVFP4_BYTES_PER_ELEMENT,
    fp4_priced_format,
    fp4_weight_bytes_per_param,
    nvfp4_linear_kernel,
)
from kernelsight.simcore.gemm_dispatch import fp8_linear_kernel, priced_format
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING, padded_slots, routing_load
from kernelsight.simcore.multimodal import MultimodalItem
from kernelsight.simcore.precision import Precision

GEMM = "gemm"
MOE_GEMM = "moe_gemm"
ATTN_PREFILL = "attn_prefill"
ATTN_DECODE = "attn_decode"
ATTN_ENCODER = "attn_encoder"   # a vision encoder's (ViT) bidirectional attention (not a decoder step's family)
# vLLM's MLA attention op as measured (``mla.py``; priced into the step's prefill / decode attention, not a family of
# the breakdown): the up-projected prefill's MHA, and the absorbed decode (W_UK bmm, MQA over the latent, W_UV bmm)
MLA_PREFILL = "mla_prefill"
MLA_DECODE = "mla_decode"
KV_WRITE = "kv_write"
ROPE = "rope"
NORM = "norm"
ACTIVATION = "activation"
EMBEDDING = "embedding"
SAMPLER = "sampler"
ENCODER = "encoder"             # a step's vision-encoder passes, every kernel of them (vision_encoder.py)
ALL_REDUCE = "all_reduce"
LAUNCH = "launch"
HOST = "host"

#: Every family a step breakdown reports, in a fixed order (GPU kernels, then communication, then CPU).
FAMILIES: tuple[str, ...] = (GEMM, MOE_GEMM, ATTN_PREFILL, ATTN_DECODE, KV_WRITE, ROPE, NORM, ACTIVATION,
                             EMBEDDING, SAMPLER, ENCODER, ALL_REDUCE, LAUNCH, HOST)
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
    decode_context_tokens: int = 0   # Σ over decodes of the tokens each attends (incl. the new ones)
    # speculative decoding: Σ over decodes of the draft tokens each verifies besides its bonus token (every verified
    # position computes a row and its logits)
    num_spec_tokens: int = 0
    # the longest decode contexts (tokens attended, incl. the new one), longest first, as many as the step model's
    # ``decode_top_k`` asks for; empty: not known (decode attention priced as equal contexts)
    decode_context_top: tuple[int, ...] = ()
    # images/videos whose encoder runs this step (vLLM V1 runs it in the step that first schedules an item's tokens)
    encoder_items: tuple[MultimodalItem, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_spec_tokens + sum(p.num_new_tokens for p in self.prefills)

    @property
    def num_sampling_rows(self) -> int:
        return self.num_decodes + self.num_spec_tokens + sum(1 for p in self.prefills if p.samples)

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


def attention_encoder_kernel(batch: int, seq_len: int, num_heads: int, head_dim: int, act_bytes: float,
                             count: int = 1) -> Kernel:
    """A vision encoder's attention: ``batch`` images of ``seq_len`` patches, every query over every key of its
    image (no causal mask: twice a causal prefill's pairs), one KV head per query head. Its features take the
    prefill kernel's layout (one chunk per image, nothing cached), so the prefill's η basis describes it."""
    pairs = float(batch) * seq_len * seq_len
    flops = 4.0 * num_heads * head_dim * pairs
    bytes_moved = 4.0 * batch * seq_len * num_heads * head_dim * act_bytes    # Q, K, V read, O written
    tiles = max(batch * math.ceil(seq_len / _ATTN_Q_TILE) * num_heads, 1)
    features = (float(batch), float(seq_len), float(seq_len), float(num_heads), float(num_heads), float(head_dim),
                float(act_bytes), 0.0)
    return Kernel("attention_encoder", ATTN_ENCODER, flops, bytes_moved, tiles, "bf16", features, count)


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


def expected_active_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Experts hit at least once when ``tokens`` tokens each pick top_k distinct experts of num_experts uniformly.

    One token misses a given expert with probability 1 - top_k/num_experts, so the exponent is the token count,
    not tokens x top_k (that would count one token as hitting ~52 of Qwen3-30B's 128 experts instead of 8)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# ------------------------------------------------------------------------------------------------
# vLLM's FusedMoE layer: the routed experts' two grouped GEMMs and their activation, one kernel model
# ------------------------------------------------------------------------------------------------
#: Expert formats of the MoE layer, as the shared MoE tables name them (their ``dtype``), and the code η switches on
#: (5th ``moe_gemm`` feature): ``int4_wo`` is weight-only int4 (Marlin W4A16), ``w4a16_mxfp4`` MXFP4 weights with
#: 16-bit activations (gpt-oss: OpenAI's Triton kernel on Hopper, Marlin on Ampere/Ada/12.x, FlashInfer TRT-LLM
#: on 10.x), ``nvfp4`` W4A4 on the FP4 tensor cores.
MOE_FORMAT_CODES: dict[str, int] = {"bf16": 0, "fp16": 0, "fp8": 1, "fp8_block": 2, NVFP4: 4, "int4_wo": 5,
                                    "w4a16_mxfp4": 6}
#: code → (tensor-core dtype, weight bytes per parameter, routed-activation input bytes per element). Scales: fp8
#: block 1 fp32 per 128×128 weights and per 128 activations; int4 one 16-bit scale per 128 weights; MXFP4 one E8M0
#: per 32; NVFP4 one FP8 per 16 (weights and activations).
MOE_FORMATS: dict[int, tuple[str, float, float]] = {
    0: ("bf16", 2.0, 2.0),
    1: ("fp8", 1.0, 1.0),
    2: ("fp8", 1.0 + 4.0 / (128 * 128), 1.0 + 4.0 / 128),
    4: ("fp4", NVFP4_BYTES_PER_ELEMENT, NVFP4_BYTES_PER_ELEMENT),
    5: ("bf16", 0.5 + 2.0 / 128, 2.0),
    6: ("bf16", 0.5 + 1.0 / 32, 2.0),
}


def fused_moe_kernel(tokens: int, hidden: int, inter: int, top_k: int, num_experts: int, fmt: str,
                     ep_size: int = 1, distribution: str = DEFAULT_EXPERT_ROUTING, act_bytes: float = 2.0,
                     count: int = 1, load_imbalance: float | None = None, name: str = "moe_experts",
                     rank_tokens_only: bool = False) -> Kernel:
    """One vLLM FusedMoE layer forward on the busiest rank: gate_up grouped GEMM (2·``inter`` × ``hidden`` per
    expert), SiLU·mul, down grouped GEMM (``hidden`` × ``inter``), over the token-slots and experts the routing
    relation gives that rank (:func:`~kernelsight.simcore.moe_routing.routing_load`). ``tokens`` enter the layer
    (the whole EP group's under expert parallelism), ``inter`` is one rank's slice (TP-split experts),
    ``load_imbalance`` (given) overrides the derived busiest-rank share. ``rank_tokens_only``: only the tokens
    that picked the rank's experts enter, each with min(top_k, E/ep) local picks (how some measurement harnesses
    time an EP rank; vLLM's own layer sees every token).

    FLOPs: 2 · slots · 3 · hidden · inter. Bytes: the touched experts' weights once, each of the rank's slots'
    GEMM operands (the gate_up input in the format's input width, its 2·inter outputs, the down GEMM's input and
    hidden-wide output), and the layer-wide elementwise traffic over *all* ``tokens·top_k`` slots, which vLLM's
    fused_experts runs whatever the rank holds (the activation reads 2·inter and writes inter per slot, the
    top-k sum reads each slot's hidden-wide output). Counting the Triton kernel's zero-writes for remote slots
    too fitted worse on the H100 (fp8 FlashInfer CUTLASS 5.5 → 8.2 %, bf16 Triton 3.8 → 4.7 %, 25 % split).
    Tiles: per touched expert its rows in 64/128-row tiles, times both GEMMs' column tiles and k-blocks.
    η features: (slots per touched expert, hidden, inter, touched experts, format code, all slots, most loaded
    expert's slots ÷ the mean: the skew whose longest row block a grouped GEMM's last wave waits for)."""
    code = MOE_FORMAT_CODES[fmt]
    compute, w, a_in = MOE_FORMATS[code]
    load = routing_load(tokens, top_k, num_experts, ep_size, distribution)
    slots, active, most = load.slots, load.active_experts, load.max_expert_slots
    if load_imbalance is not None and load.mean_slots > 0:
        scale = load.mean_slots * load_imbalance / slots if slots > 0 else 1.0
        slots, most = load.mean_slots * load_imbalance, most * scale
        active = min(max(num_experts // max(ep_size, 1), 1), max(active, min(slots, 1.0)))
    all_slots = float(tokens * top_k)
    if rank_tokens_only:
        local_k = min(top_k, max(num_experts // max(ep_size, 1), 1))
        slots = math.ceil(slots / local_k) * local_k
        all_slots = slots
    per_expert = slots / active if active > 0 else 0.0
    local_experts = max(num_experts // max(ep_size, 1), 1)
    bm = moe_block_m(tokens, top_k, local_experts, fmt)
    padded = padded_slots(tokens, top_k, num_experts, ep_size, distribution, bm) if load.slots > 0 else 0.0
    if rank_tokens_only and padded > 0:   # the same routing, only the rank's tokens entering
        padded = max(padded, math.ceil(slots / bm) * bm)
    # the rows the padding adds, in the busiest rank's slots as the caller's (or the override's) count gives them
    pad = max(padded / load.slots, 1.0) if load.slots > 0 else 1.0
    h, i = float(hidden), float(inter)
    flops, bytes_moved, tiles = moe_layer_quantities(per_expert, h, i, active, all_slots, w, a_in, act_bytes, pad,
                                                     float(bm))
    skew = most / per_expert if per_expert > 0 else 1.0
    return Kernel(name, MOE_GEMM, flops, bytes_moved, max(int(tiles), 1), compute,
                  (per_expert, h, i, active, float(code), all_slots, max(skew, 1.0), pad, float(bm)), count)


#: Row-block sizes of vLLM's Marlin MoE kernel, smallest first (``get_default_config``'s Marlin branch).
MARLIN_MOE_BLOCK_M: tuple[int, ...] = (8, 16, 32, 48, 64)


def moe_block_m(tokens: int, top_k: int, local_experts: int, fmt: str) -> int:
    """Rows per block of the grouped expert GEMMs (``BLOCK_SIZE_M``) in vLLM's default MoE config (``fused_moe.
    get_default_config``): Marlin's weight-only formats the first of 8/16/32/48/64 with tokens·top_k/E/block
    < 0.9; block-scaled fp8 64; the others 16 while the tokens are at most the rank's experts, else 64. Each
    expert's rows are padded to it (``moe_routing.padded_slots``). The tuned per-GPU config files and FlashInfer's
    CUTLASS tiles differ by shape; η per kernel absorbs that."""
    if fmt in ("int4_wo", "w4a16_mxfp4"):
        for bm in MARLIN_MOE_BLOCK_M:
            if tokens * top_k / max(local_experts, 1) / bm < 0.9:
                return bm
        return MARLIN_MOE_BLOCK_M[-1]
    if fmt == "fp8_block":
        return 64
    return 16 if tokens <= local_experts else 64


def moe_layer_quantities(per_expert: float, hidden: float, inter: float, active: float, all_slots: float,
                         weight_bytes: float, in_bytes: float, act_bytes: float = 2.0, pad: float = 1.0,
                         block_m: float = 0.0) -> tuple[float, float, float]:
    """(FLOPs, bytes, tiles) of one FusedMoE layer on a rank (see :func:`fused_moe_kernel`); scalars or arrays.
    ``pad`` (≥ 1): the rank's padded rows ÷ its slots — the GEMMs compute the padded rows (FLOPs, tiles), the
    masked rows move no bytes; ``block_m`` the rows per block (0: the 64/128-row tiles of the mean expert)."""
    slots = per_expert * active
    flops = 6.0 * slots * hidden * inter * pad
    gemm_bytes = active * 3.0 * hidden * inter * weight_bytes + slots * (
        hidden * in_bytes + 2.0 * inter * act_bytes + inter * in_bytes + hidden * act_bytes)
    layer_bytes = all_slots * (3.0 * inter + hidden) * act_bytes
    tile_m = np.where(per_expert <= _GEMM_TILE_SMALL_M, _GEMM_TILE_SMALL_M, _GEMM_TILE)
    row_blocks = np.where(np.asarray(block_m) > 0, slots * pad / np.maximum(block_m, 1.0),
                          np.ceil(per_expert / tile_m) * active)
    tiles = row_blocks * (np.ceil(2.0 * inter / _GEMM_TILE) * np.ceil(hidden / _GEMM_K_BLOCK)
                          + np.ceil(hidden / _GEMM_TILE) * np.ceil(inter / _GEMM_K_BLOCK))
    if np.ndim(tiles) == 0:
        return float(flops), float(gemm_bytes + layer_bytes), float(tiles)
    return flops, gemm_bytes + layer_bytes, tiles
