"""A GEMM wider than any the tables measured (a vocabulary-sized LM head) is priced at the widest measured GEMM's
efficiency: its time grows with its bytes, not with the smooth model's extrapolation."""

from __future__ import annotations

import numpy as np
import pytest

from kernelsight.calibrate.rows import predict_rows_s
from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.eta import fitted_gemm_nk
from kernelsight.simcore.roofline import kernel_roofline_s
from tests.conftest import make_config


@pytest.mark.parametrize("gpu", ["rtx-pro-6000", "h100", "h200"])
def test_an_lm_head_beyond_the_widest_measured_gemm_scales_with_its_bytes(gpu):
    cfg = make_config(hardware=gpu)
    sm = build_step_model(cfg)
    n_max, _ = fitted_gemm_nk(cfg.calibration.eta.get("gemm"))
    assert n_max == 65536                     # every shared kernel sweep stops there
    for m in (1, 64):
        widest = sm.kernel_time_s(K.gemm_kernel("lm_head", m, n_max, 4096, "bf16", 2, 2))
        head = K.gemm_kernel("lm_head", m, 128256, 4096, "bf16", 2, 2)
        t = sm.kernel_time_s(head)
        assert t == pytest.approx(widest * 128256 / n_max, rel=0.03)
        assert t >= kernel_roofline_s(head.flops, head.bytes_moved, head.tiles, head.dtype, cfg.hardware)


def test_a_layer_profile_measures_the_lm_head_itself():
    """The RTX 4090's calibration comes from a per-layer profile, which times Llama's vocabulary-wide LM head: no
    clamp is needed there."""
    cfg = make_config(hardware="rtx-4090")
    n_max, _ = fitted_gemm_nk(cfg.calibration.eta.get("gemm"))
    assert n_max == 128256


@pytest.mark.parametrize("gpu", ["rtx-pro-6000", "h200"])
def test_the_row_predictor_prices_a_gemm_beyond_the_widest_as_the_step_model_does(gpu):
    """`kernelsight predict` and `calibrate eval` go through calibrate.rows: a row wider than the fit's widest n
    takes η at the widest there too (the LM head was 1.29 TB/s on that path and 1.46 in the step model)."""
    cfg = make_config(hardware=gpu)
    n_max, _ = fitted_gemm_nk(cfg.calibration.eta.get("gemm"))
    shapes = [(1, 128256), (64, 128256), (64, 16384)]      # two beyond the widest, one inside
    cols = {"dtype": np.array(["bf16"] * 3), "m": np.array([m for m, _ in shapes]),
            "n": np.array([n for _, n in shapes]), "k": np.array([4096] * 3),
            "kernel": np.array(["torch.nn.functional.linear"] * 3), "latency_us": np.ones(3)}
    rows_s = predict_rows_s("gemm", cols, cfg.hardware, cfg.calibration)
    for (m, n), t in zip(shapes, rows_s, strict=True):
        k = K.gemm_kernel("g", m, n, 4096, "bf16", 2, 2)
        roof_s = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware)
        # η (and so time over roofline) at the clamped width equals the widest row's own
        clamped = predict_rows_s("gemm", {**cols, "n": np.minimum(cols["n"], n_max)}, cfg.hardware,
                                 cfg.calibration)[shapes.index((m, n))]
        widest = K.gemm_kernel("g", m, min(n, n_max), 4096, "bf16", 2, 2)
        widest_roof_s = kernel_roofline_s(widest.flops, widest.bytes_moved, widest.tiles, widest.dtype, cfg.hardware)
        assert t >= roof_s
        if n > n_max:
            assert t / roof_s == pytest.approx(clamped / widest_roof_s, rel=0.02)
