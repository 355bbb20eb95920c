"""Is a P/D split's p99 TTFT queueing? For one workload at several rates: 1P1D, 2P1D and one colocated engine, the
prefill side's utilisation, what single-server queueing predicts for it, and where 1P1D's TTFT goes by stage
(``simulate --pd``'s stage table). Simulated seconds only (no timing of this machine).

The prediction treats the prefill engine as FIFO M/D/1 with service S = one prompt's prefill alone (the step model's
price; batching up to max_num_batched_tokens only shortens waits): utilisation ρ = rate·S, Pollaczek–Khinchine mean
wait ρS / 2(1−ρ), and the p99 wait from Lindley's recursion over the run's own arrival times. The prefill side's
capacity is what a full token-budget step sustains (prompts per second); past it the queue grows for the whole run.

Usage: python benchmarks/pd_queueing.py [--model ...] [--hardware l40s] [--rates 16,20,24,28,40] [--num-prompts 1000]
       [--input-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.arrivals import arrival_times_s  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_replicas  # noqa: E402
from kernelsight.loadgen.pd_fastforward import run_pd  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_step_model  # noqa: E402
from kernelsight.simcore.kernels import BatchShape, PrefillChunk  # noqa: E402


def lindley_waits_s(arrivals_s: np.ndarray, service_s: float) -> np.ndarray:
    """FIFO single-server waits for deterministic service (Lindley: W_{n+1} = max(0, W_n + S − gap))."""
    w = np.zeros(len(arrivals_s))
    gaps = np.diff(arrivals_s)
    for i, g in enumerate(gaps, 1):
        w[i] = max(0.0, w[i - 1] + service_s - g)
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--hardware", default="l40s")
    p.add_argument("--rates", default="16,20,24,28,40")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    cfg = create_engine_config(EngineArgs(model=a.model, hardware=a.hardware))
    samples = random_dataset(a.num_prompts, a.input_len, a.output_len, 0.0, cfg.model.vocab_size, seed=0)
    sm = build_step_model(cfg)
    service_s = sm.step(BatchShape((PrefillChunk(a.input_len, 0, True),), 0, 0))[1]
    budget = cfg.scheduler.max_num_batched_tokens
    per_step = max(budget // a.input_len, 1)
    full_s = sm.step(BatchShape(tuple(PrefillChunk(a.input_len, 0, True) for _ in range(per_step)), 0, 0))[1]
    capacity = per_step / full_s
    print(f"{a.model} on {a.hardware}: {a.num_prompts} requests, {a.input_len} in / {a.output_len} out; one prompt's "
          f"prefill alone {1e3 * service_s:.1f} ms; {per_step} per {budget}-token step in {1e3 * full_s:.1f} ms: "
          f"prefill capacity {capacity:.1f} prompts/s per engine")
    rows, stages = [], {}
    for rate in (float(r) for r in a.rates.split(",")):
        arrivals = arrival_times_s(len(samples), rate, 1.0, seed=0)
        rho = rate * service_s
        w = lindley_waits_s(arrivals, service_s)
        pk = rho * service_s / (2 * (1 - rho)) if rho < 1 else float("inf")
        row = {"rate": rate, "rho_1P": round(rho, 3), "pk_mean_wait_ms": round(1e3 * pk, 1),
               "md1_p99_wait_ms": round(1e3 * float(np.percentile(w, 99)), 1)}
        arr = arrivals.tolist()
        for name in ("1P1D", "2P1D", "coloc"):
            res = (run_replicas(cfg, samples, arr, 1) if name == "coloc"
                   else run_pd(cfg, samples, arr, int(name[0]), 1))
            ttft = np.array([r.ttft_s for r in res.records if r.success])
            row[f"p99_ttft_{name}_ms"] = round(1e3 * float(np.percentile(ttft, 99)), 1)
            if res.pd is not None:
                busy = max(x["busy_s"] for x in res.pd["instances"] if x["instance"].startswith("P"))
                row[f"P_busy_{name}"] = round(busy / res.duration_s, 3)
            if name == "1P1D":
                st = res.pd["ttft_stages"]["stages"]
                row["1P1D_p99_prefill_queue_ms"] = st[0]["p99_ms"]
                stages[rate] = st
        rows.append(row)
    print(format_table(rows, list(rows[0])))
    for rate, st in stages.items():
        print(f"1P1D at {rate} req/s, TTFT by stage:")
        print(format_table(st, list(st[0])))
    path = write_result("pd_queueing", {"args": vars(a), "service_s": service_s, "capacity_prompts_per_s": capacity,
                                        "rows": rows, "stages_1p1d": {str(k): v for k, v in stages.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
