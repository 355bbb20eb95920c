"""Cross-generation rule 10: a power-limited board's compute-bound η is its own, not its architecture's."""

from __future__ import annotations

import dataclasses

import pytest

from kernelsight.calibrate.fit.transfer import retarget
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore.eta import eta_overhead_of
from kernelsight.simcore.hardware import sustained_clock_share


def test_sustained_clock_share_from_power_sms_and_clock():
    assert sustained_clock_share(load_hardware("l40s")) == pytest.approx(0.822, abs=0.005)
    assert sustained_clock_share(load_hardware("l4")) == pytest.approx(0.511, abs=0.005)
    for unthrottled in ("rtx-4090", "rtx-pro-6000", "a100-sxm", "h100-sxm", "b200-sxm"):
        assert sustained_clock_share(load_hardware(unthrottled)) == 1.0
    assert sustained_clock_share(load_hardware("mi300x")) == 1.0          # the constant is an NVIDIA SM's
    assert sustained_clock_share(dataclasses.replace(load_hardware("l40s"), tdp_w=None)) == 1.0


def test_an_l40s_gemm_model_moved_to_an_unthrottled_gpu_gains_its_clock_only_where_compute_bound():
    l40s, target = load_hardware("l40s"), load_hardware("rtx-4090")
    model = load_calibration("l40s").eta["gemm"].models["0"]
    moved = retarget(model, "gemm", "0", target, l40s)
    assert moved.device["clock_sustain_source"] == pytest.approx(sustained_clock_share(l40s))
    assert moved.device["clock_sustain_target"] == 1.0
    without = dataclasses.replace(moved, device={k: v for k, v in moved.device.items()
                                                  if not k.startswith("clock_sustain")})
    big = (8192.0, 8192.0, 8192.0, 0.0)          # compute-bound: the whole clock share comes back
    gemv = (1.0, 8192.0, 8192.0, 0.0)            # weight streaming: untouched
    assert eta_overhead_of(moved, big)[0] == pytest.approx(eta_overhead_of(without, big)[0] / 0.822, rel=0.01)
    assert eta_overhead_of(moved, gemv)[0] == pytest.approx(eta_overhead_of(without, gemv)[0], rel=1e-12)
    # between two boards of one share nothing is added
    assert "clock_sustain_source" not in retarget(model, "gemm", "0", load_hardware("h100-sxm"),
                                                  load_hardware("a100-sxm")).device
