"""FlashAttention-2's unsplit decode path (one query head per KV head): detected from measurements, applied as a
floor on the decode kernel's time, carried across GPUs only to those where vLLM runs FA2."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kernelsight.calibrate.fit.eta import fit_calibration, fit_decode_floor
from kernelsight.calibrate.fit.transfer import DECODE_FLOOR_CLOCK_EXPONENT, cross_generation_calibration
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.engine_args import create_engine_config
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore.calibration import calibration_from_dict
from kernelsight.simcore.engine_config import EngineArgs, build_step_model
from kernelsight.simcore.eta import decode_serial_floor_s
from kernelsight.simcore.kernels import ATTN_DECODE, BatchShape, attention_decode_kernel
from kernelsight.simcore.roofline import kernel_roofline_s

CTA_BYTES_PER_S = 20e9


def _sweep(hw, unsplit: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A decode sweep (MHA and GQA shapes): ``unsplit`` MHA rows stream one context per CTA at 20 GB/s, the rest
    run at 80 % of the DRAM roof."""
    grid = [(b, c, h, kv) for b in (1, 2, 4, 8, 64) for c in (255, 2047, 8191, 32767, 131071)
            for h, kv in ((1, 1), (2, 2), (4, 4), (8, 8), (32, 8), (16, 2))]
    b, c, h, kv = (np.array(x, dtype=float) for x in zip(*grid, strict=True))
    cols = {"batch": b, "cached_len": c, "num_heads": h, "num_kv_heads": kv, "head_dim": np.full(len(b), 128.0),
            "kv_dtype": np.full(len(b), "bf16"), "window": np.zeros(len(b))}
    rows = kernel_rows("attn_decode", cols)
    t = roofline_rows_s(rows, hw) / 0.8 + 4e-6
    if unsplit:
        floor = np.array([decode_serial_floor_s(f, hw.num_sms, CTA_BYTES_PER_S) for f in rows.features])
        t = np.maximum(t, floor)
    cols["latency_us"] = t * np.exp(np.random.default_rng(seed).normal(0.0, 0.01, len(t))) * 1e6
    return cols


def test_floor_is_per_cta_stream_times_waves_and_only_without_gqa():
    # 1 sequence × 1 head × 131072 tokens of bf16 K and V (head_dim 128) at 22 GB/s: ~3 ms (the A100 measures 3.0)
    assert decode_serial_floor_s((1, 131072, 1, 1, 128, 2, 0), 108, 22e9) == pytest.approx(131072 * 512 / 22e9)
    one_wave = decode_serial_floor_s((8, 32768, 8, 8, 128, 2, 0), 108, 22e9)        # 64 CTAs: one wave
    assert one_wave == pytest.approx(decode_serial_floor_s((1, 32768, 1, 1, 128, 2, 0), 108, 22e9))
    assert decode_serial_floor_s((16, 32768, 8, 8, 128, 2, 0), 108, 22e9) == pytest.approx(2 * one_wave)
    assert decode_serial_floor_s((8, 32768, 32, 8, 128, 2, 0), 108, 22e9) == 0.0    # GQA: split path
    assert decode_serial_floor_s((1, 32768, 1, 1, 128, 2, 1024), 108, 22e9) == pytest.approx(1024 * 512 / 22e9)


def test_fit_finds_the_unsplit_path_and_only_where_it_is():
    hw = load_hardware("a100-sxm")
    found = fit_decode_floor(_sweep(hw, unsplit=True), hw)
    assert set(found) == {"2"} and found["2"] == pytest.approx(CTA_BYTES_PER_S, rel=0.03)
    assert fit_decode_floor(_sweep(hw, unsplit=False), hw) == {}


