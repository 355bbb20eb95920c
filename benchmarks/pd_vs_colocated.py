"""Two GPUs, two ways, in fast-forward: two colocated replicas (round robin) against one prefill and one decode
instance (1P1D) for the same workload, and 1P1D over each KV link. Prints TTFT / TPOT / ITL and writes
benchmarks/results/pd_vs_colocated.json. Simulated seconds only (no timing of this machine).

Usage: python benchmarks/pd_vs_colocated.py [--num-prompts 400] [--request-rate 12] [--input-len 3000]
       [--output-len 200]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.arrivals import arrival_times_s  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_replicas  # noqa: E402
from kernelsight.loadgen.metrics import compute_bench_metrics  # noqa: E402
from kernelsight.loadgen.pd_fastforward import run_pd  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402
from kernelsight.simcore.kv_transfer import kv_link  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--request-rate", type=float, default=12.0)
    p.add_argument("--input-len", type=int, default=3000)
    p.add_argument("--output-len", type=int, default=200)
    a = p.parse_args()
    cfg = create_engine_config(EngineArgs(model=a.model, hardware=a.hardware, max_model_len=8192))
    samples = random_dataset(a.num_prompts, a.input_len, a.output_len, 0.0, cfg.model.vocab_size, seed=0)
    arrivals = arrival_times_s(len(samples), a.request_rate, 1.0, seed=0).tolist()
    runs = {"2 colocated replicas": run_replicas(cfg, samples, arrivals, 2)}
    for kind in ("nvlink", "infiniband", "tcp"):
        runs[f"1P1D over {kind}"] = run_pd(cfg, samples, arrivals, 1, 1, link=kv_link(cfg.hardware, kind))
    rows = []
    for name, res in runs.items():
        m = compute_bench_metrics(res.records, res.duration_s, percentile_metrics=["ttft", "tpot", "itl"],
                                  percentiles=[50, 99])
        row = {"deployment": name, "completed": m["completed"], "mean_ttft_ms": m["mean_ttft_ms"],
               "p99_ttft_ms": m["p99_ttft_ms"], "mean_tpot_ms": m["mean_tpot_ms"], "p99_tpot_ms": m["p99_tpot_ms"],
               "p99_itl_ms": m["p99_itl_ms"]}
        if res.pd is not None:
            d = res.pd["instances"][1]
            row["mean_pull_ms"] = d["mean_pull_ms"]
        rows.append(row)
    cols = ["deployment", "completed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms",
            "mean_pull_ms"]
    print(f"{a.model} on {a.hardware}: {a.num_prompts} requests, {a.input_len} in / {a.output_len} out, "
          f"{a.request_rate} req/s (simulated)")
    print(format_table(rows, cols))
    path = write_result("pd_vs_colocated", {"args": vars(a), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
