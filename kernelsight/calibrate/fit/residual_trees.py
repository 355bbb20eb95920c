"""Fitting the boosted regression trees of the target tier's step correction
(:class:`~kernelsight.simcore.residual_trees.ResidualTrees`).

Fitted on the smooth model's log residual *before* the lattice (the lattice then smooths what the steps leave).
On the 25 %/75 % split of the shared data (seed 0, ``benchmarks/kernel_accuracy.py``) this took the target tier's
GEMM / prefill / decode MAPE from 4.85 / 5.31 / 2.78 % to 4.18 / 3.90 / 2.05 % on the H100, 7.00 / 4.78 / 6.18 →
5.85 / 4.32 / 3.76 % on the A100 and 7.44 / 7.04 / 7.25 → 6.46 / 5.97 / 5.45 % on the L40S. Tried: trees stacked
on the lattice's in-sample residual instead (H100 4.43 / 5.04 / 2.55 %: the lattice already fits its training rows
closely, so little is left to learn from them); oblivious trees (one split per level, worse than the lattice
alone). With the launch-grid work counts among the coordinates, the same split went to GEMM / prefill / decode
4.02 / 3.34 / 1.90 % (H100), 4.85 / 3.27 / 3.33 % (A100) and 6.11 / 4.31 / 3.94 % (L40S). Tried: Huber-clipped
residuals and median leaves (±0.2, mixed), row subsampling per tree (±0.2), more tile shapes or tile sizes (≤ 0.05).

Squared loss on the log ratio, leaf value = learning rate × Σ residual / (count + l2), candidate thresholds at
midpoints between a coordinate's values (its quantiles above ``max_bins`` values). Histograms are built for each
parent's smaller child only (the other is the parent's minus it). Deterministic: no sampling, ties go to the lowest
coordinate and threshold. Leaves are rounded to :data:`~kernelsight.simcore.residual_trees.LEAF_STEP` while
fitting, so the stored model is the fitted one exactly.
"""

from __future__ import annotations

import numpy as np

from kernelsight.simcore.residual_trees import LEAF_STEP, THRESHOLD_DECIMALS, ResidualTrees

#: Defaults of :func:`fit_residual_trees`, chosen on the 25 %/75 % split of the shared A100 / H100 / L40S data
#: (H100 GEMM / decode / prefill of one variant: depth 6 × 200 trees 4.22 / 1.91 / 4.22 %, × 300 4.17 / 1.89 /
#: 4.05 %, depth 8 × 200 4.12 / 1.85 / 3.86 %, × 400 4.10 / 1.84 / 3.79 % for twice the fit time).
N_TREES = 200
DEPTH = 8
#: Fits on fewer rows use shallower trees (leaves of a depth-8 tree on ~1,300 rows would hold ~5 rows each).
SMALL_DEPTH = 6
DEEP_MIN_ROWS = 5_000
LEARNING_RATE = 0.1
MIN_LEAF = 5
L2 = 1.0
MAX_BINS = 64


def _cuts(col: np.ndarray, max_bins: int) -> np.ndarray:
    """Candidate thresholds of one coordinate: midpoints between its values (between quantiles if many)."""
    u = np.unique(col)
    if len(u) > max_bins:
        u = np.unique(np.quantile(col, np.linspace(0.0, 1.0, max_bins + 1)))
    return np.unique(np.round((u[1:] + u[:-1]) / 2.0, THRESHOLD_DECIMALS))


