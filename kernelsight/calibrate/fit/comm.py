"""Fitting and cross-generation transfer of collective latency curves (:class:`CommCurve`).

What the measurements show (shared/data/kernels/*/comm.csv.gz, NCCL 2.27, vLLM custom all-reduce):

* a flat latency floor up to tens of kB, then protocol switches (NCCL LL → LL128 → Simple, custom one-shot →
  two-shot) that show as kinks or steps of up to 2× between 256 kB and 8 MB, then a bandwidth-bound line;
  one α–β line cannot follow this, a piecewise α–β curve through measured sizes can;
* int8 and 16-bit curves mostly coincide, but not always (H100 8-GPU: NVLink SHARP reduces 16-bit data in the
  switch, int8 not: 26% apart at 512 MiB), so dtype classes share one shape with a per-class offset that
  may drift with size;
* vLLM's custom all-reduce above its 8 MiB buffer is NCCL's curve (it falls back); eager = graph + launch;
* over PCIe (L40S) the per-GPU bus bandwidth collapses with the GPU count (≈ 0.6, 0.16, 0.045 of the PCIe
  spec at 2, 4, 8 GPUs) while over NVLink it stays ≈ 0.65–1.0 of the link.

Target tier (:func:`fit_comm_curves`): per (backend, op, GPU count) pool the dtype classes (log offset per
class, linear in log size), take the median latency per size, clip upward spikes, make it monotone (isotonic
regression in log time), and use the sizes as knots; beyond the last knot grow at the asymptotic bandwidth
fitted on ≥ 32 MiB rows (of the curve; else of the same collective at that GPU count on any backend, since large
messages run at the interconnect's bus bandwidth whichever library sends them and vLLM's custom all-reduce hands
them to NCCL; else of the backend at that GPU count; else the prior's, below; else of the backend's op);
below the first knot, its segment extended down to the backend's latency floor (its fastest message of ≤ 64 kB at
that GPU count, else at any), or from a bandwidth-bound first knot (> 64 kB) the α–β line from that floor to it.
Groups measured at fewer than 4 sizes borrow the nearest GPU count's shape, fitted to their own points part by
part (bandwidth-bound points scale its bandwidth part, latency-bound ones its latency part).

With a prior (the GPU's cross-generation curves; ``calibrate fit`` passes it): a thin group with no GPU count of
its own to borrow from takes the prior curve's shape (and asymptote), scaled to its points, and every prior
curve of a measured backend that the rows do not cover is kept, so a sweep of all-reduce alone still prices
all-gather from the prior rather than from the all-reduce α–β line.

:func:`fit_comm` makes a backend's :class:`~kernelsight.simcore.comm.CommModel` of these curves and the single
all-reduce α–β line anything they do not cover falls back to.

Cross-generation (:func:`transfer_comm_curves`): each source curve is split into a bandwidth part
bus_bytes / B (B = its asymptotic bandwidth) and a latency/protocol remainder L(s) ≥ 0, then

    t_target(s) = k_α · L(s) + bus_bytes(s) / (B / link_source · link_target · g(T))

geometric mean over the sources of the target's link class (NVLink-class vs PCIe-only). Same class:
k_α = source clock / target clock (small-message protocols spin on flags in SM cycles), g = 1. No source of
the target's class: k_α = 1 (link latency, not SM cycles, dominates across classes) and g(T) = 2/T from
NVLink to PCIe (the T GPUs share the host bridge's peer-to-peer path; its inverse T/2 the other way).
That prior is not fitted to the data: the one PCIe system measured (L40S) falls faster, ≈ (2/T)²;
PCIe targets get that from a measured PCIe source (same class), which the bundled calibrations include.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from kernelsight.simcore.allreduce_dispatch import NCCL, allreduce_implementation, allreduce_pricing_backend
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.comm import (
    CommCurve,
    CommModel,
    comm_bus_factor,
    comm_curve_key,
    comm_dtype_class,
    has_fast_interconnect,
    nearest_gpu_count,
    ring_bus_bytes,
)
from kernelsight.simcore.hardware import HardwareSpec

#: measured backend name → calibration backend name, for rows that are not vLLM's all-reduce (those go by
#: :func:`row_backends`)
COMM_BACKENDS = {"nccl": "nccl", "vllm_custom_graph": "custom", "vllm_custom_eager": "custom_eager"}
#: measured rows of vLLM's all-reduce entry point, by whether they ran inside a CUDA graph
VLLM_ALLREDUCE_BACKENDS = {"vllm_custom_graph": True, "vllm_custom_eager": False}
#: the backends a calibration can hold: NCCL, and each all-reduce implementation in graph and eager mode
CALIBRATION_BACKENDS = ("nccl", "custom", "custom_eager", "symm_mem", "symm_mem_eager")


def row_backends(cols: Mapping[str, np.ndarray], hw: HardwareSpec) -> np.ndarray:
    """Per measured row, the calibration backend whose curve it belongs to ('' = none).

    The ``vllm_custom_graph`` / ``vllm_custom_eager`` rows time vLLM's all-reduce entry point, so each ran on
    whatever implementation vLLM dispatched it to on the measured GPU
    (:func:`~kernelsight.simcore.allreduce_dispatch.allreduce_implementation`): on H100 × 8 the custom all-reduce
    below 256 KiB, symmetric memory up to 64 MiB, NCCL above. Each row goes to that implementation's curve
    (``_eager`` for the eager rows). Rows that NCCL ran are left out: NCCL is fitted on its own table (the graph
    rows agree with it within a few % on the NVLink GPUs; the eager ones add one device copy of the message,
    which :func:`~kernelsight.simcore.comm.allreduce_implementation_s` adds). Rows already named by a calibration
    backend keep it.
    """
    op = np.asarray(cols["op"]).astype(str)
    backend = np.asarray(cols["backend"]).astype(str)
    dtypes = np.asarray(cols["dtype"]).astype(str) if "dtype" in cols else np.full(len(op), "bf16")
    gpus = np.asarray(cols["num_gpus"], dtype=float)
    size = np.asarray(cols["message_bytes"], dtype=float)
    out = np.full(len(op), "", dtype=object)
    for i, (o, b) in enumerate(zip(op, backend, strict=True)):
        if b in VLLM_ALLREDUCE_BACKENDS:
            if o != "all_reduce" or not np.isfinite(gpus[i]) or not np.isfinite(size[i]):
                continue
            graph = VLLM_ALLREDUCE_BACKENDS[b]
            impl = allreduce_implementation(hw, int(gpus[i]), size[i], dtypes[i], graph)
            if impl == NCCL:
                continue
            out[i] = allreduce_pricing_backend(impl, graph)
        elif b in CALIBRATION_BACKENDS:
            out[i] = b
    return out
#: rows at least this large are bandwidth-bound enough to fit the asymptotic bandwidth on
ASYMPTOTE_MIN_BYTES = 32 * 2**20
#: messages this small are latency-bound on every measured interconnect (the curves are flat up to tens of kB)
LATENCY_BOUND_BYTES = 64 * 2**10
#: fallback of LATENCY_BOUND_BYTES for a backend never run that small
SMALL_LATENCY_BOUND_BYTES = 2**20
#: a size's median more than this (log) above a larger size's is an interference spike, clipped to it
SPIKE_LOG = 0.1
#: groups measured at fewer sizes borrow the shape of the nearest GPU count
MIN_SIZES = 4
#: same-class transfer scales the latency part by (source clock ÷ target clock)^this. 0, 0.5 and 1 tried
#: leave-one-GPU-out over A100 / H100 jointly (all-reduce MAPE ≈ 27–45%, 20–29%, 16–18%): 1 kept.
LATENCY_CLOCK_EXPONENT = 1.0


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.array([m for m, _, c in blocks for _ in range(int(c))])


def _knots(size: np.ndarray, log_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct sizes, monotone log latency): median per size, spikes clipped, isotonic."""
    sizes = np.unique(size)
    med = np.array([np.median(log_t[size == s]) for s in sizes])
    count = np.array([np.sum(size == s) for s in sizes], dtype=float)
    later_min = np.minimum.accumulate(med[::-1])[::-1]
    return sizes, _isotonic(np.minimum(med, later_min + SPIKE_LOG), count)


