"""Regenerate the bundled calibrations in ``kernelsight/profiles/calibration/`` from ``../shared/data``.

* target-measured: a100-sxm, h100-sxm, l40s — fitted on every row of their shared kernel measurements.
* cross-generation: every other bundled GPU — transferred from those three by the spec-driven rule
  (:mod:`kernelsight.calibrate.fit.transfer`).

Each file records its tier, source data and licence. The shipped package reads only these JSON files.

    python benchmarks/build_calibrations.py [--data ../shared/data/kernels]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelsight.calibrate.evaluate import (  # noqa: E402
    SHARED_DATA_LICENCE,
    bundled_calibration_dir,
    default_fit_workers,
    fit_target,
    measured_gpu_dirs,
)
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import read_measurements  # noqa: E402
from kernelsight.profiles import list_hardware, load_hardware  # noqa: E402


def _source_line(data_dir: Path) -> str:
    src = (
        (data_dir / "SOURCE").read_text().strip().replace("\n", "; ")
        if (data_dir / "SOURCE").exists()
        else ""
    )
    return f"kernel measurements shared/data/kernels/{data_dir.name} ({src})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "kernels")
    ap.add_argument("-o", "--output-dir", type=Path, default=bundled_calibration_dir())
    args = ap.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)

    # every GPU folder of the schema whose name is a bundled profile (shared: A100, H100, L40S)
    by_profile = {name: folder for folder, name in measured_gpu_dirs(args.data).items()}
    measured = []
    for name, folder in by_profile.items():
        t0 = time.perf_counter()
        hw = load_hardware(name)
        tables = read_measurements(args.data / folder)
        calib, _ = fit_target(
            tables, hw, source=_source_line(args.data / folder), licence=SHARED_DATA_LICENCE,
            workers=default_fit_workers(),   # as `kernelsight calibrate fit` does: the same file
        )
        calib.notes = (
            "target-measured tier: η per family/variant (and per vLLM kernel where several ran, picked by a "
            "dispatch rule learned from the shapes) = bounded sigmoid of a quadratic in "
            "spec-normalized log shape features, corrected by boosted residual trees (raw shape axes and "
            "launch-grid work counts) and a residual lattice (raw shape axes); fitted by kernelsight "
            "benchmarks/build_calibrations.py"
        )
        (args.output_dir / f"{name}.json").write_text(json.dumps(calib.to_dict()))
        measured.append((calib, hw))
        print(f"{name}: target-measured from {folder} in {time.perf_counter() - t0:.1f} s")
    for name in list_hardware():
        if name in by_profile:
            continue
        hw = load_hardware(name)
        calib = cross_generation_calibration(hw, measured)
        (args.output_dir / f"{name}.json").write_text(json.dumps(calib.to_dict()))
        print(f"{name}: cross-generation ({calib.source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
