"""Fit vLLM's per-step CPU cost (HostModel.base_s, per_seq_s) on the closed-loop H100 runs.

The runs in ../shared/data/e2e/aic_silicon_vllm_h100.csv used vLLM 0.12, which scheduled synchronously:
the GPU waited for the engine core's CPU work every step, so a row's TPOT is the simulated GPU-only TPOT
plus ``base_s + per_seq_s · batch``. Each row is simulated once with a zero host cost (async off), then the
two constants minimizing the median |TPOT error| are found on a grid. They are properties of vLLM's engine
core (and the host CPU), not of any GPU: they become ``HostModel``'s defaults for every calibration.
Prints the fit and writes benchmarks/results/fit_host.json. Takes a few minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result  # noqa: E402
from silicon_h100 import TABLE  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402
from kernelsight.simcore.overheads import HostModel  # noqa: E402


def gpu_only_tpot_ms(row: dict, rounds: int) -> tuple[float, float]:
    isl, osl, conc, tp = int(row["isl"]), int(row["osl"]), int(row["concurrency"]), int(row["tp"])
    args = EngineArgs(model=row["model"], hardware="h100", tensor_parallel_size=tp,
                      quantization="fp8" if row["precision"] == "fp8" else None, max_model_len=isl + osl + 16,
                      async_scheduling=False)
    cfg = create_engine_config(args)
    cfg.calibration = replace(cfg.calibration, host=HostModel(0.0, 0.0, 0.0, 0.0))
    n = conc * rounds
    samples = random_dataset(n, isl, osl, 0.0, cfg.model.vocab_size, seed=0)
    stagger = [i * 0.05 for i in range(conc)]
    res = run_fast_forward(cfg, samples, stagger + [stagger[-1]] * (n - conc), max_concurrency=conc,
                           ignore_eos=True)
    ok = [r for r in res.records if r.success and r.output_len > 1]
    tpot = float(np.mean([(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok])) * 1e3
    return tpot, float(conc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-isl", type=int, default=4096, help="skip rows with longer prompts (speed)")
    ns = ap.parse_args()
    with open(TABLE) as f:
        rows = [r for r in csv.DictReader(f) if int(r["isl"]) <= ns.max_isl and int(r["osl"]) <= 1024]
    real, gpu, batch = [], [], []
    for r in rows:
        t0, b = gpu_only_tpot_ms(r, ns.rounds)
        real.append(float(r["tpot_ms"]))
        gpu.append(t0)
        batch.append(b)
    real_a, gpu_a, batch_a = np.array(real), np.array(gpu), np.array(batch)
    best = None
    for base_ms in np.arange(0.0, 3.01, 0.05):
        for per_seq_us in np.arange(0.0, 120.1, 1.0):
            pred = gpu_a + base_ms + per_seq_us * 1e-3 * batch_a
            err = float(np.median(np.abs(pred - real_a) / real_a))
            if best is None or err < best[0]:
                best = (err, float(base_ms), float(per_seq_us))
    err, base_ms, per_seq_us = best
    gpu_err = float(np.median(np.abs(gpu_a - real_a) / real_a))
    print(f"{len(rows)} rows: GPU-only median |TPOT error| {100 * gpu_err:.1f}% -> with host "
          f"base {base_ms:.2f} ms + {per_seq_us:.0f} µs/seq: {100 * err:.1f}%")
    path = write_result("fit_host", {"rows": len(rows), "base_s": base_ms * 1e-3, "per_seq_s": per_seq_us * 1e-6,
                                     "median_abs_tpot_err_gpu_only": gpu_err, "median_abs_tpot_err": err})
    print(json.dumps({"base_s": base_ms * 1e-3, "per_seq_s": per_seq_us * 1e-6}), f"(wrote {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
