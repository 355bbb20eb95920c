"""Cross-generation transfer: sensible η on a GPU no data came from."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kernelsight.calibrate.evaluate import bundled_calibration_dir, bundled_calibrations, measured_gpu_dirs
from kernelsight.calibrate.fit.transfer import cross_generation_calibration, merged_software, similarity_weights
from kernelsight.calibrate.measurements import measurement_software
from kernelsight.profiles import load_hardware, read_calibration_file
from kernelsight.simcore.calibration import calibration_from_dict
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


def _smooth(model, features):
    """η and fixed latency of a source's fitted model without its residual lattice and trees (what transfers)."""
    sub = model.pick(features)
    return dataclasses.replace(sub, grid=None, trees=None).eta_overhead_scalar(features)


def test_transfer_to_a_twin_of_the_source_reproduces_it(sources):
    # A GPU with exactly the L40S's spec: the rule must hand back the L40S's own smooth model (ρ and clock
    # ratios are 1, the spec-normalized features coincide).
    calib, hw = next((c, h) for c, h in sources if h.name == "l40s")
    twin = dataclasses.replace(hw, name="l40s-twin")
    out = cross_generation_calibration(twin, [(calib, hw)])
    kernels = [
        gemm_kernel("g", 40, 4096, 4096, "bf16", 2.0, 2.0),
        gemm_kernel("g", 4096, 14336, 4096, "bf16", 2.0, 2.0),
        attention_decode_kernel(8, 8 * 300, 32, 8, 128, 2.0, 2.0),  # L2-resident KV
        attention_decode_kernel(64, 64 * 4096, 32, 8, 128, 2.0, 2.0),  # streams from DRAM
    ]
    for k in kernels:
        eta, ovh = _smooth(calib.eta[k.family], k.features)
        assert out.kernel_eta(k.family, k.features) == pytest.approx(min(eta, out.eta_max), rel=1e-9)
        assert out.kernel_overhead_s(k.family, k.features) == pytest.approx(ovh, rel=1e-9)


def test_cache_gain_ratio_moves_only_l2_resident_memory_bound_work():
    from kernelsight.simcore.eta_basis import basis_matrix, cache_gain_ratio

    dev = {"num_sms": 128.0, "l2_bytes": 64 * 2**20, "balance": 200.0}
    # decode: batch 4 × 256 tokens (≈ 4 MB of KV, in L2) and batch 64 × 16k tokens (≈ 4 GB, DRAM)
    feats = np.array([[4, 256, 32, 8, 128, 2, 0], [64, 16384, 32, 8, 128, 2, 0]], dtype=float)
    z = basis_matrix("attn_decode", feats, dev)
    same = cache_gain_ratio("attn_decode", z, dict(dev, l2_bw_ratio_source=2.0, l2_bw_ratio_target=2.0))
    assert same == pytest.approx([1.0, 1.0])
    faster_l2 = cache_gain_ratio("attn_decode", z, dict(dev, l2_bw_ratio_source=2.0, l2_bw_ratio_target=6.0))
    assert faster_l2[0] > 2.0  # resident: close to the 3× L2 bandwidth ratio
    assert faster_l2[1] == pytest.approx(1.0, abs=1e-3)  # streaming: DRAM bound either way
    assert np.all(cache_gain_ratio("attn_decode", z, dev) == 1.0)  # no transfer keys: untouched
    # a compute-bound prefill whose working set fits in L2 is not sped up by a faster L2
    big_l2 = dict(dev, l2_bytes=1024 * 2**20, l2_bw_ratio_source=2.0, l2_bw_ratio_target=6.0)
    p = np.array([[1, 4096, 4096, 32, 8, 128, 2, 0]], dtype=float)
    assert cache_gain_ratio("attn_prefill", basis_matrix("attn_prefill", p, big_l2), big_l2) == pytest.approx([1.0])


