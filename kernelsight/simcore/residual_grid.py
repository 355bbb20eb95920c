"""The target tier's residual lattice: a multilinear log-time correction on knots over a few coordinate dims.

Evaluation and (de)serialization only; fitting is :mod:`kernelsight.calibrate.fit.lattice`. The lattice is keyed
on the raw residual coordinates of :mod:`kernelsight.simcore.eta_basis` (older files: on the smooth basis).
"""

from __future__ import annotations

import base64
import bisect
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernelsight.simcore.eta_basis import (
    RESIDUAL_COORDS_SCALAR,
    WINDOW_COLUMNS,
    WINDOW_COORD,
    residual_coordinates,
)


@functools.lru_cache(maxsize=16)
def _corner_bits(d: int) -> np.ndarray:
    """The 2^d corners of a unit cell as 0/1 offsets."""
    return (np.arange(1 << d)[:, None] >> np.arange(d)[None, :]) & 1


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
                c[WINDOW_COORD] = 0.0
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


def grid_from_dict(g: dict[str, Any]) -> ResidualGrid:
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


__all__ = ["ResidualGrid", "knot_coordinates"]
