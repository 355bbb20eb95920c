"""Calibration fit: physics floor, bounded η, determinism, JSON round trip, accuracy vs roofline."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_shared

from kernelsight.calibrate.evaluate import format_results, mape_table, roofline_calibration
from kernelsight.calibrate.fit.eta import SELECT_MAX_ROWS, fit_calibration
from kernelsight.calibrate.fit.lattice import (
    GAP_CV_MIN_ROWS,
    GRID_DIMS,
    GRID_GAP_CHOICES,
    GRID_MIN_GAPS,
    GRID_STAGES,
    WINDOW_FREE_MIN_PAIRS,
    _fold_stages,
    choose_lattice_gaps,
    fit_residual_grid,
    window_is_free,
)
from kernelsight.calibrate.fit.logpoly import device_constants, fit_logpoly
from kernelsight.calibrate.fit.transfer import cross_generation_calibration
from kernelsight.calibrate.measurements import Table, read_measurements
from kernelsight.calibrate.rows import eta_and_overhead, kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.profiles import load_hardware
from kernelsight.simcore.calibration import calibration_from_dict, default_calibration
from kernelsight.simcore.eta import DispatchEta, EnsembleEta, LogPolyEta, SwitchEta
from kernelsight.simcore.eta_basis import RESIDUAL_COORDS, RESIDUAL_COORDS_SCALAR, basis_matrix, residual_coordinates
from kernelsight.simcore.kernels import attention_decode_kernel, gemm_kernel
from kernelsight.simcore.residual_grid import ResidualGrid, grid_from_dict
from kernelsight.simcore.roofline import kernel_roofline_s

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
pytestmark = needs_shared(DATA)


def _subset(tables: dict[str, Table], n: int, seed: int) -> dict[str, Table]:
    rng = np.random.default_rng(seed)
    out = {}
    for fam, t in tables.items():
        idx = np.sort(rng.choice(len(t), size=min(n, len(t)), replace=False))
        out[fam] = t.subset(idx)
    return out


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-sxm")


@pytest.fixture(scope="module")
def h100_tables():
    return read_measurements(DATA / "h100_sxm")


@pytest.fixture(scope="module")
def small_fit(h100, h100_tables):
    train = _subset(h100_tables, 2500, seed=1)
    calib, report = fit_calibration({f: t.columns for f, t in train.items()}, h100)
    return calib, report


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
def test_fit_is_deterministic(h100, h100_tables):
    train = _subset({"gemm": h100_tables["gemm"]}, 1500, seed=2)
    cols = {f: t.columns for f, t in train.items()}
    a, _ = fit_calibration(cols, h100)
    b, _ = fit_calibration(cols, h100)
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_fitted_eta_is_bounded(small_fit, h100_tables):
    calib, _ = small_fit
    for fam in ("gemm", "attn_prefill", "attn_decode"):
        model = calib.eta[fam]
        assert isinstance(model, SwitchEta)
        rows = kernel_rows(
            fam, h100_tables[fam].subset(np.arange(0, len(h100_tables[fam]), 37)).columns
        )
        eta, ovh = eta_and_overhead(calib, fam, rows)
        assert np.all(eta >= calib.eta_floor) and np.all(eta <= calib.eta_max)
        assert np.all(ovh > 0) and np.all(ovh < 1e-3)  # fixed latency: µs, not ms
        for variant in model.models.values():
            # a format / KV dtype that ran several kernels (the `kernel` column) has one model per kernel
            subs = list(variant.models.values()) if isinstance(variant, DispatchEta) else [variant]
            for sub in subs:
                assert isinstance(sub, LogPolyEta)
                raw = sub.smooth_eta(np.zeros((1, len(sub.center))) + np.asarray(sub.center))
                assert sub.lo <= raw[0] <= sub.hi


def test_no_prediction_faster_than_roofline_over_eta_max(small_fit, h100, h100_tables):
    calib, _ = small_fit
    for fam in ("gemm", "attn_prefill", "attn_decode"):
        t = h100_tables[fam].subset(np.arange(0, len(h100_tables[fam]), 11))
        rows = kernel_rows(fam, t.columns)
        roof = roofline_rows_s(rows, h100)
        pred = predict_rows_s(fam, t.columns, h100, calib)
        assert np.all(pred >= roof / calib.eta_max * (1 - 1e-12))
    # the scalar path the step model uses obeys the same floor
    for k in (
        gemm_kernel("g", 4096, 8192, 8192, "bf16", 2.0, 2.0),
        gemm_kernel("g", 7, 512, 4096, "fp8", 1, 2),
        attention_decode_kernel(64, 64 * 4096, 32, 8, 128, 2.0, 2.0),
    ):
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, h100)
        t = roof / calib.kernel_eta(k.family, k.features) + calib.kernel_overhead_s(k.family, k.features)
        assert t >= roof / calib.eta_max


def test_json_round_trip_preserves_predictions(small_fit, h100, h100_tables):
    calib, _ = small_fit
    again = calibration_from_dict(json.loads(json.dumps(calib.to_dict())))
    assert again.tier == "target-measured" and again.eta_max == calib.eta_max
    for fam in ("gemm", "attn_decode"):
        t = h100_tables[fam].subset(np.arange(0, len(h100_tables[fam]), 97))
        a = predict_rows_s(fam, t.columns, h100, calib)
        b = predict_rows_s(fam, t.columns, h100, again)
        np.testing.assert_allclose(a, b, rtol=1e-3)   # lattice stored as log-ratio × 1000 (≤ 0.05%)
    assert set(again.comm) >= {"nccl", "custom"}


def test_fit_beats_roofline_on_unseen_rows(small_fit, h100, h100_tables):
    calib, _ = small_fit
    test = _subset(h100_tables, 3000, seed=7)
    fitted = mape_table(test, h100, calib)
    roof = mape_table(test, h100, roofline_calibration(h100))
    for fam in ("gemm", "attn_prefill", "attn_decode"):
        assert fitted[fam]["mape"] < 0.2, (fam, fitted[fam])
        assert fitted[fam]["mape"] < 0.5 * roof[fam]["mape"]


def test_mape_splits_by_variant(h100, h100_tables):
    """Each family's MAPE is also given per variant (format / KV dtype / backend and the kernel that ran): the
    variants partition the judged rows, so their row-weighted mean is the family's MAPE."""
    test = _subset(h100_tables, 3000, seed=7)
    res = mape_table(test, h100, roofline_calibration(h100))
    gemm = res["gemm"]["variants"]
    assert "bf16 torch.nn.functional.linear" in gemm and any(v.startswith("fp8_block ") for v in gemm)
    assert "custom" not in res["comm"]["variants"] and "vllm_custom_graph" in res["comm"]["variants"]
    assert "variants" not in res["attn_encoder"]   # one format, one kernel (FA3): nothing to split
    for fam, r in res.items():
        if fam == "attn_encoder":
            continue
        v = r["variants"]
        assert sum(x["rows"] for x in v.values()) == r["rows"]
        assert math.isclose(sum(x["mape"] * x["rows"] for x in v.values()) / r["rows"], r["mape"], rel_tol=1e-9)
        assert len({round(x["mape"], 6) for x in v.values()}) > 1, fam   # not one number copied
    text = format_results({"roofline": res})
    assert "  fp8 CutlassFP8ScaledMMLinearKernel" in text and "  bf16 vllm_flash_attn_fa3" in text


