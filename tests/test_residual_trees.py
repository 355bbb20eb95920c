"""Boosted residual trees: the target tier's correction for library kernel switches (steps in the shape)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.calibrate.fit.lattice import fit_residual_grid
from kernelsight.calibrate.fit.residual_trees import fit_residual_trees
from kernelsight.simcore.eta_basis import GEMM_TILES, PREFILL_QUERY_TILE, RESIDUAL_COORDS, RESIDUAL_COORDS_SCALAR
from kernelsight.simcore.residual_trees import LEAF_STEP, ResidualTrees


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
    lattice = fit_residual_grid(x[train], (0, 1, 2), y[train], np.ones(int(train.sum())), smooth=0.1,
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


def _gemm_wave_sweep():
    """GEMM shapes whose time relative to the roofline is the wave quantization of 128×128 output tiles over 132 SMs:
    log(⌈T/132⌉·132/T), T = ⌈m/128⌉·⌈n/128⌉. Returns (feature rows, y)."""
    m, n, k = np.meshgrid(np.arange(96.0, 4200.0, 37.0),
                          [1024.0, 1536.0, 2304.0, 3072.0, 3584.0, 4096.0, 5120.0, 6144.0, 7168.0, 9216.0],
                          [1024.0, 4096.0], indexing="ij")
    F = np.column_stack([m.ravel(), n.ravel(), k.ravel(), np.zeros(m.size)])
    tiles = np.ceil(F[:, 0] / 128) * np.ceil(F[:, 1] / 128)
    return F, np.log(np.ceil(tiles / 132) * 132 / tiles)


def test_tile_counts_let_trees_follow_wave_quantization_on_unseen_shapes():
    """The GEMM coordinates carry output tile counts, so a wave step (tiles crossing a multiple of the SM count,
    at different m for every n) is one split; on log m, log n, log k alone the trees need a staircase per n."""
    F, y = _gemm_wave_sweep()
    coords = RESIDUAL_COORDS["gemm"](F)
    assert coords.shape[1] == 4 + len(GEMM_TILES)
    train = np.random.default_rng(3).random(len(y)) < 0.25
    with_tiles = fit_residual_trees(coords[train], y[train])
    shape_only = fit_residual_trees(coords[train, :4], y[train])
    err_tiles = np.abs(with_tiles(coords[~train]) - y[~train]).mean()
    err_shape = np.abs(shape_only(coords[~train, :4]) - y[~train]).mean()
    assert err_tiles < 0.5 * err_shape


def test_raw_coordinates_scalar_path_matches_vector_path():
    rng = np.random.default_rng(5)
    n = 200
    seqs, new = rng.integers(1, 300, n).astype(float), rng.integers(1, 9000, n).astype(float)
    heads = rng.choice([8.0, 32.0, 64.0], n)
    rows = {
        "gemm": np.column_stack([rng.integers(1, 9000, n), rng.integers(64, 30000, n), rng.integers(64, 30000, n),
                                 rng.integers(0, 3, n)]).astype(float),
        "attn_prefill": np.column_stack([seqs, new, new + rng.integers(0, 500, n), heads, heads / 4,
                                         np.full(n, 128.0), np.full(n, 2.0), rng.choice([0.0, 4096.0], n)]),
        "attn_decode": np.column_stack([seqs, new, heads, heads / 8, np.full(n, 128.0), np.full(n, 1.0),
                                        rng.choice([0.0, 1024.0], n)]),
    }
    for basis, F in rows.items():
        vec = RESIDUAL_COORDS[basis](F)
        for i in range(0, n, 7):
            assert RESIDUAL_COORDS_SCALAR[basis](tuple(F[i])) == pytest.approx(vec[i].tolist(), abs=1e-12)
    # the prefill CTA count: seqs × q heads × ⌈new tokens / 128⌉
    F = rows["attn_prefill"]
    np.testing.assert_allclose(RESIDUAL_COORDS["attn_prefill"](F)[:, -1],
                               np.log(F[:, 0] * F[:, 3] * np.ceil(F[:, 1] / PREFILL_QUERY_TILE)))


def test_scalar_path_is_bit_identical_to_a_tree_by_tree_walk():
    """The step model's one-row path descends all trees at once with numpy; it must give exactly what walking
    each tree in Python and summing leaves in tree order gives (simulated timings must not move by one ulp),
    on both sides of every threshold, including rows sitting exactly on one."""
    x, y = _switching_sweep()
    trees = fit_residual_trees(x, y, n_trees=60, depth=4)
    first_leaf = (1 << trees.depth) - 1

    def walk(row: list[float]) -> float:
        total = 0.0
        for d, t, v in zip(trees.dims.tolist(), trees.thresholds.tolist(), trees.leaves.tolist(), strict=True):
            i = 0
            for _ in range(trees.depth):
                i = 2 * i + (2 if row[d[i]] > t[i] else 1)
            total += v[i - first_leaf]
        return total

    on_threshold = np.tile(x[0], (8, 1))
    finite = np.isfinite(trees.thresholds)
    for j, (t, node) in enumerate(zip(*np.nonzero(finite), strict=True)):
        if j == 8:
            break
        on_threshold[j, trees.dims[t, node]] = trees.thresholds[t, node]
    rows = np.vstack([x, on_threshold, np.random.default_rng(2).normal(7.0, 2.0, (50, 3))])
    got = [trees.scalar(r.tolist()) for r in rows]
    assert got == [walk(r.tolist()) for r in rows]
    assert got == trees(rows).tolist()
    assert len(set(got)) > 3                                 # the rows reach different leaves


def test_a_loaded_calibration_decodes_each_residual_when_first_used_and_pickles_as_decoded():
    """Residual lattices and trees of a bundled table are decoded on first use (start-up decodes none of them): the
    prices are the eagerly decoded objects', and a pickled calibration carries the decoded objects."""
    import pickle

    from kernelsight import profiles
    from kernelsight.simcore.calibration import calibration_from_dict
    from kernelsight.simcore.residual_grid import ResidualGrid, grid_from_dict
    from kernelsight.simcore.residual_trees import ResidualTrees

    calib = profiles.load_calibration("h100")
    raw = profiles._read_json(profiles._package_dir("calibration") / "h100-sxm.json")
    m = calib.eta["gemm"].models["0"]
    assert m.grid is not None and m.grid._obj is None and m.trees._obj is None      # not decoded yet
    features = (64.0, 4096.0, 4096.0, 0.0)
    eta, overhead = m.eta_overhead_scalar(features)
    assert isinstance(m.grid._obj, ResidualGrid) and isinstance(m.trees._obj, ResidualTrees)
    eager = raw["eta"]["gemm"]["models"]["0"]
    assert m.grid.to_dict() == grid_from_dict(eager["grid"]).to_dict()
    assert m.trees.to_dict() == ResidualTrees.from_dict(eager["trees"]).to_dict()
    again = calibration_from_dict(raw).eta["gemm"].models["0"]
    assert again.eta_overhead_scalar(features) == (eta, overhead)
    copy = pickle.loads(pickle.dumps(calib.eta["gemm"].models["1"]))
    assert isinstance(copy.grid, ResidualGrid) or copy.grid is None
    assert copy.to_dict() == calib.eta["gemm"].models["1"].to_dict()
