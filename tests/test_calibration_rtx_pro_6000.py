"""The bundled RTX PRO 6000 table is target-measured, NVFP4 GEMMs included (fitted on its own NVFP4 rows), and
measurement sets with formats the model cannot price yet are read without those rows instead of failing."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pytest
from conftest import needs_shared

from kernelsight.calibrate.evaluate import SHARED_DATA_LICENCE
from kernelsight.calibrate.measurements import UNMODELLED_FORMATS, read_measurements, read_table
from kernelsight.cli import main
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore.calibration import calibration_from_dict
from kernelsight.simcore.eta import LogPolyEta
from kernelsight.simcore.kernels import (
    PrefillChunk,
    attention_decode_kernel,
    attention_prefill_kernel,
    gemm_kernel,
)
from kernelsight.simcore.roofline import kernel_roofline_s

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
needs_data = needs_shared(DATA / "rtx_pro_6000_server")


def test_bundled_rtx_pro_6000_is_target_measured_with_source_and_licence():
    calib = load_calibration("rtx-pro-6000")
    assert calib.tier == "target-measured" and calib.hardware == "rtx-pro-6000"
    assert "shared/data/kernels/rtx_pro_6000_server" in calib.source and "aiconfigurator" in calib.source
    assert calib.licence == SHARED_DATA_LICENCE
    # no rows are left out any more: its NVFP4 GEMM variant is fitted on its own NVFP4 rows (target tier, with the
    # residual stages), its basis at the FP4 peak and NVFP4's 4.5-bit operands
    assert "left out" not in calib.source and "not modelled" not in calib.notes
    nvfp4 = calib.eta["gemm"].models["4"]
    assert isinstance(nvfp4, LogPolyEta) and nvfp4.trees is not None
    hw = load_hardware("rtx-pro-6000")
    assert nvfp4.device["balance"] == pytest.approx(hw.fp4_flops_per_s / hw.usable_mem_bytes_per_s)
    assert nvfp4.device["weight_bytes"] == nvfp4.device["in_bytes"] == 0.5625


def test_bundled_rtx_pro_6000_prices_kernels_at_or_above_roofline():
    hw = load_hardware("rtx-pro-6000")
    calib = load_calibration("rtx-pro-6000")
    kernels = [
        gemm_kernel("g", 1, 4096, 4096, "bf16", 2.0, 2.0),         # decode GEMV: weight streaming
        gemm_kernel("g", 4096, 4096, 4096, "bf16", 2.0, 2.0),      # compute-bound
        gemm_kernel("g", 2048, 14336, 4096, "fp8", 1.0, 2.0),
        gemm_kernel("g", 1, 4096, 4096, "nvfp4", 0.5625, 2.0),
        gemm_kernel("g", 4096, 14336, 4096, "nvfp4", 0.5625, 2.0),
        attention_decode_kernel(64, 64 * 2048, 32, 8, 128, 2.0, 2.0),
        attention_prefill_kernel((PrefillChunk(2048, 0, True),), 32, 8, 128, 2.0, 2.0),
    ]
    for k in kernels:
        roof_s = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, hw)
        t_s = roof_s / calib.kernel_eta(k.family, k.features) + calib.kernel_overhead_s(k.family, k.features)
        assert t_s >= roof_s, (k.family, k.features, t_s, roof_s)
        assert t_s < 100 * roof_s + 1e-4, (k.family, t_s, roof_s)   # and not absurdly slow


def _gemm_rows(path: Path, rows: list[str]) -> None:
    path.write_text("dtype,m,n,k,latency_us\n" + "".join(r + "\n" for r in rows))


def test_unmodelled_format_rows_are_skipped_only_when_asked(tmp_path, monkeypatch):
    # the mechanism for the next format a measurement set brings before the model prices it
    monkeypatch.setitem(UNMODELLED_FORMATS, "mxfp8", "MXFP8 is not modelled yet")
    _gemm_rows(tmp_path / "gemm.csv", ["bf16,1,4096,4096,10", "mxfp8,1,4096,4096,5", "mxfp8,8,4096,4096,5",
                                       "nvfp4,8,4096,4096,5"])
    with pytest.raises(ValueError, match="MXFP8 is not modelled yet"):
        read_measurements(tmp_path)
    skipped: dict[str, int] = {}
    tables = read_measurements(tmp_path, skipped=skipped)
    assert len(tables["gemm"]) == 2 and skipped == {"gemm mxfp8": 2}   # NVFP4 is read
    assert "nvfp4" not in UNMODELLED_FORMATS


def test_unknown_format_stays_an_error_even_when_skipping(tmp_path):
    # a misspelt dtype is a malformed row, not a format nobody has modelled yet
    _gemm_rows(tmp_path / "gemm.csv", ["bf16,1,4096,4096,10", "bf61,1,4096,4096,5"])
    with pytest.raises(ValueError, match="'bf61' not supported"):
        read_table(tmp_path / "gemm.csv", skipped={})


@needs_data
def test_calibrate_fit_and_predict_cli_take_nvfp4_rows(tmp_path, capsys):
    with gzip.open(DATA / "rtx_pro_6000_server" / "gemm.csv.gz", "rt") as fh:
        rows = list(csv.reader(fh))
    d = tmp_path / "pro6000"
    d.mkdir()
    sample = [rows[0]] + rows[1::1000]
    with open(d / "gemm.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(sample)
    n_fp4 = sum(r[0] == "nvfp4" for r in sample[1:])
    assert n_fp4 > 0
    out = tmp_path / "calib.json"
    assert main(["calibrate", "fit", "--measurements", str(d), "--hardware", "rtx-pro-6000", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipped" not in err
    calib = calibration_from_dict(json.loads(out.read_text()))
    assert calib.tier == "target-measured" and "4" in calib.eta["gemm"].models   # an nvfp4 variant of its own
    # predict prices every nvfp4 row, within a few tens of percent of what was measured (the fit saw them)
    pred = tmp_path / "pred.csv"
    assert main(["predict", "--hardware", "rtx-pro-6000", "--calibration", str(out), "--input", str(d / "gemm.csv"),
                 "-o", str(pred)]) == 0
    with open(pred) as fh:
        rows = [r for r in csv.DictReader(fh) if r["dtype"] == "nvfp4"]
    assert len(rows) == n_fp4
    errors = [abs(float(r["predicted_us"]) / float(r["latency_us"]) - 1.0) for r in rows]
    assert sum(errors) / len(errors) < 0.25


@needs_data
@pytest.mark.slow
def test_calibrate_eval_cli_reports_nvfp4_rows_apart(tmp_path, capsys):
    with gzip.open(DATA / "rtx_pro_6000_server" / "gemm.csv.gz", "rt") as fh:
        rows = list(csv.reader(fh))
    d = tmp_path / "pro6000"
    d.mkdir()
    with open(d / "gemm.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([rows[0]] + rows[1::400])
    assert main(["calibrate", "eval", "--measurements", str(d), "--hardware", "rtx-pro-6000"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4 FlashInferCutlassNvFp4LinearKernel" in out
