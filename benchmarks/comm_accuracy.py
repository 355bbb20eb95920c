"""Collective (comm family) accuracy of the calibration tiers on the shared measurements, per GPU and per
measured backend — the comm column of ``kernel_accuracy.py`` without fitting every kernel family (seconds, not
minutes), plus a breakdown by the all-reduce implementation vLLM dispatches each row to.

* cross-generation: leave-one-GPU-out — comm models fitted on each other GPU's comm rows (all of them), then
  transferred to the held-out GPU by its spec (``cross_generation_calibration``, as the bundled files are);
* target-measured: fitted on a random 25 % of the GPU's comm rows with the cross-generation tier as prior,
  judged on the other 75 % (the same rows as the cross-generation column).

Prints a table and writes JSON (default ``benchmarks/results/comm_accuracy.json``).

    python benchmarks/comm_accuracy.py [--data ../shared/data/kernels] [-o out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelsight.calibrate.evaluate import (  # noqa: E402
    fit_target,
    measured_gpu_dirs,
    predict_comm_s,
    split_masks,
)
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import read_table  # noqa: E402
from kernelsight.profiles import load_hardware  # noqa: E402


def _row_labels(cols: dict, hw) -> np.ndarray:
    """Per row, the measured backend and (for vLLM's all-reduce rows) the implementation vLLM runs it with."""
    try:
        from kernelsight.simcore.allreduce_dispatch import allreduce_implementation
    except ImportError:  # before the dispatch existed: the measured backend only
        return np.asarray(cols["backend"]).astype(str)
    out = []
    for op, b, g, s, d in zip(cols["op"], cols["backend"], cols["num_gpus"], cols["message_bytes"], cols["dtype"],
                              strict=True):
        vllm = str(b).startswith("vllm") and op == "all_reduce"
        out.append(f"{b} → {allreduce_implementation(hw, int(g), float(s), str(d))}" if vllm else str(b))
    return np.array(out, dtype=object)


def _mape(pred: np.ndarray, meas: np.ndarray, sel: np.ndarray) -> tuple[float, int]:
    ok = sel & np.isfinite(pred) & (meas > 0)
    return (float(np.mean(np.abs(pred[ok] - meas[ok]) / meas[ok])) if ok.any() else float("nan")), int(ok.sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "kernels")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "benchmarks" / "results" / "comm_accuracy.json")
    ap.add_argument("--train-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    gpus = measured_gpu_dirs(args.data)
    tables = {g: {"comm": read_table(args.data / g / "comm.csv.gz", "comm")} for g in gpus}
    hws = {g: load_hardware(n) for g, n in gpus.items()}
    full = {g: fit_target(tables[g], hws[g], residual_grid=False)[0] for g in gpus}
    results: dict[str, dict] = {}
    for g in gpus:
        hw, table = hws[g], tables[g]["comm"]
        cross = cross_generation_calibration(hw, [(full[o], hws[o]) for o in gpus if o != g])
        train, test = split_masks(tables[g], args.train_fraction, args.seed)
        target, _ = fit_target({"comm": table.subset(train["comm"])}, hw, residual_grid=False, prior=cross)
        meas = np.asarray(table["latency_us"], dtype=float) * 1e-6
        labels = _row_labels(table.columns, hw)
        small = np.asarray(table["message_bytes"], dtype=float) < 1 << 20
        res: dict[str, dict] = {}
        for tier, calib in (("cross-generation", cross), ("target", target)):
            pred = predict_comm_s(table.columns, hw, calib)
            r = {"all": _mape(pred, meas, test["comm"]), "small": _mape(pred, meas, test["comm"] & small),
                 "large": _mape(pred, meas, test["comm"] & ~small)}
            backend = np.asarray(table["backend"]).astype(str)
            for lab in sorted(set(backend.tolist())):   # by measured backend, comparable across versions
                r[lab] = _mape(pred, meas, test["comm"] & (backend == lab))
            for lab in sorted(set(labels.tolist()) - set(backend.tolist())):   # by dispatched implementation
                r[lab] = _mape(pred, meas, test["comm"] & (labels == lab))
            res[tier] = r
        results[g] = res
        print(f"\n== {g} ({hw.name}): comm MAPE on the held-out 75 % of rows")
        print(f"{'rows':40s} {'cross-generation':>18s} {'target':>10s} {'n':>5s}")
        for key in res["target"]:
            c, t = res["cross-generation"][key], res["target"][key]
            print(f"{key:40s} {100 * c[0]:17.1f}% {100 * t[0]:9.1f}% {t[1]:5d}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"results": results, "train_fraction": args.train_fraction,
                                       "seed": args.seed}, indent=1))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
