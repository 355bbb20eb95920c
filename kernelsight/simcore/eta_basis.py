"""What an η model reads off a kernel's shape features, on a given device.

* The smooth model's basis: device-normalized log-features per kernel family (:data:`BASES`, vectorized, and
  :data:`SCALAR_BASES`, the same numbers one row at a time for the step model), and the quadratic design its
  coefficients multiply (:func:`quadratic_design`).
* The cross-generation η factors a transferred model carries in its device constants (:func:`cache_gain_ratio`,
  :func:`transfer_eta_factor`).
* The raw residual coordinates (:data:`RESIDUAL_COORDS`): logs of the sweep's own shape axes plus launch-grid work
  counts, on which the residual lattice, the boosted trees and the kernel dispatch rule are keyed.

Feature layouts per family are those of ``kernels.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

#: Floor under logs and divisions (shared by the η models that take logs of it).
TINY = 1e-30


def _log(x: np.ndarray | float) -> np.ndarray:
    return np.log(np.maximum(np.asarray(x, dtype=float), TINY))


def _gemm_basis(F: np.ndarray, dev: dict[str, float]) -> np.ndarray:
    """GEMM (m, n, k[, code]) → log m, n, k, AI/balance, tiles/SMs, bytes/L2, tile-padding ratios."""
    m, n, k = F[:, 0], F[:, 1], F[:, 2]
    bytes_moved = m * k * dev["in_bytes"] + k * n * dev["weight_bytes"] + m * n * dev["out_bytes"]
    ai = 2.0 * m * n * k / bytes_moved
    tile_m = np.where(m <= 64, 64.0, 128.0)
    tiles = np.ceil(m / tile_m) * np.ceil(n / 128.0) * np.ceil(k / 64.0)  # as kernels.gemm_tiles
    # Padding waste of the last tile row/column: m = 4097 costs a whole extra 128-row tile of work.
    pad_m64 = np.ceil(m / 64.0) * 64.0 / m
    pad_m128 = np.ceil(m / 128.0) * 128.0 / m
    pad_n128 = np.ceil(n / 128.0) * 128.0 / n
    return np.column_stack(
        [
            _log(m),
            _log(n),
            _log(k),
            _log(ai / dev["balance"]),
            _log(tiles / dev["num_sms"]),
            _log(bytes_moved / dev["l2_bytes"]),
            np.log(pad_m64),
            np.log(pad_m128),
            np.log(pad_n128),
            _aligned(m),
        ]
    )


def _aligned(m: np.ndarray) -> np.ndarray:
    """1 where the token count is a multiple of 16 (vectorized loads / tile-aligned kernel paths), else 0.

    Measured: m = 4096 vs 4097 differ 5–15% at the same (n, k) — the library picks another kernel
    configuration for unaligned m. Non-integer m (mean tokens per MoE expert) counts as aligned.
    """
    return ((np.mod(m, 16.0) == 0) | (np.mod(m, 1.0) != 0)).astype(float)


def _moe_basis(F: np.ndarray, dev: dict[str, float]) -> np.ndarray:
    """FusedMoE (slots per touched expert, hidden, inter, touched experts, code, all slots, skew, padding, block
    rows) → log of the four shape axes, AI/balance (of the padded rows' FLOPs), tiles/SMs (row blocks of ``block
    rows``), bytes/L2, the layer-wide slots' share of the bytes, log skew, log of the block padding (padded rows ÷
    slots: ``kernel_shapes.fused_moe_kernel``)."""
    pe, h, i, active = (np.maximum(np.asarray(F[:, j], dtype=float), TINY) for j in range(4))
    all_slots = np.asarray(F[:, 5], dtype=float) if F.shape[1] > 5 else pe * active
    pad = np.maximum(np.asarray(F[:, 7], dtype=float), 1.0) if F.shape[1] > 8 else np.ones(len(F))
    bm = np.asarray(F[:, 8], dtype=float) if F.shape[1] > 8 else np.zeros(len(F))
    flops, gemm_bytes, layer_bytes, tiles = _moe_terms(pe, h, i, active, all_slots, dev, pad, bm)
    bytes_moved = gemm_bytes + layer_bytes
    return np.column_stack([
        _log(pe), _log(h), _log(i), _log(active),
        _log(flops / bytes_moved / dev["balance"]),
        _log(np.maximum(tiles, 1.0) / dev["num_sms"]),
        _log(bytes_moved / dev["l2_bytes"]),
        layer_bytes / bytes_moved,
        _log(np.maximum(np.asarray(F[:, 6], dtype=float), 1.0)) if F.shape[1] > 6 else np.zeros(len(F)),
        np.log(pad),
    ])


def _moe_terms(pe: Any, h: Any, i: Any, active: Any, all_slots: Any, dev: dict[str, float], pad: Any = 1.0,
               bm: Any = 0.0) -> tuple[Any, ...]:
    """(FLOPs, GEMM bytes, layer-wide elementwise bytes, tiles), as ``kernel_shapes.moe_layer_quantities``."""
    slots = pe * active
    a_in, w = dev["in_bytes"], dev["weight_bytes"]
    gemm_bytes = active * 3.0 * h * i * w + slots * (h * a_in + 4.0 * i + i * a_in + 2.0 * h)
    layer_bytes = all_slots * (3.0 * i + h) * 2.0
    tile_m = np.where(pe <= 64, 64.0, 128.0)
    row_blocks = np.where(bm > 0, slots * pad / np.maximum(bm, 1.0), np.ceil(pe / tile_m) * active)
    tiles = row_blocks * (np.ceil(2.0 * i / 128.0) * np.ceil(h / 64.0) + np.ceil(h / 128.0) * np.ceil(i / 64.0))
    return 6.0 * slots * h * i * pad, gemm_bytes, layer_bytes, tiles


def _eff_ctx(ctx: np.ndarray, window: np.ndarray) -> np.ndarray:
    return np.where(window > 0, np.minimum(ctx, np.maximum(window, 1.0)), ctx)


def _attn_prefill_basis(F: np.ndarray, dev: dict[str, float]) -> np.ndarray:
    """(seqs, new, ctx, qh, kvh, hd, kv_bytes, window) → shape logs + work/SM, AI/balance, bytes/L2."""
    seqs, new, ctx, qh, kvh, hd = (F[:, i] for i in range(6))
    kvb = F[:, 6] if F.shape[1] > 6 else np.full(len(F), 2.0)
    win = F[:, 7] if F.shape[1] > 7 else np.zeros(len(F))
    eff = _eff_ctx(ctx, win)
    pairs = seqs * new * eff
    kv_bytes = seqs * ctx * 2.0 * kvh * hd * kvb
    q_bytes = seqs * new * 2.0 * qh * hd * 2.0
    ai = 4.0 * qh * hd * pairs / (kv_bytes + q_bytes)
    ctas = seqs * np.ceil(new / 128.0) * qh
    return np.column_stack(
        [
            _log(seqs),
            _log(new),
            _log(eff),
            _log(qh),
            _log(qh / kvh),
            _log(hd / 128.0),
            _log(ai / dev["balance"]),
            _log(ctas / dev["num_sms"]),
            _log((kv_bytes + q_bytes) / dev["l2_bytes"]),
        ]
    )


def _attn_decode_basis(F: np.ndarray, dev: dict[str, float]) -> np.ndarray:
    """(seqs, ctx, qh, kvh, hd, kv_bytes, window) → shape logs + CTAs/SM and KV bytes/L2."""
    seqs, ctx, qh, kvh, hd = (F[:, i] for i in range(5))
    kvb = F[:, 5] if F.shape[1] > 5 else np.full(len(F), 2.0)
    win = F[:, 6] if F.shape[1] > 6 else np.zeros(len(F))
    eff = _eff_ctx(ctx, win)
    kv_bytes = seqs * eff * 2.0 * kvh * hd * kvb
    ctas = seqs * kvh
    return np.column_stack(
        [
            _log(seqs),
            _log(eff),
            _log(qh),
            _log(qh / kvh),
            _log(hd / 128.0),
            _log(ctas / dev["num_sms"]),
            _log(kv_bytes / dev["l2_bytes"]),
            _l2_spill(_log(kv_bytes / dev["l2_bytes"]), dev.get("l2_spill_center", L2_SPILL_CENTER)),
        ]
    )


#: Where the KV working set stops fitting in L2 (log of KV bytes / L2 bytes) and how sharp the change is.
#: The target tier fits the center per GPU (``device["l2_spill_center"]``); this is the default.
L2_SPILL_CENTER = 0.0
L2_SPILL_WIDTH = 0.2


def _l2_spill(log_ratio: np.ndarray, center: float = L2_SPILL_CENTER) -> np.ndarray:
    """0 while the decode KV working set is served from L2, 1 once it streams from DRAM (logistic step).

    Measured: decode time jumps 2–6× when the total KV bytes pass ~1–2× the L2 size (H100 between 33 and
    67 MB for a 50 MB L2, L40S between 67 and 134 MB for 48 MB): the quadratic alone cannot make that
    step, a bounded logistic of bytes/L2 can. Where exactly the step sits (the GPU's effective cache
    capacity) is fitted per GPU in the target tier; the cross-generation tier uses 1× L2.
    """
    return 1.0 / (1.0 + np.exp(-np.clip((log_ratio - center) / L2_SPILL_WIDTH, -40.0, 40.0)))


#: Cross-generation re-expression of the L2 benefit (``calibrate.fit.transfer``): a working set of ``bytes/L2`` =
#: e^center is half served from L2; the change is spread over ``width`` log units (smoother than the decode spill
#: step: it stands for every family's partial L2 reuse, not one kernel's cliff).
CACHE_GAIN_WIDTH = 0.5
#: basis → (center, columns of log working set / L2, log AI / balance, log work units / SM); None: always
#: memory-bound. Attention reuses up to ~1× L2. GEMMs only up to ~e^−1.5 ≈ 0.2× L2 (their sweeps show no L2
#: benefit for weight-streaming shapes even on the L40S: η ≈ 0.8 at m ≤ 64, n = k = 4096, 32 MB of weights in a
#: 96 MB L2, but η up to 2 for a few-MB working set). Centers tried leave-one-GPU-out: 0, −1.5, −2.5, −3.5. The
#: FusedMoE tables time a layer's repeats L2-warm: the L40S (96 MB L2, 864 GB/s) runs their layers of up to ~96 MB
#: 0.76-0.85× the H100's time (3.35 TB/s, 50 MB), and its η over the DRAM roof stays above the H100's up to ~3× L2
#: (the layer's intermediate activations stay in L2 when its weights do not); MoE centers tried leave-one-GPU-out
#: over the five MoE folders (``benchmarks/moe_accuracy.py``, MoE η transferred by kernel): −1.5 / 0 / 1 / 1.5 → mean
#: 41.3 / 35.3 / 31.9 / 32.3 % (the L40S 64 / 37 / 24 / 25 %); 1 kept.
_CACHE_COLUMNS: dict[str, tuple[float, int, int | None, int | None]] = {
    "moe": (1.0, 6, 4, 5),
    "gemm": (-1.5, 5, 3, 4),
    "attn_prefill": (0.0, 8, 6, 7),
    "attn_decode": (0.0, 6, None, None),
}


def cache_gain_ratio(basis: str, z: np.ndarray, device: dict[str, float]) -> np.ndarray:
    """η factor that swaps a transferred model's L2 benefit for the target's (all 1 without transfer keys).

    A source's η already contains its own L2 speed-up where the working set fits its L2 (η > 1 there). With
    ρ = L2 bandwidth ÷ DRAM bandwidth of a device (``device["l2_bw_ratio_source"]`` / ``"..._target"``, set
    by ``calibrate.fit.transfer``), the memory time of a kernel relative to its DRAM roof is ``s + (1 − s)/ρ`` (s: the
    share of the working set that streams from DRAM, a logistic of log bytes/L2); the compute roof is
    unaffected. So η moves by ``max(u, s + (1−s)/ρ_src) / max(u, s + (1−s)/ρ_tgt)`` with u = compute roof ÷
    DRAM roof (AI/balance × wave quantization): > 1 for a target whose L2 is relatively faster, never for a
    compute-bound kernel or a working set far beyond L2.
    """
    rs, rt = device.get("l2_bw_ratio_source"), device.get("l2_bw_ratio_target")
    if rs is None or rt is None or basis not in _CACHE_COLUMNS:
        return np.ones(len(z))
    center, xc, _, _ = _CACHE_COLUMNS[basis]
    spill = 1.0 / (1.0 + np.exp(-np.clip((z[:, xc] - center) / CACHE_GAIN_WIDTH, -40.0, 40.0)))
    u = _compute_over_memory(basis, z)
    return np.maximum(u, spill + (1.0 - spill) / rs) / np.maximum(u, spill + (1.0 - spill) / rt)


def _compute_over_memory(basis: str, z: np.ndarray) -> np.ndarray:
    """u = compute roof ÷ DRAM roof from the basis (AI/balance × wave quantization as roofline.py); 0 for decode."""
    _, _, ac, tc = _CACHE_COLUMNS[basis]
    if ac is None or tc is None:
        return np.zeros(len(z))
    per_sm = np.exp(z[:, tc])
    return np.exp(z[:, ac]) * np.ceil(per_sm) / np.maximum(per_sm, TINY)


def transfer_eta_factor(basis: str, z: np.ndarray, device: dict[str, float]) -> np.ndarray:
    """All η adjustments a cross-generation member carries in its device constants (see ``calibrate.fit.transfer``).

    Besides :func:`cache_gain_ratio`: ``device["fallback_peak_ratio"]`` = R marks a GEMM format this source
    never measured, stood in for by a format with R× less peak (bf16 for fp8). Its compute roof is taken at the
    measured format's peak — no speed-up from a format nobody measured — while the memory roof (fewer bytes)
    stays: η × max(u, 1) / max(u·R, 1). ``device["clock_sustain_source"]`` / ``"..._target"``: the share of its
    boost clock each GPU holds under a dense tensor load (``hardware.sustained_clock_share``): a source's
    compute-bound η carries its own power limit, which is divided out and the target's put in.
    """
    out = cache_gain_ratio(basis, z, device)
    ratio = device.get("fallback_peak_ratio")
    if ratio is not None and basis in _CACHE_COLUMNS:
        u = _compute_over_memory(basis, z)
        out = out * np.maximum(u, 1.0) / np.maximum(u * ratio, 1.0)
    cs, ct = device.get("clock_sustain_source"), device.get("clock_sustain_target")
    if cs is not None and ct is not None and cs != ct and basis in _CACHE_COLUMNS:
        # a compute roof reached at the sustained clock share c (memory-bound work is not slowed):
        # time ∝ max(u / c, 1), so η moves by max(u / c_src, 1) / max(u / c_tgt, 1)
        u = _compute_over_memory(basis, z)
        out = out * np.maximum(u / cs, 1.0) / np.maximum(u / ct, 1.0)
    return out


def _lg(x: float) -> float:
    return math.log(x) if x > TINY else math.log(TINY)


def _gemm_basis_scalar(f: tuple[float, ...], dev: dict[str, float]) -> list[float]:
    """Pure-Python :func:`_gemm_basis` of one feature tuple."""
    m, n, k = float(f[0]), float(f[1]), float(f[2])
    bytes_moved = m * k * dev["in_bytes"] + k * n * dev["weight_bytes"] + m * n * dev["out_bytes"]
    ai = 2.0 * m * n * k / bytes_moved
    tile_m = 64.0 if m <= 64 else 128.0
    tiles = math.ceil(m / tile_m) * math.ceil(n / 128.0) * math.ceil(k / 64.0)
    return [
        _lg(m),
        _lg(n),
        _lg(k),
        _lg(ai / dev["balance"]),
        _lg(tiles / dev["num_sms"]),
        _lg(bytes_moved / dev["l2_bytes"]),
        _lg(math.ceil(m / 64.0) * 64.0 / m),
        _lg(math.ceil(m / 128.0) * 128.0 / m),
        _lg(math.ceil(n / 128.0) * 128.0 / n),
        1.0 if (m % 16.0 == 0 or m % 1.0 != 0) else 0.0,
    ]


def _eff_ctx_scalar(ctx: float, window: float) -> float:
    return min(ctx, max(window, 1.0)) if window > 0 else ctx


def _attn_prefill_basis_scalar(f: tuple[float, ...], dev: dict[str, float]) -> list[float]:
    seqs, new, ctx, qh, kvh, hd = (float(x) for x in f[:6])
    kvb = float(f[6]) if len(f) > 6 else 2.0
    win = float(f[7]) if len(f) > 7 else 0.0
    eff = _eff_ctx_scalar(ctx, win)
    pairs = seqs * new * eff
    kv_bytes = seqs * ctx * 2.0 * kvh * hd * kvb
    q_bytes = seqs * new * 2.0 * qh * hd * 2.0
    ai = 4.0 * qh * hd * pairs / (kv_bytes + q_bytes)
    ctas = seqs * math.ceil(new / 128.0) * qh
    return [
        _lg(seqs),
        _lg(new),
        _lg(eff),
        _lg(qh),
        _lg(qh / kvh),
        _lg(hd / 128.0),
        _lg(ai / dev["balance"]),
        _lg(ctas / dev["num_sms"]),
        _lg((kv_bytes + q_bytes) / dev["l2_bytes"]),
    ]


def _attn_decode_basis_scalar(f: tuple[float, ...], dev: dict[str, float]) -> list[float]:
    seqs, ctx, qh, kvh, hd = (float(x) for x in f[:5])
    kvb = float(f[5]) if len(f) > 5 else 2.0
    win = float(f[6]) if len(f) > 6 else 0.0
    eff = _eff_ctx_scalar(ctx, win)
    kv_bytes = seqs * eff * 2.0 * kvh * hd * kvb
    l2r = _lg(kv_bytes / dev["l2_bytes"])
    center = dev.get("l2_spill_center", L2_SPILL_CENTER)
    spill = 1.0 / (1.0 + math.exp(-min(max((l2r - center) / L2_SPILL_WIDTH, -40.0), 40.0)))
    return [
        _lg(seqs),
        _lg(eff),
        _lg(qh),
        _lg(qh / kvh),
        _lg(hd / 128.0),
        _lg(seqs * kvh / dev["num_sms"]),
        l2r,
        spill,
    ]


def _moe_basis_scalar(f: tuple[float, ...], dev: dict[str, float]) -> list[float]:
    """Pure-Python :func:`_moe_basis` of one feature tuple (same numbers)."""
    return [float(x) for x in _moe_basis(np.asarray([f], dtype=float), dev)[0]]


#: basis name → pure-Python single-row version (must give the same numbers as ``BASES``)
SCALAR_BASES: dict[str, Any] = {
    "moe": _moe_basis_scalar,
    "gemm": _gemm_basis_scalar,
    "attn_prefill": _attn_prefill_basis_scalar,
    "attn_decode": _attn_decode_basis_scalar,
}


#: basis name → (function, names of its log-features)
BASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "moe": (
        _moe_basis,
        ("log_slots_per_expert", "log_hidden", "log_inter", "log_experts", "log_ai_over_balance",
         "log_tiles_per_sm", "log_bytes_over_l2", "layer_bytes_share", "log_expert_skew", "log_block_padding"),
    ),
    "gemm": (
        _gemm_basis,
        (
            "log_m",
            "log_n",
            "log_k",
            "log_ai_over_balance",
            "log_tiles_per_sm",
            "log_bytes_over_l2",
            "log_pad_m64",
            "log_pad_m128",
            "log_pad_n128",
            "m_aligned16",
        ),
    ),
    "attn_prefill": (
        _attn_prefill_basis,
        (
            "log_seqs",
            "log_new",
            "log_ctx",
            "log_q_heads",
            "log_gqa",
            "log_head_dim",
            "log_ai_over_balance",
            "log_ctas_per_sm",
            "log_bytes_over_l2",
        ),
    ),
    "attn_decode": (
        _attn_decode_basis,
        (
            "log_seqs",
            "log_ctx",
            "log_q_heads",
            "log_gqa",
            "log_head_dim",
            "log_ctas_per_sm",
            "log_bytes_over_l2",
            "l2_spill",
        ),
    ),
}


def basis_matrix(basis: str, features: np.ndarray, device: dict[str, float]) -> np.ndarray:
    """Log-features (rows × d) of a family's raw features on one device."""
    F = np.atleast_2d(np.asarray(features, dtype=float))
    return BASES[basis][0](F, device)


