"""Closed-loop H100 runs of real vLLM (aiconfigurator 'silicon' table) versus the simulator.

Every row of ../shared/data/e2e/aic_silicon_vllm_h100.csv (Qwen3-32B bf16 and Llama-3.1-70B fp8, TP 2/4/8,
fixed isl/osl, `concurrency` clients each sending one request after another) is simulated as
`concurrency` closed-loop clients sending fixed-length random-token prompts with exact output lengths.
Prints measured vs simulated mean TTFT and TPOT per row with the % error, then the median |error|, and
writes benchmarks/results/silicon_h100.json.

It also separates what the GPU batch sees from what only the client sees. Rows that differ only in the
output length give two closed-loop equations per configuration: over one request's decode phase
D = (osl − 1)·TPOT the other C − 1 clients send N = (C − 1)·D / (TTFT + D) prompts, each stalling the
shared decode batch by s, so D = (osl − 1)·d + N·s. Solving for the plain decode step d and the prefill
stall s (measured and simulated alike) shows how much of the measured TTFT is GPU work that holds up the
batch (≈ s) and how much is spent outside it (TTFT − s: API server, client, queueing before the engine), and the
prefill chunk c that would explain that gap if the prompt ran c tokens per step beside the decode batch
(TTFT ≈ s + (isl / c)·d).
Usage: python benchmarks/silicon_h100.py [--calibration FILE] [--rounds R] [--limit N] [--table FILE]
       [--max-num-batched-tokens N] [--long-prefill-token-threshold N]   (the deployment's engine args, if known)
       [--fp8-checkpoints] [--precision fp8]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, pct_error, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.datasets import random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs  # noqa: E402

TABLE = SHARED_DATA / "e2e" / "aic_silicon_vllm_h100.csv"


#: The table's precision column → (vLLM --quantization, --dtype). Other precisions are reported and skipped.
PRECISIONS = {"bf16": (None, "bfloat16"), "fp16": (None, "float16"), "fp8": ("fp8", "bfloat16")}
#: With --fp8-checkpoints, fp8 rows run these bundled FP8 checkpoints (their own scale types: Qwen3-32B-FP8 is
#: block-scaled 128x128, NVIDIA's Llama-3.1-70B FP8 static per-tensor) instead of vLLM's online quantization of the
#: bf16 model. The table does not say which the runs used; these are the FP8 checkpoints shared/data/models ships.
FP8_CHECKPOINTS = {"Qwen/Qwen3-32B": "Qwen/Qwen3-32B-FP8",
                   "meta-llama/Llama-3.1-70B": "nvidia/Llama-3.1-70B-Instruct-FP8"}


def simulate_row(row: dict, calibration: str | None, rounds: int, seed: int, fp8_checkpoints: bool = False,
                 **engine_args: int) -> tuple[float, float]:
    isl, osl, conc, tp = int(row["isl"]), int(row["osl"]), int(row["concurrency"]), int(row["tp"])
    if row["precision"] not in PRECISIONS:
        raise ValueError(f"precision {row['precision']!r} is not one the simulator runs ({', '.join(PRECISIONS)})")
    quantization, dtype = PRECISIONS[row["precision"]]
    model = row["model"]
    if fp8_checkpoints and row["precision"] == "fp8" and model in FP8_CHECKPOINTS:
        model, quantization = FP8_CHECKPOINTS[model], None
    args = EngineArgs(model=model, hardware=row.get("system") or "h100", tensor_parallel_size=tp,
                      quantization=quantization, dtype=dtype,
                      max_model_len=isl + osl + 16, seed=seed, calibration=calibration,
                      # vLLM 0.12 (these runs) scheduled synchronously; async scheduling became the default later
                      async_scheduling=False, **engine_args)
    cfg = create_engine_config(args)
    # Identical closed-loop clients that all start at t=0 stay in lockstep forever (they finish together and
    # resend together); the measured TTFTs (a few hundred ms at 128 clients) show the real clients were
    # spread out. So: one synchronized pilot round gives a request's latency T, then the clients start
    # T/C apart and the first round (warm-up) is not measured.
    pilot = run_fast_forward(cfg, random_dataset(conc, isl, osl, 0.0, cfg.model.vocab_size, seed=seed + 1),
                             [0.0] * conc, max_concurrency=conc, ignore_eos=True)
    period_s = float(np.mean([r.latency_s for r in pilot.records]))
    n = conc * (rounds + 1)
    samples = random_dataset(n, isl, osl, 0.0, cfg.model.vocab_size, seed=seed)
    stagger = [i * period_s / conc for i in range(conc)]
    arrivals = stagger + [stagger[-1]] * (n - conc)     # later requests wait for a free client slot
    res = run_fast_forward(cfg, samples, arrivals, max_concurrency=conc, ignore_eos=True)
    ok = sorted((r for r in res.records if r.success), key=lambda r: r.start_s)[conc:]
    ttft = float(np.mean([r.ttft_s for r in ok])) * 1e3
    tpot = float(np.mean([(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1])) * 1e3
    return ttft, tpot


def solve_stall(conc: int, pts: list[tuple[int, float, float]]) -> tuple[float, float] | None:
    """(decode step d, prefill stall s) in ms from two (osl, ttft_ms, tpot_ms) points of one configuration."""
    eqs = []
    for osl, ttft, tpot in pts:
        decode_ms = (osl - 1) * tpot
        others = (conc - 1) * decode_ms / (ttft + decode_ms)     # prompts of other clients during my decode
        eqs.append(((osl - 1, others), decode_ms))
    (a, b), y1 = eqs[0]
    (c, d), y2 = eqs[1]
    det = a * d - b * c
    if abs(det) < 1e-9:
        return None
    return (y1 * d - b * y2) / det, (a * y2 - c * y1) / det


def prefill_stalls(rows: list[dict], max_conc: int = 16) -> list[dict]:
    """Per configuration with ≥ 2 output lengths (low concurrency, where clients rarely collide)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["conc"] <= max_conc:
            groups.setdefault((r["model"], r["prec"], r["tp"], r["isl"], r["conc"]), []).append(r)
    out = []
    for (model, prec, tp, isl, conc), rs in groups.items():
        # the decode step must not drift with the growing context between the two lengths: the two shortest
        # outputs, the longer no longer than the prompt (or 1024)
        by_osl = sorted({r["osl"]: r for r in rs}.values(), key=lambda r: r["osl"])
        if len(by_osl) < 2 or by_osl[1]["osl"] > max(isl, 1024):
            continue
        lo, hi = by_osl[0], by_osl[1]
        real = solve_stall(conc, [(r["osl"], r["ttft_ms"], r["tpot_ms"]) for r in (lo, hi)])
        sim = solve_stall(conc, [(r["osl"], r["sim_ttft_ms"], r["sim_tpot_ms"]) for r in (lo, hi)])
        if real is None or sim is None:
            continue
        ttft = float(np.mean([r["ttft_ms"] for r in (lo, hi)]))
        out.append({"model": model, "prec": prec, "tp": tp, "isl": isl, "conc": conc,
                    "stall_ms": real[1], "sim_stall_ms": sim[1], "ttft_ms": ttft,
                    "sim_ttft_ms": float(np.mean([r["sim_ttft_ms"] for r in (lo, hi)])),
                    "outside_batch_ms": ttft - real[1], "decode_step_ms": real[0],
                    # a prompt prefilled c tokens per step beside the decode batch waits isl/c decode steps on top
                    # of its own GPU work: TTFT ≈ s + (isl / c)·d, so the chunk that would explain the gap is
                    "implied_chunk_tokens": isl * real[0] / (ttft - real[1]) if ttft > real[1] else float("inf")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: bundled h100-sxm)")
    ap.add_argument("--rounds", type=int, default=4, help="requests per client (default: 4)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", type=Path, default=TABLE,
                    help="closed-loop runs in this file's schema; `system` names the GPU profile (default: the "
                         "shared H100 table)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="engine arg of the measured deployment, when known (default: vLLM's)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None,
                    help="engine arg of the measured deployment, when known (default: vLLM's, 0)")
    ap.add_argument("--fp8-checkpoints", action="store_true",
                    help="run fp8 rows on the bundled FP8 checkpoints (FP8_CHECKPOINTS) instead of --quantization fp8")
    ap.add_argument("--precision", default=None, help="only rows of this precision (e.g. fp8)")
    ns = ap.parse_args()
    engine_args = {k: v for k, v in (("max_num_batched_tokens", ns.max_num_batched_tokens),
                                     ("long_prefill_token_threshold", ns.long_prefill_token_threshold))
                   if v is not None}
    with open(ns.table) as f:
        rows = [r for r in csv.DictReader(f) if ns.precision in (None, r["precision"])][: ns.limit]
    out = []
    for i, row in enumerate(rows, start=2):
        try:
            ttft, tpot = simulate_row(row, ns.calibration, ns.rounds, ns.seed, ns.fp8_checkpoints, **engine_args)
        except ValueError as exc:   # a model, GPU or precision the simulator does not have: say so, go on
            print(f"skipped {ns.table.name} line {i}: {exc}", flush=True)
            continue
        real_ttft, real_tpot = float(row["ttft_ms"]), float(row["tpot_ms"])
        out.append({"model": row["model"].split("/")[-1], "prec": row["precision"], "tp": int(row["tp"]),
                    "isl": int(row["isl"]), "osl": int(row["osl"]), "conc": int(row["concurrency"]),
                    "ttft_ms": real_ttft, "sim_ttft_ms": ttft, "ttft_err_pct": pct_error(ttft, real_ttft),
                    "tpot_ms": real_tpot, "sim_tpot_ms": tpot, "tpot_err_pct": pct_error(tpot, real_tpot)})
        print(format_table([out[-1]], list(out[-1])).splitlines()[-1], flush=True)
    if not out:
        raise SystemExit(f"{ns.table}: no row could be simulated")
    print(format_table(out, list(out[0])))
    med_ttft = float(np.median([abs(r["ttft_err_pct"]) for r in out]))
    med_tpot = float(np.median([abs(r["tpot_err_pct"]) for r in out]))
    print(f"median |error|: TTFT {med_ttft:.1f}% (target ≤ 15%), TPOT {med_tpot:.1f}% (target ≤ 8%) "
          f"over {len(out)} rows")
    by_config = []   # the table's models ran with different vLLM versions and setups: their errors differ in kind
    for model, prec in sorted({(r["model"], r["prec"]) for r in out}):
        sub = [r for r in out if (r["model"], r["prec"]) == (model, prec)]
        by_config.append({"model": model, "prec": prec, "rows": len(sub),
                          **{f"median_{k}": float(np.median([r[k] for r in sub])) for k in ("ttft_err_pct",
                                                                                          "tpot_err_pct")},
                          **{f"median_abs_{k}": float(np.median([abs(r[k]) for r in sub]))
                             for k in ("ttft_err_pct", "tpot_err_pct")}})
    print(format_table(by_config, list(by_config[0])))
    stalls = prefill_stalls(out)
    if stalls:
        print("\nprefill stall of the shared decode batch, solved from rows that differ only in osl (ms):")
        print(format_table(stalls, list(stalls[0])))
    name = "silicon_h100" if ns.table == TABLE else f"silicon_{ns.table.stem}"
    name += "".join(f"_{k}{v}" for k, v in engine_args.items())   # a what-if run does not overwrite the default
    name += "_fp8_checkpoints" if ns.fp8_checkpoints else ""
    name += f"_{ns.precision}" if ns.precision else ""
    path = write_result(name, {"rows": out, "median_abs_ttft_err_pct": med_ttft,
                               "median_abs_tpot_err_pct": med_tpot, "by_model": by_config, "rounds": ns.rounds,
                               "prefill_stalls": stalls, "engine_args": engine_args,
                               "fp8_checkpoints": FP8_CHECKPOINTS if ns.fp8_checkpoints else None})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
