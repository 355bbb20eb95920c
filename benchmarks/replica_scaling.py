"""Delivered streamed tokens/s of a one-machine fleet vs the processes it runs in (``--replica-processes``), and of
one engine behind N API-server processes (``--api-server-count``).

Each configuration starts ``kernelsight serve --replicas R --replica-processes P`` with a high ``--time-scale`` (the
simulated GPU is never the limit: the server's CPU is) and drives every replica with M closed-loop streams from one
client process (raw HTTP/1.1 on uvloop, counting ``data: {`` events without parsing them, so the client's own cost
per token stays small beside the server's). Reported per configuration: delivered tokens/s over the measured
window, server CPU µs per token (every server process, from /proc), the client's, the cores the server kept busy
(server CPU s / wall s), the hypervisor's steal time over the window and the load average (on a machine shared with
other jobs, a process gets a fair share of a core, not a core: more processes win more shares as well as more
cores). A first section prices the engine alone: the same closed-loop workload stepped one engine
step at a time as the server's bridge steps it (no HTTP), CPU µs per output token: what is left of the server's cost
per token is the front end (HTTP, JSON, SSE, the event loop, the release timing).

``--api-servers 1,2`` adds one server (one engine) with ``--api-server-count N`` per value, driven with as many streams
as the whole fleet (replicas × streams) on its one port: the front ends scale, the engine stays one process.

Usage: python benchmarks/replica_scaling.py [--replicas 2] [--processes 1,2] [--streams 64] [--seconds 15]
                                            [--api-servers 1,2]
Writes benchmarks/results/replica_scaling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from _common import steal_s, write_result  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
PROMPT_LEN = 32
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc ------------------------------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except OSError:
        return 0.0


def tree_pids(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def free_port_run(n: int) -> int:
    import socket
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


# -- the client -------------------------------------------------------------------------------------------------
async def _stream_loop(host: str, port: int, body: bytes, counter: list[int], stop_at: float) -> None:
    """One closed-loop stream on one keep-alive connection: a request, read to [DONE], the next."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < stop_at:
            writer.write(head + body)
            tail = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                # the tail carries a pattern cut between reads: 6 bytes cannot hold a whole "data: {" (never
                # counted twice), 11 cannot hold a whole "data: [DONE]"
                counter[0] += (tail[-6:] + data).count(b"data: {")
                buf = tail + data
                if b"data: [DONE]" in buf:
                    break
                tail = buf[-11:]
    finally:
        writer.close()