def _interp_s(curve_b: np.ndarray, curve_t: np.ndarray, tail: float, s: np.ndarray) -> np.ndarray:
    out = np.interp(s, curve_b, curve_t)
    return np.where(s > curve_b[-1], curve_t[-1] + (s - curve_b[-1]) * tail, out)


def _class_offset(x: np.ndarray, r: np.ndarray) -> tuple[float, float]:
    """(level, slope per octave) of a dtype class's log residual against the pooled curve, shrunk towards 0
    when the class has few points (a wrong offset costs more than none)."""
    n = len(r)
    if n >= 3 and np.ptp(x) >= 4:
        slope, level = np.polyfit(x, r, 1)
        return float(level) * n / (n + 1.0), float(slope) * n / (n + 4.0)
    return float(np.median(r)) * n / (n + 1.0), 0.0


def _pooled_shape(
    by_class: Mapping[str, np.ndarray], size: np.ndarray, log_t: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[float, float]]]:
    """One monotone knot curve for all dtype classes of a group plus, per class, a log offset linear in
    log2(size / 1 MiB) (classes mostly coincide, but e.g. NVLS speeds up only 16-bit data, at large sizes)."""
    off = dict.fromkeys(by_class, (0.0, 0.0))
    octave = np.log2(np.maximum(size, 1.0) / 2**20)
    for _ in range(2):  # offsets from the pooled curve, then the curve from offset-corrected points
        sizes = np.concatenate([size[i] for i in by_class.values()])
        ys = np.concatenate([log_t[i] - off[c][0] - off[c][1] * octave[i] for c, i in by_class.items()])
        b, y = _knots(sizes, ys)
        if len(by_class) == 1:
            break
        off = {c: _class_offset(octave[i], log_t[i] - np.interp(size[i], b, y)) for c, i in by_class.items()}
        mean = [sum(o[j] for o in off.values()) / len(off) for j in (0, 1)]
        off = {c: (o[0] - mean[0], o[1] - mean[1]) for c, o in off.items()}
    return b, y, off