@functools.lru_cache(maxsize=32)
def _triu(d: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(d)


def quadratic_design(zhat: np.ndarray) -> np.ndarray:
    """[1, ẑ, ẑ_i ẑ_j for i ≤ j]: the polynomial terms β multiplies."""
    n, d = zhat.shape
    iu, ju = _triu(d)
    return np.column_stack([np.ones(n), zhat, zhat[:, iu] * zhat[:, ju]])


# Raw shape coordinates of the target-tier residual lattice and trees, per basis: logs of the sweep's own axes, so
# the lattice keys on what was measured (incl. the sliding window, which switches attention kernel paths but is
# folded into the effective context in the smooth basis), whatever the smooth model's basis becomes; after them
# the launch-grid work counts only the trees use.

#: Output tile shapes (rows of m × columns of n) of the GEMM kernels libraries pick among; the residual trees see the
#: tile count of each, so a wave-quantization step (tiles crossing a multiple of the SM count) is one split.
GEMM_TILES: tuple[tuple[float, float], ...] = ((64.0, 128.0), (128.0, 128.0), (128.0, 256.0))


def _gemm_coords(F: np.ndarray) -> np.ndarray:
    """(m, n, k[, code]) → log m, log n, log k, m multiple of 16 (0/1), then log tile counts ⌈m/bm⌉·⌈n/bn⌉ per
    :data:`GEMM_TILES` (used by the residual trees, not by the lattice's axes)."""
    m, n = np.maximum(np.asarray(F[:, 0], dtype=float), 1.0), np.maximum(np.asarray(F[:, 1], dtype=float), 1.0)
    tiles = [np.log(np.ceil(m / bm)) + np.log(np.ceil(n / bn)) for bm, bn in GEMM_TILES]
    return np.column_stack([_log(F[:, 0]), _log(F[:, 1]), _log(F[:, 2]), _aligned(F[:, 0]), *tiles])


#: Query rows per CTA of the prefill attention kernels vLLM runs (FA2 / FA3 / FlashInfer tile 128 query tokens at
#: head_dim 128): the CTA count of a prefill is seqs × q heads × ⌈new tokens / this⌉.
PREFILL_QUERY_TILE = 128.0


def _attn_coords(F: np.ndarray, new: int, qh: int, win: int, prefill: bool) -> np.ndarray:
    """log seqs, log tokens (new for prefill, context for decode), log q heads, log KV heads, log head_dim,
    log(1 + window), log GQA group (q heads / KV heads: kernels switch path at group 1, e.g. no head packing),
    log(seqs × KV heads) (the (sequence, KV head) pairs a decode kernel spreads over CTAs); then the work counts
    a kernel's launch grid and split heuristics key on (used by the residual trees, not by the lattice's axes):
    prefill log CTAs (seqs × q heads × query tiles); decode log KV tokens (seqs × context), log query rows
    (seqs × q heads) and log KV head-tokens (seqs × KV heads × context)."""
    w = F[:, win] if F.shape[1] > win else np.zeros(len(F))
    seqs, tok, q, kv = _log(F[:, 0]), _log(F[:, new]), _log(F[:, qh]), _log(F[:, qh + 1])
    base = [seqs, tok, q, kv, _log(F[:, qh + 2]), np.log1p(np.maximum(w, 0.0)), q - kv, seqs + kv]
    if prefill:
        tiles = np.ceil(np.maximum(np.asarray(F[:, new], dtype=float), 1.0) / PREFILL_QUERY_TILE)
        return np.column_stack([*base, seqs + q + np.log(tiles)])
    return np.column_stack([*base, seqs + tok, seqs + q, seqs + kv + tok])


def _attn_coords_scalar(f: tuple[float, ...], new: int, qh: int, win: int, prefill: bool) -> list[float]:
    w = float(f[win]) if len(f) > win else 0.0
    q, kv, seqs, tok = _lg(float(f[qh])), _lg(float(f[qh + 1])), _lg(float(f[0])), _lg(float(f[new]))
    base = [seqs, tok, q, kv, _lg(float(f[qh + 2])), math.log1p(max(w, 0.0)), q - kv, seqs + kv]
    if prefill:
        return [*base, seqs + q + math.log(math.ceil(max(float(f[new]), 1.0) / PREFILL_QUERY_TILE))]
    return [*base, seqs + tok, seqs + q, seqs + kv + tok]


def _gemm_coords_scalar(f: tuple[float, ...]) -> list[float]:
    m, n = float(f[0]), float(f[1])
    mt, nt = max(m, 1.0), max(n, 1.0)
    tiles = [math.log(math.ceil(mt / bm)) + math.log(math.ceil(nt / bn)) for bm, bn in GEMM_TILES]
    return [_lg(m), _lg(n), _lg(float(f[2])), 1.0 if (m % 16.0 == 0 or m % 1.0 != 0) else 0.0, *tiles]


def _moe_coords(F: np.ndarray) -> np.ndarray:
    """(slots per expert, hidden, inter, experts, code, all slots, skew, padding, block rows) → log of the four shape
    axes, log all slots (the layer's token count × top-k), then log of the rank's slots, of the skew, of the
    block padding and of the rows per block (the trees' work counts: vLLM's config switches its block at tokens = E)."""
    pe, active = _log(F[:, 0]), _log(F[:, 3])
    all_slots = _log(F[:, 5]) if F.shape[1] > 5 else pe + active
    skew = _log(np.maximum(F[:, 6], 1.0)) if F.shape[1] > 6 else np.zeros(len(F))
    pad = np.log(np.maximum(np.asarray(F[:, 7], dtype=float), 1.0)) if F.shape[1] > 8 else np.zeros(len(F))
    bm = _log(np.maximum(np.asarray(F[:, 8], dtype=float), 1.0)) if F.shape[1] > 8 else np.zeros(len(F))
    return np.column_stack([pe, _log(F[:, 1]), _log(F[:, 2]), active, all_slots, pe + active, skew, pad, bm])


def _moe_coords_scalar(f: tuple[float, ...]) -> list[float]:
    return [float(x) for x in _moe_coords(np.asarray([f], dtype=float))[0]]


#: basis → raw residual coordinates (rows × d); feature layouts as in ``kernels.py``
RESIDUAL_COORDS: dict[str, Any] = {
    "moe": _moe_coords,
    "gemm": _gemm_coords,
    "attn_prefill": lambda F: _attn_coords(F, 1, 3, 7, True),
    "attn_decode": lambda F: _attn_coords(F, 1, 2, 6, False),
}
RESIDUAL_COORDS_SCALAR: dict[str, Any] = {
    "moe": _moe_coords_scalar,
    "gemm": _gemm_coords_scalar,
    "attn_prefill": lambda f: _attn_coords_scalar(f, 1, 3, 7, True),
    "attn_decode": lambda f: _attn_coords_scalar(f, 1, 2, 6, False),
}
#: Attention feature columns (context attended, sliding window) per basis, and the window's raw coordinate.
WINDOW_COLUMNS: dict[str, tuple[int, int]] = {"attn_prefill": (2, 7), "attn_decode": (1, 6)}
WINDOW_COORD = 5


def window_binds(basis: str, F: np.ndarray) -> np.ndarray:
    """Rows whose sliding window cuts the context (window > 0 and context > window)."""
    ctx, win = WINDOW_COLUMNS[basis]
    if F.shape[1] <= win:
        return np.zeros(len(F), dtype=bool)
    return (F[:, win] > 0) & (F[:, ctx] > F[:, win])


def residual_coordinates(basis: str, F: np.ndarray, free_window: bool = False) -> np.ndarray:
    """Raw lattice coordinates of feature rows; with ``free_window`` a window that does not bind is read as none
    (kernels such as FA3 or FlashInfer run the full-attention path then, so those rows share its knots)."""
    c = RESIDUAL_COORDS[basis](F)
    if free_window and basis in WINDOW_COLUMNS and F.shape[1] > WINDOW_COLUMNS[basis][1]:
        win = WINDOW_COLUMNS[basis][1]
        c[(F[:, win] > 0) & ~window_binds(basis, F), WINDOW_COORD] = 0.0
    return c


__all__ = [
    "BASES",
    "CACHE_GAIN_WIDTH",
    "GEMM_TILES",
    "L2_SPILL_CENTER",
    "L2_SPILL_WIDTH",
    "PREFILL_QUERY_TILE",
    "RESIDUAL_COORDS",
    "RESIDUAL_COORDS_SCALAR",
    "SCALAR_BASES",
    "WINDOW_COLUMNS",
    "WINDOW_COORD",
    "basis_matrix",
    "cache_gain_ratio",
    "quadratic_design",
    "residual_coordinates",
    "transfer_eta_factor",
    "window_binds",
]
