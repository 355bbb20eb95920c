"""How well can the shared kernel measurements predict themselves? Floors for the target tier (issue 3).

The target tier is judged on rows it never saw (fit on 25 %, judged on 75 %, ``kernel_accuracy.py``). A model
that interpolates between measured shapes cannot do better than the measurements' own roughness, so per GPU
and family this prints three model-free references, each a mean absolute percentage error:

* repeats: a row against the mean of the rows with the same key (duplicates: run-to-run noise); "-" if none.
* neighbours: each row predicted from its two immediate grid neighbours along one sweep axis (log-log line
  through them, every other column equal), with every other row measured (four times the benchmark's
  training density); the best axis is reported. Neighbouring grid values often run different library
  kernels (tile configs, split-K), so this is roughness of the grid, not noise. It is a reference, not a
  bound: a model pooling all axes can beat one-axis interpolation (the target tier's lattice does, on the
  same rows, at 25 % density), but where even full-density neighbours miss by 4-7 %, 4 % at 25 % is hard.

    python benchmarks/measurement_floor.py [--data ../shared/data/kernels]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.measurements import Table, read_measurements  # noqa: E402

#: Sweep axes per family (numeric columns a grid neighbour differs in); every other column is part of the key.
AXES = {
    "gemm": ("m", "n", "k"),
    "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim"),
    "attn_decode": ("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim"),
    "comm": ("message_bytes", "num_gpus"),
}


def _keys(t: Table, skip: tuple[str, ...]) -> list[tuple]:
    cols = [c for c in t.columns if c not in skip and c != "latency_us"]
    return list(zip(*(np.asarray(t[c]).tolist() for c in cols), strict=True))


def repeat_ape(t: Table) -> float:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for key, y in zip(_keys(t, ()), t["latency_us"].tolist(), strict=True):
        groups[key].append(y)
    ape = [abs(y / np.mean(v) - 1.0) for v in groups.values() if len(v) > 1 for y in v]
    return float(np.mean(ape)) if ape else float("nan")


def neighbour_ape(t: Table, axis: str, known: np.ndarray, judged: np.ndarray) -> np.ndarray:
    """APE of each ``judged`` row predicted from the nearest ``known`` rows below and above it along ``axis``
    (log-log line; NaN where one side is missing). Known rows at the same axis value are averaged in logs."""
    x = np.log(np.asarray(t[axis], dtype=float))
    y = np.log(np.asarray(t["latency_us"], dtype=float))
    out = np.full(len(t), np.nan)
    lines: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(_keys(t, (axis,))):
        lines[key].append(i)
    for idx in lines.values():
        idx_arr = np.asarray(idx)
        kn = idx_arr[known[idx_arr]]
        if len(kn) < 2:
            continue
        levels: dict[float, list[float]] = defaultdict(list)
        for i in kn:
            levels[float(x[i])].append(float(y[i]))
        xs = np.array(sorted(levels))
        ys = np.array([np.mean(levels[v]) for v in xs])
        for i in idx_arr[judged[idx_arr]]:
            # the row itself never counts as its own neighbour (strictly below / above its axis value)
            lo = np.searchsorted(xs, x[i], side="left") - 1
            hi = np.searchsorted(xs, x[i], side="right")
            if lo < 0 or hi >= len(xs):
                continue
            pred = ys[lo] + (ys[hi] - ys[lo]) * (x[i] - xs[lo]) / (xs[hi] - xs[lo])
            out[i] = abs(math.exp(pred - y[i]) - 1.0)
    return out


def family_floors(t: Table) -> dict[str, object]:
    everyone = np.ones(len(t), dtype=bool)
    per_axis = {}
    for axis in AXES[t.family]:
        if axis not in t.columns or len(np.unique(t[axis])) < 3:
            continue
        ape = neighbour_ape(t, axis, everyone, everyone)
        ok = np.isfinite(ape)
        if ok.sum() >= 20:
            per_axis[axis] = {"mape": float(np.mean(ape[ok])), "rows": int(ok.sum())}
    best = min(per_axis, key=lambda a: per_axis[a]["mape"]) if per_axis else None
    return {"rows": len(t), "repeats": repeat_ape(t), "best_axis": best,
            "neighbours": per_axis[best]["mape"] if best else float("nan"), "by_axis": per_axis}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(SHARED_DATA / "kernels"))
    args = ap.parse_args(argv)
    out: dict[str, dict] = {}
    print(f"{'gpu':10s} {'family':13s} {'rows':>7s} {'repeats':>8s} {'neighbours':>10s} {'best axis':>13s}")
    for gpu in sorted(os.listdir(args.data)):
        path = os.path.join(args.data, gpu)
        if not os.path.isdir(path):
            continue
        tables = read_measurements(path)
        out[gpu] = {}
        for fam, t in sorted(tables.items()):
            if fam not in AXES or not t.has_latency:
                continue
            r = family_floors(t)
            out[gpu][fam] = r
            rep = "-" if math.isnan(r["repeats"]) else f"{100 * r['repeats']:.1f}%"
            print(f"{gpu:10s} {fam:13s} {len(t):7d} {rep:>8s} {100 * r['neighbours']:9.1f}% "
                  f"{r['best_axis'] or '-':>13s}")
    path = write_result("measurement_floor", {"floors": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