def test_scalar_and_vector_paths_agree(small_fit, h100):
    calib, _ = small_fit
    k = gemm_kernel("g", 300, 5120, 4096, "bf16", 2.0, 2.0)
    rows = kernel_rows(
        "gemm",
        {
            "dtype": np.array(["bf16"]),
            "m": np.array([300.0]),
            "n": np.array([5120.0]),
            "k": np.array([4096.0]),
        },
    )
    eta, ovh = eta_and_overhead(calib, "gemm", rows)
    assert calib.kernel_eta("gemm", k.features) == pytest.approx(eta[0])
    assert calib.kernel_overhead_s("gemm", k.features) == pytest.approx(ovh[0])
    # old-style 3-feature GEMM tuples fall back to the default (bf16) variant
    assert calib.kernel_eta("gemm", k.features[:3]) == pytest.approx(eta[0])


def _logpoly_models(model) -> list[LogPolyEta]:
    if isinstance(model, LogPolyEta):
        return [model]
    if isinstance(model, SwitchEta | DispatchEta):
        return [m for sub in model.models.values() for m in _logpoly_models(sub)]
    if isinstance(model, EnsembleEta):
        return [m for sub in model.members for m in _logpoly_models(sub)]
    return []


def test_target_fit_carries_residual_trees_and_the_transfer_drops_them(small_fit, h100):
    """The trees encode one GPU's library switches: fitted in the target tier (and saved), never transferred.
    Sub-models of at least SELECT_MAX_ROWS rows get the full model (trees and lattice); smaller ones (here the
    block-fp8 GEMM kernels) pick theirs by cross-validation."""
    calib, report = small_fit
    fitted = [m for fam in ("gemm", "attn_prefill", "attn_decode") for m in _logpoly_models(calib.eta[fam])]
    assert fitted and any(m.trees is not None for m in fitted)
    big = [calib.eta[fam].models[v] for fam, v in (("gemm", "0"), ("gemm", "1"), ("attn_decode", "1"))]
    assert all(report.entries[k]["rows"] >= SELECT_MAX_ROWS for k in ("gemm[0]", "gemm[1]", "attn_decode[1]"))
    assert all(isinstance(m, LogPolyEta) and m.trees is not None and m.grid is not None for m in big)
    back = calibration_from_dict(json.loads(json.dumps(calib.to_dict())))
    k = gemm_kernel("g", 300, 5120, 4096, "bf16", 2.0, 2.0)
    assert back.kernel_eta("gemm", k.features) == pytest.approx(calib.kernel_eta("gemm", k.features), rel=1e-3)
    cross = cross_generation_calibration(load_hardware("l40s"), [(calib, h100)])
    moved = [m for fam in ("gemm", "attn_prefill", "attn_decode") for m in _logpoly_models(cross.eta[fam])]
    assert moved and all(m.trees is None and m.grid is None for m in moved)


