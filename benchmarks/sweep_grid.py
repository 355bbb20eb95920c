"""What a target calibration from ``kernelsight calibrate sweep`` achieves, judged on the shared measurements.

The sweep's points (:func:`kernelsight.calibrate.sweep_shapes.build_grid`, its fixed-seed draw) are looked up in each
GPU's shared tables: every axis value (and sliding window; the head layout as a whole) snapped to the nearest
measured one (in log), and the table rows at the snapped shapes stand in for what the sweep would time on that
GPU (a point whose batch × length the table did not measure at that layout finds no row, so the fits here see
fewer rows than a real sweep times). A target fit on those rows (with the
cross-generation tier from the *other* GPUs as its prior, as ``kernelsight calibrate fit`` does) is judged on every
other row, next to a fit on as many random rows and the cross-generation tier alone. Two sweeps are shown:

* ``torch``: what runs with PyTorch alone (bf16 and per-tensor fp8 GEMMs, attention without windows, NCCL
  collectives);
* ``flash``: with vLLM's FlashAttention importable (attention also with sliding windows, and on a GPU where vLLM
  runs FA3, the H100, with an fp8 KV cache).

Both GEMM formats draw the same number of points. The sweep times every NCCL collective row of the tables, so
nothing of its own is left to judge there (``covered`` is empty); the other comm rows are vLLM's custom all-reduce.

Neither times vLLM's block-scaled fp8 GEMMs, nor an fp8 KV cache on FA2 GPUs (the L40S table's fp8 rows ran
FlashInfer and Triton): those rows come from the prior, so MAPE is also given over the rows of the variants the
sweep measures (``covered``).

GPU time: the measured latencies of the matched rows × 14 calls per point (3 warm-up, 1 that sets the head start,
10 timed) plus each point's head start (:func:`kernelsight.calibrate.sweep_timing.time_us`, at the assumed issue time),
per GPU; allocating each point's tensors adds roughly a millisecond per point.

    python benchmarks/sweep_grid.py [--data ../shared/data/kernels]

Prints a table per sweep and writes benchmarks/results/sweep_grid.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate import sweep, sweep_shapes, sweep_timing  # noqa: E402
from kernelsight.calibrate.evaluate import (  # noqa: E402
    default_fit_workers,
    fit_target,
    mape_table,
    measured_gpu_dirs,
)
from kernelsight.calibrate.fit.transfer import cross_generation_calibration  # noqa: E402
from kernelsight.calibrate.measurements import Table, read_measurements  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_hardware  # noqa: E402
from kernelsight.simcore.hardware import HardwareSpec  # noqa: E402

SHAPE_AXES = {"gemm": ("m", "n", "k"),
              "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim"),
              "attn_decode": ("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim")}
COVERED_FORMATS = ("bf16", "fp8")


def _snapper(measured: np.ndarray):  # type: ignore[no-untyped-def]
    values = np.unique(measured[measured > 0])
    logs = np.log(values)
    return lambda v: float(values[np.argmin(np.abs(logs - np.log(v)))])


def _layout_snapper(table: Table):  # type: ignore[no-untyped-def]
    """(q heads, KV heads, head dim) → the nearest layout the table measured (log distance, all three together:
    snapping each axis alone lands many points on layouts no row has)."""
    measured = np.unique(np.column_stack([table["num_heads"], table["num_kv_heads"], table["head_dim"]]), axis=0)
    logs = np.log(measured)

    def nearest(layout: tuple[int, int, int]) -> tuple[float, ...]:
        d = np.sum((logs - np.log(np.asarray(layout, dtype=float))) ** 2, axis=1)
        return tuple(float(x) for x in measured[int(np.argmin(d))])

    return nearest


def sweep_rows(table: Table, family: str, grid: sweep_shapes.Grid) -> np.ndarray:
    """Mask of the table's rows at the grid's points of ``family`` (axis values snapped to measured ones)."""
    if family == "comm":
        want = {(op, backend, float(g), float(size)) for op, backend, _, g, size in grid.comm}
        keys = zip(table["op"], table["backend"], table["num_gpus"], table["message_bytes"], strict=True)
        return np.array([k in want for k in keys], dtype=bool)
    axes = SHAPE_AXES[family]
    snap = {a: _snapper(table[a]) for a in axes}
    if family == "gemm":
        want = {(p[0], *(snap[a](v) for a, v in zip(axes, p[1:], strict=True))) for p in grid.gemm}
        keys = zip(table["dtype"], *(table[a] for a in axes), strict=True)
    else:
        points = grid.attn_prefill if family == "attn_prefill" else grid.attn_decode
        window = _snapper(table["window"]) if np.any(table["window"] > 0) else (lambda w: 0.0)
        layout = _layout_snapper(table)
        want = {(snap[axes[0]](p[0]), snap[axes[1]](p[1]), *layout(p[2:5]), p[5], window(p[6]) if p[6] else 0.0)
                for p in points}
        keys = zip(*(table[a] for a in axes), table["kv_dtype"], table["window"], strict=True)
    return np.array([tuple(k) in want for k in keys], dtype=bool)


def covered(table: Table, family: str, windows: bool, fp8_kv: bool = False) -> np.ndarray:
    """Rows of the variants the sweep times (GEMM formats bf16 / fp8; bf16 KV — and fp8 KV where it times one — at
    the head dims it draws: the H100's head_dim-512 rows run FA4, which no sweep kernel reaches; windows only with
    FlashAttention)."""
    if family == "gemm":
        return np.isin(table["dtype"], COVERED_FORMATS)
    if family == "comm":
        return table["backend"] == "nccl"
    kv = np.isin(table["kv_dtype"], ("bf16", "fp8") if fp8_kv else ("bf16",))
    ok = kv & (table["head_dim"] <= max(sweep_shapes.ATTN_HEAD_DIMS))
    return ok if windows else ok & (table["window"] == 0)


def evaluate(data: Path, sweeps: dict[str, Callable[[HardwareSpec], sweep_shapes.Grid]], workers: int) -> dict:
    gpus = measured_gpu_dirs(data)
    tables = {g: read_measurements(data / g) for g in gpus}
    hws = {g: load_hardware(n) for g, n in gpus.items()}
    full = {g: fit_target(tables[g], hws[g], residual_grid=False, workers=workers)[0] for g in gpus}
    out: dict = {}
    for name, grid_for in sweeps.items():
        out[name] = {}
        for g in gpus:
            hw, tabs = hws[g], tables[g]
            grid = grid_for(hw)
            fp8_kv = any(p[5] == "fp8" for p in grid.attn_prefill)
            prior = cross_generation_calibration(hw, [(full[o], hws[o]) for o in gpus if o != g])
            head_start_s = (sweep_timing.head_start_cycles(sweep.ASSUMED_ISSUE_S, sweep_timing.TIMED_CALLS)
                            / hw.boost_clock_hz)
            on = {f: sweep_rows(t, f, grid) for f, t in tabs.items()}
            cov_all = {f: covered(t, f, name == "flash", fp8_kv) for f, t in tabs.items()}
            rng = np.random.default_rng(0)
            rand = {}   # as many rows as the sweep matched, drawn at random from the variants it times
            for f, m in on.items():
                pick = np.zeros(len(m), dtype=bool)
                pick[rng.choice(np.flatnonzero(cov_all[f]), int(m.sum()), replace=False)] = True
                rand[f] = pick
            t0 = time.perf_counter()
            fitted, _ = fit_target({f: t.subset(on[f]) for f, t in tabs.items() if on[f].any()}, hw,
                                   workers=workers, prior=prior)
            fit_s = time.perf_counter() - t0
            random_fit, _ = fit_target({f: t.subset(rand[f]) for f, t in tabs.items() if rand[f].any()}, hw,
                                       workers=workers, prior=prior)
            rest = {f: ~m for f, m in on.items()}
            cov = {f: ~on[f] & cov_all[f] for f in tabs}
            res = {"sweep": mape_table(tabs, hw, fitted, rest), "covered": mape_table(tabs, hw, fitted, cov),
                   "random": mape_table(tabs, hw, random_fit, {f: ~m & cov_all[f] for f, m in rand.items()}),
                   "cross": mape_table(tabs, hw, prior, rest)}
            out[name][g] = {
                f: {"points": len(getattr(grid, f)), "rows": int(on[f].sum()),
                    "gpu_s": float(np.sum(t["latency_us"][on[f]]) * 1e-6 * sweep_timing.CALLS_PER_POINT
                                   + head_start_s * on[f].sum()) if f != "comm" else None,
                    **{k: 100 * r[f]["mape"] for k, r in res.items()}}
                for f, t in tabs.items()
            }
            out[name][g]["fit_s"] = fit_s
            # covered MAPE per variant (KV dtype, kernel), where a family has several
            out[name][g]["covered_variants"] = {f: {v: 100 * x["mape"] for v, x in r["variants"].items()}
                                                for f, r in res["covered"].items() if "variants" in r}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    ap.add_argument("--workers", type=int, default=default_fit_workers())
    ap.add_argument("--points", default="",
                    help="points per family instead of the sweep's, e.g. gemm=12000,attn_decode=8000")
    ap.add_argument("--sweeps", default="torch,flash")
    args = ap.parse_args(argv)
    points = {k: int(v) for k, v in (kv.split("=") for kv in args.points.split(",") if kv)}
    def grid_for(name: str) -> Callable[[HardwareSpec], sweep_shapes.Grid]:
        flash = name == "flash"
        return lambda hw: sweep_shapes.build_grid(
            gemm_dtypes=COVERED_FORMATS, num_gpus=8, points=points,
            windows=sweep_shapes.SWEEP_WINDOWS if flash else (0,),
            fp8_kv=flash and sweep_shapes.runs_fa3(hw.vendor, tuple(int(x) for x in hw.compute_capability.split("."))))

    sweeps = {name: grid_for(name) for name in args.sweeps.split(",")}
    results = evaluate(args.data, sweeps, args.workers)
    cols = ["gpu", "family", "points", "rows", "gpu_s", "sweep", "covered", "random", "cross"]
    for per_gpu in results.values():
        for fams in per_gpu.values():
            timed = [r["gpu_s"] * r["points"] / r["rows"] for f, r in fams.items()
                     if f not in ("fit_s", "covered_variants") and r["gpu_s"] is not None and r["rows"]]
            fams["sweep_gpu_s"] = sum(timed)
    for name, per_gpu in results.items():
        rows = [{"gpu": g, "family": f, **{k: r[k] for k in cols[2:]}}
                for g, fams in per_gpu.items() for f, r in fams.items()
                if f not in ("fit_s", "sweep_gpu_s", "covered_variants")]
        print(f"\n== sweep '{name}': target fit on the sweep's points, MAPE % on every other row "
              "(covered: those of the variants the sweep times; random: a fit on as many random rows; cross: the "
              "cross-generation tier alone); gpu_s: GPU seconds to time the matched rows on that GPU (calls and "
              "head starts)")
        print(format_table(rows, cols, float_fmt=".1f"))
        for g, fams in per_gpu.items():
            for f, by in fams.get("covered_variants", {}).items():
                print(f"{g} {f} covered MAPE by variant: " + ", ".join(f"{v} {x:.1f}%" for v, x in by.items()))
        print("GPU seconds of the whole sweep (each family's gpu_s scaled from its matched rows to all its "
              "points): " + ", ".join(f"{g} {fams['sweep_gpu_s']:.0f} s" for g, fams in per_gpu.items()))
    path = write_result("sweep_grid", {"results": results, "points": dict(sweep_shapes.SWEEP_POINTS, **points),
                                       "calls_per_point": sweep_timing.CALLS_PER_POINT})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
