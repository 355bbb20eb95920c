"""Per-kernel variants of the target-tier fit: the ``kernel`` column separates kernels of one format, a dispatch
rule learned from the shapes names the kernel when it is not given, and files without kernel variants behave
as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.calibrate.fit.dispatch import fit_dispatch_rule
from kernelsight.calibrate.fit.eta import fit_calibration
from kernelsight.calibrate.fit.transfer import cross_generation_calibration
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.profiles import load_hardware
from kernelsight.simcore.calibration import calibration_from_dict
from kernelsight.simcore.eta import DispatchEta, DispatchRule, LogPolyEta, SwitchEta
from kernelsight.simcore.eta_basis import RESIDUAL_COORDS
from kernelsight.simcore.kernels import gemm_kernel
from kernelsight.simcore.roofline import kernel_roofline_s

#: Two kernels of one format (block-scaled fp8), vLLM-style: a skinny-m kernel up to m = 16, another above.
SKINNY, WIDE = "SkinnyFp8Kernel", "WideFp8Kernel"
ETA_BY_KERNEL = {SKINNY: 0.25, WIDE: 0.75}
OVERHEAD_S = 6e-6


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-sxm")


def _table(h100, ms: list[int], seed: int) -> dict[str, np.ndarray]:
    """A synthetic fp8_block GEMM sweep whose kernel (and so efficiency) switches at m = 16."""
    m, n, k = (a.ravel().astype(float) for a in np.meshgrid(ms, [512, 1024, 2048, 4096, 8192],
                                                            [1024, 2048, 4096, 8192], indexing="ij"))
    cols: dict[str, np.ndarray] = {"dtype": np.full(len(m), "fp8_block"), "m": m, "n": n, "k": k}
    kernel = np.where(m <= 16, SKINNY, WIDE)
    roof = roofline_rows_s(kernel_rows("gemm", cols), h100)
    eta = np.array([ETA_BY_KERNEL[str(x)] for x in kernel])
    noise = np.exp(np.random.default_rng(seed).normal(0.0, 0.01, len(m)))  # ~1 % repeat noise
    cols["kernel"] = kernel
    cols["latency_us"] = (roof / eta + OVERHEAD_S) * noise * 1e6
    return cols


TRAIN_M = [1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024, 2048]
TEST_M = [3, 6, 10, 14, 20, 28, 48, 96, 384, 1536]   # unseen m on both sides of the switch


@pytest.fixture(scope="module")
def fits(h100):
    train = _table(h100, TRAIN_M, seed=0)
    with_kernel, _ = fit_calibration({"gemm": train}, h100)
    shapes_only, _ = fit_calibration({"gemm": {c: v for c, v in train.items() if c != "kernel"}}, h100)
    return with_kernel, shapes_only, _table(h100, TEST_M, seed=1)


def _mape(calib, cols, h100) -> float:
    pred = predict_rows_s("gemm", cols, h100, calib)
    return float(np.mean(np.abs(pred * 1e6 / cols["latency_us"] - 1.0)))


def _no_kernel(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {c: v for c, v in cols.items() if c != "kernel"}


def test_kernel_column_separates_kernels_of_one_format(fits, h100):
    with_kernel, shapes_only, test = fits
    model = with_kernel.eta["gemm"]
    assert isinstance(model, SwitchEta) and isinstance(model.models["2"], DispatchEta)
    assert set(model.models["2"].models) == {SKINNY, WIDE}
    assert isinstance(shapes_only.eta["gemm"].models["2"], LogPolyEta)   # no kernel column: one model, as before
    separated, pooled = _mape(with_kernel, test, h100), _mape(shapes_only, test, h100)
    # one smooth η cannot jump 3× between m = 16 and 24; two kernel models need not
    assert separated < 0.03, separated
    assert separated < 0.5 * pooled, (separated, pooled)


def test_learned_dispatch_picks_the_kernel_from_the_shape(fits, h100):
    with_kernel, _, test = fits
    dispatch = with_kernel.eta["gemm"].models["2"]
    F = kernel_rows("gemm", test).features
    np.testing.assert_array_equal(dispatch.kernels_of(F), test["kernel"])
    # the step model's scalar path dispatches the same way
    for m in (5, 16, 30, 700):
        f = gemm_kernel("g", m, 4096, 4096, "fp8_block", 1.0, 2.0).features
        assert dispatch.kernel_of(f) == (SKINNY if m <= 16 else WIDE)
    # without the kernel column (the simulator, `predict` on shape-only files) predictions equal the labelled ones
    np.testing.assert_allclose(
        predict_rows_s("gemm", _no_kernel(test), h100, with_kernel),
        predict_rows_s("gemm", test, h100, with_kernel),
        rtol=1e-12,
    )


def test_given_kernel_wins_and_unknown_names_fall_back_to_the_rule(fits, h100):
    with_kernel, _, test = fits
    by_rule = predict_rows_s("gemm", _no_kernel(test), h100, with_kernel)
    unknown = dict(test, kernel=np.full(len(test["m"]), "SomeNewKernel"))
    np.testing.assert_allclose(predict_rows_s("gemm", unknown, h100, with_kernel), by_rule, rtol=1e-12)
    # naming the other kernel uses that kernel's model: wide-m shapes priced by the 3× slower skinny kernel
    swapped = dict(test, kernel=np.where(test["kernel"] == SKINNY, WIDE, SKINNY))
    wide = test["m"] >= 256
    ratio = predict_rows_s("gemm", swapped, h100, with_kernel)[wide] / by_rule[wide]
    assert np.all(ratio > 1.1) and np.median(ratio) > 2.0, ratio


def test_kernel_variants_round_trip_and_respect_the_roofline(fits, h100):
    with_kernel, _, test = fits
    again = calibration_from_dict(json.loads(json.dumps(with_kernel.to_dict())))
    for cols in (test, _no_kernel(test)):
        np.testing.assert_allclose(
            predict_rows_s("gemm", cols, h100, again),
            predict_rows_s("gemm", cols, h100, with_kernel),
            rtol=1e-3,   # lattices are stored as int16 milli-log-ratios
        )
    roof = roofline_rows_s(kernel_rows("gemm", test), h100)
    assert np.all(predict_rows_s("gemm", test, h100, again) >= roof / again.eta_max * (1 - 1e-12))
    for m in (1, 16, 17, 4096):
        k = gemm_kernel("g", m, 8192, 8192, "fp8_block", 1.0, 2.0)
        r = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, h100)
        t = r / again.kernel_eta(k.family, k.features) + again.kernel_overhead_s(k.family, k.features)
        assert t >= r / again.eta_max


def test_files_without_kernel_variants_load_and_ignore_the_kernel_column(fits, h100):
    _, shapes_only, test = fits
    old = json.loads(json.dumps(shapes_only.to_dict()))
    assert "dispatch" not in json.dumps(old)
    calib = calibration_from_dict(old)
    a = predict_rows_s("gemm", test, h100, calib)
    b = predict_rows_s("gemm", _no_kernel(test), h100, calib)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, predict_rows_s("gemm", test, h100, shapes_only), rtol=1e-3)


def test_transfer_uses_the_pooled_smooth_model(fits, h100):
    with_kernel, shapes_only, _ = fits
    a100 = load_hardware("a100-sxm")
    via_kernels = cross_generation_calibration(a100, [(with_kernel, h100)])
    via_pooled = cross_generation_calibration(a100, [(shapes_only, h100)])
    F = np.array([[m, 4096.0, 4096.0, 2.0] for m in (1.0, 8.0, 64.0, 1024.0)])
    for row in F:   # no kernel lattices or dispatch on a GPU nobody measured: the same as the pooled fit
        assert via_kernels.kernel_eta("gemm", tuple(row)) == pytest.approx(via_pooled.kernel_eta("gemm", tuple(row)))


def test_dispatch_rule_fits_thresholds_and_round_trips():
    rng = np.random.default_rng(3)
    ms = [1, 2, 3, 5, 8, 13, 16, 17, 31, 64, 257, 4096]
    F = np.column_stack([rng.choice(ms, 400), rng.choice([32, 64, 128, 4096], 400),
                         rng.choice([64, 128, 4096], 400), np.full(400, 2.0)]).astype(float)
    truth = np.where(F[:, 0] <= 16, "A", np.where((F[:, 1] < 128) | (F[:, 2] < 128), "C", "B"))
    rule = fit_dispatch_rule(RESIDUAL_COORDS["gemm"](F), truth)
    assert rule.kernels() == {"A", "B", "C"}
    np.testing.assert_array_equal(rule(RESIDUAL_COORDS["gemm"](F)), truth)
    again = DispatchRule.from_dict(json.loads(json.dumps(rule.to_dict())))
    np.testing.assert_array_equal(again(RESIDUAL_COORDS["gemm"](F)), truth)
