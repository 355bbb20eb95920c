"""A GEMM wider than any the tables measured (a vocabulary-sized LM head) is priced at the widest measured GEMM's
efficiency: its time grows with its bytes, not with the smooth model's extrapolation."""

from __future__ import annotations

import pytest

from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.step_model import _gemm_measured_nk
from tests.conftest import make_config


@pytest.mark.parametrize("gpu", ["rtx-pro-6000", "h100", "rtx-4090"])
def test_an_lm_head_beyond_the_widest_measured_gemm_scales_with_its_bytes(gpu):
    cfg = make_config(hardware=gpu)
    sm = build_step_model(cfg)
    n_max, _ = _gemm_measured_nk(cfg.calibration)
    assert n_max == 65536                     # every shared sweep stops there
    for m in (1, 64):
        widest = sm.kernel_time_s(K.gemm_kernel("lm_head", m, n_max, 4096, "bf16", 2, 2))
        head = K.gemm_kernel("lm_head", m, 128256, 4096, "bf16", 2, 2)
        t = sm.kernel_time_s(head)
        assert t == pytest.approx(widest * 128256 / n_max, rel=0.03)
        assert t >= kernel_roofline_s(head.flops, head.bytes_moved, head.tiles, head.dtype, cfg.hardware)
