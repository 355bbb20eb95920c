"""Calibration: the learned efficiency η per kernel family, plus the fixed costs around kernels.

η turns a roofline bound into a predicted time: ``kernel_s = roof_s / η + overhead_s``. Each family has
an :class:`EtaModel` evaluated on the family's shape features (see ``kernels.py`` for what each family's
features are). Until a GPU has fitted tables (``kernelsight calibrate``), :func:`default_calibration`
gives documented, physically plausible defaults.

A calibration also carries the collective backends' latency models (:mod:`kernelsight.simcore.comm`) and the
host and launch costs around the kernels (:mod:`kernelsight.simcore.overheads`).

Invariant kept here, not by callers: η is clipped to ``[eta_floor, eta_max]`` so that no prediction is
faster than the roofline divided by the largest η seen in calibration.
"""

from __future__ import annotations

import base64
import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kernelsight.simcore.comm import CommModel
from kernelsight.simcore.overheads import HostModel, LaunchModel
from kernelsight.simcore.residual_trees import ResidualTrees


class EtaModel(Protocol):
    """η as a function of one family's shape features (a tuple; meaning documented per family)."""

    def eta(self, features: tuple[float, ...]) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class LogisticEta:
    """η rising (or falling) smoothly between two plateaus along log(feature[index]).

        η(x) = lo + (hi − lo) / (1 + (x0 / x) ** slope)

    Bounded by construction (between lo and hi), monotone, and flat at both ends: small problems
    are dominated by fixed latency, large ones reach a steady fraction of peak.
    """

    lo: float
    hi: float
    x0: float
    slope: float = 1.0
    index: int = 0

    def eta(self, features: tuple[float, ...]) -> float:
        x = max(float(features[self.index]), 1e-9)
        return self.lo + (self.hi - self.lo) / (1.0 + (self.x0 / x) ** self.slope)

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": "logistic",
            "lo": self.lo,
            "hi": self.hi,
            "x0": self.x0,
            "slope": self.slope,
            "index": self.index,
        }


@dataclass(frozen=True, slots=True)
class ConstantEta:
    value: float

    def eta(self, features: tuple[float, ...]) -> float:
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {"form": "constant", "value": self.value}


# ---------------------------------------------------------------------------------------------------
# The fitted form: a bounded sigmoid of a quadratic in device-normalized log-features.
#
#     z   = basis(features, device)                  (log-features; some divided by spec constants)
#     s   = β · [1, ẑ, ẑ_i ẑ_j (i ≤ j)]            ẑ = (z − center) / scale
#     η   = lo + (hi − lo) · sigmoid(s)
#   kernel_s = (roof_s / η + overhead_s) · exp(g(x))      g = optional residual lattice + boosted trees,
#                                                          x = raw shape (target tier)
#   i.e. the model reports η·exp(−g) and overhead_s·exp(g), so both terms scale together
#
# Why this form: latency/roofline is governed by a few ratios — arithmetic intensity against the
# machine balance (which roof binds and how close to the ridge), work per SM (tail waves, occupancy),
# working set against L2 (cache hits can beat the DRAM roof) — plus raw tile-shape effects (m, n, k,
# heads, head_dim). η is smooth and saturating along each of them, so a low-order polynomial in log
# space squashed by a sigmoid fits it with few parameters, cannot leave [lo, hi], and does not
# oscillate between measured shapes. Expressing the device-dependent axes relative to the spec
# (balance, SM count, L2) is what lets coefficients learned on one GPU transfer to another
# (``calibrate.fit.transfer``). The residual lattice is a multilinear (continuous, bounded) correction of the
# log kernel time on a lattice of the raw sweep axes (knots at the measured values), fitted only when
# the target GPU itself was measured: it captures library kernel-selection effects (split-K, tile configs, which fp8
# kernel vLLM dispatches) that no smooth law of the shape can, and that do not transfer anyway. Boosted
# trees on the same axes (``residual_trees``) add the sharp steps where a library switches kernels.
# Scaling the fixed latency too is what lets it correct small, latency-bound shapes.
# ---------------------------------------------------------------------------------------------------

_TINY = 1e-30


