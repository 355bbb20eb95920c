"""Soak: steady mixed load against a ``kernelsight serve`` subprocess for --duration-s (default 600; run 3600 for
the hour the reliability issue asks of a release), sampling the server's RSS and open file descriptors (/proc/PID)
and its release lateness (/metrics) every --interval-s. Reports growth after warm-up (the first --warmup-frac of
the run), errors, and lateness percentiles per interval; writes benchmarks/results/soak.json.

The load: --workers clients, each looping over a random pick of a whole stream, a non-streaming completion, a
chat stream, a stream dropped after 1-5 chunks, a bad input (expects vLLM's 400/404) and a /tokenize call.
An error is any answer other than the expected one, a 5xx, a stream not ended by [DONE], or a transport failure.

    python benchmarks/soak.py --duration-s 600
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import steal_s, write_result  # noqa: E402
from _server_proc import (  # noqa: E402
    MODEL,
    ServerProc,
    lateness_quantiles,
    leaked,
    open_fds,
    rss_bytes,
    scrape,
    wait_idle,
)

BAD = [(b'{"prompt": "x",', 400), (b'{"prompt": "x", "n": 0}', 400), (b'{"prompt": "x", "model": "nope"}', 404),
       (b'{"prompt": [1, 999999]}', 400), (b'{"prompt": "x", "max_tokens": -1}', 400), (b"[]", 400)]


async def one_action(c: httpx.AsyncClient, rng: random.Random, stats: dict[str, int]) -> None:
    kind = rng.choices(["stream", "plain", "chat", "drop", "bad", "tokenize"], [4, 2, 2, 2, 1, 1])[0]
    stats[kind] = stats.get(kind, 0) + 1
    prompt = "soak " * rng.randint(1, 200)
    n_out = rng.randint(8, 128)
    if kind in ("stream", "drop", "chat"):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": n_out, "ignore_eos": True, "stream": True}
        body.update({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
        stop_after = rng.randint(1, 5) if kind == "drop" else None
        buf = b""
        async with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{kind}: status {r.status_code}")
            async for b in r.aiter_raw():
                buf += b
                if stop_after is not None and buf.count(b"data: ") >= stop_after:
                    return                      # leaving the block closes the connection mid-stream
        if not buf.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"{kind}: stream not ended by [DONE]")
    elif kind == "plain":
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n_out,
                                                  "ignore_eos": True})
        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != n_out:
            raise RuntimeError(f"plain: status {r.status_code}")
    elif kind == "bad":
        raw, want = rng.choice(BAD)
        r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        if r.status_code != want or "error" not in r.json():
            raise RuntimeError(f"bad: status {r.status_code}, wanted {want}")
    else:
        r = await c.post("/tokenize", json={"prompt": prompt})
        if r.status_code != 200:
            raise RuntimeError(f"tokenize: status {r.status_code}")


async def load(base_url: str, workers: int, stop: asyncio.Event, stats: dict[str, int], errors: list[str],
               seed: int) -> None:
    limits = httpx.Limits(max_connections=workers + 4, max_keepalive_connections=workers)

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0), limits=limits) as c:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while not stop.is_set():
                try:
                    await one_action(c, rng, stats)
                except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
        await asyncio.gather(*(worker(i) for i in range(workers)))


async def soak(srv: ServerProc, duration_s: float, interval_s: float, workers: int, seed: int = 0,
               warmup_frac: float = 0.2, echo: bool = True) -> dict[str, Any]:
    """Run the mixed load for ``duration_s`` against ``srv`` and return the report (samples, growth, errors)."""
    stats: dict[str, int] = {}
    errors: list[str] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(srv.base_url, workers, stop, stats, errors, seed))
    samples = []
    t0, st0 = time.monotonic(), steal_s()
    prev = await asyncio.to_thread(scrape, srv.base_url)
    while time.monotonic() - t0 < duration_s:
        await asyncio.sleep(min(interval_s, duration_s - (time.monotonic() - t0)))
        text = await asyncio.to_thread(scrape, srv.base_url)
        late = lateness_quantiles(prev, text)
        prev = text
        s = {"t_s": round(time.monotonic() - t0, 1), "rss_mb": rss_bytes(srv.pid) / 2**20,
             "open_fds": open_fds(srv.pid), "errors": len(errors), "actions": sum(stats.values()), **late}
        samples.append(s)
        if echo:
            print(f"  t={s['t_s']:6.0f} s  RSS {s['rss_mb']:7.1f} MB  fds {s['open_fds']:4d}  actions "
                  f"{s['actions']:6d}  errors {s['errors']}  lateness p50 {_ms(s['p50_ms'])} p99 {_ms(s['p99_ms'])}",
                  flush=True)
    stop.set()
    await task
    idle = await asyncio.to_thread(wait_idle, srv.base_url)
    warm = [s for s in samples if s["t_s"] >= warmup_frac * duration_s] or samples[-1:]
    first, last = warm[0], samples[-1]
    return {
        "duration_s": duration_s, "workers": workers, "actions": stats, "errors": len(errors),
        "error_examples": errors[:10], "samples": samples,
        "rss_growth_pct": 100 * (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"],
        "fd_growth_pct": 100 * (last["open_fds"] - first["open_fds"]) / first["open_fds"],
        "lateness_p99_ms_by_interval": [s["p99_ms"] for s in samples],
        "idle_gauges_after": idle, "leaked": leaked(idle), "vm_steal_s": steal_s() - st0,
    }


def _ms(v: float | None) -> str:
    return "   -  " if v is None else f"{v:6.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="growth is measured from this fraction of the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--max-model-len 2048 --seed 0",
                    help="extra serve flags (one string)")
    a = ap.parse_args()
    with ServerProc(a.server_args.split()) as srv:
        print(f"soak: {a.duration_s:.0f} s, {a.workers} workers against pid {srv.pid}")
        rep = asyncio.run(soak(srv, a.duration_s, a.interval_s, a.workers, a.seed, a.warmup_frac))
    ok = rep["errors"] == 0 and not rep["leaked"] and rep["rss_growth_pct"] < 5 and rep["fd_growth_pct"] < 5
    print(f"\nactions {sum(rep['actions'].values())} {rep['actions']}\nerrors {rep['errors']} "
          f"{rep['error_examples'][:3]}\nRSS growth after warm-up {rep['rss_growth_pct']:+.1f}%   open fds "
          f"{rep['fd_growth_pct']:+.1f}%   engine idle after: {not rep['leaked']}   VM steal {rep['vm_steal_s']:.1f} s"
          f"\n{'PASS' if ok else 'FAIL'} (< 5% growth, zero errors, nothing leaked)")
    path = write_result("soak", rep)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
