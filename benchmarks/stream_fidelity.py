"""Stream fidelity: do clients see tokens exactly when the simulated GPU emits them?

Starts ``kernelsight serve`` (a separate process, real time, --record-timings) on 127.0.0.1, drives it with
N concurrent streaming completions (closed loop, random token prompts, ignore_eos), and compares per chunk:

* TTFT: client (first chunk − send time) vs simulator (first token − arrival), both in wall seconds;
* ITL: client gap between consecutive chunks vs the simulator's gap between the tokens those chunks end with
  (a chunk may carry several tokens if the client lags, as with vLLM).

Also reports output tokens/s, server CPU µs per streamed token (from /proc) and the worst release lateness.
Usage: python benchmarks/stream_fidelity.py [--concurrency 64 128 256] [--output-len 64] [--input-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(client: httpx.AsyncClient, body: dict, rid: str) -> dict:
    t0 = time.perf_counter()
    times, counts = [], []
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        buf = ""
        async for text in r.aiter_text():
            now = time.perf_counter()
            buf += text
            while "\n\n" in buf:
                ev, buf = buf.split("\n\n", 1)
                if ev.startswith("data: {"):
                    d = json.loads(ev[6:])
                    if d.get("choices"):
                        times.append(now)
                        counts.append(d["choices"][0]["text"].count(" "))   # each token is " word"
    return {"id": "cmpl-" + rid, "t0": t0, "times": times, "counts": counts}


async def one_stream_aiohttp(session, url: str, body: dict, rid: str) -> dict:
    t0 = time.perf_counter()
    times, counts = [], []
    async with session.post(url, json=body, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        async for line in r.content:           # one SSE line at a time, as vllm bench serve reads them
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                d = json.loads(line[6:])
                if d.get("choices"):
                    times.append(now)
                    counts.append(d["choices"][0]["text"].count(" "))
    return {"id": "cmpl-" + rid, "t0": t0, "times": times, "counts": counts}


async def run_level_aiohttp(base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
                            seed: int) -> tuple[list[dict], float]:
    import aiohttp

    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        async def task(i: int) -> dict:
            prompt = rng.integers(1000, 100000, input_len).tolist()
            body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True}
            async with sem:
                return await one_stream_aiohttp(session, base_url + "/v1/completions", body, f"c{concurrency}-{i}")
        t0 = time.perf_counter()
        res = await asyncio.gather(*(task(i) for i in range(num_prompts)))
        return res, time.perf_counter() - t0


async def run_level(base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
                    seed: int) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def task(i: int) -> dict:
            prompt = rng.integers(1000, 100000, input_len).tolist()
            body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True}
            async with sem:
                return await one_stream(client, body, f"c{concurrency}-{i}")
        t0 = time.perf_counter()
        res = await asyncio.gather(*(task(i) for i in range(num_prompts)))
        return res, time.perf_counter() - t0


def compare(results: list[dict], timings: dict) -> dict:
    d_ttft, d_itl, chunks, tokens = [], [], 0, 0
    for r in results:
        rec = timings.get(r["id"])
        if rec is None or not r["times"]:
            continue
        virt = rec["token_times_s"]
        cum = np.cumsum(r["counts"]) - 1            # index of the last token in each chunk
        vt = np.asarray([virt[min(c, len(virt) - 1)] for c in cum])
        ct = np.asarray(r["times"])
        d_ttft.append((ct[0] - r["t0"]) - (vt[0] - rec["arrival_s"]))
        d_itl.extend((np.diff(ct) - np.diff(vt)).tolist())
        chunks += len(ct)
        tokens += int(sum(r["counts"]))
    a_ttft, a_itl = np.abs(d_ttft) * 1e3, np.abs(d_itl) * 1e3
    return {"requests": len(d_ttft), "chunks": chunks, "tokens": tokens,
            "ttft_abs_diff_ms_p50": float(np.percentile(a_ttft, 50)),
            "ttft_abs_diff_ms_p99": float(np.percentile(a_ttft, 99)),
            "ttft_diff_ms_mean": float(np.mean(d_ttft) * 1e3),
            "itl_abs_diff_ms_p50": float(np.percentile(a_itl, 50)) if len(a_itl) else 0.0,
            "itl_abs_diff_ms_p99": float(np.percentile(a_itl, 99)) if len(a_itl) else 0.0,
            "tokens_per_chunk": tokens / max(chunks, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--prompts-per-stream", type=float, default=2.0, help="requests per level = this × concurrency")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--bound-ms", type=float, default=2.0, help="p99 |difference| bound")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve flag (repeatable)")
    ap.add_argument("--out", default="stream_fidelity")
    ns = ap.parse_args()

    port = free_port()
    cmd = [sys.executable, "-m", "kernelsight.server", "--host", "127.0.0.1", "--port", str(port), "--model",
           ns.model, "--hardware", ns.hardware, "--max-model-len", "4096", "--record-timings",
           "--served-model-name", "m", "--uvicorn-log-level", "warning", *ns.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + (proc.stderr.read() if proc.stderr else ""))
            time.sleep(0.1)
        for c in ns.concurrency:
            num = max(int(c * ns.prompts_per_stream), c)
            cpu0 = cpu_s(proc.pid)
            runner = run_level
            try:
                import aiohttp  # noqa: F401 - the faster client (kernelsight[loadgen]), as vllm bench serve uses
                runner = run_level_aiohttp
            except ImportError:
                pass
            results, wall = asyncio.run(runner(base, c, num, ns.input_len, ns.output_len, seed=c))
            cpu1 = cpu_s(proc.pid)
            tim = httpx.get(base + "/kernelsight/timings", timeout=60).json()
            row = {"concurrency": c, "num_prompts": num, **compare(results, tim["requests"]),
                   "wall_s": wall, "output_tokens_per_s": sum(sum(r["counts"]) for r in results) / wall,
                   "server_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / max(sum(sum(r["counts"]) for r in results), 1),
                   "server_late_ms_max": tim["late_s_max"] * 1e3}
            row["within_bound"] = max(row["ttft_abs_diff_ms_p99"], row["itl_abs_diff_ms_p99"]) <= ns.bound_ms
            rows.append(row)
            print(f"  c={c:4d}: p99 |ΔTTFT| {row['ttft_abs_diff_ms_p99']:.2f} ms, p99 |ΔITL| "
                  f"{row['itl_abs_diff_ms_p99']:.2f} ms, {row['output_tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    cols = [("concurrency", "{:d}"), ("requests", "{:d}"), ("ttft_abs_diff_ms_p50", "{:.2f}"),
            ("ttft_abs_diff_ms_p99", "{:.2f}"), ("itl_abs_diff_ms_p50", "{:.2f}"), ("itl_abs_diff_ms_p99", "{:.2f}"),
            ("tokens_per_chunk", "{:.2f}"), ("output_tokens_per_s", "{:.0f}"), ("server_cpu_us_per_token", "{:.1f}"),
            ("within_bound", "{}")]
    print(f"\nstream fidelity: {ns.model} on {ns.hardware}, input {ns.input_len}, output {ns.output_len} tokens "
          f"(bound: p99 |Δ| ≤ {ns.bound_ms} ms)")
    print(" | ".join(name for name, _ in cols))
    for r in rows:
        print(" | ".join(fmt.format(r[name]) for name, fmt in cols))
    ok = [r for r in rows if r["within_bound"]]
    best = max(ok, key=lambda r: r["concurrency"]) if ok else None
    if best:
        print(f"most concurrent streams within bound: {best['concurrency']} ({best['output_tokens_per_s']:.0f} tok/s)")
    path = write_result(ns.out, {"benchmark": "stream_fidelity", "args": vars(ns), "rows": rows,
                                 "max_concurrency_within_bound": best["concurrency"] if best else None})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
