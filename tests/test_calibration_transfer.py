"""Cross-generation transfer: sensible η on a GPU no data came from."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kernelsight.calibrate.evaluate import bundled_calibrations
from kernelsight.profiles import load_hardware
from kernelsight.simcore.calibration import calibration_from_dict
from kernelsight.simcore.eta_transfer import cross_generation_calibration, similarity_weights
from kernelsight.simcore.kernels import attention_decode_kernel, gemm_kernel
from kernelsight.simcore.roofline import kernel_roofline_s


@pytest.fixture(scope="module")
def sources():
    measured = bundled_calibrations("target-measured")
    assert len(measured) >= 2, "bundled target-measured calibrations missing (run benchmarks/build_calibrations.py)"
    return [(c, load_hardware(c.hardware)) for c in measured]


@pytest.fixture(scope="module")
def unseen_gpu():
    # A made-up GPU between generations: nobody measured it, the rule must still be sensible.
    h = load_hardware("h100-sxm")
    return dataclasses.replace(
        h,
        name="made-up-gpu",
        bf16_flops_per_s=600e12,
        fp8_flops_per_s=1200e12,
        mem_bytes_per_s=2.5e12,
        num_sms=100,
        l2_bytes=60 * 2**20,
    )


def test_similarity_weights_normalized_and_prefer_closer(sources):
    hws = [h for _, h in sources]
    w = similarity_weights(load_hardware("h200-sxm"), hws)
    assert sum(w) == pytest.approx(1.0)
    names = [h.name for h in hws]
    assert w[names.index("h100-sxm")] == max(w)


def test_transfer_gives_sensible_eta(sources, unseen_gpu):
    calib = cross_generation_calibration(unseen_gpu, sources)
    assert calib.tier == "cross-generation" and "made-up-gpu" == calib.hardware
    big = gemm_kernel("g", 8192, 8192, 8192, "bf16", 2.0, 2.0)  # compute-bound: 40–100% of peak
    assert 0.4 <= calib.kernel_eta("gemm", big.features) <= 1.0
    skinny = gemm_kernel("g", 1, 8192, 8192, "bf16", 2.0, 2.0)  # memory-bound: most of the bandwidth
    assert 0.3 <= calib.kernel_eta("gemm", skinny.features) <= 1.5
    dec = attention_decode_kernel(64, 64 * 8192, 32, 8, 128, 2.0, 2.0)
    assert 0.2 <= calib.kernel_eta("attn_decode", dec.features) <= 1.5
    for k in (big, skinny, dec):
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, unseen_gpu)
        t = roof / calib.kernel_eta(k.family, k.features) + calib.kernel_overhead_s(k.family, k.features)
        assert roof / calib.eta_max <= t <= 3.0 * roof + 50e-6
        assert 1e-6 <= calib.kernel_overhead_s(k.family, k.features) <= 100e-6


def test_transfer_uses_target_spec(sources):
    # The same big GEMM must be predicted faster on a GPU with twice the peak and bandwidth.
    h = load_hardware("h100-sxm")
    fast = dataclasses.replace(
        h, name="fast", bf16_flops_per_s=2 * h.bf16_flops_per_s, mem_bytes_per_s=2 * h.mem_bytes_per_s
    )
    k = gemm_kernel("g", 4096, 8192, 8192, "bf16", 2.0, 2.0)
    times = []
    for hw in (h, fast):
        c = cross_generation_calibration(hw, [s for s in sources if s[1].name != "h100-sxm"])
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, hw)
        times.append(roof / c.kernel_eta("gemm", k.features) + c.kernel_overhead_s("gemm", k.features))
    assert times[1] < 0.7 * times[0]


def test_transfer_round_trips_and_excludes_target(sources):
    h100 = load_hardware("h100-sxm")
    calib = cross_generation_calibration(h100, sources)
    assert "h100-sxm (" not in calib.source  # never transfers from itself
    again = calibration_from_dict(json.loads(json.dumps(calib.to_dict())))
    f = gemm_kernel("g", 256, 4096, 4096, "bf16", 2.0, 2.0).features
    assert again.kernel_eta("gemm", f) == pytest.approx(calib.kernel_eta("gemm", f))
    assert np.isfinite(again.comm["nccl"].alpha_s)
