"""Boosted regression trees on a kernel family's raw shape coordinates: the target tier's step correction.

Why trees: neighbouring shapes of a sweep often run different library kernels (cuBLAS tile and split-K
choices, an attention kernel's split heuristics), so kernel time jumps at thresholds of m, n, k, sequence
count or context that a smooth model and a multilinear lattice both blur across a knot interval. A tree
split sits exactly at such a threshold. Evaluation only: fitting (and what it measured) is
:mod:`kernelsight.calibrate.fit.residual_trees`.

The coordinates (``eta_basis.RESIDUAL_COORDS``) also carry the work counts a launch grid depends on: GEMM output
tiles at three tile shapes, prefill attention CTAs, decode KV tokens / query rows / KV head-tokens. A wave
filling up (tiles crossing a multiple of the SM count) or a split heuristic keyed on such a count is then one
split, not a staircase over m and n.

Form: ``n_trees`` complete binary trees of depth ``depth`` (heap order), each internal node a threshold on
one coordinate (``x[dim] > threshold`` goes right; a node that did not split has threshold +inf), leaves
holding log-time corrections; the correction is the sum over trees. Leaves are multiples of :data:`LEAF_STEP`
and thresholds rounded to :data:`THRESHOLD_DECIMALS`, so the stored model is the fitted one exactly.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Leaf values are multiples of this (log units; stored as int16).
LEAF_STEP = 1e-4
#: Thresholds are stored rounded to this many decimals (they are midpoints of logs of measured sizes).
THRESHOLD_DECIMALS = 6


@dataclass(frozen=True, slots=True)
class ResidualTrees:
    """Sum of depth-``depth`` regression trees; arrays are (trees, nodes) in heap order."""

    depth: int
    dims: np.ndarray          # (T, 2^depth − 1) int: coordinate tested at each internal node
    thresholds: np.ndarray    # (T, 2^depth − 1) float: +inf where the node did not split
    leaves: np.ndarray        # (T, 2^depth) float: log-time correction of each leaf
    # flat copies for :meth:`scalar`: node j of tree t at t·(2^depth − 1) + j, leaf j at t·2^depth + j
    _flat: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n_trees, inner = self.dims.shape
        tree_rows = np.arange(n_trees, dtype=np.intp)
        object.__setattr__(self, "_flat", (
            np.ascontiguousarray(self.dims, dtype=np.intp).ravel(),
            np.ascontiguousarray(self.thresholds, dtype=float).ravel(),
            np.ascontiguousarray(self.leaves, dtype=float).ravel(),
            tree_rows * inner,
            tree_rows * self.leaves.shape[1] - inner))   # leaf offset minus the first leaf's heap index

    @property
    def n_trees(self) -> int:
        return len(self.leaves)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Correction of each row of ``x`` (rows × coordinates); one tree at a time over all rows."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        n = len(x)
        flat = np.ascontiguousarray(x.T).ravel()      # coordinate j of row i at j·n + i
        rows = np.arange(n)
        first_leaf = (1 << self.depth) - 1
        out = np.zeros(n)
        for dims, thresholds, leaves in zip(self.dims, self.thresholds, self.leaves, strict=True):
            node = np.zeros(n, dtype=np.intp)
            for _ in range(self.depth):
                node = 2 * node + 1 + (flat[dims[node] * n + rows] > thresholds[node])
            out += leaves[node - first_leaf]
        return out

    def scalar(self, x: list[float]) -> float:
        """Correction at one coordinate row (the step model's uncached path): all trees descend at once.

        Numpy over the trees, not Python over trees × levels (200 trees of depth 8: ~1.7 ms in Python, the
        largest cost of a fast-forward run). The leaves are summed left to right by ``cumsum``, exactly the
        order of a Python loop over the trees, so the result is bit-identical to it.
        """
        dims, thresholds, leaves, node_base, leaf_base = self._flat
        xs = np.asarray(x, dtype=float)
        node = np.zeros(len(node_base), dtype=np.intp)
        for _ in range(self.depth):
            at = node_base + node
            node = 2 * node + 1 + (xs[dims[at]] > thresholds[at])
        return float(leaves[leaf_base + node].cumsum()[-1]) + 0.0   # + 0.0: a Python sum from 0.0 never is −0.0

    def to_dict(self) -> dict[str, Any]:
        def b64(a: np.ndarray, dtype: str) -> str:
            return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype=dtype).tobytes(), 9)).decode("ascii")

        # thresholds as indices into the sorted table of distinct values (a few hundred), −1 = no split
        finite = np.isfinite(self.thresholds)
        table = np.unique(self.thresholds[finite])
        index = np.where(finite, np.searchsorted(table, np.where(finite, self.thresholds, 0.0)), -1)
        return {
            "form": "boosted_trees",
            "depth": self.depth,
            "n_trees": self.n_trees,
            "threshold_table": [round(float(v), THRESHOLD_DECIMALS) for v in table],
            # zlib-compressed little-endian arrays, base64
            "dims_u8_z": b64(self.dims, "u1"),
            "threshold_index_i16_z": b64(index, "<i2"),
            "leaves_i16_z": b64(np.round(self.leaves / LEAF_STEP), "<i2"),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResidualTrees:
        depth, n = int(d["depth"]), int(d["n_trees"])
        inner, n_leaves = (1 << depth) - 1, 1 << depth

        def arr(key: str, dtype: str, cols: int) -> np.ndarray:
            return np.frombuffer(zlib.decompress(base64.b64decode(d[key])), dtype=dtype).reshape(n, cols)

        table = np.asarray(d["threshold_table"], dtype=float)
        index = arr("threshold_index_i16_z", "<i2", inner).astype(np.int64)
        thresholds = np.where(index >= 0, table[np.maximum(index, 0)] if len(table) else 0.0, np.inf)
        return cls(depth, arr("dims_u8_z", "u1", inner).astype(np.int64), thresholds,
                   arr("leaves_i16_z", "<i2", n_leaves).astype(float) * LEAF_STEP)
