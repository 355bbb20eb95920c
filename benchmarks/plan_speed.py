"""Wall time of `kernelsight plan`'s acceptance run: Llama-3.1-70B, the shared ShareGPT trace (300 requests) at
20 req/s, SLO ttft_p99 ≤ 1 s and tpot_p99 ≤ 60 ms, the default search space, all cores, a fresh cache; then the same
command again (every point from the cache). Reports the CPU steal over each run (from /proc/stat).

Target: < 2 min for the fresh run. Prints a table and writes benchmarks/results/plan_speed.json.
Usage: python benchmarks/plan_speed.py [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.loadgen.report import format_table  # noqa: E402


def cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def run(argv: list[str]) -> tuple[float, float, float]:
    """(wall seconds, steal %, idle %) of one command."""
    a = cpu_times()
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    d = [y - x for x, y in zip(a, cpu_times(), strict=True)]
    total = sum(d) or 1
    return wall, 100.0 * d[7] / total, 100.0 * d[3] / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=None)
    ns = ap.parse_args()
    trace = SHARED_DATA / "e2e" / "sharegpt-llama-3.1-8b-300-sps10.jsonl.gz"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = [sys.executable, "-m", "kernelsight.cli", "plan", "--model", "meta-llama/Llama-3.1-70B",
                "--dataset-name", "trace", "--dataset-path", str(trace), "--num-prompts", "300",
                "--request-rate", "20", "--slo", "ttft_p99_ms=1000,tpot_p99_ms=60", "--cache-dir", f"{tmp}/cache",
                "--result-json", str(out), "--no-progress"]
        if ns.workers:
            argv += ["--workers", str(ns.workers)]
        rows = []
        for name in ("fresh cache", "cached"):
            wall, steal, idle = run(argv)
            plan = json.loads(out.read_text())
            rows.append({"run": name, "wall_s": round(wall, 1), "simulated": plan["search"]["simulated"],
                         "cut_short": plan["search"].get("stopped_early", 0),
                         "cache_hits": plan["search"]["cache_hits"], "pruned": plan["search"]["pruned"],
                         "chosen": plan["chosen"]["label"] if plan["chosen"] else "-",
                         "steal_%": round(steal, 2), "idle_%": round(idle, 1)})
    print(format_table(rows, list(rows[0])))
    path = write_result("plan_speed", {"workers": ns.workers or os.cpu_count(), "runs": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
