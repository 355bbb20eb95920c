"""Per-kernel accuracy of the calibration tiers on the shared measurements (issue 3).

* roofline: η = 1, no fixed latency.
* cross-generation: leave-one-GPU-out over every GPU folder in ``--data`` — fit target-measured calibrations on
  the other GPUs of the transfer sources (all their rows; default the bundled tier's sources, A100 / H100 / L40S),
  transfer to the held-out GPU by its spec. A measured GPU outside the sources (the RTX PRO 6000) is only ever
  held out: it is judged as a new GPU is, from all the sources, and its numbers leave the others' unchanged.
* rows of formats the model cannot price yet are left out of every tier and counted on stderr (none since NVFP4 is
  priced: the PRO 6000's NVFP4 rows count in its GEMM family, where its cross-generation tier, from GPUs never
  measured in FP4, prices them with bf16 η — ~50% off; ``fp4_accuracy.py`` reports them apart).
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
    CROSS_GENERATION_SOURCES,
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
from kernelsight.calibrate.measurements import describe_skipped, read_measurements  # noqa: E402
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
    ap.add_argument("--sources", default=",".join(CROSS_GENERATION_SOURCES),
                    help="GPU profiles the cross-generation tier transfers from (each held out in turn); other "
                         "measured GPUs are only judged (default: %(default)s, as the bundled tier)")
    args = ap.parse_args(argv)
    sources = {s.strip() for s in args.sources.split(",") if s.strip()}

    skipped: list[str] = []
    gpus = measured_gpu_dirs(args.data, skipped)   # every GPU folder of the schema whose name is a bundled profile
    for name in skipped:
        print(f"skipped {args.data / name}: no bundled GPU profile is named {name!r} (kernelsight profiles lists "
              "them)", file=sys.stderr)
    if len(gpus) < 2:
        raise SystemExit(f"{args.data}: leave-one-GPU-out needs measurements of at least two bundled GPUs")
    tables = {}
    for g in gpus:
        left_out: dict[str, int] = {}
        tables[g] = read_measurements(args.data / g, skipped=left_out)
        for line in describe_skipped(left_out):
            print(f"{g}: {line}", file=sys.stderr)
    hws = {g: load_hardware(n) for g, n in gpus.items()}
    source_gpus = [g for g in gpus if hws[g].name in sources]
    full_fits = {}
    timings = {}
    for g in source_gpus:    # only the sources' full fits are transferred
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
        others = [o for o in source_gpus if o != g]
        if not others:
            raise SystemExit(f"{g}: no other measured GPU among --sources {args.sources!r} to transfer from")
        cross = cross_generation_calibration(hw, [(full_fits[o], hws[o]) for o in others])
        target, test = target_fit(g, args.seed, cross)
        results[g] = {
            "roofline": mape_table(tables[g], hw, roofline_calibration(hw), test),
            "cross-generation": mape_table(tables[g], hw, cross, test),
            "target": mape_table(tables[g], hw, target, test),
        }
        print(f"\n== {g} ({hw.name}); cross-generation from {', '.join(others)}")
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