# ------------------------------------------------------------------------------------------------
# target-tier residual lattice (raw shape coordinates)
# ------------------------------------------------------------------------------------------------
def _decode_features(batch, ctx, qh, kvh, hd, window, kv_bytes=2.0) -> np.ndarray:
    """attn_decode feature rows (seqs, ctx, qh, kvh, hd, kv_bytes, window) from broadcastable columns."""
    cols = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (batch, ctx, qh, kvh, hd, kv_bytes, window)))
    return np.column_stack(cols)


def _synthetic_decode_grid(smooth: float = 1e-4):
    """A lattice fitted to a known log-ratio on a full decode sweep: window rows ×3, plus a ctx trend."""
    b, c, w = np.meshgrid([1.0, 4.0, 16.0, 64.0], [1.0, 15.0, 255.0, 4095.0], [0.0, 128.0], indexing="ij")
    F = _decode_features(b.ravel(), c.ravel(), 32.0, 8.0, 128.0, w.ravel())
    target = np.where(F[:, 6] > 0, np.log(3.0), 0.0) + 0.05 * np.log(F[:, 1])
    coords = RESIDUAL_COORDS["attn_decode"](F)
    grid = fit_residual_grid(coords, (0, 1, 5), target, np.ones(len(F)), smooth=smooth, coords="raw")
    return grid, F, target


