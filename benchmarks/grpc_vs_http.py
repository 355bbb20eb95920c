"""Server CPU per output token: vLLM's gRPC front end against the HTTP one, at N concurrent streams, in one run.

One ``kernelsight serve --grpc`` process serves both front ends on one engine (gRPC on its port, the HTTP app on
the next). Phases alternate HTTP, gRPC, HTTP, gRPC, ...: each keeps N closed-loop streaming requests in flight
(64 random prompt ids, --output-len tokens, ignore_eos; HTTP: /v1/completions with stream=true over aiohttp,
N connections; gRPC: Generate with stream=true over one channel, as a gateway multiplexes), ramps up for
--warmup-s, then measures --seconds: the server process's CPU time (utime + stime, every thread, /proc/PID/stat)
and the output tokens the engine generated (``vllm:generation_tokens_total`` in /metrics), then drains. The
clients run in this process, outside the measured one. Reported per phase: tokens/s, server CPU µs per token,
the hypervisor's steal time (/proc/stat) and the load average; and the gRPC/HTTP ratio of CPU per token over all
phases of each front end (the numbers move with the machine's load; the ratio is taken within the run).
A last phase measures grpc.aio's own floor: a bare grpc.aio server (no engine, a trivial Generate that sends one
1-token message per stream per 6 ms tick) under the same N streams, its CPU per message.

Usage: python benchmarks/grpc_vs_http.py [--streams 256] [--rounds 2] [--seconds 15] [--warmup-s 4]
Writes benchmarks/results/grpc_vs_http.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port, steal_s, write_result  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
PROMPT_LEN = 64
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def generated_tokens(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text,
                                                      re.MULTILINE))


def running(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$",
                                                      text, re.MULTILINE))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine record beside the numbers."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(PROMPT_LEN)]


async def http_stream_loop(session, url: str, rng: random.Random, out_len: int, stop: asyncio.Event) -> None:
    body = {"model": MODEL, "max_tokens": out_len, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with session.post(url, json={**body, "prompt": prompt(rng)}) as r:
            async for _ in r.content:
                pass


async def grpc_stream_loop(stub, pb, rng: random.Random, out_len: int, stop: asyncio.Event, k: int) -> None:
    n = 0
    while not stop.is_set():
        req = pb.GenerateRequest(request_id=f"b{k}-{n}", tokenized=pb.TokenizedInput(input_ids=prompt(rng)),
                                 stream=True, sampling_params=pb.SamplingParams(max_tokens=out_len, ignore_eos=True))
        n += 1
        async for _ in stub.Generate(req):
            pass


async def phase(kind: str, args: argparse.Namespace, pid: int, base_url: str, grpc_target: str) -> dict:
    stop = asyncio.Event()
    rngs = [random.Random(hash((kind, k, time.time()))) for k in range(args.streams)]
    if kind == "http":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=None))
        tasks = [asyncio.create_task(http_stream_loop(session, base_url + "/v1/completions", rngs[k],
                                                      args.output_len, stop)) for k in range(args.streams)]
        closer = session.close
    else:
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

        channel = grpc.aio.insecure_channel(grpc_target)
        stub = pb_grpc.VllmEngineStub(channel)
        tasks = [asyncio.create_task(grpc_stream_loop(stub, pb, rngs[k], args.output_len, stop, k))
                 for k in range(args.streams)]
        closer = channel.close
    await asyncio.sleep(args.warmup_s)
    tok0, cpu0, steal0, t0 = generated_tokens(base_url), cpu_s(pid), steal_s(), time.monotonic()
    load0 = os.getloadavg()[0]
    await asyncio.sleep(args.seconds)
    tok1, cpu1, steal1, t1 = generated_tokens(base_url), cpu_s(pid), steal_s(), time.monotonic()
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await closer()
    for _ in range(600):                   # drained (the cancelled requests aborted) before the next phase
        if running(base_url) == 0:
            break
        await asyncio.sleep(0.05)
    tokens = tok1 - tok0
    cpu = cpu1 - cpu0
    return {"front_end": kind, "seconds": round(t1 - t0, 2), "tokens": int(tokens),
            "tokens_per_s": round(tokens / (t1 - t0), 1), "server_cpu_s": round(cpu, 2),
            "cpu_us_per_token": round(1e6 * cpu / tokens, 2) if tokens else None,
            "steal_s": round(steal1 - steal0, 2), "loadavg_1m": round(load0, 2)}


def floor_server(port: int) -> None:
    """The bare grpc.aio server of the floor phase (run as a subprocess): Generate sends ``max_tokens``
    one-token chunks, one per 6 ms tick of a shared clock, as the engine releases one token per decode step."""
    import grpc
    import uvloop
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    tick = asyncio.Event()

    class Bare(pb_grpc.VllmEngineServicer):
        async def Generate(self, request, context):  # noqa: N802 - the RPC's name
            for i in range(request.sampling_params.max_tokens):
                await tick.wait()
                msg = pb.GenerateResponse()
                chunk = msg.chunk
                chunk.token_ids.append(i)
                chunk.prompt_tokens, chunk.completion_tokens = PROMPT_LEN, 1
                yield msg

    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(Bare(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        while True:
            await asyncio.sleep(0.006)
            tick.set()
            await asyncio.sleep(0)
            tick.clear()

    uvloop.run(serve())


async def floor_phase(args: argparse.Namespace, pid: int, target: str) -> dict:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.VllmEngineStub(channel)
    count = 0
    stop = asyncio.Event()

    async def loop() -> None:
        nonlocal count
        req = pb.GenerateRequest(stream=True, sampling_params=pb.SamplingParams(max_tokens=args.output_len))
        while not stop.is_set():
            async for _ in stub.Generate(req):
                count += 1

    tasks = [asyncio.create_task(loop()) for _ in range(args.streams)]
    await asyncio.sleep(args.warmup_s)
    n0, cpu0, steal0, t0 = count, cpu_s(pid), steal_s(), time.monotonic()
    await asyncio.sleep(args.seconds)
    n1, cpu1, steal1, t1 = count, cpu_s(pid), steal_s(), time.monotonic()
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    return {"front_end": "grpc.aio floor", "seconds": round(t1 - t0, 2), "messages": n1 - n0,
            "messages_per_s": round((n1 - n0) / (t1 - t0), 1), "server_cpu_s": round(cpu1 - cpu0, 2),
            "cpu_us_per_message": round(1e6 * (cpu1 - cpu0) / (n1 - n0), 2) if n1 > n0 else None,
            "steal_s": round(steal1 - steal0, 2)}


def run_floor(args: argparse.Namespace) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--floor-server", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        import grpc

        grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=60)
        return asyncio.run(floor_phase(args, proc.pid, f"127.0.0.1:{port}"))
    finally:
        proc.kill()
        proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="HTTP+gRPC phase pairs (default 2)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per phase")
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-floor", action="store_true", help="skip the bare grpc.aio phase")
    ap.add_argument("--floor-server", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_server is not None:
        floor_server(args.floor_server)
        return 0
    grpc_port = free_port()
    http_port = free_port()
    cmd = [sys.executable, "-m", "kernelsight.server", "--model", MODEL, "--hardware", "h100", "--grpc",
           "--host", "127.0.0.1", "--port", str(grpc_port), "--grpc-http-port", str(http_port),
           "--uvicorn-log-level", "warning", "--lateness-warn-ms", "0", "--seed", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        for _ in range(900):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        phases = []
        for r in range(args.rounds):
            for kind in (("http", "grpc") if r % 2 == 0 else ("grpc", "http")):
                p = asyncio.run(phase(kind, args, proc.pid, base_url, f"127.0.0.1:{grpc_port}"))
                phases.append(p)
                print(f"  {kind:<5} {p['tokens_per_s']:>9.1f} tok/s  {p['cpu_us_per_token']:>7.2f} µs CPU/token  "
                      f"steal {p['steal_s']:.2f} s  load {p['loadavg_1m']:.2f}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def per_token(kind: str) -> float:
        ps = [p for p in phases if p["front_end"] == kind]
        return 1e6 * sum(p["server_cpu_s"] for p in ps) / sum(p["tokens"] for p in ps)

    floor = None if args.no_floor else run_floor(args)
    if floor is not None:
        print(f"  grpc.aio floor {floor['messages_per_s']:>9.1f} msg/s  {floor['cpu_us_per_message']:>7.2f} µs "
              f"CPU/msg  steal {floor['steal_s']:.2f} s", flush=True)
    http_us, grpc_us = per_token("http"), per_token("grpc")
    ratio = grpc_us / http_us
    print()
    print("| front end | tokens/s (mean) | server CPU µs/token | steal s |")
    print("|---|---:|---:|---:|")
    for kind, us in (("HTTP (SSE)", http_us), ("gRPC", grpc_us)):
        ps = [p for p in phases if p["front_end"] == ("http" if kind.startswith("HTTP") else "grpc")]
        print(f"| {kind} | {sum(p['tokens_per_s'] for p in ps) / len(ps):.0f} | {us:.1f} | "
              f"{sum(p['steal_s'] for p in ps):.2f} |")
    if floor is not None:
        print(f"| bare grpc.aio (no engine, per message) | {floor['messages_per_s']:.0f} | "
              f"{floor['cpu_us_per_message']:.1f} | {floor['steal_s']:.2f} |")
    print(f"\ngRPC / HTTP server CPU per token at {args.streams} streams: {ratio:.3f} "
          f"({cpu_model()}, {os.cpu_count()} CPUs; steal {sum(p['steal_s'] for p in phases):.2f} s in all)")
    path = write_result("grpc_vs_http", {
        "streams": args.streams, "output_len": args.output_len, "prompt_len": PROMPT_LEN, "seconds": args.seconds,
        "warmup_s": args.warmup_s, "phases": phases, "http_cpu_us_per_token": round(http_us, 2),
        "grpc_cpu_us_per_token": round(grpc_us, 2), "grpc_over_http_cpu_per_token": round(ratio, 3),
        "steal_s_total": round(sum(p["steal_s"] for p in phases), 2), "cpu_model": cpu_model(),
        "grpc_aio_floor": floor})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