def _asymptote_s_per_bus_byte(
    size: np.ndarray, lat_s: np.ndarray, ops: np.ndarray, gpus: np.ndarray
) -> float | None:
    """β of t = a_(op,T) + β · bus_bytes, least squares on relative error over rows ≥ ASYMPTOTE_MIN_BYTES."""
    sel = size >= ASYMPTOTE_MIN_BYTES
    if len(np.unique(size[sel])) < 2:
        return None
    keys = [(str(o), int(g)) for o, g in zip(ops[sel], gpus[sel], strict=True)]
    cols = sorted(set(keys))
    a = np.zeros((len(keys), len(cols) + 1))
    for j, k in enumerate(cols):
        a[:, j] = [x == k for x in keys]
    a[:, -1] = [comm_bus_factor(o, g) * s for (o, g), s in zip(keys, size[sel], strict=True)]
    w = 1.0 / lat_s[sel]
    coef, *_ = np.linalg.lstsq(a * w[:, None], lat_s[sel] * w, rcond=None)
    return float(coef[-1]) if coef[-1] > 0 else None


def fit_comm_curves(
    cols: Mapping[str, np.ndarray], hw: HardwareSpec, prior: Mapping[str, Mapping[str, CommCurve]] | None = None
) -> dict[str, dict[str, CommCurve]]:
    """Curves per calibration backend name, keyed by :func:`comm_curve_key`, from measured collective rows.

    ``prior`` (curves of the GPU's cross-generation tier, same keys): a group measured at fewer than MIN_SIZES
    sizes with no GPU count of its own to borrow a shape from takes the prior curve's shape, scaled to its points;
    and every prior curve of a measured backend that the rows do not cover is kept as it is.
    """
    op = np.asarray(cols["op"]).astype(str)
    backend = row_backends(cols, hw).astype(str)
    dtypes = np.asarray(cols["dtype"]).astype(str) if "dtype" in cols else np.full(len(op), "bf16")
    dclass = np.array([comm_dtype_class(d) for d in dtypes])
    gpus = np.asarray(cols["num_gpus"], dtype=float).astype(int)
    size = np.asarray(cols["message_bytes"], dtype=float)
    lat = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    ok = np.isfinite(lat) & (lat > 0) & (size > 0) & (gpus > 1) & (backend != "")
    log_t = np.log(np.where(ok, lat, 1.0))
    groups: dict[tuple[str, str, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i in np.flatnonzero(ok):
        groups[(backend[i], op[i], int(gpus[i]))][dclass[i]].append(int(i))
    link = hw.intra_node_bytes_per_s

    def beta(idx: np.ndarray) -> float | None:
        return _asymptote_s_per_bus_byte(size[idx], lat[idx], op[idx], gpus[idx])

    def _latency_floor(rows: np.ndarray, g: int) -> float:
        """Fastest latency-bound (≤ LATENCY_BOUND_BYTES) row of a backend at GPU count g, else at any count, else
        its fastest row at all: a sparse sweep's fastest row at g may be a large, bandwidth-bound message."""
        small = rows[size[rows] <= LATENCY_BOUND_BYTES]
        # no such row (symmetric memory runs only from 256 KiB on H100 × 8, 8 MiB × 2): its rows up to 1 MiB,
        # still mostly latency (else H100's 2-GPU curve, first measured at 8 MiB, stayed at 45 µs all the way
        # down to the 2 MiB where B200 starts using it)
        mid = rows[size[rows] <= SMALL_LATENCY_BOUND_BYTES]
        for pool in (small[gpus[small] == g], small, mid[gpus[mid] == g], mid, rows[gpus[rows] == g], rows):
            if len(pool):
                return float(lat[pool].min())
        raise ValueError("no rows")

    shapes = {}
    for key, by in groups.items():
        by_class = {c: np.array(v) for c, v in by.items()}
        shapes[key] = (*_pooled_shape(by_class, size, log_t), by_class)
    out: dict[str, dict[str, CommCurve]] = defaultdict(dict)
    for (be, o, g), (b, y, off, by_class) in shapes.items():
        idx = np.concatenate(list(by_class.values()))
        borrowed_tail = None
        prior_curve = _prior_curve(prior, be, o, g, by_class)
        if len(b) < MIN_SIZES:
            near = [k for k, v in shapes.items() if k[:2] == (be, o) and k[2] != g and len(v[0]) >= MIN_SIZES]
            if near:  # borrow the nearest GPU count's shape, scaled to this group's own points
                n = (be, o, nearest_gpu_count([k[2] for k in near], g))
                b, y, _ = _rescaled_shape(shapes[n][0], shapes[n][1], size[idx], lat[idx],
                                          comm_bus_factor(o, n[2]) / link)
            elif prior_curve is not None:  # else the prior's shape of the same collective, fitted the same way
                b, y, scale = _rescaled_shape(np.array(prior_curve.message_bytes), np.log(prior_curve.latency_s),
                                              size[idx], lat[idx], prior_curve.tail_s_per_byte)
                borrowed_tail = prior_curve.tail_s_per_byte * scale
            elif be != NCCL and len(shapes.get((NCCL, o, g), ((),))[0]) >= MIN_SIZES and not np.any(
                    ok & (backend == be) & (size <= LATENCY_BOUND_BYTES)):
                # else, for an implementation that only ever ran large messages (no latency floor of its own to
                # draw a line from), NCCL's shape of the same collective and GPU count: symmetric memory at 25 %
                # of H100's rows had one size at 2 GPUs, and its own knots put 64 MiB at 187 µs, measured 307
                nb, ny = shapes[(NCCL, o, g)][:2]
                b, y, scale = _rescaled_shape(nb, ny, size[idx], lat[idx], comm_bus_factor(o, g) / link)
        same_backend = np.flatnonzero(ok & (backend == be))
        s_per_bus = (
            beta(idx)
            or beta(np.flatnonzero(ok & (op == o) & (gpus == g)))
            or beta(same_backend[gpus[same_backend] == g])
            # the prior's asymptote of this collective at this GPU count before measured ones at other counts
            # (over PCIe the bus bandwidth per GPU falls several-fold from 2 to 8 GPUs)
            or (prior_curve.tail_s_per_byte / comm_bus_factor(o, g) if prior_curve is not None else None)
            or beta(same_backend[op[same_backend] == o])
            or 1.0 / (0.7 * link)
        )
        tail = max(s_per_bus, 1.0 / link) * comm_bus_factor(o, g)
        if borrowed_tail is not None and beta(idx) is None:
            tail = max(borrowed_tail, comm_bus_factor(o, g) / link)
        smallest = float(size[same_backend].min())
        if b[0] > smallest:
            # below the first measured size, as a knot at the backend's smallest size: from a latency-bound first
            # knot its segment extended down to the backend's latency floor (nothing of that backend ran faster);
            # from a bandwidth-bound one the α–β line from the floor to it (extending a segment between 4 and
            # 256 MiB, 8 GPUs over PCIe, gave a 1.5 ms intercept, 100× the small-message latency). The line from
            # the floor for every first knot was tried: comm MAPE at the 25 % split A100 6.90 → 7.08, H100
            # 4.53 → 4.86 %.
            floor = _latency_floor(same_backend, g)
            if len(b) > 1 and b[0] <= LATENCY_BOUND_BYTES:
                t0, t1 = math.exp(y[0]), math.exp(y[1])
                head = max(t0 - (t1 - t0) / (b[1] - b[0]) * (b[0] - smallest), min(floor, t0))
            else:
                head = min(floor, math.exp(y[0]))
            b = np.concatenate([[smallest], b])
            y = np.concatenate([[math.log(head)], y])
        for c, (level, per_octave) in off.items():
            t = np.maximum.accumulate(np.exp(y + level + per_octave * np.log2(b / 2**20)))
            own = beta(by_class[c]) if len(off) > 1 else None  # a class's own asymptote when it has one
            c_tail = max(own, 1.0 / link) * comm_bus_factor(o, g) if own else tail
            out[be][comm_curve_key(o, c, g)] = CommCurve(
                tuple(float(x) for x in b), tuple(float(x) for x in t), float(c_tail)
            )
    for backend, curves in out.items():
        for key, curve in (prior or {}).get(backend, {}).items():
            curves.setdefault(key, curve)
    return dict(out)


def fit_comm(cols: Mapping[str, np.ndarray], hw: HardwareSpec, prior: Mapping[str, CommModel] | None = None
             ) -> dict[str, CommModel]:
    """Collective models per calibration backend (:data:`CALIBRATION_BACKENDS`: ``nccl``, and each all-reduce
    implementation vLLM dispatched measured rows to, ``custom`` / ``symm_mem`` in-graph, ``*_eager`` outside;
    :func:`row_backends`).

    Measured piecewise α–β curves per (op, dtype class, GPU count) (:func:`fit_comm_curves`), plus
    the single all-reduce α–β line they fall back to elsewhere: least squares on relative error of
    t = α_T + ring_bytes / (link_bw · f), with α per GPU count T. ``prior`` (the cross-generation tier's models):
    shapes for thinly measured collectives, curves for unmeasured ones, and a line where the rows cannot place one.
    """
    op = np.asarray(cols["op"])
    backend = row_backends(cols, hw)
    gpus = np.asarray(cols["num_gpus"], dtype=float)
    msg = np.asarray(cols["message_bytes"], dtype=float)
    lat = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    out: dict[str, CommModel] = {}
    for name in CALIBRATION_BACKENDS:
        sel = (op == "all_reduce") & (backend == name) & np.isfinite(lat) & (lat > 0)
        if sel.sum() < 3:
            continue
        line = _fit_line(msg[sel], gpus[sel].astype(int), lat[sel], hw.intra_node_bytes_per_s)
        if line is None and prior is not None and name in prior:
            line = prior[name]
        out[name] = line or _fit_line(msg[sel], gpus[sel].astype(int), lat[sel], hw.intra_node_bytes_per_s,
                                      force=True)
    prior_curves = {b: m.curves for b, m in (prior or {}).items()}
    for name, curves in fit_comm_curves(cols, hw, prior_curves).items():
        # no all-reduce line of its own: the prior's, else a default line for the other ops
        line = out.get(name) or (prior or {}).get(name) or CommModel(1.5e-5, 0.7)
        out[name] = CommModel(line.alpha_s, line.bus_bytes_per_s_fraction, dict(line.alpha_s_by_gpus), curves)
    return out


def _fit_line(msg: np.ndarray, gpus: np.ndarray, lat: np.ndarray, link_bytes_per_s: float,
              force: bool = False) -> CommModel | None:
    """All-reduce α–β line t = α_T + ring_bytes / (link · f), least squares on relative error.

    α_T is fitted where T was measured at ≥ 2 sizes (else α and bandwidth cannot be told apart there): elsewhere it
    is the nearest such T's, or with none at all the fastest measured all-reduce. A fit faster than the link (too
    few sizes) is None unless ``force``: then f = 1 and α_T is what the link leaves of each row (median per T).
    """
    bus_s = ring_bus_bytes(msg, gpus) / link_bytes_per_s
    g_vals = sorted(set(gpus.tolist()))
    free = [g for g in g_vals if len(np.unique(msg[gpus == g])) >= 2]
    w = 1.0 / lat
    cols = [(gpus == g).astype(float) for g in free]
    fixed = np.zeros(len(lat))
    if not free:
        fixed[:] = float(lat.min())
    else:
        for g in g_vals:
            if g not in free:
                near = nearest_gpu_count(free, g)
                cols[free.index(near)] = cols[free.index(near)] + (gpus == g)
    A = np.column_stack([*cols, bus_s])
    coef, *_ = np.linalg.lstsq(A * w[:, None], (lat - fixed) * w, rcond=None)
    coef = np.maximum(coef, 1e-9)
    if coef[-1] < 1.0:
        if not force:
            return None
        coef[-1] = 1.0
        alphas = {str(g): max(float(np.median((lat - bus_s)[gpus == g])), 1e-6) for g in g_vals}
        return CommModel(float(np.median(list(alphas.values()))), 1.0, alphas)
    alpha_of = {f: float(coef[j]) for j, f in enumerate(free)}
    alphas = {str(g): alpha_of[nearest_gpu_count(free, g)] if free else float(lat.min()) for g in g_vals}
    return CommModel(float(np.median(list(alphas.values()))), float(1.0 / coef[-1]), alphas)


def _rescaled_shape(b: np.ndarray, log_t: np.ndarray, own_size: np.ndarray, own_lat: np.ndarray, tail: float
                    ) -> tuple[np.ndarray, np.ndarray, float]:
    """A borrowed knot curve fitted to a thin group's own points, part by part: the curve is split into a bandwidth
    part (its last segment's slope × size) and the latency rest; own points where the bandwidth part dominates set
    its scale, the others the latency part's. Without latency-bound points the borrowed latency stays (one common
    factor, as before, scaled the 2-GPU shape's ~10 µs floor by 15× from bandwidth-bound 8-GPU PCIe points);
    without bandwidth-bound ones both parts take the common factor, as before. Returns (knots, log latencies, the
    bandwidth part's scale)."""
    t = np.exp(log_t)
    slope = (t[-1] - t[-2]) / (b[-1] - b[-2]) if len(b) > 1 else 0.0
    bw = slope * b
    lat_part = np.maximum(t - bw, 0.0)
    own_bw = slope * own_size
    own_lp = np.interp(own_size, b, lat_part, right=lat_part[-1])
    fitted = _interp_s(b, t, tail, own_size)
    by_bw = own_bw > own_lp
    common = float(np.median(own_lat / fitted))
    k = float(np.median(np.maximum(own_lat[by_bw] - own_lp[by_bw], 0.0) / own_bw[by_bw])) if by_bw.any() else common
    rest = own_lat[~by_bw] - k * own_bw[~by_bw]
    a = float(np.median(np.maximum(rest, 0.0) / np.maximum(own_lp[~by_bw], 1e-12))) if (~by_bw).any() else 1.0
    if k <= 0 or a <= 0:
        return b, log_t + math.log(common), common
    return b, np.log(np.maximum(a * lat_part + k * bw, 1e-9)), k


def _prior_curve(prior: Mapping[str, Mapping[str, CommCurve]] | None, backend: str, op: str, num_gpus: int,
                 by_class: Mapping[str, np.ndarray]) -> CommCurve | None:
    """The prior's curve of (backend, op, GPU count) in the group's first dtype class (else the 16-bit one)."""
    curves = (prior or {}).get(backend, {})
    for cls in (*sorted(by_class), "16"):
        found = curves.get(comm_curve_key(op, cls, num_gpus))
        if found is not None:
            return found
    return None


def _transfer_curve(
    curve: CommCurve, op: str, num_gpus: int, src: HardwareSpec, target: HardwareSpec, grid: np.ndarray
) -> tuple[np.ndarray, float]:
    """(target latency at ``grid``, tail s per message byte) of one source curve by the module-docstring rule."""
    bf = comm_bus_factor(op, num_gpus)
    t_src = _interp_s(np.array(curve.message_bytes), np.array(curve.latency_s), curve.tail_s_per_byte, grid)
    s_per_bus_src = max(curve.tail_s_per_byte / bf, 1e-300)
    fraction = 1.0 / (s_per_bus_src * src.intra_node_bytes_per_s)  # of the source's link actually reached
    latency = np.maximum(t_src - bf * grid * s_per_bus_src, 0.0)
    if has_fast_interconnect(src) == has_fast_interconnect(target):
        k_alpha, g_t = (src.boost_clock_hz / target.boost_clock_hz) ** LATENCY_CLOCK_EXPONENT, 1.0
    else:
        k_alpha = 1.0
        g_t = 2.0 / num_gpus if has_fast_interconnect(src) else num_gpus / 2.0
    bus_bytes_per_s = fraction * target.intra_node_bytes_per_s * g_t
    t = np.maximum.accumulate(k_alpha * latency + bf * grid / bus_bytes_per_s)
    return t, bf / bus_bytes_per_s


def comm_source_pool(sources: Sequence[tuple[Calibration, HardwareSpec]], target: HardwareSpec, backend: str
                     ) -> list[tuple[Calibration, HardwareSpec]]:
    """The sources a backend's collectives transfer from: those of the target's link class (NVLink-class vs
    PCIe-only) that have curves of it, else all that have curves of it (L40S's custom all-reduce is only the
    default α–β line: nobody measured it there), else all that have the backend at all."""
    have = [(c, h) for c, h in sources if backend in c.comm and c.comm[backend].curves] or [
        (c, h) for c, h in sources if backend in c.comm]
    return [(c, h) for c, h in have if has_fast_interconnect(h) == has_fast_interconnect(target)] or have


def transfer_comm_curves(
    sources: Sequence[tuple[Calibration, HardwareSpec]], target: HardwareSpec
) -> dict[str, dict[str, CommCurve]]:
    """Curves for ``target`` from the sources' curves: per backend, the sources of the target's link class that
    have it, else every source that has it (a PCIe target gets the custom all-reduce, measured only over NVLink,
    by the cross-class rule rather than none: vLLM runs it on two P2P-capable PCIe GPUs)."""
    out: dict[str, dict[str, CommCurve]] = defaultdict(dict)
    for backend in sorted({b for c, _ in sources for b in c.comm}):
        pool = comm_source_pool(sources, target, backend)
        keys = sorted({k for c, _ in pool if backend in c.comm for k in c.comm[backend].curves})
        for key in keys:
            op, _, g = key.split("/")
            have = [(c.comm[backend].curves[key], h) for c, h in pool
                    if backend in c.comm and key in c.comm[backend].curves]
            grid = np.unique(np.concatenate([np.array(cv.message_bytes) for cv, _ in have]))
            logs, tails = [], []
            for cv, h in have:
                t, tail = _transfer_curve(cv, op, int(g), h, target, grid)
                logs.append(np.log(t))
                tails.append(math.log(tail))
            t = np.maximum.accumulate(np.exp(np.mean(logs, axis=0)))
            out[backend][key] = CommCurve(
                tuple(float(x) for x in grid), tuple(float(x) for x in t), math.exp(sum(tails) / len(tails))
            )
    return dict(out)


__all__ = ["CALIBRATION_BACKENDS", "COMM_BACKENDS", "comm_source_pool", "fit_comm", "fit_comm_curves", "row_backends",
           "transfer_comm_curves"]
