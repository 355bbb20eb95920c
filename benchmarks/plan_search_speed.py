"""Wall time of a 200+-point `kernelsight plan` search over benchmarks/sim_speed.py's workload (issue #26's
"a 200-point search of that workload in < 1 min on this 2-core machine").

Workload: 10,000 random requests of Llama-3.1-8B, ~1000 tokens in / ~200 out (range ratio 0.1), Poisson 20 req/s,
seed 0 (sim_speed.py's; one simulation of it on one H100 is ~2 s of CPU here). SLO ttft_p99 ≤ 1 s, tpot_p99 ≤ 60 ms.
Space (256 points): GPUs l40s, a100, h100, h200 × TP 1, 2 × replicas 1-4 × max-num-seqs default, 128 × weights
bf16, fp8 × KV auto, fp8. All cores, a fresh cache, no latency-vs-load curves (``--curve-loads 1``: they are extra
points at other rates, not part of the search). Prints a table (points, simulated, cut short, pruned by reason,
wall, CPU of the plan process and its workers, steal, the answer) and writes benchmarks/results/plan_search_speed.json.

``--no-early-stop`` runs the same search with every point simulated to its end (the reference the early stop must
agree with: same chosen deployment, same front); ``--both`` runs both, one after the other, and checks they agree.
Usage: python benchmarks/plan_search_speed.py [--workers N] [--num-prompts N] [--no-early-stop | --both]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_jiffies, write_result  # noqa: E402

from kernelsight.loadgen.report import format_table  # noqa: E402

SPACE = ["--gpus", "l40s,a100,h100,h200", "--tp", "1,2", "--replicas", "1-4", "--max-num-seqs", "default,128",
         "--quantization", "none,fp8", "--kv-cache-dtype", "auto,fp8"]
SLO = "ttft_p99_ms=1000,tpot_p99_ms=60"


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(argv: list[str], out: Path, name: str) -> dict:
    j0, c0, t0 = cpu_jiffies(), children_cpu_s(), time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - c0
    d = [b - a for a, b in zip(j0, cpu_jiffies(), strict=True)]
    total = sum(d) or 1
    plan = json.loads(out.read_text())
    s = plan["search"]
    row = {"run": name, "points": s["space_points"], "simulated": s["simulated"],
           "cut_short": s.get("stopped_early", 0), "rerun_full": s.get("rerun_in_full", 0),
           "pruned": s["pruned"], "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
           "steal_%": round(100.0 * d[7] / total, 2), "idle_%": round(100.0 * d[3] / total, 1),
           "chosen": plan["chosen"]["label"] if plan["chosen"] else "-"}
    return {"row": row, "pruned_by_reason": s["pruned_by_reason"], "front": plan["front"],
            "chosen_key": plan["chosen"]["key"] if plan["chosen"] else None,
            "front_labels": [p["label"] for p in plan["points"] if p["key"] in set(plan["front"])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=10_000)
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="keep each run's cache (fresh: DIR must not hold one) and JSON in DIR, to look at per point")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-early-stop", action="store_true", help="simulate every point to its end")
    mode.add_argument("--both", action="store_true", help="early stop and full, then check they agree")
    ns = ap.parse_args()
    runs = ([("early stop", []), ("full", ["--no-early-stop"])] if ns.both else
            [("full", ["--no-early-stop"])] if ns.no_early_stop else [("early stop", [])])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if ns.keep:
            tmp = ns.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for i, (name, extra) in enumerate(runs):
            out = Path(tmp) / f"plan{i}.json"
            argv = [sys.executable, "-m", "kernelsight.cli", "plan", "--model", "meta-llama/Llama-3.1-8B",
                    "--dataset-name", "random", "--num-prompts", str(ns.num_prompts), "--random-input-len", "1000",
                    "--random-output-len", "200", "--random-range-ratio", "0.1", "--request-rate", "20",
                    "--seed", "0", "--slo", SLO, *SPACE, "--curve-loads", "1",
                    "--cache-dir", f"{tmp}/cache{i}", "--result-json", str(out), "--no-progress", *extra]
            if ns.workers:
                argv += ["--workers", str(ns.workers)]
            results.append(run_once(argv, out, name))
    rows = [r["row"] for r in results]
    print(f"kernelsight plan, {ns.num_prompts} requests of Llama-3.1-8B at 20 req/s, SLO {SLO}")
    print(format_table(rows, list(rows[0])))
    for r in results:
        print(f"{r['row']['run']}: pruned by reason: " +
              "; ".join(f"{n} {k}" for k, n in sorted(r["pruned_by_reason"].items(), key=lambda kv: -kv[1])))
        print(f"  front: {', '.join(r['front_labels'])}")
    agree = None
    if len(results) == 2:
        agree = results[0]["front"] == results[1]["front"] and results[0]["chosen_key"] == results[1]["chosen_key"]
        print(f"early stop and full agree on the chosen deployment and the front: {agree}")
    path = write_result("plan_search_speed", {"workers": ns.workers or os.cpu_count(), "num_prompts": ns.num_prompts,
                                              "slo": SLO, "space": SPACE, "runs": results, "agree": agree})
    print(f"wrote {path}")
    return 0 if agree is not False else 1


if __name__ == "__main__":
    sys.exit(main())
