"""Stream fidelity: do clients see tokens exactly when the simulated GPU emits them?

Starts ``kernelsight serve`` (a separate process, real time, --record-timings) on 127.0.0.1, drives it with
N concurrent streaming completions (closed loop, random token prompts, ignore_eos), and compares per chunk:

* TTFT: client (first chunk − send time) vs simulator (first token − arrival), both in wall seconds;
* ITL: client gap between consecutive chunks vs the simulator's gap between the tokens those chunks end with
  (a chunk may carry several tokens if the client lags, as with vLLM).

Also reports output tokens/s, server and client CPU µs per streamed token (from /proc) and the worst release
lateness. The default client is a lean raw-asyncio one (``--client raw``; aiohttp alone costs more per chunk than
the server's whole budget and shares the 2 cores); ``--client raw aiohttp`` runs both. Server and client are
pinned to different CPUs unless ``--no-pin``. ``KS_SERVER_CMD`` replaces ``-m kernelsight.server`` (e.g. with a
wrapper script that logs GC pauses).
Usage: python benchmarks/stream_fidelity.py [--concurrency 64 128 256] [--output-len 64] [--input-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, steal_s, write_result  # noqa: E402


def cpu_s(pid: int | None) -> float:
    """CPU seconds of a process and every process below it (a supervisor's --api-server-count children)."""
    if pid is None:
        return float("nan")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            todo += [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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


#: SO_TIMESTAMPNS (Linux): every read returns the kernel's receive time of its data as ancillary data
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)


def realtime_offset_s() -> float:
    """CLOCK_REALTIME − perf_counter() (the kernel stamps packets on the realtime clock)."""
    pairs = []
    for _ in range(5):
        a = time.perf_counter()
        r = time.time()
        b = time.perf_counter()
        pairs.append((b - a, r - (a + b) / 2))
    return min(pairs)[1]


class _RawConn:
    """One keep-alive HTTP/1.1 connection of the lean client. A read only timestamps and keeps the bytes (parsing
    happens after the run). The timestamp is the kernel's receive time of the data (``SO_TIMESTAMPNS``) where
    available: with 256 streams a step's chunks arrive within a ms, and reading them one by one takes the client
    several ms, a lag of the measuring client, not of the server."""

    def __init__(self, sock: socket.socket, offset_s: float) -> None:
        self.sock = sock
        self.offset_s = offset_s
        self.kernel_stamps = False
        if SO_TIMESTAMPNS is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.kernel_stamps = True
            except OSError:
                pass
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.pieces: list[tuple[float, bytes]] = []
        self.tail = b""
        self.done: asyncio.Future | None = None
        self.bodiless = False

    async def warm(self, host: str, port: str) -> None:
        """One bodiless round trip (GET /health): the server has accepted and set up this connection."""
        loop = asyncio.get_running_loop()
        self.pieces, self.tail, self.done, self.bodiless = [], b"", loop.create_future(), True
        await loop.sock_sendall(self.sock, f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        await self.done
        self.bodiless = False

    def on_readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 16, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        t = time.perf_counter()
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", raw[:16])
                t = sec + nsec * 1e-9 - self.offset_s
        if not data:
            self._fail(None)
            return
        self.pieces.append((t, data))
        tail = self.tail + data[-7:]
        self.tail = tail[-7:]
        end = b"\r\n\r\n" if self.bodiless else b"\r\n0\r\n\r\n"
        if tail.endswith(end) and self.done is not None and not self.done.done():
            self.done.set_result(None)     # the last chunk of a chunked response (or a bodiless one's headers)

    def _fail(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"server closed the connection: {exc}"))


def parse_raw_response(pieces: list[tuple[float, bytes]]) -> tuple[list[float], list[int]]:
    """(arrival time, tokens) of every token-bearing SSE event in one chunked response: an event's time is
    when the read that completed it returned."""
    raw = b"".join(p for _, p in pieces)
    ends = np.cumsum([len(p) for _, p in pieces])
    head_end = raw.index(b"\r\n\r\n") + 4
    status = raw[:raw.index(b"\r\n")].split()[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {raw[head_end:head_end + 300]!r}")
    times, counts = [], []
    pos = head_end
    buf, buf_ends = b"", []            # de-chunked body, and the raw end offset of each of its events
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        if size == 0:
            break
        start = eol + 2
        payload = raw[start:start + size]
        base = len(buf)
        buf += payload
        j = buf.find(b"\n\n", max(base - 1, 0))      # an event may straddle two HTTP chunks
        while j >= 0:
            buf_ends.append((j + 2, start + j + 1 - base))
            j = buf.find(b"\n\n", j + 2)
        pos = start + size + 2
    prev = 0
    for dend, rend in buf_ends:
        ev = buf[prev:dend - 2]
        prev = dend
        if ev.startswith(b"data: {"):
            d = json.loads(ev[6:])
            if d.get("choices"):
                times.append(float(pieces[int(np.searchsorted(ends, rend, side="right"))][0]))
                counts.append(d["choices"][0]["text"].count(" "))   # each token is " word"
    return times, counts


async def run_level_raw(base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
                        seed: int) -> tuple[list[dict], float]:
    """The lean client: ``concurrency`` keep-alive connections, each running requests back to back."""
    host, port = base_url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(seed)
    next_i = iter(range(num_prompts))
    out: list[dict] = []

    async def worker(proto: _RawConn) -> None:
        try:
            for i in next_i:
                rid = f"c{concurrency}-{i}"
                prompt = rng.integers(1000, 100000, input_len).tolist()
                body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": output_len, "stream": True,
                                   "ignore_eos": True}).encode()
                req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\nX-Request-Id: {rid}\r\n\r\n").encode() + body
                proto.pieces, proto.tail, proto.done = [], b"", loop.create_future()
                t0 = time.perf_counter()
                await loop.sock_sendall(proto.sock, req)
                await proto.done
                out.append({"id": "cmpl-" + rid, "t0": t0, "pieces": proto.pieces})
        finally:
            loop.remove_reader(proto.sock.fileno())
            proto.sock.close()

    # connect every client before the first request (a warm keep-alive pool): otherwise early requests wait while
    # the server accepts the later connections, a start-up transient no simulated timeline can contain
    offset_s = realtime_offset_s()
    conns = [_RawConn(socket.create_connection((host, int(port))), offset_s) for _ in range(concurrency)]
    for proto in conns:
        loop.add_reader(proto.sock.fileno(), proto.on_readable)
    # and warm: a connect returns once the kernel completed the handshake, but the server sets each connection
    # up (~40 µs) only when it gets to accepting it; 256 first requests sent right away would be read late
    await asyncio.gather(*(proto.warm(host, port) for proto in conns))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(proto) for proto in conns))
    wall = time.perf_counter() - t0
    results = []
    for r in out:      # parse after the run: off the measured path
        times, counts = parse_raw_response(r.pop("pieces"))
        results.append({**r, "times": times, "counts": counts})
    return results, wall