def fit_residual_trees(
    x: np.ndarray,
    y: np.ndarray,
    *,
    n_trees: int = N_TREES,
    depth: int | None = None,
    learning_rate: float = LEARNING_RATE,
    min_leaf: int = MIN_LEAF,
    l2: float = L2,
    max_bins: int = MAX_BINS,
) -> ResidualTrees:
    """Boost ``n_trees`` depth-``depth`` trees on (x, y) (squared loss, level-wise histogram splits); depth
    None: :data:`DEPTH`, or :data:`SMALL_DEPTH` below :data:`DEEP_MIN_ROWS` rows."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n, p = x.shape
    if depth is None:
        depth = DEPTH if n >= DEEP_MIN_ROWS else SMALL_DEPTH
    cuts = [_cuts(x[:, j], max_bins) for j in range(p)]
    n_bins = max(len(c) for c in cuts) + 1
    # bin b of coordinate j holds cuts[j][b-1] < x ≤ cuts[j][b]; a split "after bin b" is x > cuts[j][b]
    bins = np.stack([np.searchsorted(cuts[j], x[:, j], side="left") for j in range(p)], axis=1)
    flat_bins = (bins + (np.arange(p) * n_bins)[None, :]).astype(np.int32)
    bins_by_dim = np.ascontiguousarray(bins.T).ravel()    # bin of coordinate j of row i at j·n + i
    inner, n_leaves = (1 << depth) - 1, 1 << depth
    dims = np.zeros((n_trees, inner), dtype=np.int64)
    thresholds = np.full((n_trees, inner), np.inf)
    leaves = np.zeros((n_trees, n_leaves))
    fitted = np.zeros(n)
    span = p * n_bins
    flat_all = flat_bins.ravel()
    all_rows = np.arange(n)
    H_root = np.bincount(flat_all, None, span).reshape(1, p, n_bins)   # counts at the root never change
    g_rep = np.empty((n, p))     # each row's residual once per coordinate (a broadcast copy: np.repeat is slower)
    for t in range(n_trees if n_bins > 1 else 0):     # no coordinate varies: nothing to split, no correction
        g = y - fitted
        g_rep[:] = g[:, None]
        node = np.zeros(n, dtype=np.int32)
        go = np.zeros(n, dtype=bool)
        G = H = None
        for level in range(depth):
            width = 1 << level
            if level == 0:
                G, H = np.bincount(flat_all, g_rep.ravel(), span).reshape(1, p, n_bins), H_root
            else:
                # histograms of each parent's smaller child only; the other child's = its parent's − its sibling's
                half = width >> 1
                parent = node >> 1
                n_right = np.bincount(parent, go, half)
                right_small = n_right < np.bincount(parent, None, half) - n_right
                rows = np.flatnonzero(go == right_small[parent])
                idx = (np.take(flat_bins, rows, axis=0) + (parent[rows] * np.int32(span))[:, None]).ravel()
                GS = np.bincount(idx, np.take(g_rep, rows, axis=0).ravel(), half * span).reshape(half, p, n_bins)
                HS = np.bincount(idx, None, half * span).reshape(half, p, n_bins)
                rs = right_small[:, None, None]
                G2 = np.empty((width, p, n_bins))
                H2 = np.empty((width, p, n_bins))
                G2[0::2], G2[1::2] = np.where(rs, G - GS, GS), np.where(rs, GS, G - GS)
                H2[0::2], H2[1::2] = np.where(rs, H - HS, HS), np.where(rs, HS, H - HS)
                G, H = G2, H2
            GL, HL = np.cumsum(G, axis=2)[:, :, :-1], np.cumsum(H, axis=2)[:, :, :-1]
            GT, HT = G.sum(axis=2, keepdims=True), H.sum(axis=2, keepdims=True)
            GR, HR = GT - GL, HT - HL
            gain = GL * GL / (HL + l2) + GR * GR / (HR + l2) - GT * GT / (HT + l2)
            gain = np.where((HL >= min_leaf) & (HR >= min_leaf), gain, -np.inf).reshape(width, -1)
            best = gain.argmax(axis=1)
            ok = gain[np.arange(width), best] > 1e-12
            if not ok.any():   # a node that cannot split hands all its rows left: so can none below it
                node <<= depth - level
                break
            dim, b = best // (n_bins - 1), best % (n_bins - 1)
            heap = width - 1 + np.arange(width)
            split = np.flatnonzero(ok)
            dims[t, heap[split]] = dim[split]
            thresholds[t, heap[split]] = [cuts[int(dim[i])][int(b[i])] for i in split]
            limit = np.where(ok, b, n_bins)          # no split: every row goes left
            go = bins_by_dim[np.where(ok, dim, 0)[node] * n + all_rows] > limit[node]
            node = 2 * node + go
        G = np.bincount(node, g, n_leaves)
        H = np.bincount(node, None, n_leaves)
        leaves[t] = np.round(learning_rate * G / (H + l2) / LEAF_STEP) * LEAF_STEP
        fitted += leaves[t][node]
    return ResidualTrees(depth, dims, thresholds, leaves)


__all__ = ["fit_residual_trees"]