def test_residual_lattice_reproduces_training_points():
    grid, F, target = _synthetic_decode_grid()
    got = grid(RESIDUAL_COORDS["attn_decode"](F))
    np.testing.assert_allclose(got, target, atol=0.02)
    # the window is an axis of its own: same effective context, different kernel path, different correction
    assert grid.shape == (4, 4, 2) and grid.coords == "raw"


def test_residual_lattice_is_clamped_outside_and_scalar_agrees():
    grid, F, _ = _synthetic_decode_grid()
    edge = RESIDUAL_COORDS["attn_decode"](_decode_features(64.0, 4095.0, 32.0, 8.0, 128.0, 128.0))
    far = RESIDUAL_COORDS["attn_decode"](_decode_features(1e6, 1e9, 32.0, 8.0, 128.0, 1e7))
    assert grid(far)[0] == pytest.approx(grid(edge)[0])   # edge value holds beyond the lattice
    assert abs(grid(far)[0]) <= max(abs(v) for v in grid.values)
    mid = _decode_features([3.0, 20.0], [100.0, 3000.0], 32.0, 8.0, 128.0, [0.0, 60.0])
    vec = grid(RESIDUAL_COORDS["attn_decode"](mid))
    for row, v in zip(mid, vec, strict=True):
        assert grid.scalar(RESIDUAL_COORDS_SCALAR["attn_decode"](tuple(row))) == pytest.approx(v, abs=1e-12)


def test_residual_lattice_json_round_trip():
    grid, F, _ = _synthetic_decode_grid()
    again = grid_from_dict(json.loads(json.dumps(grid.to_dict())))
    assert again.coords == "raw" and again.dims == grid.dims and again.shape == grid.shape
    z = RESIDUAL_COORDS["attn_decode"](F)
    np.testing.assert_allclose(again(z), grid(z), atol=1e-3)   # stored as int16 milli-log-ratios


def test_residual_cannot_push_eta_above_eta_max(h100):
    """A lattice asking for a huge speed-up (log-ratio −3) still leaves η ≤ eta_max: predictions ≥ roof/η_max."""
    grid, F, _ = _synthetic_decode_grid()
    fast = ResidualGrid(grid.dims, grid.knots, tuple(-3.0 for _ in grid.values), "raw")
    dev = device_constants("attn_decode", "2", h100)
    z = basis_matrix("attn_decode", F, dev)
    beta, ovh, center, scale = fit_logpoly(z, np.full(len(F), 1e-5), np.full(len(F), 2e-5))
    model = LogPolyEta("attn_decode", dev, tuple(center), tuple(scale), tuple(beta), overhead_s=ovh, grid=fast)
    calib = default_calibration(h100.name)
    calib.eta["attn_decode"] = model
    calib.eta_max = 1.2
    for row in F:
        assert calib.kernel_eta("attn_decode", tuple(row)) <= 1.2
    rows = kernel_rows(
        "attn_decode",
        {
            "batch": F[:, 0], "cached_len": F[:, 1] - 1, "num_heads": F[:, 2], "num_kv_heads": F[:, 3],
            "head_dim": F[:, 4], "kv_dtype": np.full(len(F), "bf16"), "window": F[:, 6],
        },
    )
    eta, _ = eta_and_overhead(calib, "attn_decode", rows)
    assert np.all(eta <= 1.2)


def test_fitted_lattices_use_raw_coordinates_and_agree_scalar(small_fit):
    """Fitted attention lattices key on the raw sweep axes; the step model's scalar path gives the same η."""
    calib, _ = small_fit
    model = calib.eta["attn_decode"].models["2"]
    if isinstance(model, DispatchEta):   # bf16 KV ran FA3 and FA4 on the H100: the majority kernel's model
        model = model.models[model.default]
    assert model.grid is not None and model.grid.coords == "raw" and len(model.grid.dims) == 6
    F = _decode_features([1.0, 37.0, 256.0], [100.0, 3000.0, 70000.0], [32.0, 40.0, 8.0], [8.0, 8.0, 1.0],
                         128.0, [0.0, 128.0, 4096.0])
    eta_vec, ovh_vec = model.eta_and_overhead_array(F)
    for row, e, o in zip(F, eta_vec, ovh_vec, strict=True):
        es, os_ = model.eta_overhead_scalar(tuple(row))
        assert es == pytest.approx(e, rel=1e-9) and os_ == pytest.approx(o, rel=1e-9)


