"""Which kernel vLLM runs for a shape, learned from measured rows that name it (the ``kernel`` column).

Per GPU each shape ran exactly one kernel, chosen by the library from the shape, so a shallow classification tree
over the raw shape axes (:data:`~kernelsight.simcore.eta_basis.RESIDUAL_COORDS`) reproduces the choice; the
resulting :class:`~kernelsight.simcore.eta.DispatchRule` names the kernel where only the shape is known
(the simulator, shape-only files).
"""

from __future__ import annotations

import numpy as np

from kernelsight.simcore.eta import DispatchRule

#: Depth limit and smallest leaf of the learned dispatch tree (vLLM's rules are a few thresholds per format).
DISPATCH_MAX_DEPTH = 6
DISPATCH_MIN_LEAF = 1


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


__all__ = ["DISPATCH_MAX_DEPTH", "DISPATCH_MIN_LEAF", "fit_dispatch_rule"]
