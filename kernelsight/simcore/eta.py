"""η models: the learned efficiency of a kernel family as a function of its shape features.

η turns a roofline bound into a predicted time: ``kernel_s = roof_s / η + overhead_s``. Each family has
an :class:`EtaModel` evaluated on the family's shape features (see ``kernels.py`` for what each family's
features are): a constant or logistic default, the fitted :class:`LogPolyEta`, or a composite picking or
averaging such models (:class:`SwitchEta` by a categorical feature, :class:`DispatchEta` by the kernel vLLM runs,
:class:`EnsembleEta` over transferred sources). :func:`eta_model_from_dict` reads any of them from a calibration
file. Evaluation only: fitting is :mod:`kernelsight.calibrate.fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kernelsight.simcore.eta_basis import (
    RESIDUAL_COORDS,
    RESIDUAL_COORDS_SCALAR,
    SCALAR_BASES,
    TINY,
    basis_matrix,
    quadratic_design,
    residual_coordinates,
    transfer_eta_factor,
)
from kernelsight.simcore.residual_grid import ResidualGrid, grid_from_dict
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
        dev = self.device
        if "l2_bw_ratio_target" in dev or "fallback_peak_ratio" in dev or "clock_sustain_target" in dev:  # transferred
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
        dev = self.device
        if "l2_bw_ratio_target" in dev or "fallback_peak_ratio" in dev or "clock_sustain_target" in dev:
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


class _Deferred:
    """A residual lattice or tree ensemble of a calibration file, decoded when first used: a run prices a few of a
    table's variants, and decoding all of them was most of the start-up's calibration load. It stands for the object
    (attributes, calls, equality; it pickles and copies as the object itself)."""

    __slots__ = ("_build", "_data", "_obj")

    def __init__(self, build: Callable[[dict[str, Any]], Any], data: dict[str, Any]) -> None:
        self._build, self._data, self._obj = build, data, None

    def _get(self) -> Any:
        obj = self._obj
        if obj is None:       # two threads may both build it: the same object, one of them kept
            obj = self._obj = self._build(self._data)
        return obj

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._get()(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return self._get() == (other._get() if isinstance(other, _Deferred) else other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (_same, (self._get(),))

    def __repr__(self) -> str:
        return repr(self._get())


def _same(obj: Any) -> Any:
    return obj


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
        None if g is None else _Deferred(grid_from_dict, g),   # type: ignore[arg-type]
        None if d.get("zlo") is None else tuple(float(x) for x in d["zlo"]),
        None if d.get("zhi") is None else tuple(float(x) for x in d["zhi"]),
        None if d.get("trees") is None else _Deferred(ResidualTrees.from_dict, d["trees"]),   # type: ignore[arg-type]
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
        return eta_overhead_of(self.pick(features), features)

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
        return eta_overhead_of(self.pick(features), features)

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
            log_eta += w * np.log(np.maximum(e, TINY))
            log_ovh += w * np.log(np.maximum(o, 1e-12))
        return np.exp(log_eta), np.exp(log_ovh)

    def eta_overhead_scalar(self, features: tuple[float, ...]) -> tuple[float, float]:
        log_eta = log_ovh = 0.0
        for m, w in zip(self.members, self.weights, strict=True):
            e, o = eta_overhead_of(m, features)
            log_eta += w * math.log(max(e, TINY))
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


def eta_overhead_of(model: EtaModel, features: tuple[float, ...]) -> tuple[float, float | None]:
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


def fitted_gemm_nk(model: EtaModel | None) -> tuple[float, float]:
    """Widest n and k a GEMM η model was fitted on (its smooth basis' log n / log k range, over every sub-model);
    inf if none says. The sweeps stop at 65,536; a vocabulary-sized LM head (n = 128,256) is beyond, where η is
    held at the widest (the measured GEMVs' bandwidth is flat in n from 16k to 65k)."""
    n_max = k_max = 0.0
    stack = [model]
    while stack:
        m = stack.pop()
        if m is None:
            continue
        if isinstance(m, LogPolyEta):
            if m.basis == "gemm" and m.zhi is not None:
                n_max, k_max = max(n_max, math.exp(m.zhi[1])), max(k_max, math.exp(m.zhi[2]))
            continue
        for attr in ("models", "members", "pooled"):
            sub = getattr(m, attr, None)
            if isinstance(sub, dict):
                stack.extend(sub.values())
            elif isinstance(sub, tuple):
                stack.extend(sub)
            elif sub is not None:
                stack.append(sub)
    return (round(n_max) if n_max else math.inf), (round(k_max) if k_max else math.inf)


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


__all__ = [
    "ETA_FORMS",
    "ConstantEta",
    "DispatchEta",
    "DispatchNode",
    "DispatchRule",
    "EnsembleEta",
    "EtaModel",
    "LogPolyEta",
    "LogisticEta",
    "SwitchEta",
    "fitted_gemm_nk",
    "decode_serial_floor_s",
    "eta_model_from_dict",
    "switch_key",
]
