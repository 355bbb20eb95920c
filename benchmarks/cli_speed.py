"""Whole-process speed of ``kernelsight simulate``: start-up alone (``--num-prompts 10``) and the sim_speed workload
(10,000 requests, Llama-3.1-8B on h100, ~1000 in / ~200 out, Poisson 20 req/s) from the command line, dataset and
report included.

Targets (issue #39): start-up ≤ 0.4 s, the 10,000-request run ≤ 1.0 s of wall time. Each run is a fresh process; its
CPU seconds (user + system, from the child's rusage) are the number to read on a shared machine, wall seconds beside
them. With ``--against DIR`` (a directory holding another ``kernelsight`` package, e.g. ``git worktree add /tmp/main
main``) the rounds alternate this tree and that one (ABBA), each process importing its tree's package, and the table
gives each tree's median and best, and the paired ratio this/against (median over rounds). The machine's steal and busy
share over the whole comparison come from /proc/stat. Prints a table and writes benchmarks/results/cli_speed.json.
Usage: python benchmarks/cli_speed.py [--repeat R] [--against DIR] [--only startup|sim10k ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import ROOT, cpu_jiffies, machine, steal_busy_pct, write_result  # noqa: E402

WORKLOADS = {
    "startup": ["simulate", "--num-prompts", "10"],
    "sim10k": ["simulate", "--num-prompts", "10000", "--request-rate", "20", "--random-input-len", "1000",
               "--random-output-len", "200", "--random-range-ratio", "0.1", "--model", "meta-llama/Llama-3.1-8B",
               "--hardware", "h100", "--seed", "0"],
}
TARGET_WALL_S = {"startup": 0.4, "sim10k": 1.0}
# the tree's package first on sys.path, the editable install's finder (which answers for the installed tree) dropped
# (the tree's console-script entry, kernelsight/__main__.py's main, where it has one; else the CLI's main)
_CHILD = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
          "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
          "try:\n    from kernelsight.__main__ import main\n"
          "except ImportError:\n    from kernelsight.cli import main\n"
          "sys.exit(main(sys.argv[1:]))")


# One BLAS thread, and bytecode caches written: under PYTHONDONTWRITEBYTECODE=1 every run would compile its ~150
# modules from source (~0.1 s more) instead of reading what the unmeasured warm-up run wrote, as an install does
_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_once(root: str, argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one ``kernelsight`` process importing the package under ``root``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _CHILD, root, *argv], check=True, stdout=subprocess.DEVNULL, env=_ENV)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--against", default=None, help="another tree's root (holding kernelsight/) to alternate with")
    ap.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    ns = ap.parse_args()
    trees = {"this": str(ROOT)} | ({"against": os.path.abspath(ns.against)} if ns.against else {})
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {w: {t: [] for t in trees} for w in ns.only}
    for w in ns.only:                       # warm the bytecode caches and the page cache, unmeasured
        for root in trees.values():
            run_once(root, WORKLOADS[w])
    j0 = cpu_jiffies()
    for i in range(ns.repeat):
        for w in ns.only:
            order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
            for name, root in order:
                runs[w][name].append(run_once(root, WORKLOADS[w]))
    j1 = cpu_jiffies()
    steal, busy = steal_busy_pct(j0, j1)
    rows = []
    for w in ns.only:
        for name in trees:
            rs = runs[w][name]
            row = {"workload": w, "tree": name, "runs": len(rs),
                   "cpu_median_s": statistics.median(c for _, c in rs), "cpu_best_s": min(c for _, c in rs),
                   "wall_median_s": statistics.median(t for t, _ in rs), "wall_best_s": min(t for t, _ in rs),
                   "target_wall_s": TARGET_WALL_S[w]}
            if name == "this" and "against" in trees:
                pairs = zip(rs, runs[w]["against"], strict=True)
                row["paired_cpu_ratio"] = statistics.median(a[1] / b[1] for a, b in pairs)
            rows.append(row)
    print(f"kernelsight simulate, whole process: {', '.join(trees.values())} (machine: {machine()}; over the "
          f"comparison: steal {steal:.1f}%, machine busy {busy:.0f}%)")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>16.3f}" if isinstance(r.get(c), float) else f"{r.get(c, ''):>16}" for c in cols))
    path = write_result("cli_speed", {"trees": trees, "steal_pct": steal, "machine_busy_pct": busy, "rows": rows,
                                      "runs": runs, "commands": {w: WORKLOADS[w] for w in ns.only}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
