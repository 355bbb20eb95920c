"""The bundled RTX PRO 6000 table is target-measured, and measurement sets with formats the model cannot price
yet (NVFP4) are read without those rows instead of failing."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pytest

from kernelsight.calibrate.evaluate import SHARED_DATA_LICENCE
from kernelsight.calibrate.measurements import UNMODELLED_FORMATS, read_measurements, read_table
from kernelsight.cli import main
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore.calibration import calibration_from_dict
from kernelsight.simcore.kernels import (
    PrefillChunk,
    attention_decode_kernel,
    attention_prefill_kernel,
    gemm_kernel,
)
from kernelsight.simcore.roofline import kernel_roofline_s

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
needs_data = pytest.mark.skipif(not (DATA / "rtx_pro_6000_server").is_dir(), reason="shared data not available")


def test_bundled_rtx_pro_6000_is_target_measured_with_source_and_licence():
    calib = load_calibration("rtx-pro-6000")
    assert calib.tier == "target-measured" and calib.hardware == "rtx-pro-6000"
    assert "shared/data/kernels/rtx_pro_6000_server" in calib.source and "aiconfigurator" in calib.source
    assert calib.licence == SHARED_DATA_LICENCE
    # the NVFP4 rows it was not fitted on are counted, with the reason
    assert "nvfp4" in calib.source and "NVFP4 is not modelled yet" in calib.notes


def test_bundled_rtx_pro_6000_prices_kernels_at_or_above_roofline():
    hw = load_hardware("rtx-pro-6000")
    calib = load_calibration("rtx-pro-6000")
    kernels = [
        gemm_kernel("g", 1, 4096, 4096, "bf16", 2.0, 2.0),         # decode GEMV: weight streaming
        gemm_kernel("g", 4096, 4096, 4096, "bf16", 2.0, 2.0),      # compute-bound
        gemm_kernel("g", 2048, 14336, 4096, "fp8", 1.0, 2.0),
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


def test_unmodelled_format_rows_are_skipped_only_when_asked(tmp_path):
    _gemm_rows(tmp_path / "gemm.csv", ["bf16,1,4096,4096,10", "nvfp4,1,4096,4096,5", "nvfp4,8,4096,4096,5"])
    with pytest.raises(ValueError, match="NVFP4 is not modelled yet"):
        read_measurements(tmp_path)
    skipped: dict[str, int] = {}
    tables = read_measurements(tmp_path, skipped=skipped)
    assert len(tables["gemm"]) == 1 and skipped == {"gemm nvfp4": 2}
    assert "nvfp4" in UNMODELLED_FORMATS


def test_unknown_format_stays_an_error_even_when_skipping(tmp_path):
    # a misspelt dtype is a malformed row, not a format nobody has modelled yet
    _gemm_rows(tmp_path / "gemm.csv", ["bf16,1,4096,4096,10", "bf61,1,4096,4096,5"])
    with pytest.raises(ValueError, match="'bf61' not supported"):
        read_table(tmp_path / "gemm.csv", skipped={})


@needs_data
def test_calibrate_fit_cli_skips_nvfp4_rows_with_a_note(tmp_path, capsys):
    with gzip.open(DATA / "rtx_pro_6000_server" / "gemm.csv.gz", "rt") as fh:
        rows = list(csv.reader(fh))
    d = tmp_path / "pro6000"
    d.mkdir()
    sample = [rows[0]] + rows[1::400]
    with open(d / "gemm.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(sample)
    n_fp4 = sum(r[0] == "nvfp4" for r in sample[1:])
    assert n_fp4 > 0
    out = tmp_path / "calib.json"
    assert main(["calibrate", "fit", "--measurements", str(d), "--hardware", "rtx-pro-6000", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {n_fp4} gemm rows of format 'nvfp4': NVFP4 is not modelled yet" in err
    assert calibration_from_dict(json.loads(out.read_text())).tier == "target-measured"
