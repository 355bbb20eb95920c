"""Replay the shared ShareGPT trace with the RTX 4090 run's engine args; compare with the measured vLLM run.

Measured (vLLM 0.19, Llama-3.1-8B bf16, one RTX 4090): per request TTFT = first_token_ts − queued_ts,
TPOT = (last_token_ts − first_token_ts)/(output_toks − 1), E2EL = last_token_ts − queued_ts.
Simulated: the same trace (at the run's queue times, exact output lengths, real token ids) through `simulate`'s
fast-forward driver on the rtx-4090 profile with its bundled calibration (no RTX 4090 kernel data
exists, so that is the cross-generation tier). Prints mean / median / p90 / p99 side by side with the %
error and writes benchmarks/results/replay_rtx4090.json.

Composition check (step = kernels + comm + host): the measured per-second time series gives the pure-decode
step time (running ÷ generation tokens/s in seconds without prompt tokens, KV cache > 90% full); the simulated
timeline gives the same for its decode-only steps. Both are printed by number of running requests, with the run
durations, so a gap can be placed in the step model (same gap in decode steps) or in the scheduling dynamics. The
start-up burst (requests of the first seconds, prefilled before the KV cache fills) gives the prefill side: its
length and its prompt tokens per second, counted alike on both sides.

    python benchmarks/replay_rtx4090.py [--calibration FILE] [--run DIR] [--workload FILE] [--hardware NAME]

Any run in the same schema (``meta.json`` with ``engine_kwargs`` / ``kv_cache`` / ``hardware``, ``requests.jsonl``,
``timeseries.csv``) replays with ``--run``. Reading the run, choosing what to replay and on what, and the latency
statistics are :mod:`kernelsight.loadgen.validate`'s (``kernelsight validate RUN_DIR`` is the same comparison for
any run): the workload is the trace ``meta.json``'s ``dataset_path`` names (beside the run, with or without .gz;
it must hold the run's requests), the GPU the profile whose name or alias is the run's CUDA device name, and the
engine args the run's (:func:`kernelsight.loadgen.vllm_run.engine_args_from_run`: what vLLM resolved them to when
``meta.json`` has ``resolved_config``, else the flags given). This script adds the composition check.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.loadgen.validate import (  # noqa: E402
    Run,
    latency_rows,
    measured_latency_stats_ms,
    pct_error,
    read_run,
    replay,
    replay_workload,
    run_engine_config,
    simulated_latency_stats_ms,
)

RUN = SHARED_DATA / "e2e" / "llmservingsim_rtx4090_llama31_8b"
METRICS = ("ttft", "tpot", "e2el")


def measured_decode_steps(run: Run) -> tuple[np.ndarray, np.ndarray, float]:
    """(running, step seconds) of the measured seconds that only decoded with the KV cache > 90% full; duration."""
    ts = run.timeseries
    t, prompt, gen, running, kv = (ts[c] for c in ("t", "prompt_throughput", "gen_throughput", "running",
                                                    "kv_cache_pct"))
    pure = (prompt == 0) & (gen > 0) & (kv > 90.0)
    return running[pure], running[pure] / gen[pure], float(t[-1])


#: The start-up burst: requests arriving in the first seconds all prefill before the KV cache fills, so the time
#: to their last first token measures prefill throughput (with the few decodes riding along), not queueing.
STARTUP_S = 3.0


def startup_burst_s(first_token_s: np.ndarray, arrival_s: np.ndarray) -> float:
    """Time from the first arrival to the last first token of the requests that arrived within STARTUP_S."""
    t0 = float(arrival_s.min())
    return float(first_token_s[arrival_s - t0 < STARTUP_S].max() - t0)


def burst_prefill_tokens_per_s(first_token_s: np.ndarray, arrival_s: np.ndarray, prompt_toks: np.ndarray
                               ) -> float:
    """Prompt tokens per second over the start-up burst: the prompts whose first token came after the earliest
    first token and by the burst's last one, over that span. Counted the same way on both sides, so a gap is the
    prefill rate's (an upper estimate of it: a prompt begun before the span counts whole)."""
    t0 = float(arrival_s.min())
    end = float(first_token_s[arrival_s - t0 < STARTUP_S].max())
    start = float(first_token_s.min())
    sel = (first_token_s > start) & (first_token_s <= end)
    return float(prompt_toks[sel].sum()) / (end - start) if end > start else float("nan")


def measured_startup(run: Run) -> tuple[float, int, int, float]:
    """(start-up burst seconds, requests, prompt tokens, prefill tokens/s) of the measured run."""
    q = np.array([r.queued_s for r in run.requests])
    sel = q - q.min() < STARTUP_S
    ft = np.array([r.first_token_s for r in run.requests])
    prompt = np.array([r.input_toks for r in run.requests])
    return startup_burst_s(ft, q), int(sel.sum()), int(prompt[sel].sum()), burst_prefill_tokens_per_s(ft, q, prompt)


