"""Fingerprints of simulated results: a speed change to the simulator must leave every one unchanged.

Each workload is simulated and every request's token times (TTFT, every ITL, E2EL, as float64 bytes) plus the
step count, preemptions and per-family time breakdown are hashed (sha256). ``--save FILE`` records them (run it
before a change), ``--check FILE`` recomputes and compares (after it): bit-for-bit, not approximately.

The workloads cover what the fast path special-cases: the sim_speed workload itself, prefix-cache hits,
preemption under a small KV cache, chunked prefill of long prompts with tensor parallelism (a MoE model too),
a max-concurrency client, a data-parallel MoE group in lockstep, the exact per-request scheduler (no decode group,
long-prefill threshold, priority), and the real-time server's per-token event stream.

``--hardware GPU`` runs every chosen workload on that GPU instead of its own (a calibration change of one GPU, e.g.
the RTX PRO 6000's or a cross-generation table's, is checked on that GPU).

Usage: python benchmarks/sim_fingerprint.py [--save FILE | --check FILE] [--only NAME ...] [--hardware GPU]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import RESULTS, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.arrivals import arrival_times_s  # noqa: E402
from kernelsight.loadgen.datasets import prefix_repetition_dataset, random_dataset  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.simcore.engine import Engine  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_step_model  # noqa: E402

#: ``--hardware``: the GPU every workload runs on instead of its own (None: as written)
HARDWARE_OVERRIDE: str | None = None


def _on_gpu(args: EngineArgs) -> EngineArgs:
    return args if HARDWARE_OVERRIDE is None else dataclasses.replace(args, hardware=HARDWARE_OVERRIDE)


def _ff(args: EngineArgs, samples, rate: float, max_concurrency: int | None = None) -> dict:
    cfg = create_engine_config(_on_gpu(args))
    arrivals = arrival_times_s(len(samples), rate, 1.0, seed=0).tolist()
    res = run_fast_forward(cfg, samples, arrivals, max_concurrency=max_concurrency, ignore_eos=True)
    h = hashlib.sha256()
    for r in res.records:
        h.update(np.array([r.success, r.output_len, r.ttft_s, r.latency_s, r.start_s], dtype=np.float64).tobytes())
        h.update(np.asarray(r.itl_s, dtype=np.float64).tobytes())
    h.update(np.array(list(res.breakdown_s.values()), dtype=np.float64).tobytes())
    h.update(repr((res.num_steps, res.num_preemptions, res.prefix_cache_hit_rate, res.finish_reasons)).encode())
    return {"sha256": h.hexdigest(), "steps": res.num_steps, "preemptions": res.num_preemptions,
            "prefix_hit_rate": round(res.prefix_cache_hit_rate, 4), "duration_s": res.duration_s}


def _vocab(args: EngineArgs) -> int:
    return create_engine_config(args).model.vocab_size


def sim_speed() -> dict:
    """The benchmarks/sim_speed.py run: 10,000 requests, 8B on H100, ~1000/200 tokens, 20 req/s."""
    a = EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=0)
    return _ff(a, random_dataset(10_000, 1000, 200, 0.1, _vocab(a), seed=0), 20.0)


def prefix_hits() -> dict:
    """Shared prefixes (list prompts, hashed block by block on admission) at a rate that queues."""
    a = EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=1)
    return _ff(a, prefix_repetition_dataset(2000, 1500, 300, 8, 150, _vocab(a), seed=1), 40.0)


def preemption() -> dict:
    """A KV cache of 3,000 blocks under 30 req/s: the decode group dissolves and requests are preempted."""
    a = EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=2, num_gpu_blocks_override=3000,
                   max_model_len=8192)
    return _ff(a, random_dataset(800, 800, 400, 0.5, _vocab(a), seed=2, prefix_len=64), 30.0)


def chunked_tp() -> dict:
    """70B at TP=4 with 6,000-token prompts chunked at 2,048 tokens, random output lengths."""
    a = EngineArgs(model="meta-llama/Llama-3.1-70B", hardware="h100", tensor_parallel_size=4, seed=3,
                   max_num_batched_tokens=2048)
    return _ff(a, random_dataset(600, 6000, 300, 0.6, _vocab(a), seed=3), 3.0)


def moe_concurrency() -> dict:
    """Mixtral at TP=2 (MoE kernels), a closed-loop client of 64 in flight, eager mode."""
    a = EngineArgs(model="mistralai/Mixtral-8x7B-v0.1", hardware="h100", tensor_parallel_size=2, seed=4,
                   enforce_eager=True, enable_prefix_caching=False)
    return _ff(a, random_dataset(800, 500, 250, 0.5, _vocab(a), seed=4), float("inf"), max_concurrency=64)


def dp_moe_lockstep() -> dict:
    """Qwen3-30B-A3B as DP2 + EP on RTX PRO 6000s: the ranks step in lockstep (padded rows, dummy batches,
    all-to-all), requests routed by vLLM's DP load balancer."""
    a = EngineArgs(model="Qwen/Qwen3-30B-A3B-Instruct-2507", hardware="rtx-pro-6000", seed=7, data_parallel_size=2,
                   enable_expert_parallel=True, max_model_len=8192)
    return _ff(a, random_dataset(300, 600, 150, 0.5, _vocab(a), seed=7), 8.0)


