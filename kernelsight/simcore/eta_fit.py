"""Fit η (and the fixed per-kernel latency) from kernel measurements: pure numpy, no I/O.

Each measured row is mapped onto the same :class:`~kernelsight.simcore.kernels.Kernel` the step model
builds (so calibration and simulation share FLOPs, bytes and tiles), giving its roofline time ``roof_s``
on the GPU. Per family and per categorical variant (GEMM format, KV-cache bytes) we then fit

    latency_s ≈ roof_s / η(features) + overhead_s

with η of the :class:`~kernelsight.simcore.calibration.LogPolyEta` form (bounded sigmoid of a quadratic in
device-normalized log-features). The loss is the squared log-ratio of predicted to measured latency
— i.e. relative error, what MAPE judges — minimized by Levenberg–Marquardt with a small ridge on the
polynomial terms (keeps extrapolation tame). Duplicate measurements are simply more samples.

Kernels (target tier): when the measurements name the vLLM kernel that ran (``kernel`` column) and a
variant ran several (H100 block-scaled fp8: FlashInfer / DeepGEMM / CUTLASS; H100 bf16 attention: FA3 / FA4
at head_dim 512; L40S fp8 KV: FlashInfer / Triton), each kernel gets its own smooth η and residual lattice
(:class:`~kernelsight.simcore.calibration.DispatchEta`), and a shallow threshold tree on the raw shape axes,
learned from the same rows, names the kernel when only the shape is known (the simulator, shape-only files).
Measured on the 25 %/75 % split of ``benchmarks/kernel_accuracy.py``: own smooth η per kernel beat a shared
smooth η with per-kernel lattices (H100 GEMM 5.0 vs 5.2 %, decode 3.9 vs 4.0 %).

Target tier: a residual lattice g over the sweep's raw shape axes (GEMM: m, n, k, m % 16; attention: seqs
(decode: seqs × KV heads), tokens, q heads (decode: GQA group), KV heads, head_dim, window — in logs)
multiplies the time by exp(g). Why: what the smooth form misses is library kernel selection (tile configs,
split-K, GQA packing switched off by a window, FA2 vs FlashInfer vs Triton by head_dim), a property of the raw
shape that jumps between neighbouring grid values and does not transfer across GPUs. Form: multilinear on
knots at the measured values (merged where dense), penalized least squares (second differences fill unmeasured
knots from their neighbours, a ridge pulls toward 0), attention first through coarse sub-lattices that pool
the broad trends; the knot spacing along a head axis is chosen per fit on held-out training rows, and a kernel
that ignores a window its context fits in shares those shapes with full attention. Before the lattice, boosted
regression trees on the same axes (:mod:`~kernelsight.simcore.residual_trees`) take the smooth model's residual:
a tree split sits exactly at a kernel switch, which the lattice would blur across a knot interval; g is their
sum. Bounded: edge values hold outside the lattice, |g| ≤ 3, and η stays ≤ eta_max.
Measured floor (``benchmarks/measurement_floor.py``): the residual varies at the grid spacing, not by noise
(repeated measurements agree to 0.5–1.2%, but a GEMM row's two immediate grid neighbours, all measured,
predict it only to 4.2–6.5% along the best axis), so at 25% training density interpolation alone does not reach
the paper's 3.8%; the trees, which pool a switch over every row on its side, do better than neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import (
    RESIDUAL_COORDS,
    WINDOW_COLUMNS,
    Calibration,
    ConstantEta,
    DispatchEta,
    DispatchRule,
    EnsembleEta,
    EtaModel,
    LogPolyEta,
    ResidualGrid,
    SwitchEta,
    basis_matrix,
    decode_serial_floor_s,
    default_calibration,
    knot_coordinates,
    quadratic_design,
    residual_coordinates,
    switch_key,
    window_binds,
)
from kernelsight.simcore.comm import CommModel
from kernelsight.simcore.comm_fit import fit_comm
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.residual_trees import fit_residual_trees
from kernelsight.simcore.roofline import roofline_s

Columns = Mapping[str, np.ndarray]

KERNEL_FAMILIES: tuple[str, ...] = ("gemm", "attn_prefill", "attn_decode")
#: Bytes per element of the dtype names a measurement's ``kv_dtype`` may hold ("auto": vLLM's name for the model's
#: own 16-bit dtype).
ELEMENT_BYTES = {
    "auto": 2.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
    "fp32": 4.0,
    "float": 4.0,
}
#: Which feature selects the sub-model (categorical variant) per family.
SWITCH_INDEX = {"gemm": 3, "attn_prefill": 6, "attn_decode": 5}
ETA_LO, ETA_HI = 0.01, 1.5
_RIDGE = 1e-3


# ------------------------------------------------------------------------------------------------
# measured rows → kernels
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelRows:
    """Per-row kernel quantities of one family (vectors of equal length)."""

    family: str
    flops: np.ndarray
    bytes_moved: np.ndarray
    tiles: np.ndarray
    compute_dtype: np.ndarray  # str
    features: np.ndarray  # rows × nf
    variant: np.ndarray  # str: sub-model key (switch_key of the categorical feature)
    kernel: np.ndarray | None = None  # str: the vLLM kernel that ran (``kernel`` column), when known

    def __len__(self) -> int:
        return len(self.flops)


def element_bytes(dtype: str) -> float:
    try:
        return ELEMENT_BYTES[dtype]
    except KeyError as exc:
        raise ValueError(f"unknown element dtype {dtype!r}") from exc


def _row_kernel(family: str, key: tuple) -> K.Kernel:
    if family == "gemm":
        dtype, m, n, k = key
        w = 2.0 if dtype in ("bf16", "fp16") else 1.0
        return K.gemm_kernel("gemm", int(m), int(n), int(k), dtype, w, 2.0)
    if family == "attn_prefill":
        batch, seq, qh, kvh, hd, kv_dtype, window = key
        chunks = (K.PrefillChunk(int(seq), 0, True),) * int(batch)
        return K.attention_prefill_kernel(
            chunks, int(qh), int(kvh), int(hd), 2.0, element_bytes(kv_dtype), int(window) or None
        )
    if family == "attn_decode":
        batch, cached, qh, kvh, hd, kv_dtype, window = key
        return K.attention_decode_kernel(
            int(batch),
            int(batch) * (int(cached) + 1),
            int(qh),
            int(kvh),
            int(hd),
            2.0,
            element_bytes(kv_dtype),
            window=int(window) or None,
        )
    raise ValueError(f"no kernel mapping for family {family!r}")


_KEY_COLUMNS = {
    "gemm": ("dtype", "m", "n", "k"),
    "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
    "attn_decode": ("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
}


def kernel_rows(family: str, cols: Columns) -> KernelRows:
    """Map measured rows to kernels via the step model's constructors (deduplicated: shapes repeat).

    The ``kernel`` column (the vLLM kernel that ran), when present, is carried along as ``KernelRows.kernel``.
    """
    names = _KEY_COLUMNS[family]
    n = len(cols[names[0]])
    keys = list(zip(*(cols[c].tolist() for c in names), strict=True))
    uniq: dict[tuple, int] = {}
    inverse = np.empty(n, dtype=np.int64)
    for i, key in enumerate(keys):
        inverse[i] = uniq.setdefault(key, len(uniq))
    kernels = [_row_kernel(family, key) for key in uniq]
    if not kernels:
        nf = {"gemm": 4, "attn_prefill": 8, "attn_decode": 7}[family]
        z = np.zeros(0)
        return KernelRows(family, z, z, z, np.zeros(0, dtype=str), np.zeros((0, nf)), np.zeros(0, dtype=str))
    flops = np.array([k.flops for k in kernels])[inverse]
    bytes_moved = np.array([k.bytes_moved for k in kernels])[inverse]
    tiles = np.array([k.tiles for k in kernels], dtype=float)[inverse]
    dtype = np.array([k.dtype for k in kernels])[inverse]
    feats = np.array([k.features for k in kernels], dtype=float)[inverse]
    variant = np.array([switch_key(f) for f in feats[:, SWITCH_INDEX[family]]]) if n else np.zeros(0, str)
    kernel = np.asarray(cols["kernel"]).astype(str) if "kernel" in cols else None
    return KernelRows(family, flops, bytes_moved, tiles, dtype, feats, variant, kernel)


def roofline_rows_s(rows: KernelRows, hw: HardwareSpec) -> np.ndarray:
    """Roofline seconds of every row on ``hw`` (per-row compute dtype peak)."""
    out = np.empty(len(rows))
    for dt in np.unique(rows.compute_dtype):
        sel = rows.compute_dtype == dt
        out[sel] = roofline_s(
            rows.flops[sel],
            rows.bytes_moved[sel],
            rows.tiles[sel],
            hw.peak_flops_per_s(str(dt)),
            hw.usable_mem_bytes_per_s,
            hw.num_sms,
        )
    return out


# ------------------------------------------------------------------------------------------------
# device constants the bases normalize by
# ------------------------------------------------------------------------------------------------
def device_constants(family: str, variant: str, hw: HardwareSpec) -> dict[str, float]:
    """Spec numbers a family's basis divides by: machine balance of the variant's dtype, SMs, L2."""
    dev = {"num_sms": float(hw.num_sms), "l2_bytes": float(hw.l2_bytes)}
    if family == "gemm":
        code = int(float(variant))
        fmt = {c: f for f, c in K.GEMM_FORMAT_CODES.items() if f != "fp16"}.get(code, "bf16")
        compute = K.GEMM_COMPUTE_DTYPE[fmt]
        one_byte = fmt in ("fp8", "fp8_block", "int8")
        dev.update(
            balance=hw.peak_flops_per_s(compute) / hw.usable_mem_bytes_per_s,
            in_bytes=1.0 if one_byte else 2.0,
            weight_bytes=1.0 if one_byte else 2.0,
            out_bytes=2.0,
        )
    else:
        dev["balance"] = hw.peak_flops_per_s("bf16") / hw.usable_mem_bytes_per_s
    return dev


def basis_name(family: str) -> str:
    return {"gemm": "gemm", "lm_head": "gemm", "moe_gemm": "gemm"}.get(family, family)


# ------------------------------------------------------------------------------------------------
# the nonlinear least-squares fit of one sub-model
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class SubFit:
    """Result of fitting one (family, variant): the model and its training-set diagnostics."""

    model: LogPolyEta
    n_rows: int
    train_mape: float
    eta_max_seen: float
    cv_mape: float = math.inf  # held-out MAPE of the chosen complexity (small samples only; inf: not measured)


def _sigmoid(s: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(s, -40.0, 40.0)))


def fit_logpoly(
    z: np.ndarray,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    *,
    lo: float = ETA_LO,
    hi: float = ETA_HI,
    ridge: float = _RIDGE,
    iters: int = 60,
    overhead_s: float | None = None,
    center: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Levenberg–Marquardt on Σ (log pred − log meas)², pred = roof/η(z) + overhead.

    Returns (β, overhead_s, center, scale). ``overhead_s`` given → held fixed (not fitted).
    """
    center = z.mean(axis=0) if center is None else center
    scale = np.maximum(z.std(axis=0), 1e-6) if scale is None else scale
    X = quadratic_design((z - center) / scale)
    p = X.shape[1]
    log_lat = np.log(lat_s)
    fit_ovh = overhead_s is None
    ovh0 = float(np.quantile(lat_s, 0.02)) * 0.8 if fit_ovh else float(overhead_s)
    # Initial β: linear LS of the logit of the η implied by subtracting the initial overhead.
    eta_star = roof_s / np.maximum(lat_s - ovh0, 0.05 * lat_s)
    u = np.clip((eta_star - lo) / (hi - lo), 1e-4, 1 - 1e-4)
    reg = ridge * len(z) * np.eye(p)
    reg[0, 0] = 0.0
    beta = np.linalg.solve(X.T @ X + reg + 1e-9 * np.eye(p), X.T @ np.log(u / (1 - u)))
    theta = np.log(max(ovh0, 1e-9))

    def evaluate(b: np.ndarray, th: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        sig = _sigmoid(X @ b)
        eta = lo + (hi - lo) * sig
        pred = roof_s / eta + np.exp(th)
        r = np.log(pred) - log_lat
        loss = float(r @ r) + ridge * len(z) * float(b[1:] @ b[1:])
        return r, eta, sig, loss

    r, eta, sig, loss = evaluate(beta, theta)
    mu = 1e-3
    for _ in range(iters):
        pred = np.exp(r + log_lat)
        d_eta = (hi - lo) * sig * (1.0 - sig)
        g = -(roof_s / eta**2) * d_eta / pred  # d log pred / d s
        J = X * g[:, None]
        if fit_ovh:
            J = np.column_stack([J, np.exp(theta) / pred])
        q = J.shape[1]
        R = np.zeros((q, q))
        R[1:p, 1:p] = ridge * len(z) * np.eye(p - 1)
        A = J.T @ J + R
        grad = J.T @ r
        grad[:p] += R[:p, :p] @ beta
        improved = False
        for _ in range(8):
            step = np.linalg.solve(A + mu * np.diag(np.diag(A) + 1e-12), -grad)
            nb = beta + step[:p]
            nt = theta + (step[p] if fit_ovh else 0.0)
            nr, neta, nsig, nloss = evaluate(nb, nt)
            if nloss < loss:
                rel = (loss - nloss) / max(loss, 1e-300)
                beta, theta, r, eta, sig, loss = nb, nt, nr, neta, nsig, nloss
                mu = max(mu / 3.0, 1e-9)
                improved = True
                break
            mu *= 4.0
        if not improved or rel < 1e-7:
            break
    return beta, float(np.exp(theta)), center, scale


def lattice_knots(x: np.ndarray, min_gap: float) -> tuple[float, ...]:
    """Knots along one log-feature: its distinct measured values, merged while closer than ``min_gap``.

    Placing knots at the sweep grid's own values means a shape of the grid is corrected by its measured
    neighbours along each axis (interpolation, not a smooth law); ``min_gap`` caps the lattice size.
    ``min_gap < 0`` asks for a regular lattice with knots ``|min_gap|`` apart instead.
    """
    u = np.unique(np.round(x, 6))
    if len(u) == 1:
        return (float(u[0]) - 0.5, float(u[0]) + 0.5)
    if min_gap < 0:  # a regular lattice, |min_gap| apart, spanning the measured range
        count = int(max(2, np.ceil((u[-1] - u[0]) / -min_gap - 1e-9) + 1))
        return tuple(float(v) for v in np.linspace(u[0], u[-1], count))
    if min_gap <= 0:
        return tuple(float(v) for v in u)
    kept = [float(u[0])]
    for v in u[1:-1]:
        if v - kept[-1] >= min_gap and u[-1] - v >= 0.5 * min_gap:
            kept.append(float(v))
    kept.append(float(u[-1]))
    return tuple(kept)


def fit_residual_grid(
    z: np.ndarray,
    dims: tuple[int, ...],
    log_ratio: np.ndarray,
    weight: np.ndarray,
    min_gaps: tuple[float, ...] | None = None,
    smooth: float = 0.3,
    ridge: float = 1e-3,
    cg_iters: int = 300,
    coords: str = "basis",
) -> ResidualGrid:
    """Penalized least-squares lattice of log time corrections over columns ``dims`` of ``z``.

    Minimizes Σ w (interp(v) − r)² + smooth·(N/K)·‖Δ²v‖² + ridge·(N/K)·‖v‖² by Jacobi-preconditioned
    conjugate gradients (matrix-free: the interpolation acts through two ``bincount`` calls on its nonzero
    (row, knot, weight) triplets). The second-difference penalty fills knots no sample touches by smooth
    interpolation from their neighbours; the ridge pulls far-off regions back to 0, i.e. to the smooth model.
    """
    zs = z[:, list(dims)]
    n, d = zs.shape
    gaps = min_gaps if min_gaps is not None else (0.0,) * d
    knots = tuple(lattice_knots(zs[:, j], gaps[j]) for j in range(d))
    shape = tuple(len(k) for k in knots)
    size = int(np.prod(shape))
    idx0, frac = knot_coordinates(zs, knots)
    rows_l, cols_l, ws_l = [], [], []
    for corner in range(1 << d):
        w = np.ones(n)
        flat = np.zeros(n, dtype=np.int64)
        for j in range(d):
            bit = (corner >> j) & 1
            w = w * (frac[:, j] if bit else 1.0 - frac[:, j])
            flat = flat * shape[j] + np.minimum(idx0[:, j] + bit, shape[j] - 1)
        keep = w > 1e-12  # grid points sit on knots: most corners carry no weight
        rows_l.append(np.flatnonzero(keep))
        cols_l.append(flat[keep])
        ws_l.append(w[keep])
    rows, cols, ws = np.concatenate(rows_l), np.concatenate(cols_l), np.concatenate(ws_l)
    scale_pen = n / size

    def interp(v: np.ndarray) -> np.ndarray:
        return np.bincount(rows, ws * v[cols], minlength=n)

    def interp_t(r: np.ndarray) -> np.ndarray:
        return np.bincount(cols, ws * r[rows], minlength=size)

    def penalty(v: np.ndarray) -> np.ndarray:
        V = v.reshape(shape)
        out = np.zeros(shape)
        for j in range(d):
            if shape[j] < 3:
                continue
            # (Δ²)ᵀΔ² along axis j on views: ~4× faster than diff/pad/diff (it dominated the CG at 25 % rows)
            Vj, oj = np.moveaxis(V, j, 0), np.moveaxis(out, j, 0)
            d2 = Vj[2:] - 2.0 * Vj[1:-1] + Vj[:-2]
            oj[:-2] += d2
            oj[1:-1] -= 2.0 * d2
            oj[2:] += d2
        return out.ravel()

    def matvec(v: np.ndarray) -> np.ndarray:
        return interp_t(weight * interp(v)) + scale_pen * (smooth * penalty(v) + ridge * v)

    # Jacobi preconditioner: data diagonal + the penalty's interior diagonal (6 per axis with ≥ 3 knots)
    pen_diag = 6.0 * sum(1 for s in shape if s >= 3)
    m_inv = 1.0 / (np.bincount(cols, weight[rows] * ws * ws, minlength=size) + scale_pen * (smooth * pen_diag + ridge))
    rhs = interp_t(weight * log_ratio)
    v = np.zeros(size)
    r = rhs.copy()
    zr = m_inv * r
    pvec = zr.copy()
    rz = float(r @ zr)
    tol = 1e-10 * max(float(rhs @ rhs), 1e-30)
    for _ in range(cg_iters):
        if float(r @ r) <= tol:
            break
        ap = matvec(pvec)
        alpha = rz / float(pvec @ ap)
        v += alpha * pvec
        r -= alpha * ap
        zr = m_inv * r
        rz_new = float(r @ zr)
        pvec = zr + (rz_new / rz) * pvec
        rz = rz_new
    return ResidualGrid(tuple(dims), knots, tuple(v.tolist()), coords)


#: Raw shape axes (:data:`~kernelsight.simcore.calibration.RESIDUAL_COORDS`) the target-tier residual lattice
#: spans, per family: GEMM (log m, n, k, m % 16 == 0); attention (log seqs, tokens, q heads, KV heads,
#: head_dim, 1 + window) — every axis of the sweep, so e.g. the window (FA2 on the L40S stops packing GQA
#: heads with a window: decode time ∝ batch × q heads instead of × KV heads) gets its own knots.
#: Decode spans the GQA group (column 6: q / KV heads) instead of q heads: the same information on another
#: lattice. Why: decode kernels switch path at group 1 (A100 FA2 with q heads = KV heads at long contexts runs
#: up to ~90× its roofline, 1 head × 131k tokens: 3.0 ms vs 33 µs, while GQA shapes next to it stay near it),
#: a diagonal of the (q, KV) plane that a lattice on those axes smears into its GQA neighbours. Measured on
#: the 25 %/75 % split, seeds 0 / 1: A100 decode 7.86 / 7.89 → 7.35 / 7.23 %; prefill got worse (4.78 → 4.83).
#: Decode also spans log(seqs × KV heads) (column 7) instead of log seqs: the (sequence, KV head) pairs are what
#: a decode kernel spreads over the SMs, so shapes with the same pair count share a coordinate and a lattice
#: along it pools them. Seeds 0 / 1, decode: A100 6.57 / 6.73 → 6.18 / 6.41 %, L40S 7.65 / 7.70 → 7.28 / 7.46 %,
#: H100 3.18 / 3.29 → 3.17 / 3.23 %. (The prefill analogue, seqs × q heads, won on two GPUs and lost on the A100.)
GRID_DIMS = {"gemm": (0, 1, 2, 3), "attn_prefill": (0, 1, 2, 3, 4, 5), "attn_decode": (7, 1, 6, 3, 4, 5)}
#: Largest |log(measured / smooth)| a lattice is fitted to (outliers beyond it are clipped).
GRID_FIT_CLIP = 2.0
#: Smallest log-gap between lattice knots per dim (0: a knot at every measured value; < 0: a regular
#: lattice that many log units apart, e.g. −ln2/2 = two knots per octave). Chosen on other splits than the
#: benchmark's: per-value knots overfit GEMMs (neighbouring m differ by kernel choice, not smoothly), while
#: attention wants a knot at every measured value except the dense head-count axes (merged to ~1 per 0.6;
#: decode: the group axis).
_OCT2 = -math.log(2.0) / 2.0
GRID_MIN_GAPS = {
    "gemm": (_OCT2, _OCT2, _OCT2, 0.0),
    "attn_prefill": (0.0, 0.0, 0.6, 0.6, 0.0, 0.0),
    "attn_decode": (0.0, 0.0, 0.6, 0.0, 0.0, 0.0),
}
#: Second-difference penalty weight per family (same selection as the gaps).
GRID_SMOOTH = {"gemm": 0.3, "attn_prefill": 0.1, "attn_decode": 0.1}
#: Coarse sub-lattices fitted before the full one (attention: (seqs, tokens, window) and (heads, head_dim,
#: window)): they pool the broad trends over many rows, so the sparse 6-D lattice only adds interactions.
GRID_STAGES: dict[str, tuple[tuple[int, ...], ...]] = {
    "attn_prefill": ((0, 1, 5), (2, 3, 4, 5)),
    "attn_decode": ((7, 1, 5), (6, 3, 4, 5)),
}


def _fold_stages(full: ResidualGrid, stages: list[ResidualGrid]) -> ResidualGrid:
    """One lattice equal to ``full`` + Σ stages (each stage's dims ⊂ full's, on the same knots)."""
    if not stages:
        return full
    total = np.asarray(full.values, dtype=float).reshape(full.shape)
    for g in stages:
        pos = [full.dims.index(d) for d in g.dims]
        if pos != sorted(pos) or any(g.knots[i] != full.knots[p] for i, p in enumerate(pos)):
            raise ValueError("a stage lattice must share the full lattice's knots (dims in the same order)")
        view = np.asarray(g.values, dtype=float).reshape(g.shape)
        shape = [1] * len(full.dims)
        for i, p in enumerate(pos):
            shape[p] = g.shape[i]
        total = total + view.reshape(shape)
    return replace(full, values=tuple(total.ravel().tolist()))


def fit_submodel(
    family: str,
    variant: str,
    rows: KernelRows,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    hw: HardwareSpec,
    *,
    residual_grid: bool = False,
    grid_rounds: int = 1,
    spill_center: float | None = None,
) -> SubFit:
    """Fit η (+ overhead) of one family variant on one GPU (``spill_center`` given: decode's L2 step not searched)."""
    dev = device_constants(family, variant, hw)
    if family == "attn_decode":
        dev["l2_spill_center"] = (
            fit_spill_center(rows.features, dev, roof_s, lat_s) if spill_center is None else spill_center
        )
    z = basis_matrix(basis_name(family), rows.features, dev)
    level, cv_mape = FULL_COMPLEXITY if residual_grid else SMOOTH_COMPLEXITY, math.inf
    if len(z) < SELECT_MAX_ROWS:
        levels = COMPLEXITY_LEVELS if residual_grid else tuple(c for c in COMPLEXITY_LEVELS if not c.trees)
        level, cv_mape = choose_complexity(family, rows.features, dev, z, roof_s, lat_s, levels)
    model = _fit_at_level(family, dev, z, roof_s, lat_s, rows.features, level, grid_rounds)
    eta, ovh_rows = model.from_basis(z, rows.features)
    pred = roof_s / eta + ovh_rows
    return SubFit(model, len(z), float(np.mean(np.abs(pred - lat_s) / lat_s)), float(eta.max()), cv_mape)


@dataclass(frozen=True)
class Complexity:
    """How much a sub-model may bend to its rows: the smooth fit's ridge and which residual stages it gets."""

    ridge: float
    trees: bool
    lattice: bool


#: The model every sweep of at least SELECT_MAX_ROWS rows gets: smooth η, boosted trees, then the lattice.
FULL_COMPLEXITY = Complexity(_RIDGE, True, True)
#: ... and without the residual stages (``residual_grid=False``).
SMOOTH_COMPLEXITY = Complexity(_RIDGE, False, False)
#: Candidates for smaller samples, simplest first. No lattice: its knots sit at every measured value of 6 axes, so
#: it costs by the grid, not the rows (~1 s a fit even on 50 rows), and a sample this small leaves most cells empty.
COMPLEXITY_LEVELS = (
    Complexity(1e-1, False, False),
    Complexity(_RIDGE, False, False),
    Complexity(_RIDGE, True, False),
)
#: Sub-models with fewer rows pick their complexity by cross-validation (a handful of rows cannot pin a quadratic
#: in 5–8 log-features plus boosted trees and a lattice: fitted on 100 rows, they interpolate the rows exactly and
#: miss unseen shapes by 10–100×). From a few hundred rows on, the full model is the better on the A100 and L40S
#: (held-out error of 100, 300 and 1000-row samples of their GEMM, prefill and decode tables).
SELECT_MAX_ROWS = 500
SELECT_FOLDS = 5


def _fit_at_level(family: str, dev: dict[str, float], z: np.ndarray, roof_s: np.ndarray, lat_s: np.ndarray,
                  features: np.ndarray, level: Complexity, grid_rounds: int = 1) -> LogPolyEta:
    beta, ovh, center, scale = fit_logpoly(z, roof_s, lat_s, ridge=level.ridge)
    model = LogPolyEta(
        basis_name(family),
        dev,
        tuple(center.tolist()),
        tuple(scale.tolist()),
        tuple(beta.tolist()),
        ETA_LO,
        ETA_HI,
        ovh,
        zlo=tuple(z.min(axis=0).tolist()),
        zhi=tuple(z.max(axis=0).tolist()),
    )
    if level.trees or level.lattice:
        model = add_residual_grid(model, family, z, roof_s, lat_s, rounds=grid_rounds, features=features,
                                  residual_trees=level.trees, lattice=level.lattice)
    return model


def choose_complexity(family: str, features: np.ndarray, dev: dict[str, float], z: np.ndarray, roof_s: np.ndarray,
                      lat_s: np.ndarray, levels: tuple[Complexity, ...] = COMPLEXITY_LEVELS
                      ) -> tuple[Complexity, float]:
    """The level of ``levels`` with the least MAPE on held-out rows (deterministic k-fold), and that MAPE (inf when
    there are too few rows to hold any out: then the simplest)."""
    n = len(z)
    if n < 2 * SELECT_FOLDS:
        return levels[0], math.inf
    fold = np.random.default_rng(0).permutation(n) % SELECT_FOLDS
    best, best_err = levels[-1], math.inf
    for level in levels:
        ape = np.empty(n)
        for k in range(SELECT_FOLDS):
            tr, te = fold != k, fold == k
            m = _fit_at_level(family, dev, z[tr], roof_s[tr], lat_s[tr], features[tr], level)
            e, o = m.from_basis(z[te], features[te])
            ape[te] = np.abs((roof_s[te] / e + o) / lat_s[te] - 1.0)
        err = float(ape.mean())
        if err < best_err:
            best, best_err = level, err
    return best, best_err


#: Candidate positions (log KV bytes / L2) of the decode L2 step searched in the target tier.
SPILL_CENTERS = tuple(-0.75 + 0.25 * i for i in range(11))


def fit_spill_center(
    features: np.ndarray, dev: dict[str, float], roof_s: np.ndarray, lat_s: np.ndarray, max_rows: int = 4000
) -> float:
    """Position of the decode L2 step (a GPU property): the candidate whose smooth fit has the least loss.

    Searched on a fixed subsample (≤ ``max_rows`` rows, deterministic) with a short fit, so it costs
    a few seconds at most.
    """
    n = len(roof_s)
    idx = np.arange(n) if n <= max_rows else np.random.default_rng(0).choice(n, max_rows, replace=False)
    best, best_loss = 0.0, np.inf
    for c in SPILL_CENTERS:
        d = dict(dev, l2_spill_center=c)
        z = basis_matrix("attn_decode", features[idx], d)
        beta, ovh, center, scale = fit_logpoly(z, roof_s[idx], lat_s[idx], iters=25)
        m = LogPolyEta("attn_decode", d, tuple(center), tuple(scale), tuple(beta), ETA_LO, ETA_HI, ovh)
        e, o = m.from_basis(z)
        loss = float(np.mean(np.log((roof_s[idx] / e + o) / lat_s[idx]) ** 2))
        if loss < best_loss:
            best, best_loss = c, loss
    return best


def add_residual_grid(
    model: LogPolyEta,
    family: str,
    z: np.ndarray,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    rounds: int = 1,
    *,
    features: np.ndarray,
    residual_trees: bool = True,
    lattice: bool = True,
) -> LogPolyEta:
    """Backfit the residual correction: log(measured / predicted) kernel time, first by boosted trees on the raw
    shape axes (``residual_trees``), then by the raw-shape lattice on what the trees leave.

    ``z`` is the smooth model's basis of the rows, ``features`` their raw feature rows (the lattice's axes).
    """
    grid = None
    free = window_is_free(model.basis, features, lat_s)
    coords = residual_coordinates(model.basis, features, free)
    eta, ovh = model.from_basis(z, features)
    smooth_log_ratio = np.log(lat_s / (roof_s / eta + ovh))
    trees = None
    if residual_trees:
        # the steps first, on the smooth model's honest residual; the lattice then smooths what they leave
        trees = fit_residual_trees(coords, np.clip(smooth_log_ratio, -GRID_FIT_CLIP, GRID_FIT_CLIP))
        smooth_log_ratio = smooth_log_ratio - trees(coords)
    gaps = None
    for _ in range(rounds if lattice else 0):
        log_ratio = smooth_log_ratio if grid is None else smooth_log_ratio - grid(coords)
        if gaps is None:
            gaps = choose_lattice_gaps(family, coords, log_ratio)
        add = _fit_lattice(family, coords, log_ratio, gaps)
        if grid is not None:
            add = replace(add, values=tuple(a + b for a, b in zip(add.values, grid.values, strict=True)))
        grid = add
    return replace(model, grid=replace(grid, free_window=free) if grid is not None else None, trees=trees)


def _fit_lattice(family: str, coords: np.ndarray, log_ratio: np.ndarray, gaps: tuple[float, ...]) -> ResidualGrid:
    """Coarse stages first (sub-lattices pooling many rows), then the full lattice on what they leave; a
    sub-lattice on the same knots is constant along its missing axes, so it folds into the full one."""
    dims = GRID_DIMS[family]
    ones = np.ones(len(log_ratio))
    stages = []
    for sub in GRID_STAGES.get(family, ()):
        g = fit_residual_grid(
            coords, sub, np.clip(log_ratio, -GRID_FIT_CLIP, GRID_FIT_CLIP), ones,
            min_gaps=tuple(gaps[dims.index(d)] for d in sub), smooth=GRID_SMOOTH[family], coords="raw",
        )
        log_ratio = log_ratio - g(coords)
        stages.append(g)
    full = fit_residual_grid(coords, dims, np.clip(log_ratio, -GRID_FIT_CLIP, GRID_FIT_CLIP), ones, min_gaps=gaps,
                             smooth=GRID_SMOOTH[family], coords="raw")
    return _fold_stages(full, stages)


#: Knot spacing chosen per fit, by family: (position in GRID_DIMS, candidate min gaps) per searched axis. How much
#: a kernel's time moves along a head axis is a property of the kernel (H100 FA3 decode packs a GQA group's heads
#: into one CTA, so its time is nearly flat along the group and coarse knots pool more rows; A100 FA2 is not), so
#: one global spacing was a compromise. On the 25 %/75 % split, seed 0: decode group gap 0.6 / 0.9 / 1.4 gave
#: A100 6.18 / 7.34 / 8.39 %, L40S 7.28 / 7.27 / 7.60 %, H100 3.17 / 2.89 / 2.77 %; prefill KV-head gap 0.6 / 1.0
#: gave A100 4.78 / 4.86 %, L40S 7.42 / 7.06 %, H100 5.31 / 5.64 %.
GRID_GAP_CHOICES: dict[str, tuple[tuple[int, tuple[float, ...]], ...]] = {
    "attn_decode": ((2, (0.6, 0.9, 1.4)),),
    "attn_prefill": ((3, (0.6, 1.0)),),
}
#: The choice is made on the training rows alone, by MAPE on held-out rows (fixed seed, so a fit stays
#: deterministic): 5-fold cross-validation, or one 20 % hold-out above GAP_CV_ONE_FOLD_ROWS rows. A lattice fit
#: costs by its knots, not its rows, so small samples of a big sweep (fewer than GAP_CV_MIN_ROWS rows) keep the
#: default spacing: the search would cost as much as on the whole sweep, and a hold-out of < 1000 rows cannot
#: tell spacings apart whose effect is a few tenths of a percent (A100, 25 % split: it picked 0.6 or 1.0 by seed).
GAP_CV_FOLDS = 5
GAP_CV_ONE_FOLD_ROWS = 10_000
GAP_CV_MIN_ROWS = 5_000


def choose_lattice_gaps(family: str, coords: np.ndarray, log_ratio: np.ndarray) -> tuple[float, ...]:
    """``GRID_MIN_GAPS[family]`` with the axes of ``GRID_GAP_CHOICES`` set by a hold-out on these rows (one axis
    after the other)."""
    best = GRID_MIN_GAPS[family]
    choices = GRID_GAP_CHOICES.get(family, ())
    if not choices or len(log_ratio) < GAP_CV_MIN_ROWS:
        return best
    fold = np.random.default_rng(0).integers(0, GAP_CV_FOLDS, len(log_ratio))
    folds = range(1 if len(log_ratio) > GAP_CV_ONE_FOLD_ROWS else GAP_CV_FOLDS)

    def holdout_ape(gaps: tuple[float, ...]) -> float:
        ape = np.empty(len(log_ratio))
        for k in folds:
            hold = fold == k
            grid = _fit_lattice(family, coords[~hold], log_ratio[~hold], gaps)
            ape[hold] = np.abs(np.expm1(np.clip(grid(coords[hold]), -3.0, 3.0) - log_ratio[hold]))
        return float(np.mean(ape[np.isin(fold, list(folds))]))

    for pos, values in choices:
        cands = [tuple(v if j == pos else g for j, g in enumerate(best)) for v in values]
        best = min(cands, key=holdout_ape)
    return best


#: A kernel ignores a non-binding sliding window when its windowed rows with context ≤ window time like the same
#: shape without a window: mean |log ratio| over such measured pairs at most this (H100 FA3 0.011–0.017, L40S
#: FlashInfer 0.019–0.05; L40S FA2 decode 0.2–1.0: with any window it stops packing GQA heads), on at least
#: WINDOW_FREE_MIN_PAIRS pairs.
WINDOW_FREE_MAX_LOG = 0.04
WINDOW_FREE_MIN_PAIRS = 10


def window_is_free(basis: str, features: np.ndarray, lat_s: np.ndarray) -> bool:
    """Whether these rows' kernel runs a non-binding window as full attention (decided on measured pairs).

    Why: then a windowed shape whose context fits the window is the full-attention shape (on the H100 the two
    agree to ~1 %), and mapping both to one lattice point doubles the measurements behind it: on the 25 %/75 %
    split the H100 prefill / decode MAPE went 5.74 / 3.73 → 5.31 / 3.18 %. Kernels that switch path on any
    window (L40S FA2) keep the window axis as measured.
    """
    if basis not in WINDOW_COLUMNS or features.shape[1] <= WINDOW_COLUMNS[basis][1]:
        return False
    win = WINDOW_COLUMNS[basis][1]
    loose = (features[:, win] > 0) & ~window_binds(basis, features)
    full = features[:, win] == 0
    if not loose.any() or not full.any():
        return False
    others = [j for j in range(features.shape[1]) if j != win]
    log_lat = np.log(lat_s)
    by_shape: dict[tuple, list[float]] = {}
    for row, y in zip(np.round(features[full][:, others], 6).tolist(), log_lat[full].tolist(), strict=True):
        by_shape.setdefault(tuple(row), []).append(y)
    diffs = []
    for row, y in zip(np.round(features[loose][:, others], 6).tolist(), log_lat[loose].tolist(), strict=True):
        base = by_shape.get(tuple(row))
        if base:
            diffs.append(abs(y - sum(base) / len(base)))
    return len(diffs) >= WINDOW_FREE_MIN_PAIRS and float(np.mean(diffs)) <= WINDOW_FREE_MAX_LOG


# ------------------------------------------------------------------------------------------------
# whole-GPU calibration
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class FitReport:
    """Per (family, variant): rows used and training MAPE."""

    entries: dict[str, dict[str, float]] = field(default_factory=dict)


#: A kernel gets its own η model only with at least this many training rows; rarer kernels are left to the
#: dispatch rule (their shapes are priced by the kernel it names).
MIN_KERNEL_ROWS = 40
#: Depth limit and smallest leaf of the learned dispatch tree (vLLM's rules are a few thresholds per format).
DISPATCH_MAX_DEPTH = 6
DISPATCH_MIN_LEAF = 1


def _take(rows: KernelRows, sel: np.ndarray) -> KernelRows:
    return KernelRows(
        rows.family,
        rows.flops[sel],
        rows.bytes_moved[sel],
        rows.tiles[sel],
        rows.compute_dtype[sel],
        rows.features[sel],
        rows.variant[sel],
        None if rows.kernel is None else rows.kernel[sel],
    )


def fit_dispatch_rule(
    coords: np.ndarray,
    kernels: np.ndarray,
    *,
    max_depth: int = DISPATCH_MAX_DEPTH,
    min_leaf: int = DISPATCH_MIN_LEAF,
) -> DispatchRule:
    """Greedy classification tree (Gini splits at midpoints between measured values) kernel ← raw shape axes.

    The kernel is a deterministic function of the shape per GPU, so a few splits usually classify every
    training row; ties between equally good splits go to the lowest axis, so the fit is deterministic.
    """
    names, y = np.unique(np.asarray(kernels).astype(str), return_inverse=True)
    n_cls = len(names)

    def grow(idx: np.ndarray, depth: int) -> tuple:
        counts = np.bincount(y[idx], minlength=n_cls).astype(float)
        leaf = (str(names[int(counts.argmax())]),)
        if depth >= max_depth or counts.max() == len(idx) or len(idx) < 2 * min_leaf:
            return leaf
        best = (len(idx) - float(counts @ counts) / len(idx) - 1e-9, -1, 0.0)  # must beat the parent's Gini
        for dim in range(coords.shape[1]):
            u, inv = np.unique(coords[idx, dim], return_inverse=True)
            if len(u) < 2:
                continue
            tab = np.bincount(inv * n_cls + y[idx], minlength=len(u) * n_cls).reshape(len(u), n_cls)
            left = np.cumsum(tab, axis=0)[:-1].astype(float)
            right = counts - left
            nl, nr = left.sum(axis=1), right.sum(axis=1)
            ok = (nl >= min_leaf) & (nr >= min_leaf)
            if not ok.any():
                continue
            gini = (nl - (left * left).sum(axis=1) / np.maximum(nl, 1)
                    + nr - (right * right).sum(axis=1) / np.maximum(nr, 1))
            gini = np.where(ok, gini, np.inf)
            j = int(np.argmin(gini))
            if gini[j] < best[0]:
                best = (float(gini[j]), dim, 0.5 * float(u[j] + u[j + 1]))
        if best[1] < 0:
            return leaf
        _, dim, thr = best
        le = coords[idx, dim] <= thr
        lo, hi = grow(idx[le], depth + 1), grow(idx[~le], depth + 1)
        if len(lo) == 1 and lo == hi:  # both sides dispatch the same kernel: no split needed
            return lo
        return (dim, thr, lo, hi)

    if n_cls == 0:
        raise ValueError("a dispatch rule needs at least one labelled row")
    return DispatchRule(grow(np.arange(len(y)), 0))


def _fit_variant(
    family: str,
    variant: str,
    rows: KernelRows,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    hw: HardwareSpec,
    residual_grid: bool,
    prior: tuple[EtaModel, float] | None = None,
) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """One variant's model: a LogPolyEta, or a DispatchEta over the kernels that ran (``kernel`` column); or
    ``prior`` = (the cross-generation model of the variant, its MAPE on these rows) if that does better."""
    names: list[str] = []
    if rows.kernel is not None:
        uniq, counts = np.unique(rows.kernel, return_counts=True)
        names = [str(k) for k, c in zip(uniq, counts, strict=True) if c >= MIN_KERNEL_ROWS]
    report: dict[str, dict[str, float]] = {}

    def entry(f: SubFit) -> dict[str, float]:
        return {"rows": float(f.n_rows), "train_mape": f.train_mape, "overhead_us": (f.model.overhead_s or 0.0) * 1e6}

    pooled = fit_submodel(family, variant, rows, roof_s, lat_s, hw, residual_grid=residual_grid and len(names) < 2)
    if len(names) < 2:
        report[f"{family}[{variant}]"] = entry(pooled)
        return _or_prior(pooled.model, pooled.cv_mape, pooled.eta_max_seen, report, prior)
    report[f"{family}[{variant}/pooled smooth]"] = entry(pooled)  # for transfer only: all kernels, no lattice
    assert rows.kernel is not None
    models: dict[str, EtaModel] = {}
    counts_by: dict[str, int] = {}
    cv_by: dict[str, float] = {}
    eta_max = 0.0
    for name in names:
        sel = rows.kernel == name
        sub = _take(rows, sel)
        # each kernel gets its own smooth η and lattice. Tried: the variant's pooled smooth η with a per-kernel
        # lattice only: H100 gemm / decode / prefill 5.23 / 4.03 / 5.86% vs 4.98 / 3.89 / 5.84% (target tier).
        # The L2 step is the GPU's cache capacity, not the kernel's: reuse the pooled fit's position.
        f = fit_submodel(family, variant, sub, roof_s[sel], lat_s[sel], hw, residual_grid=residual_grid,
                         spill_center=pooled.model.device.get("l2_spill_center"))
        models[name] = f.model
        counts_by[name] = f.n_rows
        cv_by[name] = f.cv_mape
        eta_max = max(eta_max, f.eta_max_seen)
        report[f"{family}[{variant}/{name}]"] = entry(f)
    keep = np.isin(rows.kernel, names)
    basis = basis_name(family)
    rule = fit_dispatch_rule(RESIDUAL_COORDS[basis](rows.features[keep]), rows.kernel[keep])
    default = max(names, key=lambda k: (counts_by[k], k))
    cv = sum(cv_by[k] * counts_by[k] for k in names) / sum(counts_by.values())
    return _or_prior(DispatchEta(basis, rule, models, default, pooled.model), cv, max(eta_max, pooled.eta_max_seen),
                     report, prior)


def _or_prior(model: EtaModel, cv_mape: float, eta_max: float, report: dict[str, dict[str, float]],
              prior: tuple[EtaModel, float] | None) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """The fitted model, or the prior's (``(model, MAPE on these rows)``) where it predicts the measured rows
    better than the fit predicts rows it did not see (only measured for small samples: see SELECT_MAX_ROWS)."""
    if prior is None or not prior[1] < cv_mape:
        return model, eta_max, report
    for e in report.values():
        e["prior_mape"] = prior[1]
    key = next(iter(report))
    report[key]["uses_prior"] = 1.0
    return prior[0], eta_max, report


def fit_family(
    family: str, cols: Columns, hw: HardwareSpec, *, residual_grid: bool = False, prior: Calibration | None = None
) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """η model of one family on one GPU: a SwitchEta over its variants (each a DispatchEta over the kernels that
    ran when the ``kernel`` column names several). Returns (model, η max, report).

    ``prior`` (a cross-generation calibration of this GPU): a variant measured at fewer than SELECT_MAX_ROWS rows
    takes the prior's model instead when that predicts its rows better than the fit predicts held-out rows, and a
    variant the prior has but the rows lack is the prior's.
    """
    rows = kernel_rows(family, cols)
    lat_s = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    ok = np.isfinite(lat_s) & (lat_s > 0)
    roof = roofline_rows_s(rows, hw)
    models: dict[str, EtaModel] = {}
    report: dict[str, dict[str, float]] = {}
    eta_max = 0.0
    counts: dict[str, int] = {}
    prior_model = prior.eta.get(family) if prior is not None else None
    prior_t = rows_time_s(prior, family, rows, roof, hw) if prior is not None and prior_model is not None else None
    for v in np.unique(rows.variant[ok]):
        sel = ok & (rows.variant == v)
        alt = None
        if (prior_t is not None and isinstance(prior_model, SwitchEta) and str(v) in prior_model.models
                and sel.sum() < SELECT_MAX_ROWS):
            alt = (prior_model.models[str(v)], float(np.mean(np.abs(prior_t[sel] / lat_s[sel] - 1.0))))
        model, emax, rep = _fit_variant(family, str(v), _take(rows, sel), roof[sel], lat_s[sel], hw, residual_grid,
                                        alt)
        if alt is not None and model is alt[0]:
            emax = max(emax, prior.eta_max)  # type: ignore[union-attr]
        models[str(v)] = model
        counts[str(v)] = int(sel.sum())
        eta_max = max(eta_max, emax)
        report.update(rep)
    # Features without the categorical entry (older tuples) mean bf16 weights / bf16 KV.
    preferred = "0" if family == "gemm" else "2"
    default = preferred if preferred in counts else max(counts, key=counts.__getitem__)
    if isinstance(prior_model, SwitchEta):
        # A variant with no rows (a GEMM format or KV dtype the sweep did not time) takes the prior's model, built
        # for that variant, rather than a measured variant's: on the shared data, H100 / L40S fp8_block GEMMs priced
        # by the GPU's own fp8 model miss by 73 / 80 %, by the cross-generation fp8_block model by 60 / 71 %.
        for key, sub in prior_model.models.items():
            if key not in models:
                models[key] = sub
                eta_max = max(eta_max, prior.eta_max)  # type: ignore[union-attr]
                report[f"{family}[{key}]"] = {"rows": 0.0, "train_mape": math.nan, "overhead_us": math.nan,
                                              "uses_prior": 1.0}
    return SwitchEta(SWITCH_INDEX[family], models, default), eta_max, report


FamilyFit = tuple[EtaModel, float, dict[str, dict[str, float]]]


def _fit_family_job(job: tuple[str, Columns], *, hw: HardwareSpec, residual_grid: bool,
                    prior: Calibration | None = None) -> FamilyFit:
    return fit_family(job[0], job[1], hw, residual_grid=residual_grid, prior=prior)


def fit_calibration(
    tables: Mapping[str, Columns],
    hw: HardwareSpec,
    *,
    residual_grid: bool = True,
    source: str = "",
    licence: str = "",
    map_fn: Callable[[Callable[[tuple[str, Columns]], FamilyFit], Iterable[tuple[str, Columns]]],
                     Iterator[FamilyFit]] = map,
    prior: Calibration | None = None,
) -> tuple[Calibration, FitReport]:
    """Target-measured calibration of one GPU from its measurement tables (family → columns).

    The kernel families are fitted independently through ``map_fn`` (an ordered map over (family, columns): the
    builtin, or a process pool's ``map`` to fit them in parallel; the same result under the same BLAS threading).

    ``prior``: the cross-generation calibration of this GPU (what it would get with no measurements). What the
    tables do not measure comes from it: kernel families with no rows (with their fixed latency and the decode
    floor), variants with no rows within a measured family (a GEMM format, a KV dtype) and collective backends
    with no rows; and small variants take its model where it predicts their rows
    better than their own fit predicts held-out rows (:func:`fit_family`).
    """
    calib = default_calibration(hw.name)
    calib.tier = "target-measured"
    calib.source, calib.licence = source, licence
    report = FitReport()
    eta_max = 0.0
    fams = [
        f for f in KERNEL_FAMILIES
        if (cols := tables.get(f)) is not None and "latency_us" in cols and len(cols["latency_us"]) > 0
    ]
    # largest family first, so a two-worker pool balances (H100: decode ≈ gemm + prefill in fit time)
    fams.sort(key=lambda f: -len(tables[f]["latency_us"]))
    job = partial(_fit_family_job, hw=hw, residual_grid=residual_grid, prior=prior)
    fitted = dict(zip(fams, map_fn(job, [(f, tables[f]) for f in fams]), strict=True))
    for fam in KERNEL_FAMILIES:
        if fam not in fitted:
            continue
        model, emax, rep = fitted[fam]
        calib.eta[fam] = model
        eta_max = max(eta_max, emax)
        report.entries.update(rep)
        if fam == "gemm":
            bf16 = model.models.get("0") if isinstance(model, SwitchEta) else None
            if bf16 is not None:  # lm_head / MoE expert GEMMs: the bf16 GEMM model on (m, n, k)
                calib.eta["lm_head"] = bf16
                calib.eta["moe_gemm"] = bf16
    calib.overhead_s.update(family_overheads(calib))
    calib.eta_max = max(eta_max, 1.0) if eta_max else calib.eta_max
    # The floor is a sanity cap on time, not a fit: let it sit below the slowest η the fitted form can express
    # (sigmoid floor ÷ the lattice's largest factor), so measured slow paths (H100 FA4 decode at head_dim 512:
    # 0.1 % of the roofline at short contexts) are not cut off. Older files keep their stored 0.02.
    calib.eta_floor = min(calib.eta_floor, ETA_LO * math.exp(-3.0))
    dec = tables.get("attn_decode")
    if dec is not None and "latency_us" in dec and len(dec["latency_us"]):
        calib.decode_cta_bytes_per_s = fit_decode_floor(dec, hw)
    comm: dict[str, CommModel] = {}
    if "comm" in tables and "latency_us" in tables["comm"]:
        comm = fit_comm(tables["comm"], hw, prior.comm if prior is not None else None)
        calib.comm.update(comm)
    if prior is not None:
        _fill_from_prior(calib, prior, fitted, comm)
    return calib, report


def _fill_from_prior(calib: Calibration, prior: Calibration, fitted: Mapping[str, FamilyFit],
                     comm: Mapping[str, CommModel]) -> None:
    """What the measurements leave out, from the prior: unmeasured kernel families (lm_head and MoE GEMMs follow
    the GEMM family) with their fixed latency, the decode floor without decode rows, unmeasured backends."""
    stands_for = {"lm_head": "gemm", "moe_gemm": "gemm"}
    for fam, model in prior.eta.items():
        if fam == "default" or stands_for.get(fam, fam) in fitted:
            continue
        calib.eta[fam] = model
        if fam in prior.overhead_s:
            calib.overhead_s[fam] = prior.overhead_s[fam]
        calib.eta_max = max(calib.eta_max, prior.eta_max)
    if "attn_decode" not in fitted:
        calib.decode_cta_bytes_per_s = dict(prior.decode_cta_bytes_per_s)
    for backend, model in prior.comm.items():
        if backend not in comm:
            calib.comm[backend] = model


#: Decode rows that can show the unsplit path (``calibration.decode_serial_floor_s``): one query head per KV head,
#: contexts at least this long (shorter ones are launch-bound) and few CTAs (so that even together they stay under
#: the DRAM roof of any GPU: the path is then the only limit)
DECODE_FLOOR_MIN_CONTEXT = 2048.0
DECODE_FLOOR_MAX_CTAS = 16.0
#: The path's signature on those rows: time ∝ context (log-log slope at least this) and independent of the number
#: of CTAs (|slope| at most this). Measured: A100 and L40S FA2 bf16 0.97 / 0.01 and 0.96 / 0.01; H100 FA3 0.48-0.57
#: / 0.27-0.43 and L40S fp8 (FlashInfer) 0.68 / 0.49, which split the KV cache.
DECODE_FLOOR_MIN_CTX_SLOPE = 0.85
DECODE_FLOOR_MAX_CTA_SLOPE = 0.1


def fit_decode_floor(cols: Columns, hw: HardwareSpec) -> dict[str, float]:
    """Per decode variant, the streaming bandwidth of one CTA on the unsplit path (median over the rows that
    show it), or nothing when the measured kernel splits the KV cache."""
    rows = kernel_rows("attn_decode", cols)
    lat = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    f = rows.features
    ctx = np.where(f[:, 6] > 0, np.minimum(f[:, 1], f[:, 6]), f[:, 1])
    ctas = f[:, 0] * f[:, 3]
    out: dict[str, float] = {}
    for v in np.unique(rows.variant):
        sel = ((rows.variant == v) & (f[:, 2] == f[:, 3]) & (ctas <= DECODE_FLOOR_MAX_CTAS)
               & (ctx >= DECODE_FLOOR_MIN_CONTEXT) & (lat > 0))
        if sel.sum() < 8:
            continue
        per_cta_bytes = ctx[sel] * 2.0 * f[sel, 4] * f[sel, 5]
        x = np.column_stack([np.ones(int(sel.sum())), np.log(per_cta_bytes), np.log(ctas[sel])])
        (_, ctx_slope, cta_slope), *_ = np.linalg.lstsq(x, np.log(lat[sel]), rcond=None)
        if ctx_slope >= DECODE_FLOOR_MIN_CTX_SLOPE and abs(cta_slope) <= DECODE_FLOOR_MAX_CTA_SLOPE:
            out[str(v)] = float(np.median(per_cta_bytes / lat[sel]))
    return out


def family_overheads(calib: Calibration) -> dict[str, float]:
    """Family-level fallback overhead = the default variant's fitted one."""
    out: dict[str, float] = {}
    for fam, model in calib.eta.items():
        if isinstance(model, SwitchEta):
            m = model.models[model.default]
            if isinstance(m, DispatchEta):  # the pooled fit's: what transfer averages, as before kernel models
                m = m.pooled if m.pooled is not None else m.models[m.default]
            if isinstance(m, LogPolyEta) and m.overhead_s is not None:
                out[fam] = m.overhead_s
    return out


def predict_rows_s(family: str, cols: Columns, hw: HardwareSpec, calib: Calibration) -> np.ndarray:
    """Predicted latency (s) of each measured row under a calibration (vectorized over variants)."""
    rows = kernel_rows(family, cols)
    return rows_time_s(calib, family, rows, roofline_rows_s(rows, hw), hw)


def rows_time_s(calib: Calibration, family: str, rows: KernelRows, roof_s: np.ndarray, hw: HardwareSpec
                ) -> np.ndarray:
    """Predicted latency (s) of kernel rows whose roofline times are ``roof_s``."""
    eta, ovh = eta_and_overhead(calib, family, rows)
    t = roof_s / eta + ovh
    if family == "attn_decode" and calib.decode_cta_bytes_per_s:
        t = np.maximum(t, decode_floor_rows_s(rows, hw, calib.decode_cta_bytes_per_s))
    return t


def decode_floor_rows_s(rows: KernelRows, hw: HardwareSpec, cta_bytes_per_s: Mapping[str, float]) -> np.ndarray:
    """``decode_serial_floor_s`` of every decode row (0 where its variant has no unsplit path)."""
    out = np.zeros(len(rows))
    for key, bw in cta_bytes_per_s.items():
        # only rows with one query head per KV head can take the path (a minority of a sweep)
        for i in np.flatnonzero((rows.variant == key) & (rows.features[:, 2] == rows.features[:, 3])):
            out[i] = decode_serial_floor_s(rows.features[i], hw.num_sms, bw)
    return out


def eta_and_overhead(calib: Calibration, family: str, rows: KernelRows) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized ``kernel_eta`` (clipped to [eta_floor, eta_max]) and ``kernel_overhead_s``.

    Where the calibration has per-kernel models, ``rows.kernel`` (when known) picks them; otherwise, and for
    kernel names it has no model of, its learned dispatch rule does.
    """
    model = calib.eta.get(family) or calib.eta["default"]
    eta = np.empty(len(rows))
    ovh = np.full(len(rows), calib.kernel_overhead_s(family))
    for v in np.unique(rows.variant) if len(rows) else []:
        sel = rows.variant == v
        sub = (
            model.pick(tuple(rows.features[np.flatnonzero(sel)[0]]))
            if isinstance(model, SwitchEta)
            else model
        )
        if isinstance(sub, DispatchEta):
            e, o = sub.eta_and_overhead_array(rows.features[sel], None if rows.kernel is None else rows.kernel[sel])
            eta[sel], ovh[sel] = e, o
        elif isinstance(sub, LogPolyEta | EnsembleEta):
            e, o = sub.eta_and_overhead_array(rows.features[sel])
            eta[sel] = e
            if not (isinstance(sub, LogPolyEta) and sub.overhead_s is None):
                ovh[sel] = o
        else:
            eta[sel] = [sub.eta(tuple(f)) for f in rows.features[sel]]
    return np.clip(eta, calib.eta_floor, calib.eta_max), ovh


__all__ = [
    "FitReport",
    "KernelRows",
    "SubFit",
    "ConstantEta",
    "add_residual_grid",
    "device_constants",
    "element_bytes",
    "eta_and_overhead",
    "fit_calibration",
    "fit_decode_floor",
    "fit_dispatch_rule",
    "fit_family",
    "fit_logpoly",
    "fit_residual_grid",
    "fit_submodel",
    "kernel_rows",
    "predict_rows_s",
    "roofline_rows_s",
]
