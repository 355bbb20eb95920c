"""Speculative decoding in fast-forward: TPOT with and without each method at 1, 32 and 256 concurrent requests.

Closed loop (``--max-concurrency`` N, 4·N requests, at least 16), random prompts of 1000 tokens, 128 output tokens,
seed 0. Llama-3.1-8B on one H100 with n-gram, EAGLE and EAGLE-3 heads; Llama-3.1-70B on 4 H100s with Llama-3.1-8B as
its draft model. The acceptance rates are the per-method defaults (``simcore/spec_decode.py``: documented defaults,
not measurements). Prints mean TPOT, the measured mean acceptance length, the estimated decode speedup (decode-only
steps against the same batches without drafts) beside the measured TPOT and run-duration ratios to the run without
speculation, the drafting share and wall time; writes benchmarks/results/spec_decode.json.

Usage: python benchmarks/spec_decode.py [--concurrency 1 32 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import steal_s, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402

L8, L70 = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"
CASES = (
    (L8, 1, None),
    (L8, 1, {"method": "ngram", "num_speculative_tokens": 3}),
    (L8, 1, {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}),
    (L8, 1, {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}),
    (L70, 4, None),
    (L70, 4, {"method": "draft_model", "model": L8, "num_speculative_tokens": 3}),
)


def run(model: str, tp: int, spec: dict | None, conc: int) -> dict:
    cfg = create_engine_config(EngineArgs(model=model, hardware="h100", tensor_parallel_size=tp,
                                          max_model_len=4096, speculative_config=spec))
    n = max(4 * conc, 16)
    samples = random_dataset(n, 1000, 128, 0.0, cfg.model.vocab_size, seed=0)
    t0 = time.perf_counter()
    res = run_fast_forward(cfg, samples, [0.0] * n, max_concurrency=conc, ignore_eos=True)
    wall = time.perf_counter() - t0
    tpot = float(np.mean([(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in res.records]))
    sd = res.spec_decode or {}
    return {"model": model, "tp": tp, "method": spec["method"] if spec else "none",
            "k": spec["num_speculative_tokens"] if spec else 0, "concurrency": conc, "tpot_ms": tpot * 1e3,
            "acceptance_length": sd.get("mean_acceptance_length", 1.0),
            "est_speedup": sd.get("estimated_decode_speedup") or float("nan"),
            "e2e_duration_s": res.duration_s,
            "draft_share": sd["draft_s"] / (sd["draft_s"] + sd["verify_s"]) if sd else 0.0, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ns = ap.parse_args()
    steal0 = steal_s()
    rows = []
    for model, tp, spec in CASES:
        base = None
        for conc in ns.concurrency:
            row = run(model, tp, spec, conc)
            rows.append(row)
        for row in rows[-len(ns.concurrency):]:
            base = next(r for r in rows if r["model"] == row["model"] and r["method"] == "none"
                        and r["concurrency"] == row["concurrency"])
            row["tpot_ratio"] = base["tpot_ms"] / row["tpot_ms"]
            row["duration_ratio"] = base["e2e_duration_s"] / row["e2e_duration_s"]
    print(format_table(rows, ["model", "method", "k", "concurrency", "tpot_ms", "acceptance_length", "est_speedup",
                              "tpot_ratio", "duration_ratio", "draft_share", "wall_s"]))
    steal = steal_s() - steal0
    print(f"steal time during the run: {steal:.1f} s (all CPUs)")
    path = write_result("spec_decode", {"rows": rows, "steal_s": steal})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