def test_faster_l2_never_slows_a_transferred_kernel(sources):
    # Same GPU except twice the SMs × clock product (ρ doubles, balance halves for compute): an L2-resident
    # decode must not get slower, a DRAM-streaming one must stay within a few percent.
    h = load_hardware("h100-sxm")
    srcs = [s for s in sources if s[1].name != "h100-sxm"]
    base = cross_generation_calibration(h, srcs)
    more_l2 = dataclasses.replace(h, name="more-l2", boost_clock_hz=2 * h.boost_clock_hz)
    fast = cross_generation_calibration(more_l2, srcs)
    small = attention_decode_kernel(4, 4 * 512, 32, 8, 128, 2.0, 2.0)
    assert fast.kernel_eta("attn_decode", small.features) >= base.kernel_eta("attn_decode", small.features)
    assert fast.kernel_overhead_s("attn_decode", small.features) < base.kernel_overhead_s(
        "attn_decode", small.features
    )  # higher clock: shorter fixed latency


def test_cross_generation_covers_every_bundled_gpu(sources):
    from kernelsight.profiles import list_hardware

    k = gemm_kernel("g", 40, 4096, 4096, "bf16", 2.0, 2.0)
    dec = attention_decode_kernel(32, 32 * 1024, 32, 8, 128, 2.0, 2.0)
    for name in list_hardware():
        hw = load_hardware(name)
        calib = cross_generation_calibration(hw, sources)
        for kern in (k, dec):
            eta = calib.kernel_eta(kern.family, kern.features)
            assert calib.eta_floor <= eta <= calib.eta_max
            assert 0.2 <= eta <= 1.5, (name, kern.family, eta)


def test_unmeasured_format_gets_no_compute_speedup_but_keeps_its_bytes(sources):
    # The A100 measured bf16 GEMMs only. Transferred to the H100 alone, an fp8 GEMM runs on its bf16 η: a big
    # compute-bound one must not be credited the 2× fp8 peak, a memory-bound one keeps its halved weight bytes.
    a100 = next(s for s in sources if s[1].name == "a100-sxm")
    assert "1" not in a100[0].eta["gemm"].models
    h100 = load_hardware("h100-sxm")
    calib = cross_generation_calibration(h100, [a100])

    def t(m: int, fmt: str) -> float:
        k = gemm_kernel("g", m, 8192, 8192, fmt, 2.0 if fmt == "bf16" else 1.0, 2.0)
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, h100)
        return roof / calib.kernel_eta("gemm", k.features) + calib.kernel_overhead_s("gemm", k.features)

    assert t(8192, "fp8") >= 0.95 * t(8192, "bf16")
    assert t(1, "fp8") < 0.75 * t(1, "bf16")


def test_a_transferred_calibration_records_the_software_its_sources_were_timed_under(sources, unseen_gpu):
    """Per component, the sources' distinct versions; a calibration written and read keeps the record."""
    for c, _ in sources:
        assert c.software.get("vllm"), f"{c.hardware}: the bundled file records no vLLM version"
    calib = cross_generation_calibration(unseen_gpu, sources)
    expected = {v for c, _ in sources for v in c.software["vllm"].split(" / ")}
    assert set(calib.software["vllm"].split(" / ")) == expected
    assert calibration_from_dict(json.loads(json.dumps(calib.to_dict()))).software == calib.software
    assert merged_software([{"vllm": "0.24.0", "nccl": "2.27.3"}, {"vllm": "0.14.0 / 0.24.0"}, {}]) == {
        "vllm": "0.14.0 / 0.24.0", "nccl": "2.27.3"}
    # a calibration that records none (an older file) reads as none
    d = calib.to_dict()
    del d["software"]
    assert calibration_from_dict(d).software == {}


def test_each_measured_bundled_calibration_records_the_software_of_its_tables(shared_data):
    """What build_calibrations.py writes: a measured GPU's versions are its kernel folder's SOURCE lines."""
    for folder, name in measured_gpu_dirs(shared_data / "kernels").items():
        software = measurement_software(shared_data / "kernels" / folder)
        assert software.get("vllm"), f"{folder}/SOURCE names no vLLM version"
        assert read_calibration_file(bundled_calibration_dir() / f"{name}.json").software == software
