"""Data and expert parallelism in fast-forward: Qwen3-30B-A3B-Instruct-2507 on RTX PRO 6000s, the shared ShareGPT
trace (300 requests at 10/s; its token ids are Llama's, only the lengths matter here) as one GPU, DP2 (MoE
lockstep, experts tensor-sliced), DP2 + EP with each all2all backend family, and a dense model at DP2 (independent
ranks). Prints TTFT/TPOT/E2EL means, the all-to-all share and the wall time; writes benchmarks/results/dp_ep.json.

The engine settings are those of the shared e2e runs (max_num_seqs 128, max_num_batched_tokens 2048, seed 42).
Usage: python benchmarks/dp_ep.py [--trace FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, machine, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.datasets import trace_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.loadgen.metrics import compute_bench_metrics  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402

TRACE = SHARED_DATA / "e2e" / "sharegpt-llama-3.1-8b-300-sps10.jsonl.gz"
QWEN = "Qwen/Qwen3-30B-A3B-Instruct-2507"
CASES = (
    ("1 GPU", QWEN, {}),
    ("DP2 (TP-sliced experts)", QWEN, {"data_parallel_size": 2}),
    ("DP2+EP allgather_reducescatter", QWEN, {"data_parallel_size": 2, "enable_expert_parallel": True}),
    ("DP2+EP deepep_low_latency", QWEN, {"data_parallel_size": 2, "enable_expert_parallel": True,
                                         "all2all_backend": "deepep_low_latency"}),
    ("DP2+EP imbalance 1.0", QWEN, {"data_parallel_size": 2, "enable_expert_parallel": True,
                                    "expert_load_imbalance": 1.0}),
    ("Llama-3.1-8B 1 GPU", "meta-llama/Llama-3.1-8B", {}),
    ("Llama-3.1-8B DP2", "meta-llama/Llama-3.1-8B", {"data_parallel_size": 2}),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=str(TRACE))
    ns = ap.parse_args()
    samples = trace_dataset(ns.trace)
    arrivals = [s.arrival_offset_s or 0.0 for s in samples]
    rows = []
    for name, model, kw in CASES:
        cfg = create_engine_config(EngineArgs(model=model, hardware="rtx-pro-6000", max_num_seqs=128,
                                              max_num_batched_tokens=2048, seed=42, **kw))
        t0 = time.perf_counter()
        res = run_fast_forward(cfg, samples, arrivals)
        wall = time.perf_counter() - t0
        m = compute_bench_metrics(res.records, max(res.duration_s, 1e-9))
        ranks = res.ranks or []
        a2a = sum(r["all2all_s"] for r in ranks)
        busy = sum(r["own_step_s"] + r["all2all_s"] + r["sync_wait_s"] for r in ranks)
        rows.append({"case": name, "ttft_ms": m["mean_ttft_ms"], "tpot_ms": m["mean_tpot_ms"],
                     "e2el_ms": m["mean_e2el_ms"], "kv_blocks": cfg.num_gpu_blocks,
                     "a2a_%": 100 * a2a / busy if busy else 0.0,
                     "requests_per_rank": "/".join(str(r["requests"]) for r in ranks) or "-", "wall_s": wall})
    print(format_table(rows, list(rows[0])))
    path = write_result("dp_ep", {"machine": machine(), "trace": str(ns.trace), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