def exact_scheduler() -> dict:
    """The per-request scheduler loop: no decode group, a long-prefill threshold, priority policy, abort."""
    a = EngineArgs(model="Qwen/Qwen3-8B", hardware="a100-sxm", seed=5, long_prefill_token_threshold=256,
                   scheduling_policy="priority", num_gpu_blocks_override=4000, max_num_seqs=64,
                   max_model_len=8192)
    return _engine_events(a, use_decode_group=False)


def per_token_events() -> dict:
    """The server's path: an event per token per step, windows up to 64 steps, a request with n=3."""
    a = EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=6, num_gpu_blocks_override=6000,
                   max_model_len=8192)
    return _engine_events(a, use_decode_group=True)


def _engine_events(args: EngineArgs, use_decode_group: bool) -> dict:
    cfg = create_engine_config(_on_gpu(args))
    eng = Engine(cfg.scheduler, cfg.num_gpu_blocks, build_step_model(cfg), seed=args.seed,
                 use_decode_group=use_decode_group, per_token_events=True)
    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1 / 25.0, 400))
    prefix = rng.integers(100, 30_000, 256).tolist()
    for i, t in enumerate(arrivals):
        body = rng.integers(100, 30_000, int(rng.integers(20, 2000))).tolist()
        eng.add_request(f"r{i}", (prefix if i % 3 == 0 else []) + body, int(rng.integers(1, 500)),
                        ignore_eos=bool(i % 2), n=3 if i == 7 else 1, priority=int(i % 4), arrival_s=float(t))
    h = hashlib.sha256()
    steps = 0
    aborted = False
    while True:
        res = eng.step(max_steps=64)
        if res is None:
            break
        steps += res.num_steps
        if not aborted and eng.now_s > 2.0:
            aborted = eng.abort("r5") or eng.abort("r40") or True
        for ev in res.events:
            k = ev.step_index - res.first_step_index
            # the time's value, not its Python type: the pure step model leaves numpy float64s where the compiled
            # core (kernelsight.accel) gives the same doubles as floats
            t = float(res.step_end_s[k]) if 0 <= k < res.num_steps else -1.0
            h.update(repr((ev.kind, ev.request_id, ev.step_index, ev.num_tokens, ev.finish_reason, t)).encode())
        h.update(np.array(res.step_end_s, dtype=np.float64).tobytes())
        h.update(repr((res.num_running, res.num_waiting, res.kv_usage, res.num_scheduled_tokens)).encode())
        h.update(np.asarray(res.breakdown_s, dtype=np.float64).tobytes())
    return {"sha256": h.hexdigest(), "steps": steps, "preemptions": eng.stats.num_preemptions,
            "prefix_hit_rate": round(eng.kv.prefix_hits_tokens / max(eng.kv.prefix_queries_tokens, 1), 4),
            "duration_s": eng.now_s}


WORKLOADS = {f.__name__: f for f in (sim_speed, prefix_hits, preemption, chunked_tp, moe_concurrency,
                                     dp_moe_lockstep, exact_scheduler, per_token_events)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--save", metavar="FILE", help="write the fingerprints to FILE")
    g.add_argument("--check", metavar="FILE", help="compare against fingerprints saved in FILE")
    ap.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), help="run only these workloads")
    ap.add_argument("--hardware", help="run every workload on this GPU instead of its own")
    ns = ap.parse_args()
    global HARDWARE_OVERRIDE
    HARDWARE_OVERRIDE = ns.hardware
    names = ns.only or list(WORKLOADS)
    saved = json.loads(open(ns.check).read()) if ns.check else {}
    out, bad = {}, []
    print(f"{'workload':<18} {'steps':>8} {'preempt':>7} {'hit':>6} {'wall_s':>7}  sha256[:16]  check")
    for name in names:
        t0 = time.perf_counter()
        fp = WORKLOADS[name]()
        wall = time.perf_counter() - t0
        out[name] = fp
        verdict = ""
        if ns.check:
            ref = saved.get(name)
            verdict = "no reference" if ref is None else ("same" if ref["sha256"] == fp["sha256"] else "DIFFERENT")
            if verdict == "DIFFERENT":
                bad.append(name)
        print(f"{name:<18} {fp['steps']:>8} {fp['preemptions']:>7} {fp['prefix_hit_rate']:>6.3f} {wall:>7.2f}  "
              f"{fp['sha256'][:16]}  {verdict}", flush=True)
    if ns.save:
        with open(ns.save, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {ns.save}")
    else:
        print(f"wrote {write_result('sim_fingerprint', {'workloads': out})}")
    if bad:
        print(f"changed: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    RESULTS.mkdir(parents=True, exist_ok=True)
    sys.exit(main())