def _log(x: np.ndarray | float) -> np.ndarray:
    return np.log(np.maximum(np.asarray(x, dtype=float), _TINY))


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
#: 96 MB L2, but η up to 2 for a few-MB working set). Centers tried leave-one-GPU-out: 0, −1.5, −2.5, −3.5.
_CACHE_COLUMNS: dict[str, tuple[float, int, int | None, int | None]] = {
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
    return np.exp(z[:, ac]) * np.ceil(per_sm) / np.maximum(per_sm, _TINY)


def transfer_eta_factor(basis: str, z: np.ndarray, device: dict[str, float]) -> np.ndarray:
    """All η adjustments a cross-generation member carries in its device constants (see ``calibrate.fit.transfer``).

    Besides :func:`cache_gain_ratio`: ``device["fallback_peak_ratio"]`` = R marks a GEMM format this source
    never measured, stood in for by a format with R× less peak (bf16 for fp8). Its compute roof is taken at the
    measured format's peak — no speed-up from a format nobody measured — while the memory roof (fewer bytes)
    stays: η × max(u, 1) / max(u·R, 1).
    """
    out = cache_gain_ratio(basis, z, device)
    ratio = device.get("fallback_peak_ratio")
    if ratio is not None and basis in _CACHE_COLUMNS:
        u = _compute_over_memory(basis, z)
        out = out * np.maximum(u, 1.0) / np.maximum(u * ratio, 1.0)
    return out


def _lg(x: float) -> float:
    return math.log(x) if x > _TINY else math.log(_TINY)


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


#: basis name → pure-Python single-row version (must give the same numbers as ``BASES``)
SCALAR_BASES: dict[str, Any] = {
    "gemm": _gemm_basis_scalar,
    "attn_prefill": _attn_prefill_basis_scalar,
    "attn_decode": _attn_decode_basis_scalar,
}


#: basis name → (function, names of its log-features)
BASES: dict[str, tuple[Any, tuple[str, ...]]] = {
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


@functools.lru_cache(maxsize=16)
def _corner_bits(d: int) -> np.ndarray:
    """The 2^d corners of a unit cell as 0/1 offsets."""
    return (np.arange(1 << d)[:, None] >> np.arange(d)[None, :]) & 1


@functools.lru_cache(maxsize=32)
def _triu(d: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(d)


def quadratic_design(zhat: np.ndarray) -> np.ndarray:
    """[1, ẑ, ẑ_i ẑ_j for i ≤ j]: the polynomial terms β multiplies."""
    n, d = zhat.shape
    iu, ju = _triu(d)
    return np.column_stack([np.ones(n), zhat, zhat[:, iu] * zhat[:, ju]])


@dataclass(frozen=True, slots=True)
class ResidualGrid:
    """Multilinear interpolation of a log-time correction on a rectilinear lattice over some coordinate dims.

    ``dims`` index the columns of the coordinates named by ``coords``: ``"raw"`` = the family's raw shape
    axes (:data:`RESIDUAL_COORDS`, independent of the smooth model's basis), ``"basis"`` = the smooth
    model's basis (older files). ``knots[j]`` are the increasing knot positions along ``dims[j]`` (the
    target tier puts them at the measured grid's own values, so a shape of the sweep grid is corrected
    by its measured neighbours); ``values`` is the flattened lattice (C order). Outside the lattice the
    edge value holds (clamped), so the correction stays bounded.
    """

    dims: tuple[int, ...]
    knots: tuple[tuple[float, ...], ...]
    values: tuple[float, ...]
    coords: str = "basis"
    #: The kernel ignores a sliding window that does not bind (context ≤ window): such rows sit at window 0.
    free_window: bool = False
    _vals: np.ndarray = field(init=False, repr=False, compare=False)   # lattice array
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = self.shape
        object.__setattr__(self, "_vals", np.asarray(self.values, dtype=float).reshape(shape))
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        object.__setattr__(self, "_strides", tuple(reversed(strides)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(k) for k in self.knots)

    def __call__(self, z: np.ndarray) -> np.ndarray:
        shape = self.shape
        idx0, frac = knot_coordinates(z[:, list(self.dims)], self.knots)
        bits = _corner_bits(len(self.dims))                                   # (C, d)
        w = np.where(bits[None, :, :], frac[:, None, :], 1.0 - frac[:, None, :]).prod(axis=2)   # (n, C)
        idx = np.minimum(idx0[:, None, :] + bits[None, :, :], np.asarray(shape) - 1)            # (n, C, d)
        flat = np.ravel_multi_index(tuple(np.moveaxis(idx, 2, 0)), shape)
        return (w * self._vals.ravel()[flat]).sum(axis=1)

    def scalar(self, z: list[float]) -> float:
        """Pure-Python evaluation at one basis row (the step model's uncached path)."""
        vals = self.values
        base = 0
        axes: list[tuple[float, int]] = []
        for j, dim in enumerate(self.dims):
            kn = self.knots[j]
            x = z[dim]
            last = len(kn) - 1
            if x <= kn[0]:
                i, f = 0, 0.0
            elif x >= kn[last]:
                i, f = last - 1, 1.0
            else:
                i = bisect.bisect_right(kn, x) - 1
                f = (x - kn[i]) / (kn[i + 1] - kn[i])
            base += i * self._strides[j]
            axes.append((f, self._strides[j]))
        # successive linear interpolation over the 2^d corners
        points = [(base, 1.0)]
        for f, stride in axes:
            if f == 0.0:
                continue
            if f == 1.0:
                points = [(o + stride, w) for o, w in points]
                continue
            g = 1.0 - f
            points = [p for o, w in points for p in ((o, w * g), (o + stride, w * f))]
        return sum(vals[o] * w for o, w in points)

    def to_dict(self) -> dict[str, Any]:
        return {
            "coords": self.coords,
            "dims": list(self.dims),
            "knots": [[round(x, 6) for x in k] for k in self.knots],
            # compact: log-ratio × 1000 as little-endian int16, base64 (|value| ≤ 3 is applied anyway)
            "values_milli_i16": base64.b64encode(
                np.clip(np.round(self._vals.ravel() * 1000.0), -32767, 32767).astype("<i2").tobytes()
            ).decode("ascii"),
            **({"free_window": True} if self.free_window else {}),
        }

    def coordinates(self, basis: str, z: np.ndarray, features: np.ndarray | None) -> np.ndarray:
        """The matrix this lattice is indexed by: basis rows ``z`` or the raw coordinates of ``features``."""
        if self.coords == "basis":
            return z
        if features is None:
            raise ValueError("a raw-coordinate residual lattice needs the feature rows")
        return residual_coordinates(basis, np.atleast_2d(np.asarray(features, dtype=float)), self.free_window)

    def scalar_coordinates(self, basis: str, z: list[float], features: tuple[float, ...]) -> list[float]:
        if self.coords == "basis":
            return z
        c = RESIDUAL_COORDS_SCALAR[basis](features)
        if self.free_window and basis in WINDOW_COLUMNS:
            ctx, win = WINDOW_COLUMNS[basis]
            if len(features) > win and features[win] > 0 and features[ctx] <= features[win]:
                c[_WINDOW_COORD] = 0.0
        return c


def knot_coordinates(
    zs: np.ndarray, knots: tuple[tuple[float, ...], ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Lower knot index and fractional position of each point along each lattice dim (clamped)."""
    idx0 = np.empty(zs.shape, dtype=np.int64)
    frac = np.empty(zs.shape)
    for j, kn in enumerate(knots):
        k = np.asarray(kn, dtype=float)
        i = np.clip(np.searchsorted(k, zs[:, j], side="right") - 1, 0, len(k) - 2)
        idx0[:, j] = i
        frac[:, j] = np.clip((zs[:, j] - k[i]) / (k[i + 1] - k[i]), 0.0, 1.0)
    return idx0, frac


def _grid_from_dict(g: dict[str, Any]) -> ResidualGrid:
    if "knots" in g:
        knots = tuple(tuple(float(x) for x in k) for k in g["knots"])
    else:  # older files: a regular lattice given by lo / step / shape
        knots = tuple(
            tuple(float(lo + i * st) for i in range(int(n))) for lo, st, n in zip(g["lo"], g["step"], g["shape"],
                                                                                  strict=True)
        )
    if "values_milli_i16" in g:
        raw = np.frombuffer(base64.b64decode(g["values_milli_i16"]), dtype="<i2")
        values = tuple((raw.astype(float) * 1e-3).tolist())
    elif "values_milli" in g:
        values = tuple(float(v) * 1e-3 for v in g["values_milli"])
    else:
        values = tuple(float(v) for v in g["values"])
    return ResidualGrid(tuple(int(d) for d in g["dims"]), knots, values, str(g.get("coords", "basis")),
                        bool(g.get("free_window", False)))


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


#: basis → raw residual coordinates (rows × d); feature layouts as in ``kernels.py``
RESIDUAL_COORDS: dict[str, Any] = {
    "gemm": _gemm_coords,
    "attn_prefill": lambda F: _attn_coords(F, 1, 3, 7, True),
    "attn_decode": lambda F: _attn_coords(F, 1, 2, 6, False),
}
RESIDUAL_COORDS_SCALAR: dict[str, Any] = {
    "gemm": _gemm_coords_scalar,
    "attn_prefill": lambda f: _attn_coords_scalar(f, 1, 3, 7, True),
    "attn_decode": lambda f: _attn_coords_scalar(f, 1, 2, 6, False),
}
#: Attention feature columns (context attended, sliding window) per basis, and the window's raw coordinate.
WINDOW_COLUMNS: dict[str, tuple[int, int]] = {"attn_prefill": (2, 7), "attn_decode": (1, 6)}
_WINDOW_COORD = 5


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
        c[(F[:, win] > 0) & ~window_binds(basis, F), _WINDOW_COORD] = 0.0
    return c


@dataclass(frozen=True, slots=True)
class LogPolyEta:
    """η = lo + (hi − lo)·sigmoid(β·quad(ẑ)), time scaled by exp(grid(z)) (see the block comment).

    ``zlo``/``zhi`` (optional) are the range of the basis seen in fitting: the polynomial is evaluated at
    the basis clamped to it, so extrapolation (a GPU or shape outside the sources' range) holds the edge
    value instead of following a quadratic away.
    """

    basis: str
    device: dict[str, float]
    center: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    lo: float = 0.01
    hi: float = 1.5
    overhead_s: float | None = None  # fixed latency of kernels this model covers (None: family's)
    grid: ResidualGrid | None = None
    zlo: tuple[float, ...] | None = None
    zhi: tuple[float, ...] | None = None
    #: boosted trees on the same raw coordinates as a raw ``grid``: their correction adds to the lattice's
    trees: ResidualTrees | None = None
    _arrays: tuple[np.ndarray, ...] = field(init=False, repr=False, compare=False)  # center, scale, coef
    _pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        arrays = tuple(np.asarray(v, dtype=float) for v in (self.center, self.scale, self.coef))
        object.__setattr__(self, "_arrays", arrays)
        d = len(self.center)
        object.__setattr__(self, "_pairs", tuple((i, j) for i in range(d) for j in range(i, d)))

    def eta_array(self, features: np.ndarray) -> np.ndarray:
        return self.eta_and_overhead_array(features)[0]

    def eta_and_overhead_array(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(η, overhead_s) per feature row, residual lattice applied to both."""
        z = basis_matrix(self.basis, features, self.device)
        return self.from_basis(z, features)

    def smooth_eta(self, z: np.ndarray) -> np.ndarray:
        center, scale, coef = self._arrays
        if self.zlo is not None and self.zhi is not None:
            z = np.clip(z, np.asarray(self.zlo), np.asarray(self.zhi))
        zhat = (z - center) / scale
        s = quadratic_design(zhat) @ coef
        return self.lo + (self.hi - self.lo) / (1.0 + np.exp(-np.clip(s, -40.0, 40.0)))

    def from_basis(self, z: np.ndarray, features: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(η, overhead_s) at basis rows ``z``; ``features`` (the same rows) is needed by a raw-coordinate grid."""
        eta = self.smooth_eta(z)
        if "l2_bw_ratio_target" in self.device or "fallback_peak_ratio" in self.device:  # cross-generation
            eta = eta * transfer_eta_factor(self.basis, z, self.device)
        ovh = np.full(len(z), self.overhead_s or 0.0)
        if self.grid is not None or self.trees is not None:
            g = np.zeros(len(z))
            if self.grid is not None:
                coords = self.grid.coordinates(self.basis, z, features)
                g += self.grid(coords)
            if self.trees is not None:
                if self.grid is None or self.grid.coords != "raw":
                    if features is None:
                        raise ValueError("residual trees need the feature rows")
                    coords = residual_coordinates(self.basis, np.atleast_2d(np.asarray(features, dtype=float)))
                g += self.trees(coords)
            scale = np.exp(np.clip(g, -3.0, 3.0))
            eta, ovh = eta / scale, ovh * scale
        return eta, ovh

    def eta_overhead_scalar(self, features: tuple[float, ...]) -> tuple[float, float]:
        """(η, overhead_s) of one feature tuple in pure Python (same numbers as the array path)."""
        z = SCALAR_BASES[self.basis](features, self.device)
        zc = z
        if self.zlo is not None and self.zhi is not None:
            zc = [min(max(x, a), b) for x, a, b in zip(z, self.zlo, self.zhi, strict=True)]
        zh = [(x - c) / s for x, c, s in zip(zc, self.center, self.scale, strict=True)]
        coef = self.coef
        d = len(zh)
        s = coef[0]
        for i in range(d):
            s += coef[1 + i] * zh[i]
        k = 1 + d
        for i, j in self._pairs:
            s += coef[k] * zh[i] * zh[j]
            k += 1
        s = min(max(s, -40.0), 40.0)
        eta = self.lo + (self.hi - self.lo) / (1.0 + math.exp(-s))
        if "l2_bw_ratio_target" in self.device or "fallback_peak_ratio" in self.device:
            eta *= float(transfer_eta_factor(self.basis, np.asarray([z], dtype=float), self.device)[0])
        ovh = self.overhead_s or 0.0
        if self.grid is not None or self.trees is not None:
            g = 0.0
            if self.grid is not None:
                coords = self.grid.scalar_coordinates(self.basis, z, features)
                g += self.grid.scalar(coords)
            if self.trees is not None:
                if self.grid is None or self.grid.coords != "raw":
                    coords = RESIDUAL_COORDS_SCALAR[self.basis](features)
                g += self.trees.scalar(coords)
            scale = math.exp(min(max(g, -3.0), 3.0))
            eta, ovh = eta / scale, ovh * scale
        return eta, ovh

    def eta(self, features: tuple[float, ...]) -> float:
        return self.eta_overhead_scalar(features)[0]

    def overhead(self, features: tuple[float, ...]) -> float | None:
        if self.overhead_s is None:
            return None
        if self.grid is None and self.trees is None:
            return self.overhead_s
        return self.eta_overhead_scalar(features)[1]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "form": "logpoly",
            "basis": self.basis,
            "device": dict(self.device),
            "center": list(self.center),
            "scale": list(self.scale),
            "coef": list(self.coef),
            "lo": self.lo,
            "hi": self.hi,
            "overhead_s": self.overhead_s,
        }
        if self.zlo is not None and self.zhi is not None:
            d["zlo"], d["zhi"] = list(self.zlo), list(self.zhi)
        if self.grid is not None:
            d["grid"] = self.grid.to_dict()
        if self.trees is not None:
            d["trees"] = self.trees.to_dict()
        return d


def _logpoly_from_dict(d: dict[str, Any]) -> LogPolyEta:
    g = d.get("grid")
    return LogPolyEta(
        d["basis"],
        {k: float(v) for k, v in d["device"].items()},
        tuple(float(x) for x in d["center"]),
        tuple(float(x) for x in d["scale"]),
        tuple(float(x) for x in d["coef"]),
        float(d.get("lo", 0.01)),
        float(d.get("hi", 1.5)),
        None if d.get("overhead_s") is None else float(d["overhead_s"]),
        None if g is None else _grid_from_dict(g),
        None if d.get("zlo") is None else tuple(float(x) for x in d["zlo"]),
        None if d.get("zhi") is None else tuple(float(x) for x in d["zhi"]),
        None if d.get("trees") is None else ResidualTrees.from_dict(d["trees"]),
    )


@dataclass(frozen=True, slots=True)
class SwitchEta:
    """Dispatch on a categorical feature (GEMM format code, KV bytes per element) to sub-models."""

    index: int
    models: dict[str, EtaModel]  # key: the feature value formatted with ``switch_key``
    default: str

    def pick(self, features: tuple[float, ...]) -> EtaModel:
        key = switch_key(features[self.index]) if len(features) > self.index else self.default
        return self.models.get(key) or self.models[self.default]

    def eta(self, features: tuple[float, ...]) -> float:
        return self.pick(features).eta(features)

    def eta_overhead_scalar(self, features: tuple[float, ...]) -> tuple[float, float | None]:
        return _eta_overhead_of(self.pick(features), features)

    def overhead(self, features: tuple[float, ...]) -> float | None:
        m = self.pick(features)
        return m.overhead(features) if hasattr(m, "overhead") else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": "switch",
            "index": self.index,
            "default": self.default,
            "models": {k: v.to_dict() for k, v in self.models.items()},
        }


#: A dispatch-tree node: a leaf ``(kernel,)`` or a split ``(dim, threshold, node if x ≤ threshold, node else)``.
DispatchNode = tuple


@dataclass(frozen=True, slots=True)
class DispatchRule:
    """Which kernel vLLM runs for a shape: a shallow threshold tree over the raw shape axes (:data:`RESIDUAL_COORDS`).

    Learned from measured rows (``calibrate.fit.dispatch.fit_dispatch_rule``): per GPU each shape ran exactly one
    kernel, chosen by the library from the shape (e.g. H100 block-scaled fp8: FlashInfer for m ≤ 16, DeepGEMM above,
    CUTLASS where n or k is not a multiple of 128), so thresholds on log m, n, k, heads, head_dim, window reproduce
    it.
    """

    root: DispatchNode

    def __call__(self, coords: np.ndarray) -> np.ndarray:
        """Kernel name per row of raw coordinates (rows × d)."""
        out = np.empty(len(coords), dtype=object)
        stack = [(self.root, np.arange(len(coords)))]
        while stack:
            node, idx = stack.pop()
            if len(node) == 1:
                out[idx] = node[0]
                continue
            dim, thr, lo, hi = node
            le = coords[idx, dim] <= thr
            stack += [(lo, idx[le]), (hi, idx[~le])]
        return out.astype(str) if len(out) else np.zeros(0, dtype=str)

    def scalar(self, coords: list[float]) -> str:
        node = self.root
        while len(node) != 1:
            dim, thr, lo, hi = node
            node = lo if coords[dim] <= thr else hi
        return str(node[0])

    def kernels(self) -> set[str]:
        out, stack = set(), [self.root]
        while stack:
            node = stack.pop()
            if len(node) == 1:
                out.add(str(node[0]))
            else:
                stack += [node[2], node[3]]
        return out

    def to_dict(self) -> Any:
        def enc(node: DispatchNode) -> Any:
            if len(node) == 1:
                return node[0]
            return {"dim": node[0], "le": round(node[1], 6), "lo": enc(node[2]), "hi": enc(node[3])}

        return enc(self.root)

    @classmethod
    def from_dict(cls, d: Any) -> DispatchRule:
        def dec(x: Any) -> DispatchNode:
            if isinstance(x, str):
                return (x,)
            return (int(x["dim"]), float(x["le"]), dec(x["lo"]), dec(x["hi"]))

        return cls(dec(d))


@dataclass(frozen=True, slots=True)
class DispatchEta:
    """One η model per kernel vLLM dispatches for a variant (target tier), picked by kernel name or by shape.

    The kernel that ran is known for measured rows (``kernel`` column) and used when given and known; the step
    model only knows shapes, so otherwise ``rule`` (learned from the training rows) names the kernel. Kernels
    share nothing: each has its own smooth η and residual lattice (a minority kernel, e.g. H100 FA4 at
    head_dim 512, no longer bends the majority's fit). ``pooled`` is a smooth model of all the variant's rows:
    what cross-generation transfer uses, since a GPU without measurements has no kernel information.
    """

    basis: str
    rule: DispatchRule
    models: dict[str, EtaModel]  # by kernel name
    default: str  # the kernel with most training rows
    pooled: EtaModel | None = None

    def kernel_of(self, features: tuple[float, ...], kernel: str | None = None) -> str:
        if kernel is not None and kernel in self.models:
            return kernel
        name = self.rule.scalar(RESIDUAL_COORDS_SCALAR[self.basis](features))
        return name if name in self.models else self.default

    def kernels_of(self, features: np.ndarray, kernels: np.ndarray | None = None) -> np.ndarray:
        """Kernel name per feature row: the given name where it has a model, else the dispatch rule's."""
        F = np.atleast_2d(np.asarray(features, dtype=float))
        out = self.rule(RESIDUAL_COORDS[self.basis](F)) if len(F) else np.zeros(0, dtype=str)
        out = np.where(np.isin(out, list(self.models)), out, self.default)
        if kernels is not None:
            given = np.asarray(kernels).astype(str)
            out = np.where(np.isin(given, list(self.models)), given, out)
        return out

    def pick(self, features: tuple[float, ...], kernel: str | None = None) -> EtaModel:
        return self.models[self.kernel_of(features, kernel)]

    def eta_and_overhead_array(
        self, features: np.ndarray, kernels: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        F = np.atleast_2d(np.asarray(features, dtype=float))
        names = self.kernels_of(F, kernels)
        eta, ovh = np.empty(len(F)), np.zeros(len(F))
        for name in np.unique(names):
            sel = names == name
            m = self.models[str(name)]
            if hasattr(m, "eta_and_overhead_array"):
                eta[sel], ovh[sel] = m.eta_and_overhead_array(F[sel])
            else:
                eta[sel] = [m.eta(tuple(f)) for f in F[sel]]
        return eta, ovh

    def eta_overhead_scalar(self, features: tuple[float, ...]) -> tuple[float, float | None]:
        return _eta_overhead_of(self.pick(features), features)

    def eta(self, features: tuple[float, ...]) -> float:
        return self.pick(features).eta(features)

    def overhead(self, features: tuple[float, ...]) -> float | None:
        m = self.pick(features)
        return m.overhead(features) if hasattr(m, "overhead") else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "form": "dispatch",
            "basis": self.basis,
            "default": self.default,
            "rule": self.rule.to_dict(),
            "models": {k: v.to_dict() for k, v in self.models.items()},
        }
        if self.pooled is not None:
            d["pooled"] = self.pooled.to_dict()
        return d


@dataclass(frozen=True, slots=True)
class EnsembleEta:
    """Weighted geometric mean of member models' η and fixed latency (cross-generation tier).

    log η = Σ wᵢ log ηᵢ, log overhead = Σ wᵢ log overheadᵢ with Σ wᵢ = 1; bounded by the members' bounds.
    """

    members: tuple[EtaModel, ...]
    weights: tuple[float, ...]

    def eta_and_overhead_array(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        F = np.atleast_2d(np.asarray(features, dtype=float))
        log_eta = np.zeros(len(F))
        log_ovh = np.zeros(len(F))
        for m, w in zip(self.members, self.weights, strict=True):
            if hasattr(m, "eta_and_overhead_array"):
                e, o = m.eta_and_overhead_array(F)
            else:
                e = np.array([m.eta(tuple(f)) for f in F])
                o = np.full(len(F), 0.0)
            log_eta += w * np.log(np.maximum(e, _TINY))
            log_ovh += w * np.log(np.maximum(o, 1e-12))
        return np.exp(log_eta), np.exp(log_ovh)

    def eta_overhead_scalar(self, features: tuple[float, ...]) -> tuple[float, float]:
        log_eta = log_ovh = 0.0
        for m, w in zip(self.members, self.weights, strict=True):
            e, o = _eta_overhead_of(m, features)
            log_eta += w * math.log(max(e, _TINY))
            log_ovh += w * math.log(max(o or 0.0, 1e-12))
        return math.exp(log_eta), math.exp(log_ovh)

    def eta(self, features: tuple[float, ...]) -> float:
        return self.eta_overhead_scalar(features)[0]

    def overhead(self, features: tuple[float, ...]) -> float | None:
        return self.eta_overhead_scalar(features)[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": "ensemble",
            "weights": list(self.weights),
            "members": [m.to_dict() for m in self.members],
        }


def _eta_overhead_of(model: EtaModel, features: tuple[float, ...]) -> tuple[float, float | None]:
    """(η, own fixed latency or None) of any η model at one feature tuple, pure Python where possible."""
    if isinstance(model, LogPolyEta):
        e, o = model.eta_overhead_scalar(features)
        return e, (None if model.overhead_s is None else o)
    if isinstance(model, SwitchEta | EnsembleEta | DispatchEta):
        return model.eta_overhead_scalar(features)
    return model.eta(features), None


def decode_serial_floor_s(features: Sequence[float], num_sms: int, cta_bytes_per_s: float) -> float:
    """Least time of a decode attention kernel that streams the KV cache unsplit, one CTA per (sequence, KV head).

    FlashAttention-2's decode (vLLM on Ampere and Ada) does so when every query head has its own KV head: no
    split-KV, no GQA packing, so a CTA reads a whole context alone at a few tens of GB/s (A100 ~22, L40S ~28),
    and 1 head × 131k tokens takes 3.0 ms on the A100 against a 33 µs DRAM roof, whatever the head count up to
    the SM count. GQA shapes split and reach the roof; FA3 (Hopper) never shows the regime. The time is the
    per-CTA stream of one (mean) context times the waves of CTAs over the SMs; ``features`` are those of
    ``attention_decode_kernel`` (sequences, mean context, q heads, KV heads, head_dim, KV bytes, window).
    """
    batch, ctx, q_heads, kv_heads, head_dim, kv_bytes = (float(x) for x in features[:6])
    window = float(features[6]) if len(features) > 6 else 0.0
    if q_heads != kv_heads or batch <= 0 or cta_bytes_per_s <= 0:
        return 0.0
    if window > 0:
        ctx = min(ctx, window)
    waves = math.ceil(batch * kv_heads / max(num_sms, 1))
    return waves * ctx * 2.0 * head_dim * kv_bytes / cta_bytes_per_s


def switch_key(value: float) -> str:
    """Canonical text key of a categorical feature value (``1.0`` → ``"1"``)."""
    return f"{float(value):g}"


ETA_FORMS: dict[str, Any] = {
    "logistic": lambda d: LogisticEta(d["lo"], d["hi"], d["x0"], d.get("slope", 1.0), d.get("index", 0)),
    "constant": lambda d: ConstantEta(d["value"]),
    "logpoly": _logpoly_from_dict,
    "ensemble": lambda d: EnsembleEta(
        tuple(eta_model_from_dict(m) for m in d["members"]), tuple(float(w) for w in d["weights"])
    ),
    "dispatch": lambda d: DispatchEta(
        str(d["basis"]),
        DispatchRule.from_dict(d["rule"]),
        {k: eta_model_from_dict(v) for k, v in d["models"].items()},
        str(d["default"]),
        None if d.get("pooled") is None else eta_model_from_dict(d["pooled"]),
    ),
    "switch": lambda d: SwitchEta(
        int(d["index"]), {k: eta_model_from_dict(v) for k, v in d["models"].items()}, str(d["default"])
    ),
}


def eta_model_from_dict(d: dict[str, Any]) -> EtaModel:
    try:
        return ETA_FORMS[d["form"]](d)
    except KeyError as exc:
        raise ValueError(f"unknown η model form {d.get('form')!r}; known: {sorted(ETA_FORMS)}") from exc


@dataclass(slots=True)
class Calibration:
    """Everything fitted (or defaulted) for one GPU."""

    hardware: str
    tier: str  # "default" | "target-measured" | "cross-generation"
    eta: dict[str, EtaModel]
    overhead_s: dict[str, float]  # fixed per-kernel GPU latency by family
    eta_max: float = 1.0  # largest η seen in calibration (physics floor)
    eta_floor: float = 0.02
    comm: dict[str, CommModel] = field(default_factory=dict)  # by backend name
    host: HostModel = field(default_factory=HostModel)
    launch: LaunchModel = field(default_factory=LaunchModel)
    source: str = ""
    licence: str = ""
    notes: str = ""
    #: Per decode variant (KV bytes key, as in ``SwitchEta``): the streaming bandwidth of one CTA on the decode
    #: kernel's unsplit path (:func:`decode_serial_floor_s`); absent: the kernel splits the KV cache.
    decode_cta_bytes_per_s: dict[str, float] = field(default_factory=dict)
    # init=False: dataclasses.replace() then starts an empty memo instead of sharing the original's (a copy with
    # another eta_max or η model would answer from the old one's cache)
    _memo: dict[tuple[str, tuple[float, ...]], tuple[float, float | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def kernel_eta(self, family: str, features: tuple[float, ...]) -> float:
        """η of one kernel, clipped to [eta_floor, eta_max] (memoized: the step model asks repeatedly)."""
        return self._eta_overhead(family, features)[0]

    def kernel_overhead_s(self, family: str, features: tuple[float, ...] | None = None) -> float:
        """Fixed per-launch latency; a fitted η model may carry its own (per GEMM format, per shape)."""
        if features is not None:
            own = self._eta_overhead(family, features)[1]
            if own is not None:
                return own
        return self.overhead_s.get(family, self.overhead_s.get("default", 0.0))

    def decode_floor_s(self, features: Sequence[float], num_sms: int) -> float:
        """Least time of one decode attention kernel (features of ``attention_decode_kernel``); 0 if none."""
        if not self.decode_cta_bytes_per_s or features[2] != features[3]:   # GQA: the split path
            return 0.0
        bw = self.decode_cta_bytes_per_s.get(switch_key(features[5]))
        return decode_serial_floor_s(features, num_sms, bw) if bw else 0.0

    def _eta_overhead(self, family: str, features: tuple[float, ...]) -> tuple[float, float | None]:
        key = (family, features)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        model = self.eta.get(family) or self.eta["default"]
        eta, own = _eta_overhead_of(model, features)
        if len(self._memo) > 200_000:   # bounded: decode contexts make many distinct keys
            self._memo.clear()
        out = (min(max(eta, self.eta_floor), self.eta_max), own)
        self._memo[key] = out
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "tier": self.tier,
            "source": self.source,
            "licence": self.licence,
            "notes": self.notes,
            "eta_max": self.eta_max,
            "eta_floor": self.eta_floor,
            "eta": {k: v.to_dict() for k, v in self.eta.items()},
            "overhead_s": dict(self.overhead_s),
            "comm": {k: v.to_dict() for k, v in self.comm.items()},
            "host": self.host.to_dict(),
            "launch": self.launch.to_dict(),
            **({"decode_cta_bytes_per_s": dict(self.decode_cta_bytes_per_s)} if self.decode_cta_bytes_per_s else {}),
        }


def calibration_from_dict(d: dict[str, Any]) -> Calibration:
    return Calibration(
        hardware=d["hardware"],
        tier=d["tier"],
        eta={k: eta_model_from_dict(v) for k, v in d["eta"].items()},
        overhead_s={k: float(v) for k, v in d["overhead_s"].items()},
        eta_max=float(d.get("eta_max", 1.0)),
        eta_floor=float(d.get("eta_floor", 0.02)),
        comm={k: CommModel.from_dict(v) for k, v in d.get("comm", {}).items()},
        host=HostModel(**d.get("host", {})),
        launch=LaunchModel(**d.get("launch", {})),
        source=d.get("source", ""),
        licence=d.get("licence", ""),
        notes=d.get("notes", ""),
        decode_cta_bytes_per_s={k: float(v) for k, v in d.get("decode_cta_bytes_per_s", {}).items()},
    )


def default_calibration(hardware: str) -> Calibration:
    """Defaults for a GPU with no fitted table.

    Numbers are round values typical of current NVIDIA datacenter GPUs running vLLM's kernels:
    GEMMs reach ~85% of the DRAM roof when memory-bound and ~80% of peak when large; attention
    kernels are less efficient at small shapes; elementwise kernels stream at ~70% of bandwidth;
    every kernel costs a few µs of fixed latency. They are placeholders for fitted tables, not fits.
    """
    eta: dict[str, EtaModel] = {
        "gemm": ConstantEta(0.85),
        "moe_gemm": ConstantEta(0.6),
        "attn_prefill": LogisticEta(lo=0.2, hi=0.7, x0=512.0, slope=1.0, index=1),
        "attn_decode": LogisticEta(lo=0.3, hi=0.8, x0=256.0, slope=1.0, index=1),
        "default": ConstantEta(0.7),
    }
    return Calibration(
        hardware=hardware,
        tier="default",
        eta=eta,
        overhead_s={"default": 2.0e-6, "gemm": 3.0e-6, "attn_prefill": 5.0e-6, "attn_decode": 5.0e-6},
        eta_max=1.0,
        comm={
            "nccl": CommModel(alpha_s=1.5e-5, bus_bytes_per_s_fraction=0.7),
            "custom": CommModel(alpha_s=6.0e-6, bus_bytes_per_s_fraction=0.6),
        },
        source="kernelsight built-in defaults (no measurements)",
        licence="Apache-2.0",
    )


__all__ = [
    "BASES",
    "Calibration",
    "ConstantEta",
    "DispatchEta",
    "DispatchRule",
    "EnsembleEta",
    "EtaModel",
    "LogPolyEta",
    "LogisticEta",
    "ResidualGrid",
    "SwitchEta",
    "basis_matrix",
    "cache_gain_ratio",
    "calibration_from_dict",
    "decode_serial_floor_s",
    "default_calibration",
    "eta_model_from_dict",
    "quadratic_design",
    "switch_key",
    "transfer_eta_factor",
]
