"""How far to trust a prediction: the validation table, and the error bands every report quotes (issue 23 item 6).

For every measured run in the shared e2e schema (``--e2e``, default ``shared/data/e2e``: each directory with a
``meta.json``) and every calibration tier that can be built for its GPU — the GPU's bundled table (target-measured
where its kernels were measured) and the cross-generation tier (transferred from the bundled sources, the GPU's own
table left out) — ``kernelsight validate`` replays the run and the mean / median errors of TTFT, TPOT and E2E are
tabled. Per tier, the band is the largest |error| over the runs of that tier (mean and median alike), per metric;
the per-kernel bands come from ``benchmarks/kernel_accuracy.py``'s JSON when it is there (leave-one-GPU-out for the
cross-generation tier, held-out rows for the target tier; the largest family MAPE over the GPUs).

    python benchmarks/accuracy_bands.py --hardware llmservingsim_rtxpro6000_llama31_8b=rtx-pro-6000 [--write]

A run whose ``meta.json`` names no CUDA device needs ``--hardware RUN=GPU`` (the shared PRO 6000 run does); runs it
cannot place are skipped with a message. ``--write`` stores the bands in ``kernelsight/profiles/accuracy.json``, which
``simulate``, ``serve`` and ``validate`` quote beside the calibration tier. Prints the table as Markdown and writes
``benchmarks/results/accuracy_bands.json``. After ``--write``, ``python docs/gen/page_numbers.py`` renders the new
bands into README.md and docs/accuracy.md (``tests/test_docs.py`` fails until it has).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import CROSS_GENERATION_SOURCES, cross_generation_for  # noqa: E402
from kernelsight.loadgen.validate import read_run, run_hardware, validate_run  # noqa: E402
from kernelsight.profiles import load_calibration, load_hardware  # noqa: E402

METRICS = ("ttft", "tpot", "e2el")
ACCURACY_FILE = ROOT / "kernelsight" / "profiles" / "accuracy.json"
KERNEL_ACCURACY = ROOT / "benchmarks" / "results" / "kernel_accuracy.json"


def run_errors(result: dict[str, Any]) -> dict[str, float]:
    """``{"ttft_mean": %, "ttft_median": %, ...}`` of one validation result."""
    return {f"{r['metric']}_{r['stat']}": r["error_pct"] for r in result["latency"]
            if r["metric"] in METRICS and r["stat"] in ("mean", "median")}


def kernel_bands(path: Path) -> dict[str, dict[str, float]]:
    """Per tier, per family: the largest MAPE (%) over the GPUs of ``kernel_accuracy.py``'s result."""
    if not path.is_file():
        return {}
    results = json.loads(path.read_text())["results"]
    out: dict[str, dict[str, float]] = {}
    for per_tier in results.values():
        for tier, fams in per_tier.items():
            if tier == "roofline":
                continue
            name = "target-measured" if tier == "target" else tier
            for fam, r in fams.items():
                if r.get("mape") is None or fam.startswith("_"):
                    continue
                cur = out.setdefault(name, {})
                cur[fam] = round(max(cur.get(fam, 0.0), 100 * r["mape"]), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", type=Path, default=SHARED_DATA / "e2e")
    ap.add_argument("--hardware", action="append", default=[], metavar="RUN=GPU",
                    help="GPU profile of a run whose meta.json names no CUDA device (repeatable)")
    ap.add_argument("--kernel-accuracy", type=Path, default=KERNEL_ACCURACY,
                    help="kernel_accuracy.py's JSON, for the per-kernel bands (default: %(default)s)")
    ap.add_argument("--write", action="store_true", help="store the bands in kernelsight/profiles/accuracy.json")
    args = ap.parse_args(argv)
    gpu_of = dict(h.split("=", 1) for h in args.hardware)

    rows: list[dict[str, Any]] = []
    for run_dir in sorted(p for p in args.e2e.iterdir() if (p / "meta.json").is_file()):
        run = read_run(run_dir)
        try:
            gpu = gpu_of.get(run_dir.name) or run_hardware(run.meta)
        except ValueError as exc:
            print(f"skipped {run_dir.name}: {exc}", file=sys.stderr)
            continue
        hw = load_hardware(gpu)
        # the GPU's bundled calibration of the run's software stack (as validate picks it from meta.json)
        tiers: list[tuple[str, str | None]] = [
            (load_calibration(hw.name, vllm_version=run.meta.get("vllm_version")).tier, None)]
        if tiers[0][0] != "cross-generation":
            cross = cross_generation_for(hw)
            tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump(cross.to_dict(), tmp)
            tmp.close()
            tiers.append(("cross-generation", tmp.name))
        for tier, calib_path in tiers:
            v = validate_run(run_dir, hardware=hw.name, calibration=calib_path)
            rows.append({"run": run_dir.name, "gpu": hw.name, "model": v.result["config"]["model"],
                         "vllm": v.result.get("vllm_version"), "tier": tier,
                         "calibration_vllm": v.result["config"].get("calibration_vllm", ""), **run_errors(v.result)})
            if calib_path:
                Path(calib_path).unlink()

    bands: dict[str, dict[str, Any]] = {}
    for tier in sorted({r["tier"] for r in rows}):
        mine = [r for r in rows if r["tier"] == tier]
        bands[tier] = {"runs": len(mine), **{m: round(max(max(abs(r[f"{m}_mean"]), abs(r[f"{m}_median"]))
                                                          for r in mine), 1) for m in METRICS}}
    kernels = kernel_bands(args.kernel_accuracy)

    print("| run | GPU | tier (kernels timed under) | TTFT mean / median | TPOT mean / median | E2E mean / median |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[f'{m}_mean']:+.1f}% / {r[f'{m}_median']:+.1f}%" for m in METRICS)
        print(f"| {r['run']} | {r['gpu']} | {r['tier']} (vLLM {r['calibration_vllm'] or '?'}) | {cells} |")
    print()
    for tier, b in bands.items():
        k = kernels.get(tier, {})
        print(f"{tier}: ±{b['ttft']}% TTFT, ±{b['tpot']}% TPOT, ±{b['e2el']}% E2E over {b['runs']} run(s)"
              + (f"; per kernel up to {', '.join(f'{f} {v}%' for f, v in sorted(k.items()))}" if k else ""))

    payload = {"built_by": "benchmarks/accuracy_bands.py", "date": dt.date.today().isoformat(),
               "cross_generation_sources": list(CROSS_GENERATION_SOURCES), "runs": rows, "run_bands_pct": bands,
               "kernel_mape_pct": kernels}
    path = write_result("accuracy_bands", payload)
    print(f"\nwrote {path}")
    if args.write:
        ACCURACY_FILE.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {ACCURACY_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