def test_stage_lattices_fold_into_one():
    """Coarse sub-lattices added into the full lattice give the same correction as evaluating them apart."""
    full, F, _ = _synthetic_decode_grid()
    coords = RESIDUAL_COORDS["attn_decode"](F)
    stage = fit_residual_grid(coords, (0, 5), 0.1 * np.log(F[:, 0]) - 0.3 * (F[:, 6] > 0),
                              np.ones(len(F)), coords="raw")
    folded = _fold_stages(full, [stage])
    np.testing.assert_allclose(folded(coords), full(coords) + stage(coords), atol=1e-12)
    mid = RESIDUAL_COORDS["attn_decode"](_decode_features(5.0, 100.0, 32.0, 8.0, 128.0, 60.0))
    assert folded(mid)[0] == pytest.approx(full(mid)[0] + stage(mid)[0])


def _group_one_error(dims: tuple[int, ...], gaps: tuple[float, ...]) -> tuple[float, float]:
    """Fit a decode lattice to a sweep where q heads = KV heads (group 1) runs 5× slower than GQA shapes;
    return |error| at a group-1 and a GQA head count the training rows never had (log units)."""
    heads = [(q, kv) for kv in (1.0, 2.0, 4.0, 16.0) for q in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0) if q >= kv]
    heads += [(16.0, 8.0), (64.0, 8.0)]   # KV heads 8 seen only with GQA
    b, c, h = np.meshgrid([1.0, 8.0, 64.0], [255.0, 4095.0, 65535.0], np.arange(len(heads)), indexing="ij")
    qh = np.array([heads[i][0] for i in h.ravel().astype(int)])
    kvh = np.array([heads[i][1] for i in h.ravel().astype(int)])
    F = _decode_features(b.ravel(), c.ravel(), qh, kvh, 128.0, 0.0)
    target = np.where(F[:, 2] == F[:, 3], np.log(5.0), 0.0)
    grid = fit_residual_grid(RESIDUAL_COORDS["attn_decode"](F), dims, target, np.ones(len(F)),
                             min_gaps=gaps, smooth=0.1, coords="raw")
    probe = RESIDUAL_COORDS["attn_decode"](_decode_features(8.0, 4095.0, [8.0, 32.0], 8.0, 128.0, 0.0))
    got = grid(probe)
    return abs(float(got[0]) - math.log(5.0)), abs(float(got[1]))


def test_decode_lattice_keys_on_gqa_group():
    """The decode lattice spans the GQA group, so the group-1 slow path carries over to a KV-head count never
    measured at group 1 (a lattice on q heads × KV heads smears it into its GQA neighbours), GQA shapes stay ~0."""
    dims, gaps = GRID_DIMS["attn_decode"], GRID_MIN_GAPS["attn_decode"]
    assert 6 in dims
    err_mha, err_gqa = _group_one_error(dims, gaps)
    assert err_mha < 0.45 and err_gqa < 0.2   # of log 5 = 1.61
    qkv = tuple(2 if d == 6 else d for d in dims)
    old_mha, _ = _group_one_error(qkv, gaps)   # the same lattice on q heads × KV heads
    assert old_mha > err_mha + 0.15


