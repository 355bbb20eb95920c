"""KV offloading's TTFT gain on a multi-turn workload whose history exceeds the GPU cache, in fast-forward.

Sessions of several turns, each turn's prompt the whole history (the previous prompts and answers) plus a new user
message; a session's next turn is sent when its previous answer has finished plus a think time, and a fixed number
of sessions run at once (closed loop, driven here on the engine directly). The GPU cache is cut
(--num-gpu-blocks) so that the sessions' histories do not fit in it while they think: without offloading a
returning session recomputes what the GPU evicted; with --kv-offloading-size it loads it from the CPU tier.

Prints mean / p50 / p99 TTFT, TTFT by turn, the GPU and CPU prefix-hit rates, for no offloading, the native
connector and LMCache, and writes benchmarks/results/kv_offloading.json. Simulated seconds only (the machine's
CPU time and steal are reported for the run itself).

Usage: python benchmarks/kv_offloading.py [--sessions 64] [--turns 8] [--concurrency 16] [--first-len 2000]
       [--user-len 200] [--answer-len 200] [--think-s 5] [--num-gpu-blocks 2000] [--offload-gib 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_jiffies, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_engine  # noqa: E402


def run_sessions(args: EngineArgs, a: argparse.Namespace) -> dict:
    """One closed-loop multi-turn run: every turn's (session, turn, TTFT) and the engine's cache counters."""
    cfg = create_engine_config(args)
    eng = build_engine(cfg, per_token_events=False)
    rng = np.random.default_rng(a.seed)
    vocab = cfg.model.vocab_size
    history: dict[int, list[int]] = {}
    turn_of: dict[int, int] = {}
    started = 0
    meta: dict[str, tuple[int, int, float]] = {}       # request id -> (session, turn, arrival)
    ttfts: list[tuple[int, float]] = []                  # (turn, TTFT s)

    def send(session: int, at_s: float) -> None:
        turn = turn_of[session]
        prompt = history[session] + rng.integers(0, vocab, a.first_len if turn == 0 else a.user_len).tolist()
        answer = rng.integers(0, vocab, a.answer_len).tolist()
        history[session] = prompt + answer
        rid = f"s{session}t{turn}"
        eng.add_request(rid, prompt, a.answer_len, ignore_eos=True, arrival_s=at_s, output_token_ids=answer)
        meta[rid] = (session, turn, at_s)

    def start(at_s: float) -> None:
        nonlocal started
        s = started
        started += 1
        history[s], turn_of[s] = [], 0
        send(s, at_s)

    for i in range(min(a.concurrency, a.sessions)):
        start(i * 0.05)
    while eng.has_unfinished():
        res = eng.step(max_steps=64)
        if res is None:
            break
        for ev in res.events:
            t = res.step_end_s[ev.step_index - res.first_step_index] if ev.kind in (FIRST_TOKEN, FINISHED) else 0
            if ev.kind == FIRST_TOKEN:
                session, turn, arrival = meta[ev.request_id]
                ttfts.append((turn, t - arrival))
            elif ev.kind == FINISHED:
                session, turn, _ = meta[ev.request_id]
                if turn + 1 < a.turns:
                    turn_of[session] = turn + 1
                    send(session, t + rng.exponential(a.think_s))
                elif started < a.sessions:
                    start(t)
    kv, off = eng.kv, eng.offload
    out = {"ttfts": ttfts, "gpu_hit_rate": kv.prefix_hits_tokens / max(kv.prefix_queries_tokens, 1),
           "duration_s": eng.now_s, "preemptions": eng.stats.num_preemptions}
    if off is not None:
        st = off.stats
        out.update(cpu_hit_rate=st.hit_rate, cpu_blocks=off.config.num_blocks, loads=st.loads,
                   load_gb=st.bytes["CPU_to_GPU"] / 1e9, store_gb=st.bytes["GPU_to_CPU"] / 1e9,
                   load_s=st.time_s["CPU_to_GPU"], evicted_blocks=st.evicted_blocks)
        # every prompt token served from a cache, GPU or CPU (the CPU hits are counted past the GPU's)
        out["any_hit_rate"] = (kv.prefix_hits_tokens + st.external_hits_tokens) / max(kv.prefix_queries_tokens, 1)
    else:
        out["any_hit_rate"] = out["gpu_hit_rate"]
    return out


def summarize(name: str, r: dict, turns: int) -> dict:
    t = np.array([x for _, x in r["ttfts"]]) * 1e3
    by_turn = {k: float(np.mean([x for tt, x in r["ttfts"] if tt == k]) * 1e3) for k in range(turns)}
    return {"config": name, "requests": len(t), "mean_ttft_ms": float(t.mean()),
            "p50_ttft_ms": float(np.percentile(t, 50)),
            "p99_ttft_ms": float(np.percentile(t, 99)), "ttft_ms_by_turn": by_turn,
            **{k: v for k, v in r.items() if k != "ttfts"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16, help="sessions at once")
    p.add_argument("--first-len", type=int, default=2000, help="first turn's prompt tokens (system + user)")
    p.add_argument("--user-len", type=int, default=200, help="each later turn's new user tokens")
    p.add_argument("--answer-len", type=int, default=200)
    p.add_argument("--think-s", type=float, default=5.0, help="mean think time between turns (exponential)")
    p.add_argument("--num-gpu-blocks", type=int, default=2000, help="GPU KV blocks (16 tokens each)")
    p.add_argument("--offload-gib", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    base = EngineArgs(model=a.model, hardware=a.hardware, max_model_len=16384,
                      num_gpu_blocks_override=a.num_gpu_blocks)
    configs = [("no offloading", base),
               ("native", dataclasses.replace(base, kv_offloading_size_gib=a.offload_gib)),
               ("lmcache", dataclasses.replace(base, kv_offloading_size_gib=a.offload_gib,
                                               kv_offloading_backend="lmcache"))]
    j0, w0 = cpu_jiffies(), time.perf_counter()
    rows = [summarize(name, run_sessions(args, a), a.turns) for name, args in configs]
    j1, wall = cpu_jiffies(), time.perf_counter() - w0
    d = [y - x for x, y in zip(j0, j1, strict=True)] if j0 and j1 else []
    steal = 100.0 * d[7] / (sum(d) or 1) if d else float("nan")
    max_hist = a.first_len + (a.turns - 1) * (a.user_len + a.answer_len) + a.answer_len
    print(f"{a.model} on {a.hardware}: {a.sessions} sessions × {a.turns} turns, {a.concurrency} at once, "
          f"history up to {max_hist} tokens; GPU cache {a.num_gpu_blocks * 16} tokens "
          f"(sessions' live history up to {a.concurrency * max_hist}); CPU tier {a.offload_gib:g} GiB")
    print(f"{'config':<15} {'mean TTFT':>10} {'p50':>8} {'p99':>8} {'GPU hit':>8} {'CPU hit':>8} {'any hit':>8} "
          f"{'loaded GB':>9}")
    for r in rows:
        print(f"{r['config']:<15} {r['mean_ttft_ms']:>8.1f}ms {r['p50_ttft_ms']:>6.1f}ms {r['p99_ttft_ms']:>6.1f}ms "
              f"{r['gpu_hit_rate']:>8.1%} {r.get('cpu_hit_rate', 0.0):>8.1%} {r['any_hit_rate']:>8.1%} "
              f"{r.get('load_gb', 0.0):>9.2f}")
    print("mean TTFT by turn (ms): " + "; ".join(
        f"{r['config']}: " + " ".join(f"{v:.0f}" for v in r["ttft_ms_by_turn"].values()) for r in rows))
    print(f"(run: {wall:.1f} s wall on this machine, steal {steal:.1f}%)")
    path = write_result("kv_offloading", {"args": vars(a), "rows": rows, "wall_s": wall, "steal_pct": steal})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