def _client(ports: list[int], streams: int, max_tokens: int, seconds: float, out: multiprocessing.Queue) -> None:
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    body = json.dumps({"model": MODEL, "prompt": list(range(1000, 1000 + PROMPT_LEN)), "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    counter = [0]

    async def main() -> tuple[int, float]:
        stop_at = time.monotonic() + seconds
        tasks = [asyncio.ensure_future(_stream_loop("127.0.0.1", p, body, counter, stop_at))
                 for p in ports for _ in range(streams)]
        await asyncio.sleep(seconds)
        n, cpu = counter[0], time.process_time()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return n, cpu

    t0 = time.process_time()
    n, cpu = run(main())
    out.put((n, cpu - t0))


def drive(ports: list[int], streams: int, max_tokens: int, seconds: float) -> tuple[int, float]:
    """(tokens delivered, client CPU s) over ``seconds`` of closed-loop streams from a separate process."""
    q: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    p = multiprocessing.get_context("spawn").Process(target=_client, args=(ports, streams, max_tokens, seconds, q))
    p.start()
    n, cpu = q.get(timeout=seconds + 120)
    p.join(30)
    return n, cpu


# -- one configuration ------------------------------------------------------------------------------------------
def start_fleet(replicas: int, processes: int, time_scale: float, api_servers: int = 1
                ) -> tuple[subprocess.Popen, list[int]]:
    base = free_port_run(replicas)
    cmd = [sys.executable, "-m", "kernelsight.server", "--model", MODEL, "--host", "127.0.0.1", "--port", str(base),
           "--replicas", str(replicas), "--replica-processes", str(processes), "--time-scale", str(time_scale),
           "--max-model-len", "2048", "--uvicorn-log-level", "warning", "--lateness-warn-ms", "0",
           "--api-server-count", str(api_servers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ports = [base + i for i in range(replicas)]
    t_end = time.monotonic() + 240
    pending = list(ports)
    while pending:
        if proc.poll() is not None or time.monotonic() > t_end:
            proc.kill()
            raise RuntimeError(f"fleet did not start: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{pending[0]}/health", timeout=1).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return proc, ports


def stop_fleet(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_config(replicas: int, processes: int, streams: int, max_tokens: int, seconds: float, warmup_s: float,
               time_scale: float, api_servers: int = 1) -> dict:
    proc, ports = start_fleet(replicas, processes, time_scale, api_servers)
    try:
        drive(ports, streams, max_tokens, warmup_s)              # warm-up: caches, allocator, connection setup
        pids = tree_pids(proc.pid)
        cpu0 = sum(proc_cpu_s(p) for p in pids)
        st0, t0 = steal_s(), time.monotonic()
        tokens, client_cpu = drive(ports, streams, max_tokens, seconds)
        wall = time.monotonic() - t0
        cpu1 = sum(proc_cpu_s(p) for p in pids)
        st1 = steal_s()
    finally:
        stop_fleet(proc)
    return {"replicas": replicas, "processes": processes, "api_servers": api_servers,
            "streams_per_replica": streams, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "server_cpu_s": cpu1 - cpu0,
            "server_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / max(tokens, 1), "client_cpu_s": client_cpu,
            "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1), "wall_s": wall, "steal_s": st1 - st0}


# -- the engine alone ---------------------------------------------------------------------------------------------
def engine_cost(streams: int, max_tokens: int, num_prompts: int) -> dict:
    """CPU per output token of the simulated engine alone, stepped one step at a time as the server's bridge steps
    it (``max_steps=1``, per-token events), closed loop at ``streams`` concurrent requests: no HTTP, no JSON."""
    from kernelsight.engine_args import create_engine_config, engine_args_from
    from kernelsight.server.serve_args import serve_parser
    from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, TOKENS
    from kernelsight.simcore.engine_config import build_engine

    ns = serve_parser().parse_args(["--max-model-len", "2048"])
    eng = build_engine(create_engine_config(engine_args_from(ns)), per_token_events=True)
    prompt = list(range(1000, 1000 + PROMPT_LEN))
    sent = done = tokens = 0

    def send() -> None:
        nonlocal sent
        # a distinct first token per request: no prefix-cache hit, as the client's identical prompts would get
        eng.add_request(f"r{sent}", [sent % 50_000] + prompt[1:], max_tokens, ignore_eos=True)
        sent += 1

    for _ in range(min(streams, num_prompts)):
        send()
    t0 = time.process_time()
    while done < num_prompts:
        res = eng.step(max_steps=1)
        if res is None:
            break
        for ev in res.events:
            if ev.kind == FIRST_TOKEN:
                tokens += 1
            elif ev.kind == TOKENS:
                tokens += ev.num_tokens
            if ev.kind == FINISHED:
                done += 1
                if sent < num_prompts:
                    send()
    cpu = time.process_time() - t0
    return {"num_prompts": num_prompts, "tokens": tokens, "cpu_s": cpu, "cpu_us_per_token": 1e6 * cpu / max(tokens, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ncpu = len(os.sched_getaffinity(0))
    ap.add_argument("--replicas", type=int, default=ncpu, help="replicas of the fleet (default: usable CPUs)")
    ap.add_argument("--processes", default=",".join(str(i) for i in range(1, ncpu + 1)),
                    help="process counts to compare (default: 1..usable CPUs)")
    ap.add_argument("--streams", type=int, default=64, help="closed-loop streams per replica (default: 64)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per configuration")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--time-scale", type=float, default=1000.0,
                    help="virtual s per wall s: high, so the CPU and not the simulated GPU sets the pace")
    ap.add_argument("--api-servers", default="",
                    help="--api-server-count values to run as one server (one engine) with replicas × streams "
                         "streams, e.g. 1,2 (default: none)")
    ap.add_argument("--single-replica", action=argparse.BooleanOptionalAction, default=True,
                    help="also run one replica in one process (the baseline a single server gives)")
    ns = ap.parse_args()

    eng = engine_cost(ns.streams, ns.max_tokens, num_prompts=4 * ns.streams)
    print(f"engine alone (one step at a time, {eng['tokens']:,} tokens at {ns.streams} concurrent): "
          f"{eng['cpu_us_per_token']:.1f} µs CPU per output token")
    configs = [(1, 1, 1, ns.streams)] if ns.single_replica else []
    configs += [(ns.replicas, int(p), 1, ns.streams) for p in ns.processes.split(",") if p]
    configs += [(1, 1, int(a), ns.replicas * ns.streams) for a in ns.api_servers.split(",") if a]
    rows = []
    hdr = (f"{'replicas':>8} {'procs':>5} {'api srv':>7} {'streams':>7} {'tokens/s':>9} {'srv µs/tok':>10} "
           f"{'cli µs/tok':>10} {'srv cores':>9} {'steal s':>7}")
    print(hdr)
    print("-" * len(hdr))
    for replicas, procs, api, streams in configs:
        r = run_config(replicas, procs, streams, ns.max_tokens, ns.seconds, ns.warmup_s, ns.time_scale, api)
        rows.append(r)
        print(f"{replicas:>8} {procs:>5} {api:>7} {replicas * streams:>7} {r['tokens_per_s']:>9,.0f} "
              f"{r['server_cpu_us_per_token']:>10.1f} {r['client_cpu_us_per_token']:>10.1f} "
              f"{r['server_cpu_s'] / r['wall_s']:>9.2f} {r['steal_s']:>7.2f}",
              flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    path = write_result("replica_scaling", {"args": vars(ns), "engine_alone": eng, "rows": rows, "loadavg": load})
    print(f"load average after: {' '.join(load)}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
