"""Fast-forward over several cores: ``simulate`` with a dense ``-dp N`` group's ranks in worker processes, and with
``--replicas N`` in worker processes or as Ray tasks, against the same run in one process.

Each configuration is run in process (``run_group_in_processes`` / ``run_replicas``; the workload built once) and
timed by its simulation's wall time (what ``Simulated ... in X s of wall time`` prints), the one-process run beside
it in the same round (ABBA over ``--repeat`` rounds); the results must be the one-process run's bit for bit (checked
on every run: records, steps, breakdown). The table gives each mode's median wall time and its paired ratio to one
process, the number of 100 ms router refresh windows of a ``-dp`` run (one round trip to each worker per window), and
the machine's steal time and busy share over the whole comparison (/proc/stat): on a machine whose other cores are
busy, more processes cannot win. Ray runs only with ``--ray`` (``pip install ray``; a local instance in this process).

Usage: python benchmarks/fleet_scaling.py [--requests 10000] [--rate 40] [--dp 2] [--replicas 4] [--processes 2]
                                          [--repeat 3] [--ray]
Writes benchmarks/results/fleet_scaling.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_jiffies, machine, steal_busy_pct, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.arrivals import arrival_times_s  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.dp_processes import run_group_in_processes  # noqa: E402
from kernelsight.loadgen.dp_processes import supports as dp_split  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward, run_replicas  # noqa: E402
from kernelsight.simcore.dp_group import LB_STATS_INTERVAL_S  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402

MODEL, HARDWARE = "meta-llama/Llama-3.1-8B", "h100"


def _same(a, b) -> bool:
    if len(a.records) != len(b.records):
        return False
    for x, y in zip(a.records, b.records, strict=True):
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if not (np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v):
                return False
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a)
               if f.name not in ("records", "wall_s"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s of the whole run")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ray", action="store_true", help="also run the replicas as Ray tasks (local instance)")
    ns = ap.parse_args()

    dp_cfg = create_engine_config(EngineArgs(model=MODEL, hardware=HARDWARE, data_parallel_size=ns.dp, seed=0))
    one_cfg = create_engine_config(EngineArgs(model=MODEL, hardware=HARDWARE, seed=0))
    assert dp_split(dp_cfg, None, False)
    samples = random_dataset(ns.requests, 1000, 200, 0.1, one_cfg.model.vocab_size, seed=0)
    arrivals = arrival_times_s(ns.requests, ns.rate, 1.0, seed=0).tolist()
    windows, nxt = 0, -1.0
    for t in sorted(arrivals):
        if t >= nxt:
            windows += 1
            nxt = (t // LB_STATS_INTERVAL_S + 1) * LB_STATS_INTERVAL_S

    modes = {
        f"dp{ns.dp} 1 process": lambda: run_fast_forward(dp_cfg, samples, arrivals),
        f"dp{ns.dp} {ns.processes} processes": lambda: run_group_in_processes(dp_cfg, samples, arrivals, True,
                                                                            ns.processes),
        f"{ns.replicas} replicas 1 process": lambda: run_replicas(one_cfg, samples, arrivals, ns.replicas),
        f"{ns.replicas} replicas {ns.processes} processes": lambda: run_replicas(one_cfg, samples, arrivals,
                                                                               ns.replicas, processes=ns.processes),
    }
    if ns.ray:
        modes[f"{ns.replicas} replicas Ray ({ns.processes} CPUs)"] = lambda: run_replicas(
            one_cfg, samples, arrivals, ns.replicas, processes=ns.processes, ray_address="local")
    baseline = {name: next(b for b in modes if b.split()[0] == name.split()[0] and "1 process" in b) for name in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    ref: dict[str, object] = {}
    j0 = cpu_jiffies()
    try:
        for i in range(ns.repeat):
            for name in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                res = modes[name]()
                walls[name].append(res.wall_s)
                base = baseline[name]
                if name == base:
                    ref.setdefault(name, res)
                elif base in ref and not _same(ref[base], res):
                    raise SystemExit(f"{name}: not the one-process result")
    finally:
        if ns.ray:
            import ray

            ray.shutdown()
    j1 = cpu_jiffies()
    steal, busy = steal_busy_pct(j0, j1)
    rows = []
    for name in modes:
        base = baseline[name]
        ratio = statistics.median(a / b for a, b in zip(walls[name], walls[base], strict=True))
        rows.append({"mode": name, "runs": len(walls[name]), "wall_median_s": statistics.median(walls[name]),
                     "wall_best_s": min(walls[name]), "ratio_to_1_process": ratio})
    print(f"fast-forward over cores: {ns.requests} requests at {ns.rate:g}/s ({windows} router refresh windows); "
          f"machine: {machine()}; over the comparison: steal {steal:.2f}%, machine busy {busy:.0f}%")
    print(f"{'mode':<34}{'runs':>6}{'wall median s':>15}{'wall best s':>13}{'ratio to 1 process':>20}")
    for r in rows:
        print(f"{r['mode']:<34}{r['runs']:>6}{r['wall_median_s']:>15.3f}{r['wall_best_s']:>13.3f}"
              f"{r['ratio_to_1_process']:>20.3f}")
    path = write_result("fleet_scaling", {"args": vars(ns), "windows": windows, "steal_pct": steal,
                                          "machine_busy_pct": busy, "rows": rows, "walls": walls})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
