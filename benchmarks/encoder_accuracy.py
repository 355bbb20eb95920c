"""Per-kernel accuracy of the ViT attention family (``attn_encoder``) on the shared tables (issue 36, item 3).

For every GPU folder with an ``attn_encoder`` table (H100, L40S, RTX PRO 6000 under vLLM 0.24):

* roofline: η = 1, no fixed latency;
* target-measured: fitted on a random 25% of the rows (``--train-fraction``), judged on the other 75%;
* cross-generation: leave-one-GPU-out — fitted on all rows of the bundled tier's sources (A100 / H100 / L40S) that
  time it, other than the GPU itself, transferred by the spec-driven rule (``calibrate.fit.transfer``), judged on
  every row.

Prints a table (MAPE %) and writes ``benchmarks/results/encoder_accuracy.json``.

    python benchmarks/encoder_accuracy.py [--data ../shared/data/kernels] [--train-fraction 0.25] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import CROSS_GENERATION_SOURCES, measured_gpu_dirs  # noqa: E402
from kernelsight.calibrate.fit.eta import fit_family  # noqa: E402
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import Table, read_table  # noqa: E402
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_hardware  # noqa: E402
from kernelsight.simcore.calibration import Calibration, default_calibration  # noqa: E402
from kernelsight.simcore.hardware import HardwareSpec  # noqa: E402

FAMILY = "attn_encoder"


def fitted(table: Table, hw: HardwareSpec) -> Calibration:
    model, eta_max, _ = fit_family(FAMILY, table.columns, hw, residual_grid=True)
    calib = default_calibration(hw.name)
    calib.eta[FAMILY] = model
    calib.eta_max = max(eta_max, 1.0)
    return calib


def mape_pct(table: Table, hw: HardwareSpec, calib: Calibration) -> float:
    pred = predict_rows_s(FAMILY, table.columns, hw, calib)
    return float(100 * np.mean(np.abs(pred / (table["latency_us"] * 1e-6) - 1.0)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    ap.add_argument("--train-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tables = {name: read_table(args.data / folder / f"{FAMILY}.csv.gz", FAMILY)
              for folder, name in measured_gpu_dirs(args.data).items()
              if (args.data / folder / f"{FAMILY}.csv.gz").is_file()}
    full = {name: fitted(t, load_hardware(name)) for name, t in tables.items()}
    rows = []
    for name, table in tables.items():
        hw = load_hardware(name)
        t0 = time.perf_counter()
        train = np.random.default_rng(args.seed).random(len(table)) < args.train_fraction
        test = table.subset(~train)
        roof = roofline_rows_s(kernel_rows(FAMILY, test.columns), hw)
        sources = [(full[s], load_hardware(s)) for s in CROSS_GENERATION_SOURCES if s in full and s != name]
        rows.append({
            "gpu": name, "rows": len(table),
            "roofline": round(float(100 * np.mean(np.abs(roof / (test["latency_us"] * 1e-6) - 1.0))), 1),
            "target_25pct": round(mape_pct(test, hw, fitted(table.subset(train), hw)), 2),
            "cross_generation": round(mape_pct(table, hw, cross_generation_calibration(hw, sources)), 1)
            if sources else None,
            "cross_generation_sources": ", ".join(h.name for _, h in sources),
            "seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    print(format_table(rows, list(rows[0]) if rows else []))
    print(f"wrote {write_result('encoder_accuracy', {'train_fraction': args.train_fraction, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
