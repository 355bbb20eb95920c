"""NVFP4 GEMM accuracy on the shared RTX PRO 6000 rows, and how far the cross-generation rule for FP4 can be trusted.

1. **Target tier** on the 35,742 NVFP4 rows of ``kernels/rtx_pro_6000_server/gemm.csv.gz``: the ``nvfp4`` GEMM
   variant fitted on a random 25 % of the GEMM table's rows, judged on the other 75 % — the split of
   ``benchmarks/kernel_accuracy.py`` / ``calibrate eval`` (``split_masks``, seed 0; variants fit independently, so
   the nvfp4 sub-model is the one a whole-table fit on those rows holds). Beside it: the plain roofline (η = 1) and
   the PRO 6000's cross-generation tier, which has no FP4 source and prices NVFP4 with its bf16 η.
2. **The FP4 transfer rule's self-consistency.** One GPU was measured in FP4, so leave-one-GPU-out cannot judge the
   rule that moves its NVFP4 η to B200 / B300 / GB200 / GB300 (transfer rule 9). Instead the same single-source move
   is applied to formats measured elsewhere: the PRO 6000's bf16 and fp8 η, transferred to the A100 / H100 / L40S,
   judged on their own GEMM rows (the same 75 % split), beside the usual cross-generation tier of those GPUs (from
   the bundled calibrations of the other two sources).
3. What the bundled calibrations predict for NVFP4, FP8 and bf16 GEMMs of Llama-3.1-8B's shapes on every GPU with
   FP4 tensor cores (and Marlin W4A16 on the H100), with the roofline bound beside each.

    python benchmarks/fp4_accuracy.py [--data ../shared/data/kernels] [--more-seeds N]

Prints the tables and writes ``benchmarks/results/fp4_accuracy.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED_DATA, steal_s, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import roofline_calibration, split_masks  # noqa: E402
from kernelsight.calibrate.fit.eta import fit_family  # noqa: E402
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import Table, read_table  # noqa: E402
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s  # noqa: E402
from kernelsight.profiles import (  # noqa: E402
    load_calibration,
    load_hardware,
    load_model,  # noqa: E402
)
from kernelsight.simcore.calibration import Calibration  # noqa: E402
from kernelsight.simcore.eta import SwitchEta  # noqa: E402
from kernelsight.simcore.kernels import linear_kernel  # noqa: E402
from kernelsight.simcore.precision import resolve_precision  # noqa: E402
from kernelsight.simcore.roofline import kernel_roofline_s  # noqa: E402
from kernelsight.simcore.step_model import StepConfig, StepModel  # noqa: E402

PRO6000 = "rtx_pro_6000_server"
SMALL_ROOFLINE_S = 10e-6
#: the measured GPUs the self-consistency check moves the PRO 6000's η to (folder, profile)
OTHERS = (("a100_sxm", "a100-sxm"), ("h100_sxm", "h100-sxm"), ("l40s", "l40s"))


def _ape(table: Table, hw, calib: Calibration) -> np.ndarray:
    pred = predict_rows_s("gemm", table.columns, hw, calib)
    return np.abs(pred / (table["latency_us"] * 1e-6) - 1.0)


def _stats(ape: np.ndarray, small: np.ndarray) -> dict[str, float]:
    return {"mape": float(ape.mean()), "median": float(np.median(ape)), "p90": float(np.quantile(ape, 0.9)),
            "mape_small": float(ape[small].mean()) if small.any() else float("nan"),
            "mape_large": float(ape[~small].mean()) if (~small).any() else float("nan"), "rows": int(len(ape))}


def target_tier(data: Path, seeds: list[int]) -> dict:
    hw = load_hardware("rtx-pro-6000")
    table = read_table(data / PRO6000 / "gemm.csv.gz", "gemm")
    nv = table["dtype"] == "nvfp4"
    bundled = load_calibration("rtx-pro-6000")
    cross = cross_generation_calibration(
        hw, [(load_calibration(p), load_hardware(p)) for _, p in OTHERS])   # what the PRO 6000 had without its tables
    out: dict = {"by_seed": {}}
    for seed in seeds:
        train, test = split_masks({"gemm": table}, 0.25, seed)
        tr, te = table.subset(train["gemm"] & nv), table.subset(test["gemm"] & nv)
        t0 = time.perf_counter()
        model, _, report = fit_family("gemm", tr.columns, hw, residual_grid=True)
        fit_s = time.perf_counter() - t0
        target = load_calibration("rtx-pro-6000")
        target.eta["gemm"] = SwitchEta(bundled.eta["gemm"].index,   # type: ignore[union-attr]
                                       {**bundled.eta["gemm"].models, "4": model.models["4"]},  # type: ignore[union-attr]
                                       bundled.eta["gemm"].default)   # type: ignore[union-attr]
        small = roofline_rows_s(kernel_rows("gemm", te.columns), hw) < SMALL_ROOFLINE_S
        row = {"target": _stats(_ape(te, hw, target), small), "train_rows": len(tr), "fit_s": fit_s,
               "train_mape": report["gemm[4]"]["train_mape"]}
        if seed == seeds[0]:
            row["roofline"] = _stats(_ape(te, hw, roofline_calibration(hw)), small)
            row["cross-generation (no FP4 source)"] = _stats(_ape(te, hw, cross), small)
            row["bundled (fitted on every row)"] = _stats(_ape(te, hw, bundled), small)
        out["by_seed"][seed] = row
    return out


def transfer_self_consistency(data: Path, seed: int) -> dict:
    pro_hw = load_hardware("rtx-pro-6000")
    pro = load_calibration("rtx-pro-6000")
    out: dict = {}
    for folder, name in OTHERS:
        hw = load_hardware(name)
        table = read_table(data / folder / "gemm.csv.gz", "gemm")
        _, test = split_masks({"gemm": table}, 0.25, seed)
        single = cross_generation_calibration(hw, [(pro, pro_hw)])
        usual = cross_generation_calibration(hw, [(load_calibration(p), load_hardware(p)) for _, p in OTHERS
                                                  if p != name])
        for fmt in ("bf16", "fp8"):
            sel = test["gemm"] & (table["dtype"] == fmt)
            if not sel.any():
                continue
            te = table.subset(sel)
            small = roofline_rows_s(kernel_rows("gemm", te.columns), hw) < SMALL_ROOFLINE_S
            out[f"{name} {fmt}"] = {"from PRO 6000 alone": _stats(_ape(te, hw, single), small),
                                    "usual cross-generation": _stats(_ape(te, hw, usual), small)}
    return out


#: Llama-3.1-8B's linear layers (n, k): qkv, o, gate_up, down
LLAMA8B_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
                  "down_proj": (4096, 14336)}


def predicted_gemms() -> dict:
    """Per GPU and token count: the bundled calibrations' time of Llama-3.1-8B's four linear layers (one layer,
    CUDA graphs) in bf16, fp8 and NVFP4, and the NVFP4 roofline."""
    model = load_model("meta-llama/Llama-3.1-8B")
    out: dict = {}
    for gpu in ("rtx-pro-6000", "b200", "gb200", "b300", "gb300", "h100"):
        hw = load_hardware(gpu)
        calib = load_calibration(gpu)
        for m in (1, 32, 256, 4096):
            row: dict = {}
            for quant in (None, "fp8", "nvfp4"):
                p = resolve_precision("bfloat16", quant, "auto", compute_capability=hw.compute_capability)
                sm = StepModel(model, hw, calib, p, StepConfig(cudagraph_capture_sizes=(1, 32, 256)))
                ks = [linear_kernel(n_, m, n, k, p) for n_, (n, k) in LLAMA8B_SHAPES.items()]
                row[quant or "bf16"] = sum(sm.kernel_time_s(x) for x in ks) * 1e6
                if quant == "nvfp4":
                    row["nvfp4 roofline"] = sum(kernel_roofline_s(x.flops, x.bytes_moved, x.tiles, x.dtype, hw)
                                                for x in ks) * 1e6
                    row["nvfp4 kernel"] = ks[0].impl
            out[f"{gpu} m={m}"] = row
    return out


def _pct(x: float) -> str:
    return f"{100 * x:6.2f}%" if np.isfinite(x) else "     -"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--more-seeds", type=int, default=0, help="also fit on this many further random splits")
    args = ap.parse_args(argv)
    seeds = list(range(args.seed, args.seed + 1 + args.more_seeds))
    steal0, t0 = steal_s(), time.perf_counter()

    tier = target_tier(args.data, seeds)
    print("== NVFP4 GEMM rows of the RTX PRO 6000, held out (75 %), MAPE / median / p90 / small / large shapes")
    first = tier["by_seed"][seeds[0]]
    for label in ("roofline", "cross-generation (no FP4 source)", "target", "bundled (fitted on every row)"):
        s = first[label]
        print(f"  {label:<36} {_pct(s['mape'])} {_pct(s['median'])} {_pct(s['p90'])} {_pct(s['mape_small'])} "
              f"{_pct(s['mape_large'])}  ({s['rows']} rows)")
    if len(seeds) > 1:
        v = [tier["by_seed"][s]["target"]["mape"] for s in seeds]
        print(f"  target tier over seeds {seeds[0]}–{seeds[-1]}: mean {100 * np.mean(v):.2f}% "
              f"({100 * min(v):.2f}–{100 * max(v):.2f})")

    consistency = transfer_self_consistency(args.data, args.seed)
    print("\n== transfer rule self-consistency: GEMM MAPE on the GPU's own held-out rows")
    print(f"  {'GPU format':<16} {'from PRO 6000 alone':>20} {'usual cross-generation':>24}")
    for key, r in consistency.items():
        single, usual = r["from PRO 6000 alone"]["mape"], r["usual cross-generation"]["mape"]
        print(f"  {key:<16} {_pct(single):>20} {_pct(usual):>24}")

    gemms = predicted_gemms()
    print("\n== Llama-3.1-8B linear layers (one layer), bundled calibrations, µs")
    print(f"  {'GPU tokens':<18} {'bf16':>9} {'fp8':>9} {'nvfp4':>9} {'nvfp4 roof':>11}  nvfp4 kernel")
    for key, r in gemms.items():
        print(f"  {key:<18} {r['bf16']:>9.1f} {r['fp8']:>9.1f} {r['nvfp4']:>9.1f} {r['nvfp4 roofline']:>11.1f}  "
              f"{r['nvfp4 kernel']}")
    wall, steal = time.perf_counter() - t0, steal_s() - steal0
    print(f"\nwall {wall:.0f} s, steal {steal:.1f} s")
    path = write_result("fp4_accuracy", {"target_tier": tier, "transfer_self_consistency": consistency,
                                         "llama8b_linear_us": gemms, "wall_s": wall, "steal_s": steal})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