RUNNERS = {"raw": run_level_raw, "aiohttp": run_level_aiohttp, "httpx": run_level}


def run_client(client: str, base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
               seed: int) -> tuple[list[dict], float]:
    coro = RUNNERS[client](base_url, concurrency, num_prompts, input_len, output_len, seed)
    # the measuring client must not pause itself: its timestamps and result lists grow through the run, and a
    # cyclic-GC pass over them (tens of ms once they are large) would read as late chunks. Collect after the run.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        if client == "raw":
            try:  # the lean client's event loop: a few µs less per read than asyncio's
                import uvloop
                return uvloop.run(coro)
            except ImportError:
                pass
        return asyncio.run(coro)
    finally:
        gc.enable()
        gc.unfreeze()


def compare(results: list[dict], timings: dict) -> dict:
    d_ttft, d_itl, chunks, tokens = [], [], 0, 0
    admit, late, late_first = [], [], []
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
        if "wall0_s" in rec:     # same monotonic clock: split ΔTTFT into admission delay and delivery lateness
            admit.append(rec["arrival_s"] + rec["wall0_s"] - r["t0"])
            late.extend((ct - vt - rec["wall0_s"]).tolist())
            late_first.append(ct[0] - vt[0] - rec["wall0_s"])
    a_ttft, a_itl = np.abs(d_ttft) * 1e3, np.abs(d_itl) * 1e3
    diag = {}
    if admit:
        diag = {"admit_ms_p50": float(np.percentile(admit, 50) * 1e3),
                "admit_ms_p99": float(np.percentile(admit, 99) * 1e3),
                "chunk_late_ms_p50": float(np.percentile(late, 50) * 1e3),
                "chunk_late_ms_p99": float(np.percentile(late, 99) * 1e3),
                "first_chunk_late_ms_p99": float(np.percentile(late_first, 99) * 1e3)}
    return {"requests": len(d_ttft), "chunks": chunks, "tokens": tokens, **diag,
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
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per level (each reported, with the VM steal during it): on a shared VM the steal "
                         "varies from 0 to >1 s per run, so one run says little")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--bound-ms", type=float, default=2.0, help="p99 |difference| bound")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve flag (repeatable)")
    ap.add_argument("--client", nargs="+", choices=sorted(RUNNERS), default=["raw"],
                    help="measuring client(s), each run at every level: raw = lean asyncio protocol over keep-alive "
                         "HTTP/1.1 (uvloop if installed; measures the server), aiohttp = as vllm bench serve reads "
                         "streams, httpx")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin the server to CPU 0 and the client to CPU 1 (pinned by default on ≥ 2 CPUs)")
    ap.add_argument("--nice", type=int, default=None,
                    help="scheduling priority (nice value) for server and client, e.g. -10 on a shared machine "
                         "(negative values need root)")
    ap.add_argument("--realtime", action="store_true",
                    help="run server and client under SCHED_FIFO (root): on a machine shared with CPU-bound jobs this "
                         "approximates an idle one (the kernel still caps RT tasks at 95%% of a CPU)")
    ap.add_argument("--base-url", default=None,
                    help="measure an already running `kernelsight serve --record-timings --served-model-name m` "
                         "(e.g. one under a profiler) instead of starting one")
    ap.add_argument("--server-pid", type=int, default=None, help="with --base-url: its pid, for the CPU column")
    ap.add_argument("--out", default="stream_fidelity")
    ns = ap.parse_args()

    port = free_port()
    server = os.environ.get("KS_SERVER_CMD", "-m kernelsight.server").split()   # or an instrumented wrapper script
    cmd = [sys.executable, *server, "--host", "127.0.0.1", "--port", str(port), "--model", ns.model,
           "--hardware", ns.hardware, "--max-model-len", "4096", "--record-timings", "--served-model-name",
           "m", "--uvicorn-log-level", "warning", *ns.server_arg]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = ns.pin and len(cpus) >= 2

    def place(cpu: int | None) -> None:
        """Pin this process to ``cpu`` (None: leave it) and apply --nice / --realtime."""
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        if ns.nice is not None:
            os.setpriority(os.PRIO_PROCESS, 0, ns.nice)
        if ns.realtime:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))

    def preexec() -> None:      # the server's threads inherit affinity and priority set before exec
        place(cpus[0] if pin else None)

    if ns.base_url:
        proc, pin, base = None, False, ns.base_url.rstrip("/")
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=preexec)
        base = f"http://127.0.0.1:{port}"
    server_pid = proc.pid if proc is not None else ns.server_pid
    place(cpus[1] if pin else None)
    affinity = f"server on CPU {cpus[0]}, client on CPU {cpus[1]}" if pin else "not pinned"
    if ns.nice is not None:
        affinity += f", nice {ns.nice}"
    if ns.realtime:
        affinity += ", SCHED_FIFO"
    print(f"stream fidelity: client(s) {', '.join(ns.client)}; {affinity}", flush=True)
    rows = []
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc is not None and proc.poll() is not None:
                raise RuntimeError("server exited: " + (proc.stderr.read() if proc.stderr else ""))
            time.sleep(0.1)
        # warm-up (not measured): the server's first requests pay one-off costs (lazy imports, first big prefill)
        run_client(ns.client[0], base, 8, 16, ns.input_len, 8, seed=0)
        for client in ns.client:
            for c, rep in [(c, rep) for c in ns.concurrency for rep in range(ns.repeat)]:
                num = max(int(c * ns.prompts_per_stream), c)
                # the server's worst release lateness is counted from here (per level)
                tim0 = httpx.get(base + "/kernelsight/timings?reset_late=true", timeout=60).json()
                cpu0, ccpu0, st0 = cpu_s(server_pid), time.process_time(), steal_s()
                # fresh prompts every run: a repeat of the same ones would be all prefix-cache hits
                results, wall = run_client(client, base, c, num, ns.input_len, ns.output_len,
                                           seed=c + 100_000 * rep)
                cpu1, ccpu1, st1 = cpu_s(server_pid), time.process_time(), steal_s()
                tim = httpx.get(base + "/kernelsight/timings", timeout=60).json()
                ntok = max(sum(sum(r["counts"]) for r in results), 1)
                row = {"client": client, "concurrency": c, "num_prompts": num, **compare(results, tim["requests"]),
                       "wall_s": wall, "output_tokens_per_s": ntok / wall,
                       "server_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / ntok,
                       "client_cpu_us_per_token": 1e6 * (ccpu1 - ccpu0) / ntok,
                       "server_late_ms_max": tim["late_s_max"] * 1e3, "affinity": affinity,
                       "vm_steal_ms": (st1 - st0) * 1e3,
                       "fast_path_writes": tim.get("fast_writes", 0) - tim0.get("fast_writes", 0),
                       "fast_path_handbacks": tim.get("fast_handbacks", 0) - tim0.get("fast_handbacks", 0)}
                row["within_bound"] = max(row["ttft_abs_diff_ms_p99"], row["itl_abs_diff_ms_p99"]) <= ns.bound_ms
                rows.append(row)
                print(f"  {client} c={c:4d}: p99 |ΔTTFT| {row['ttft_abs_diff_ms_p99']:.2f} ms, p99 |ΔITL| "
                      f"{row['itl_abs_diff_ms_p99']:.2f} ms, {row['output_tokens_per_s']:.0f} tok/s, server "
                      f"{row['server_cpu_us_per_token']:.1f} µs/token; admission p50/p99 "
                      f"{row.get('admit_ms_p50', float('nan')):.2f}/{row.get('admit_ms_p99', float('nan')):.2f} ms, "
                      f"chunk lateness p50/p99 {row.get('chunk_late_ms_p50', float('nan')):.2f}/"
                      f"{row.get('chunk_late_ms_p99', float('nan')):.2f} ms (first chunk p99 "
                      f"{row.get('first_chunk_late_ms_p99', float('nan')):.2f}), client "
                      f"{row['client_cpu_us_per_token']:.1f} µs/token, server late max "
                      f"{row['server_late_ms_max']:.2f} ms, VM steal {row['vm_steal_ms']:.0f} ms, fast-path writes "
                      f"{row['fast_path_writes']} "
                      f"(hand-backs {row['fast_path_handbacks']})", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    cols = [("client", "{}"), ("concurrency", "{:d}"), ("requests", "{:d}"), ("ttft_abs_diff_ms_p50", "{:.2f}"),
            ("ttft_abs_diff_ms_p99", "{:.2f}"), ("itl_abs_diff_ms_p50", "{:.2f}"), ("itl_abs_diff_ms_p99", "{:.2f}"),
            ("tokens_per_chunk", "{:.2f}"), ("output_tokens_per_s", "{:.0f}"), ("server_cpu_us_per_token", "{:.1f}"),
            ("client_cpu_us_per_token", "{:.1f}"), ("vm_steal_ms", "{:.0f}"), ("within_bound", "{}")]
    print(f"\nstream fidelity: {ns.model} on {ns.hardware}, input {ns.input_len}, output {ns.output_len} tokens "
          f"(bound: p99 |Δ| ≤ {ns.bound_ms} ms; {affinity})")
    print(" | ".join(name for name, _ in cols))
    for r in rows:
        print(" | ".join(fmt.format(r[name]) for name, fmt in cols))
    if ns.repeat > 1:
        for client in ns.client:
            for c in ns.concurrency:
                runs = [r for r in rows if r["client"] == client and r["concurrency"] == c]
                worst = sorted(max(r["ttft_abs_diff_ms_p99"], r["itl_abs_diff_ms_p99"]) for r in runs)
                steal = ", ".join(f"{r['vm_steal_ms']:.0f}" for r in runs)
                print(f"{client} c={c}: within bound in {sum(r['within_bound'] for r in runs)} of {len(runs)} runs; "
                      f"max(p99 |ΔTTFT|, p99 |ΔITL|) per run, ascending: {', '.join(f'{w:.2f}' for w in worst)} ms; "
                      f"VM steal per run: {steal} ms")
    best_by_client = {}
    for client in ns.client:
        ok = [r for r in rows if r["within_bound"] and r["client"] == client]
        best = max(ok, key=lambda r: r["concurrency"]) if ok else None
        best_by_client[client] = best["concurrency"] if best else None
        if best:
            print(f"{client}: most concurrent streams within bound: {best['concurrency']} "
                  f"({best['output_tokens_per_s']:.0f} tok/s)")
    path = write_result(ns.out, {"benchmark": "stream_fidelity", "args": vars(ns), "affinity": affinity, "rows": rows,
                                 "max_concurrency_within_bound": best_by_client})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
