"""Per-kernel accuracy of the FusedMoE family (``moe_gemm``) on the shared MoE tables (issue #36, item 2).

Each row of ``kernels/<gpu>/moe.csv.gz`` is one vLLM FusedMoE layer forward on one GPU; it is priced as the simulator
prices a serving step's MoE layer (``simcore.kernel_shapes.fused_moe_kernel``: the roofline of the experts the
routing relation says the rank touches, ÷ η per expert format and kernel, + fixed latency).

* target: fit on a random 25 % of the GPU's MoE rows (``--train-fraction``), judge on the other 75 %; every folder
  of the shared layout whose GPU is a bundled profile, and the RTX PRO 6000's vLLM 0.19 folder (its own kernels).
* leave-one-GPU-out (cross-generation): fit the MoE family on every row of the other GPUs (the vLLM 0.24 folders;
  the A100's tables time only the rank's tokens and are never transferred from: ``MOE_TRANSFER_EXCLUDED``),
  transfer to the held-out GPU by its spec and by the kernel vLLM runs there for each format under the folder's
  release (``calibrate.fit.transfer``, rule 12), judge on its same 75 %.
  A format no source measured (NVFP4 outside the PRO 6000) is priced by the nearest measured format's model.

Prints a table per GPU and dtype and writes JSON (default ``benchmarks/results/moe_accuracy.json``).

    python benchmarks/moe_accuracy.py [--data ../shared/data/kernels] [-o out.json] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelsight.calibrate.fit.eta import fit_family  # noqa: E402
from kernelsight.calibrate.fit.transfer import MOE_TRANSFER_EXCLUDED, cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import Table, measurement_software, read_measurements  # noqa: E402
from kernelsight.calibrate.rows import kernel_rows, roofline_rows_s, rows_time_s  # noqa: E402
from kernelsight.profiles import bundled_hardware_name, load_hardware  # noqa: E402
from kernelsight.simcore.calibration import Calibration, default_calibration  # noqa: E402
from kernelsight.simcore.hardware import HardwareSpec  # noqa: E402

FAMILY = "moe_gemm"


def moe_folders(data: Path) -> dict[str, str]:
    """Folder → bundled GPU profile of every folder with a ``moe.csv[.gz]`` (``gpu@vllm-x`` folders by their GPU)."""
    out = {}
    for d in sorted(data.iterdir()):
        if not (d.is_dir() and any(d.glob("moe.csv*"))):
            continue
        name = bundled_hardware_name(d.name.split("@")[0])
        if name is not None:
            out[d.name] = name
    return out


def fitted(table: Table, hw: HardwareSpec, residual_grid: bool, software: dict[str, str] | None = None
           ) -> Calibration:
    """A calibration whose only fitted family is the MoE layer (fitted on every row of ``table``), recording the
    ``software`` its kernels were timed under (the transfer reads which kernel ran from the vLLM release)."""
    model, eta_max, _ = fit_family(FAMILY, table.columns, hw, residual_grid=residual_grid)
    calib = default_calibration(hw.name)
    calib.software = dict(software or {})
    calib.tier = "target-measured"
    calib.eta[FAMILY] = model
    calib.eta_max = max(eta_max, 1.0)
    calib.eta_floor = 0.001
    return calib


def errors(table: Table, hw: HardwareSpec, calib: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """(|predicted / measured − 1|, predicted ÷ roofline) per row."""
    rows = kernel_rows(FAMILY, table.columns)
    roof = roofline_rows_s(rows, hw)
    pred = rows_time_s(calib, FAMILY, rows, roof, hw)
    return np.abs(pred / (table["latency_us"] * 1e-6) - 1.0), pred / roof


def breakdown(table: Table, ape: np.ndarray) -> dict[str, dict[str, float]]:
    out = {"all": {"mape": float(ape.mean()), "rows": float(len(ape))}}
    for d in np.unique(table["dtype"]):
        sel = table["dtype"] == d
        out[str(d)] = {"mape": float(ape[sel].mean()), "rows": float(sel.sum())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "kernels")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "benchmarks" / "results" / "moe_accuracy.json")
    ap.add_argument("--train-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    folders = moe_folders(args.data)
    tables = {f: read_measurements(args.data / f)[FAMILY] for f in folders}
    hws = {f: load_hardware(n) for f, n in folders.items()}
    # one folder per GPU among the sources: the release-specific folders are judged, never transferred from
    sources = {f for f in folders if "@" not in f}
    full = {}
    for f in sorted(sources):
        t0 = time.perf_counter()
        full[f] = fitted(tables[f], hws[f], residual_grid=False, software=measurement_software(args.data / f))
        print(f"smooth fit of {f}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    results: dict[str, dict] = {}
    for f in folders:
        t, hw = tables[f], hws[f]
        rng = np.random.default_rng(args.seed)
        train = rng.random(len(t)) < args.train_fraction
        test = t.subset(~train)
        target = fitted(t.subset(train), hw, residual_grid=True)
        ape_t, over_roof = errors(test, hw, target)
        # MOE_TRANSFER_EXCLUDED: tables timing only the rank's tokens are never transferred from
        others = [o for o in sorted(sources) if hws[o].name != hw.name and hws[o].name not in MOE_TRANSFER_EXCLUDED]
        cross = cross_generation_calibration(hw, [(full[o], hws[o]) for o in others],
                                             vllm_version=measurement_software(args.data / f).get("vllm"))
        ape_x, _ = errors(test, hw, cross)
        results[f] = {"target": breakdown(test, ape_t), "cross-generation": breakdown(test, ape_x),
                      "cross_sources": others, "min_pred_over_roofline": float(over_roof.min())}
        print(f"\n== {f} ({hw.name}); cross-generation from {', '.join(others)}")
        print(f"{'dtype':<14}{'rows':>7}{'target':>9}{'cross-gen':>11}")
        for k in results[f]["target"]:
            r_t, r_x = results[f]["target"][k], results[f]["cross-generation"][k]
            print(f"{k:<14}{int(r_t['rows']):>7}{100 * r_t['mape']:>8.2f}%{100 * r_x['mape']:>10.2f}%")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"results": results, "train_fraction": args.train_fraction,
                                       "seed": args.seed}, indent=1))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
