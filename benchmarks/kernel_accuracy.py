"""Per-kernel accuracy of the calibration tiers on the shared measurements (issue 3).

* roofline: η = 1, no fixed latency.
* cross-generation: leave-one-GPU-out over every GPU folder in ``--data`` (shared: A100 / H100 / L40S) — fit
  target-measured calibrations on the other GPUs (all their rows), transfer to the held-out GPU by its spec.
* target-measured: fit on a random 25% of each family's rows of the GPU, judge on the other 75%, with the
  cross-generation tier as the fit's prior (as ``kernelsight calibrate fit`` does; it only speaks for variants
  sampled at fewer than calibrate.fit.eta.SELECT_MAX_ROWS rows, so a small ``--train-fraction`` shows a thin sweep).

Roofline and cross-generation are judged on the same 75% rows as the target tier so the columns are
comparable. Prints a table per GPU and writes JSON (default ``benchmarks/results/kernel_accuracy.json``).

    python benchmarks/kernel_accuracy.py [--data ../shared/data/kernels] [-o out.json] [--more-seeds N]
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

from kernelsight.calibrate.evaluate import (  # noqa: E402
    SHARED_DATA_LICENCE,
    default_fit_workers,
    fit_target,
    format_results,
    mape_table,
    measured_gpu_dirs,
    roofline_calibration,
    split_masks,
)
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import read_measurements  # noqa: E402
from kernelsight.profiles import load_hardware  # noqa: E402
from kernelsight.simcore.calibration import Calibration  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "kernels")
    ap.add_argument(
        "-o", "--output", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_accuracy.json"
    )
    ap.add_argument("--train-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--more-seeds", type=int, default=0,
                    help="also fit the target tier on this many further random splits (seed+1, ...) and print "
                         "each family's MAPE over all splits: how much of a result is the draw")
    args = ap.parse_args(argv)

    skipped: list[str] = []
    gpus = measured_gpu_dirs(args.data, skipped)   # every GPU folder of the schema whose name is a bundled profile
    for name in skipped:
        print(f"skipped {args.data / name}: no bundled GPU profile is named {name!r} (kernelsight profiles lists "
              "them)", file=sys.stderr)
    if len(gpus) < 2:
        raise SystemExit(f"{args.data}: leave-one-GPU-out needs measurements of at least two bundled GPUs")
    tables = {g: read_measurements(args.data / g) for g in gpus}
    hws = {g: load_hardware(n) for g, n in gpus.items()}
    full_fits = {}
    timings = {}
    for g in gpus:
        t0 = time.perf_counter()
        full_fits[g], _ = fit_target(
            tables[g],
            hws[g],
            source=f"shared data kernels/{g}",
            licence=SHARED_DATA_LICENCE,
            residual_grid=False,
            workers=default_fit_workers(),
        )
        timings[g] = time.perf_counter() - t0
    results: dict[str, dict] = {}
    by_seed: dict[str, dict[str, list[float]]] = {}
    def target_fit(g: str, seed: int, prior: Calibration) -> tuple[Calibration, dict[str, np.ndarray]]:
        """The target tier fitted on one random split of GPU g's rows, and the rows it is judged on."""
        train, test = split_masks(tables[g], args.train_fraction, seed)
        fit, _ = fit_target({f: t.subset(train[f]) for f, t in tables[g].items()}, hws[g],
                            workers=default_fit_workers(), prior=prior)
        return fit, test

    for g in gpus:
        hw = hws[g]
        cross = cross_generation_calibration(hw, [(full_fits[o], hws[o]) for o in gpus if o != g])
        target, test = target_fit(g, args.seed, cross)
        results[g] = {
            "roofline": mape_table(tables[g], hw, roofline_calibration(hw), test),
            "cross-generation": mape_table(tables[g], hw, cross, test),
            "target": mape_table(tables[g], hw, target, test),
        }
        print(f"\n== {g} ({hw.name}); cross-generation from {', '.join(o for o in gpus if o != g)}")
        print(format_results(results[g]))
        for seed in range(args.seed + 1, args.seed + 1 + args.more_seeds):   # the target tier on other draws
            fit, held_out = target_fit(g, seed, cross)
            for fam, r in mape_table(tables[g], hw, fit, held_out).items():
                by_seed.setdefault(g, {}).setdefault(fam, [results[g]["target"][fam]["mape"]]).append(r["mape"])
        if g in by_seed:
            print(f"target tier over {1 + args.more_seeds} random splits (seeds {args.seed}–"
                  f"{args.seed + args.more_seeds}): " + "; ".join(
                      f"{fam} mean {100 * np.mean(v):.2f}% ({100 * min(v):.2f}–{100 * max(v):.2f})"
                      for fam, v in sorted(by_seed[g].items())))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "results": results,
                "smooth_fit_seconds": timings,
                "train_fraction": args.train_fraction,
                "seed": args.seed,
                "target_mape_by_seed": by_seed,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
