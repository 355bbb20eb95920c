"""Boosted residual trees: the target tier's correction for library kernel switches (steps in the shape)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.simcore import eta_fit
from kernelsight.simcore.residual_trees import LEAF_STEP, ResidualTrees, fit_residual_trees


def _switching_sweep(seed: int = 0):
    """A (log m, log n, log k) sweep whose log time steps where a library would switch kernels: +0.3 above
    m = 1000 at every n, k, and +0.15 where n > 3000 meets k < 500 (a split-K choice). Returns (x, y)."""
    m, n, k = np.meshgrid([16.0, 64.0, 256.0, 768.0, 1024.0, 1025.0, 2048.0, 4096.0, 8192.0],
                          [256.0, 1024.0, 2048.0, 3072.0, 4096.0, 8192.0],
                          [128.0, 256.0, 512.0, 1024.0, 4096.0], indexing="ij")
    x = np.column_stack([np.log(m.ravel()), np.log(n.ravel()), np.log(k.ravel())])
    y = 0.3 * (m.ravel() > 1000) + 0.15 * ((n.ravel() > 3000) & (k.ravel() < 500))
    y = y + np.random.default_rng(seed).normal(0.0, 0.005, len(y))
    return x, y


def test_trees_recover_kernel_switch_steps_on_unseen_shapes():
    """Fitted on a quarter of the sweep, the trees put the steps where they are, at every unseen shape; a lattice
    with knots at the measured values, fitted on the same rows, smears the m step across a knot interval."""
    x, y = _switching_sweep()
    train = np.random.default_rng(1).random(len(y)) < 0.25
    trees = fit_residual_trees(x[train], y[train])
    err_trees = np.abs(trees(x[~train]) - y[~train])
    assert err_trees.mean() < 0.02 and err_trees.max() < 0.08
    lattice = eta_fit.fit_residual_grid(x[train], (0, 1, 2), y[train], np.ones(int(train.sum())), smooth=0.1,
                                        coords="raw")
    err_lattice = np.abs(lattice(x[~train]) - y[~train])
    assert err_lattice.mean() > 2.0 * err_trees.mean()


def test_trees_are_deterministic_and_round_trip_exactly():
    x, y = _switching_sweep()
    a, b = fit_residual_trees(x, y, n_trees=40), fit_residual_trees(x, y, n_trees=40)
    assert np.array_equal(a.thresholds, b.thresholds) and np.array_equal(a.leaves, b.leaves)
    back = ResidualTrees.from_dict(json.loads(json.dumps(a.to_dict())))
    assert np.array_equal(back(x), a(x))
    for row, v in zip(x[::17], a(x[::17]), strict=True):
        assert a.scalar(row.tolist()) == pytest.approx(v, abs=1e-12)
    # leaves are stored on their grid, so the loaded model is the fitted one
    assert np.allclose(a.leaves / LEAF_STEP, np.round(a.leaves / LEAF_STEP), atol=1e-9)


def test_no_split_without_signal_or_without_rows():
    x, _ = _switching_sweep()
    flat = fit_residual_trees(x, np.full(len(x), 0.02), n_trees=5)
    assert np.isinf(flat.thresholds).all()                   # nothing to split on: every node passes rows left
    assert np.allclose(flat(x), flat(x)[0])
    few = fit_residual_trees(x[:8], np.arange(8.0), n_trees=5, min_leaf=5)
    assert np.isinf(few.thresholds).all()                    # 8 rows cannot make two leaves of 5
    same = fit_residual_trees(np.ones((30, 3)), np.arange(30.0), n_trees=5)   # no coordinate varies
    assert np.isinf(same.thresholds).all() and not same(np.ones((2, 3))).any()


def test_small_samples_get_shallow_trees():
    x, y = _switching_sweep()
    assert fit_residual_trees(x, y, n_trees=2).depth == 6       # 270 rows
    big = np.repeat(x, 20, axis=0)
    assert fit_residual_trees(big, np.repeat(y, 20), n_trees=2).depth == 8
