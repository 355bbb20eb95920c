"""Fast-forward speed: 10,000 requests (Llama-3.1-8B on h100, ~1000 in / ~200 out, Poisson 20 req/s).

Target (issue #26): ≤ 0.5 s of wall time on one core. Prints a table and writes benchmarks/results/sim_speed.json.
The first run also pays the calibration's η memo (each distinct kernel shape is evaluated once per Calibration);
later runs reuse it, as a search over one GPU in one process would. CPU seconds and the machine's steal and
busy share (from /proc/stat) are printed beside wall seconds: on a shared machine wall time measures the load.
With ``--against DIR`` (a directory holding another ``kernelsight`` package, e.g. ``git worktree add /tmp/main main``)
it alternates this tree and that one, each round a fresh process per tree (warm-up run, then one measured run), so a
before/after comparison shares one session's load; the table gives each tree's best and median CPU seconds.
With ``--in-process`` as well, both trees are imported side by side into this one process (each warmed once) and
their runs alternate (ABBA...) in it: on a shared machine whose load swings CPU seconds by ±20% between processes,
neighbouring runs share far more of it, and the paired ratio (each round's this/against) is the number to read.
Usage: python benchmarks/sim_speed.py [--num-prompts N] [--repeat R] [--against DIR [--in-process]]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")      # one core: no BLAS threads

if "--child-root" in sys.argv:     # a comparison child: import kernelsight from the given tree, not the installed one
    _root = sys.argv[sys.argv.index("--child-root") + 1]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, _root)
sys.path.insert(0, os.path.dirname(__file__))
from _common import ROOT, cpu_jiffies, machine, write_result  # noqa: E402

# kernelsight is imported inside the functions, not here: --in-process loads each tree itself, and a compiled core
# (python -m kernelsight.accel build) loaded once stays bound to the modules it was first imported beside



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--against", default=None, help="another tree's root (holding kernelsight/) to alternate with")
    ap.add_argument("--in-process", action="store_true",
                    help="with --against: load both trees into this process and alternate their runs in it")
    ap.add_argument("--child-root", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.against and ns.in_process:
        return compare_in_process(ns)
    if ns.against:
        return compare(ns)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # pin to one core
    from kernelsight.engine_args import create_engine_config
    from kernelsight.loadgen.arrivals import arrival_times_s
    from kernelsight.loadgen.datasets import random_dataset
    from kernelsight.loadgen.fastforward import run_fast_forward
    from kernelsight.loadgen.report import format_table
    from kernelsight.simcore.engine_config import EngineArgs

    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=0))
    samples = random_dataset(ns.num_prompts, 1000, 200, 0.1, cfg.model.vocab_size, seed=0)
    arrivals = arrival_times_s(ns.num_prompts, 20.0, 1.0, seed=0).tolist()
    if ns.child_root:                 # one warm-up run, then the measured one, as one JSON line
        run_fast_forward(cfg, samples, arrivals, ignore_eos=True)
        ns.repeat = 1
    rows = []
    for i in range(ns.repeat):
        j0, t0, c0 = cpu_jiffies(), time.perf_counter(), time.process_time()
        res = run_fast_forward(cfg, samples, arrivals, ignore_eos=True)
        wall, cpu, j1 = time.perf_counter() - t0, time.process_time() - c0, cpu_jiffies()
        d = [b - a for a, b in zip(j0, j1, strict=True)] if j0 and j1 else []
        total = sum(d) or 1
        rows.append({"run": i, "wall_s": wall, "cpu_s": cpu,
                     "machine_busy_pct": 100.0 * (total - d[3] - d[4]) / total if d else float("nan"),
                     "steal_pct": 100.0 * d[7] / total if d else float("nan"),
                     "simulated_s": res.duration_s, "steps": res.num_steps,
                     "sim_s_per_wall_s": res.duration_s / wall, "steps_per_s": res.num_steps / wall,
                     "completed": sum(r.success for r in res.records)})
    if ns.child_root:
        import kernelsight
        print(json.dumps({**rows[0], "package": os.path.dirname(kernelsight.__file__)}))
        return 0
    print(f"fast-forward speed, {ns.num_prompts} requests, Llama-3.1-8B on h100 (machine: {machine()})")
    print(format_table(rows, list(rows[0])))
    best = min(rows, key=lambda r: r["wall_s"])
    print(f"best wall time {best['wall_s']:.2f} s (target ≤ 0.5 s): {best['sim_s_per_wall_s']:.0f} simulated s per "
          f"wall s, {best['steps_per_s']:.0f} steps/s")
    path = write_result("sim_speed", {"num_prompts": ns.num_prompts, "runs": rows, "best": best,
                                      "target_wall_s": 0.5})
    print(f"wrote {path}")
    return 0


def compare(ns: argparse.Namespace) -> int:
    """Alternate this tree and ``ns.against`` (fresh processes), ``ns.repeat`` rounds; table of CPU and wall seconds."""
    trees = {"this": str(ROOT), "against": os.path.abspath(ns.against)}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(ns.repeat):
        for name, root in trees.items():
            out = subprocess.run([sys.executable, __file__, "--num-prompts", str(ns.num_prompts), "--child-root", root],
                                 check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for name, rs in runs.items():
        cpu = [r["cpu_s"] for r in rs]
        rows.append({"tree": name, "runs": len(rs), "cpu_best_s": min(cpu),
                     "cpu_median_s": statistics.median(cpu), "wall_best_s": min(r["wall_s"] for r in rs),
                     "steal_pct_max": max(r["steal_pct"] for r in rs),
                     "busy_pct_min": min(r["machine_busy_pct"] for r in rs), "package": rs[0]["package"]})
    from kernelsight.loadgen.report import format_table

    print(f"fast-forward speed, {ns.num_prompts} requests, this tree vs {trees['against']} (machine: {machine()})")
    print(format_table(rows, list(rows[0])))
    path = write_result("sim_speed_compare", {"num_prompts": ns.num_prompts, "rows": rows, "runs": runs})
    print(f"wrote {path}")
    return 0


def _package_modules() -> dict[str, object]:
    return {m: mod for m, mod in sys.modules.items() if m == "kernelsight" or m.startswith("kernelsight.")}


def _load_tree(root: str, num_prompts: int) -> dict:
    """Import kernelsight from ``root`` (replacing any loaded copy), warm it with one run, and keep its modules (lazy
    imports included) so that they can be put back in ``sys.modules`` before each of its runs."""
    for m in _package_modules():
        del sys.modules[m]
    sys.path.insert(0, root)
    try:
        ea = importlib.import_module("kernelsight.engine_args")
        ec = importlib.import_module("kernelsight.simcore.engine_config")
        ds = importlib.import_module("kernelsight.loadgen.datasets")
        ar = importlib.import_module("kernelsight.loadgen.arrivals")
        ff = importlib.import_module("kernelsight.loadgen.fastforward")
        if not os.path.realpath(ff.__file__).startswith(os.path.realpath(root)):
            raise RuntimeError(f"imported {ff.__file__}, not the tree at {root}")
        cfg = ea.create_engine_config(ec.EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=0))
        samples = ds.random_dataset(num_prompts, 1000, 200, 0.1, cfg.model.vocab_size, seed=0)
        arrivals = ar.arrival_times_s(num_prompts, 20.0, 1.0, seed=0).tolist()
        res = ff.run_fast_forward(cfg, samples, arrivals, ignore_eos=True)
    finally:
        sys.path.remove(root)
    return {"root": root, "run": ff.run_fast_forward, "args": (cfg, samples, arrivals), "steps": res.num_steps,
            "modules": _package_modules(), "cpu_s": [], "wall_s": []}


def compare_in_process(ns: argparse.Namespace) -> int:
    """``compare`` with both trees in this process: rounds alternate the order (ABBA), CPU seconds per run."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # pin to one core
    # the editable install's finder would answer for the installed tree: import each tree from its root instead
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    trees = [_load_tree(str(ROOT), ns.num_prompts), _load_tree(os.path.abspath(ns.against), ns.num_prompts)]
    if trees[0]["steps"] != trees[1]["steps"]:
        print(f"note: the trees simulate different step counts ({trees[0]['steps']} vs {trees[1]['steps']})")
    j0 = cpu_jiffies()
    for i in range(ns.repeat):
        for t in (trees if i % 2 == 0 else trees[::-1]):
            for m in _package_modules():
                del sys.modules[m]
            sys.modules.update(t["modules"])
            t0, c0 = time.perf_counter(), time.process_time()
            t["run"](*t["args"], ignore_eos=True)
            t["cpu_s"].append(time.process_time() - c0)
            t["wall_s"].append(time.perf_counter() - t0)
    j1 = cpu_jiffies()
    d = [b - a for a, b in zip(j0, j1, strict=True)] if j0 and j1 else []
    steal = 100.0 * d[7] / (sum(d) or 1) if d else float("nan")
    from kernelsight.loadgen.report import format_table  # the tree loaded last's: the same function

    rows = [{"tree": name, "runs": len(t["cpu_s"]), "cpu_best_s": min(t["cpu_s"]),
             "cpu_median_s": statistics.median(t["cpu_s"]), "wall_best_s": min(t["wall_s"]), "package": t["root"]}
            for name, t in zip(("this", "against"), trees, strict=True)]
    ratio = statistics.median(a / b for a, b in zip(trees[0]["cpu_s"], trees[1]["cpu_s"], strict=True))
    print(f"fast-forward speed, {ns.num_prompts} requests, in one process: this tree vs {trees[1]['root']} "
          f"(machine: {machine()}, steal {steal:.1f}%)")
    print(format_table(rows, list(rows[0])))
    print(f"paired CPU ratio this/against (median over rounds): {ratio:.3f}")
    path = write_result("sim_speed_compare", {"num_prompts": ns.num_prompts, "in_process": True, "rows": rows,
                                              "paired_cpu_ratio": ratio, "steal_pct": steal,
                                              "runs": {r["tree"]: {"cpu_s": t["cpu_s"], "wall_s": t["wall_s"]}
                                                       for r, t in zip(rows, trees, strict=True)}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