def test_fitted_floor_predicts_the_slow_mha_rows_and_leaves_gqa_alone():
    hw = load_hardware("a100-sxm")
    train, test = _sweep(hw, unsplit=True, seed=0), _sweep(hw, unsplit=True, seed=1)
    calib, _ = fit_calibration({"attn_decode": train}, hw)
    assert "2" in calib.decode_cta_bytes_per_s
    pred = predict_rows_s("attn_decode", test, hw, calib)
    meas = test["latency_us"] * 1e-6
    slow = (test["num_heads"] == test["num_kv_heads"]) & (test["cached_len"] >= 8191) & (test["batch"] <= 8)
    assert np.median(np.abs(pred[slow] / meas[slow] - 1)) < 0.05     # 5-80× the roofline, predicted
    # the same calibration through the file format (its lattice is stored quantized), with and without the floor
    stored = calibration_from_dict(calib.to_dict())
    without = calibration_from_dict({**calib.to_dict(), "decode_cta_bytes_per_s": {}})
    gqa = test["num_heads"] != test["num_kv_heads"]
    np.testing.assert_array_equal(predict_rows_s("attn_decode", test, hw, stored)[gqa],
                                  predict_rows_s("attn_decode", test, hw, without)[gqa])


def test_floor_round_trips_and_old_files_load_without_it():
    calib = load_calibration("a100-sxm")
    assert calib.decode_cta_bytes_per_s["2"] > 0                       # bundled: fitted on the shared A100 rows
    again = calibration_from_dict(json.loads(json.dumps(calib.to_dict())))
    assert again.decode_cta_bytes_per_s == calib.decode_cta_bytes_per_s
    old = calib.to_dict()
    del old["decode_cta_bytes_per_s"]
    assert calibration_from_dict(old).decode_cta_bytes_per_s == {}
    assert "decode_cta_bytes_per_s" not in load_calibration("h100-sxm").to_dict()   # FA3 splits


def test_transfer_gives_the_floor_to_fa2_gpus_only():
    a100, l40s = load_hardware("a100-sxm"), load_hardware("l40s")
    sources = [(load_calibration("a100-sxm"), a100), (load_calibration("h100-sxm"), load_hardware("h100-sxm"))]
    to_l40s = cross_generation_calibration(l40s, sources)
    expect = load_calibration("a100-sxm").decode_cta_bytes_per_s["2"] * (
        l40s.boost_clock_hz / a100.boost_clock_hz) ** DECODE_FLOOR_CLOCK_EXPONENT
    assert to_l40s.decode_cta_bytes_per_s == {"2": pytest.approx(expect)}     # Ada runs FA2; H100 has no floor
    assert cross_generation_calibration(load_hardware("h200-sxm"), sources).decode_cta_bytes_per_s == {}
    # sm_120 runs FA2 too (its own tables time vllm_flash_attn_fa2); datacenter Blackwell prefers FlashInfer
    assert set(cross_generation_calibration(load_hardware("rtx-pro-6000"), sources).decode_cta_bytes_per_s) == {"2"}
    assert cross_generation_calibration(load_hardware("b200-sxm"), sources).decode_cta_bytes_per_s == {}


def test_step_model_applies_the_floor_to_mha_decode_above_the_roofline():
    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="a100-sxm", max_model_len=32768))
    sm = build_step_model(cfg)
    calib, hw = cfg.calibration, cfg.hardware
    # an MHA shape (q heads = KV heads), as an MHA model's layer would run it
    k = attention_decode_kernel(2, 2 * 16384, 32, 32, 128, 2.0, 2.0)
    t = sm.kernel_time_s(k)
    floor = decode_serial_floor_s(k.features, hw.num_sms, calib.decode_cta_bytes_per_s["2"])
    assert k.family == ATTN_DECODE and t >= floor > 0
    assert t >= kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, hw)
    # Llama-3.1-8B is GQA (32 q / 8 KV heads): its decode steps never hit the floor
    _, t_with = sm.step(BatchShape(num_decodes=4, decode_context_tokens=4 * 16384))
    without = calibration_from_dict({**calib.to_dict(), "decode_cta_bytes_per_s": {}})
    _, t_without = build_step_model(dataclasses.replace(cfg, calibration=without)).step(
        BatchShape(num_decodes=4, decode_context_tokens=4 * 16384))
    assert t_with == pytest.approx(t_without)