def composition_rows(timeline: list[tuple], duration_s: float, startup_s: float, startup_tokens_per_s: float,
                     run: Run) -> list[dict]:
    """Median pure-decode step time, measured vs simulated, by running requests; the start-up burst (prefill) and
    its prefill rate; the run durations."""
    tl = np.asarray(timeline, dtype=float)  # time_s, running, waiting, kv_cache_usage, scheduled_tokens, step_s
    sim_pure = (tl[:, 4] == tl[:, 1]) & (tl[:, 3] > 0.9)
    run_m, step_m, dur_m = measured_decode_steps(run)
    out = []
    for lo, hi in ((20, 30), (30, 40), (40, 50), (0, 10**6)):
        a = (run_m >= lo) & (run_m < hi)
        b = sim_pure & (tl[:, 1] >= lo) & (tl[:, 1] < hi)
        if a.any() and b.any():
            r, s = float(np.median(step_m[a])) * 1e3, float(np.median(tl[b, 5])) * 1e3
            label = "all" if hi > 10**5 else f"{lo}-{hi - 1}"
            out.append({"what": f"decode step, running {label}", "measured": r, "simulated": s,
                        "error_pct": pct_error(s, r), "samples": f"{int(a.sum())} s / {int(b.sum())} steps"})
    burst_m, n, tokens, rate_m = measured_startup(run)
    out.append({"what": "start-up burst s (prefill)", "measured": burst_m, "simulated": startup_s,
                "error_pct": pct_error(startup_s, burst_m), "samples": f"{n} requests, {tokens} prompt tokens"})
    out.append({"what": "burst prefill tokens/s", "measured": rate_m, "simulated": startup_tokens_per_s,
                "error_pct": pct_error(startup_tokens_per_s, rate_m), "samples": "first to last first token"})
    out.append({"what": "run duration s", "measured": dur_m, "simulated": duration_s,
                "error_pct": pct_error(duration_s, dur_m), "samples": ""})
    return out


def simulated_metrics(calibration: str | None, run: Run, workload: Path | None = None,
                      hardware: str | None = None) -> tuple[dict, dict, int]:
    """Simulated latency statistics (ms) of the replay; the config, simulator stats and composition rows; the
    number of requests simulated."""
    cfg = run_engine_config(run, hardware=hardware, calibration=calibration)
    samples, arrivals, _ = replay_workload(run, workload)
    res = replay(cfg, samples, arrivals)
    first_token_s = np.array([r.start_s + r.ttft_s for r in res.records])
    arrival_s = np.array([r.start_s for r in res.records])
    prompt = np.array([r.prompt_len for r in res.records])
    info = {"config": cfg.summary(), "measured_num_gpu_blocks": (run.meta.get("kv_cache") or {}).get("num_gpu_blocks"),
            "simulator": res.simulator_stats(),
            "composition": composition_rows(res.timeline or [], res.duration_s,
                                            startup_burst_s(first_token_s, arrival_s),
                                            burst_prefill_tokens_per_s(first_token_s, arrival_s, prompt), run)}
    return simulated_latency_stats_ms(res.records), info, sum(r.success for r in res.records)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: the GPU's bundled one)")
    ap.add_argument("--run", type=Path, default=RUN, help="measured run directory (default: the RTX 4090 run)")
    ap.add_argument("--workload", type=Path, default=None, help="trace (default: the one meta.json names)")
    ap.add_argument("--hardware", default=None, help="GPU profile (default: the run's CUDA device name)")
    ns = ap.parse_args()
    try:
        run = read_run(ns.run)
        sim, info, num_simulated = simulated_metrics(ns.calibration, run, ns.workload, ns.hardware)
    except ValueError as exc:   # a missing or malformed run, or a setting the simulator does not have
        raise SystemExit(str(exc)) from None
    rows = latency_rows(measured_latency_stats_ms(run.requests), sim, METRICS)
    print(f"{ns.run.name} trace replay on {info['config']['hardware']}: {num_simulated} requests simulated, "
          f"calibration tier "
          f"{info['config']['calibration_tier']}, num_gpu_blocks {info['config']['num_gpu_blocks']} "
          f"(measured {info['measured_num_gpu_blocks']})")
    print(format_table(rows, ["metric", "stat", "measured_ms", "simulated_ms", "error_pct"]))
    print("\ncomposition (pure-decode steps with the KV cache > 90% full, ms; start-up burst: the requests that "
          f"arrived in the first {STARTUP_S:g} s, until the last one's first token, s; run duration, s):")
    print(format_table(info["composition"], ["what", "measured", "simulated", "error_pct", "samples"]))
    path = write_result("replay_rtx4090" if ns.run == RUN else f"replay_{ns.run.name}", {"rows": rows, **info})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