def _window_sweep(window_cost: float):
    """Decode rows with windows 0 / 128 / 1024 over contexts either side of them; a window that binds scales the
    time by its effective context, one that does not costs ``window_cost`` (1 = the kernel ignores it)."""
    b, c, w = np.meshgrid([1.0, 8.0, 64.0], [15.0, 127.0, 511.0, 4095.0], [0.0, 128.0, 1024.0], indexing="ij")
    F = _decode_features(b.ravel(), c.ravel(), 32.0, 8.0, 128.0, w.ravel())
    eff = np.where(F[:, 6] > 0, np.minimum(F[:, 1], F[:, 6]), F[:, 1])
    lat = 1e-6 * (5.0 + F[:, 0] * eff / 100.0)
    loose = (F[:, 6] > 0) & (F[:, 1] <= F[:, 6])
    return F, np.where(loose, lat * window_cost, lat), loose


def test_window_is_free_only_when_measured_pairs_agree():
    F, lat, loose = _window_sweep(1.0)
    assert loose.sum() >= WINDOW_FREE_MIN_PAIRS
    assert window_is_free("attn_decode", F, lat)
    F, lat, _ = _window_sweep(2.4)          # FA2 on the L40S: any window takes the slower unpacked path
    assert not window_is_free("attn_decode", F, lat)
    F, lat, _ = _window_sweep(1.0)
    assert not window_is_free("attn_decode", F[:6], lat[:6])   # too few pairs to tell
    assert not window_is_free("gemm", F, lat)


def test_free_window_puts_non_binding_rows_on_the_full_attention_knots():
    F, lat, loose = _window_sweep(1.0)
    coords = RESIDUAL_COORDS["attn_decode"](F)
    free = residual_coordinates("attn_decode", F, free_window=True)
    assert np.all(free[loose, 5] == 0.0) and np.all(coords[loose, 5] > 0.0)
    np.testing.assert_array_equal(free[~loose], coords[~loose])   # binding windows keep their own knots
    target = np.where(F[:, 6] > 0, 0.3, 0.0)
    grid = fit_residual_grid(free, (0, 1, 5), target, np.ones(len(F)), smooth=1e-4, coords="raw")
    grid = replace(grid, free_window=True)
    again = grid_from_dict(json.loads(json.dumps(grid.to_dict())))
    assert again.free_window
    probe = _decode_features([8.0, 8.0, 8.0], [100.0, 100.0, 900.0], 32.0, 8.0, 128.0, [0.0, 128.0, 128.0])
    got = again(again.coordinates("attn_decode", None, probe))
    assert got[1] == pytest.approx(got[0], abs=1e-9)     # window 128 over 100 tokens = no window
    assert got[2] == pytest.approx(0.3, abs=0.02)         # window 128 over 900 tokens binds
    for row, v in zip(probe, got, strict=True):
        assert again.scalar(again.scalar_coordinates("attn_decode", [], tuple(row))) == pytest.approx(v, abs=1e-12)


def _pair_count_error(dims: tuple[int, ...], stages: tuple[tuple[int, ...], ...]) -> float:
    """Fit a decode lattice to a sweep whose time depends on seqs × KV heads only (work spread over CTAs), with
    the probe's (seqs, KV heads) combination never measured; return the probe's |error| (log units)."""
    b, kv, c = np.meshgrid([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 2.0, 4.0, 8.0], [255.0, 4095.0], indexing="ij")
    F = _decode_features(b.ravel(), c.ravel(), 8.0 * kv.ravel(), kv.ravel(), 128.0, 0.0)
    keep = ~((F[:, 0] == 16.0) & (F[:, 3] == 8.0))
    F = F[keep]

    def truth(F):
        return 1.6 * np.tanh(np.log(F[:, 0] * F[:, 3]) - 2.5)

    coords = RESIDUAL_COORDS["attn_decode"](F)
    r = truth(F)
    stage_grids = []
    for sub in stages:
        g = fit_residual_grid(coords, sub, r, np.ones(len(F)), smooth=0.1, coords="raw")
        r = r - g(coords)
        stage_grids.append(g)
    grid = _fold_stages(fit_residual_grid(coords, dims, r, np.ones(len(F)), smooth=0.1,
                                          coords="raw"), stage_grids)
    probe = _decode_features(16.0, 4095.0, 64.0, 8.0, 128.0, 0.0)
    return abs(float(grid(RESIDUAL_COORDS["attn_decode"](probe))[0] - truth(probe)[0]))


