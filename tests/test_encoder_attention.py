"""The ViT attention family (``attn_encoder``): its kernel, its rows and its bundled fits."""

from __future__ import annotations

import numpy as np
import pytest

from kernelsight.calibrate.fit.eta import fit_family
from kernelsight.calibrate.measurements import read_measurements, read_table
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.profiles import calibration_stacks, list_calibrations, load_calibration, load_hardware
from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import default_calibration


def test_an_encoder_attends_every_key_of_its_image():
    enc = K.attention_encoder_kernel(2, 1024, 16, 80, 2.0)
    causal = K.attention_prefill_kernel((K.PrefillChunk(1024, 0, True),) * 2, 16, 16, 80, 2.0, 2.0)
    assert enc.family == K.ATTN_ENCODER
    assert enc.flops == pytest.approx(4.0 * 16 * 80 * 2 * 1024 ** 2)
    assert enc.flops / causal.flops == pytest.approx(2.0, rel=1e-3)       # no mask: twice the pairs
    assert enc.bytes_moved == pytest.approx(4.0 * 2 * 1024 * 16 * 80 * 2.0)
    assert enc.features == (2.0, 1024.0, 1024.0, 16.0, 16.0, 80.0, 2.0, 0.0)   # the prefill kernel's layout


def _synthetic_table(tmp_path, eta: float, ovh_us: float):
    hw = load_hardware("h100")
    shapes = [(b, s, h, d) for b in (1, 4, 16) for s in (16, 64, 256, 1024, 4096) for h in (4, 16) for d in (64, 80)]
    cols = {"batch": np.array([x[0] for x in shapes], float), "seq_len": np.array([x[1] for x in shapes], float),
            "num_heads": np.array([x[2] for x in shapes], float), "head_dim": np.array([x[3] for x in shapes], float),
            "dtype": np.array(["bf16"] * len(shapes))}
    lat_us = roofline_rows_s(kernel_rows("attn_encoder", cols), hw) / eta * 1e6 + ovh_us
    lines = ["batch,seq_len,num_heads,head_dim,dtype,kernel,latency_us"]
    lines += [f"{b},{s},{h},{d},bf16,vllm_vit_flash_attn_fa3,{t:.5f}" for (b, s, h, d), t in
              zip(shapes, lat_us, strict=True)]
    (tmp_path / "attn_encoder.csv").write_text("\n".join(lines) + "\n")
    return hw


def test_a_measured_encoder_table_is_read_and_fitted(tmp_path):
    hw = _synthetic_table(tmp_path, eta=0.5, ovh_us=7.0)
    tables = read_measurements(tmp_path)
    assert set(tables) == {"attn_encoder"} and len(tables["attn_encoder"]) == 60
    model, _, report = fit_family("attn_encoder", tables["attn_encoder"].columns, hw)
    calib = default_calibration(hw.name)
    calib.eta["attn_encoder"] = model
    pred = predict_rows_s("attn_encoder", tables["attn_encoder"].columns, hw, calib)
    assert np.median(np.abs(pred / (tables["attn_encoder"]["latency_us"] * 1e-6) - 1.0)) < 0.02
    assert report["attn_encoder[2]"]["rows"] == 60


def test_every_bundled_calibration_prices_vit_attention():
    for gpu in list_calibrations():
        for _, file in calibration_stacks(gpu):
            version = file.split("@vllm-")[1][:-5] if "@vllm-" in file else None
            calib = load_calibration(gpu, vllm_version=version)
            assert "attn_encoder" in calib.eta and "attn_encoder" in calib.overhead_s, file


def test_bundled_vit_fits_price_the_shared_tables_and_respect_the_roof(shared_data):
    for folder, gpu in (("h100_sxm", "h100-sxm"), ("l40s", "l40s"), ("rtx_pro_6000_server", "rtx-pro-6000")):
        hw, calib = load_hardware(gpu), load_calibration(gpu)
        table = read_table(shared_data / "kernels" / folder / "attn_encoder.csv.gz", "attn_encoder")
        pred = predict_rows_s("attn_encoder", table.columns, hw, calib)
        assert np.mean(np.abs(pred / (table["latency_us"] * 1e-6) - 1.0)) < 0.05, gpu   # fitted on every row
        roof = roofline_rows_s(kernel_rows("attn_encoder", table.columns), hw)
        assert (pred >= roof / calib.eta_max * (1 - 1e-9)).all(), gpu