def test_decode_lattice_keys_on_sequence_kv_head_pairs():
    """Column 7 = log(seqs × KV heads): a shape whose pair count was measured with other splits is predicted from
    them; the lattice on seqs and KV heads apart only interpolates its neighbours."""
    new = _pair_count_error(GRID_DIMS["attn_decode"], GRID_STAGES["attn_decode"])
    old = _pair_count_error((0, 1, 6, 3, 4, 5), ((0, 1, 5), (6, 3, 4, 5)))
    assert GRID_DIMS["attn_decode"][0] == 7
    assert new < 0.05 and old > new + 0.05


def _group_sweep(seed: int = 0):
    """Decode rows over seqs × context × GQA group (KV heads 8), repeated up to the rows a spacing search needs;
    log-ratio noise of 5 % on every row."""
    b, c, q = np.meshgrid([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0], [127.0, 1023.0, 8191.0],
                          [8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 64.0, 80.0, 96.0, 128.0], indexing="ij")
    reps = -(-GAP_CV_MIN_ROWS // b.size)
    F = _decode_features(np.repeat(b.ravel(), reps), np.repeat(c.ravel(), reps), np.repeat(q.ravel(), reps), 8.0,
                         128.0, 0.0)
    noise = 0.05 * np.random.default_rng(seed).standard_normal(len(F))
    return F, RESIDUAL_COORDS["attn_decode"](F), noise


def test_lattice_spacing_is_chosen_on_held_out_rows():
    """Flat along the GQA group (the kernel packs the group's heads): the coarsest spacing pools the most rows.
    A time that alternates between neighbouring group values needs a knot at each: the finest candidate wins."""
    pos, values = GRID_GAP_CHOICES["attn_decode"][0]
    F, coords, noise = _group_sweep()
    assert len(F) >= GAP_CV_MIN_ROWS
    flat = 0.2 * np.log(F[:, 0]) / 4 + noise
    assert choose_lattice_gaps("attn_decode", coords, flat)[pos] == max(values)
    group = np.round(F[:, 2] / F[:, 3]).astype(int)
    jagged = np.where(np.isin(group, (2, 4, 6, 10)), 0.4, 0.0) + noise
    chosen = choose_lattice_gaps("attn_decode", coords, jagged)
    assert chosen[pos] == min(values)
    assert chosen == choose_lattice_gaps("attn_decode", coords, jagged)   # deterministic
    few = choose_lattice_gaps("attn_decode", coords[:100], flat[:100])
    assert few == GRID_MIN_GAPS["attn_decode"]   # too few rows to tell: the default


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
def test_parallel_fit_is_the_same_calibration_for_any_worker_count(h100, h100_tables):
    """Families fitted in worker processes (one BLAS thread each) give one calibration whatever the worker count;
    ``map_fn`` may run the families in any order as long as it returns results in order."""
    from kernelsight.calibrate.evaluate import fit_target

    train = _subset({f: h100_tables[f] for f in ("gemm", "attn_decode")}, 150, seed=4)
    one, _ = fit_target(train, h100, workers=1)
    two, _ = fit_target(train, h100, workers=2)
    assert json.dumps(one.to_dict(), sort_keys=True) == json.dumps(two.to_dict(), sort_keys=True)

    seen: list[str] = []

    def reversed_map(fn, jobs):
        jobs = list(jobs)
        seen.extend(f for f, _ in jobs)
        return reversed([fn(j) for j in reversed(jobs)])

    cols = {f: t.columns for f, t in train.items()}
    a, _ = fit_calibration(cols, h100, map_fn=reversed_map, residual_grid=False)
    b, _ = fit_calibration(cols, h100, residual_grid=False)
    assert sorted(seen) == ["attn_decode", "gemm"]
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)
