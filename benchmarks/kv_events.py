"""KV-cache events under load: N replicas × M closed-loop streams each, with and without --kv-events-config.

For each load level the server runs twice (events off, events on) on the same workload: prompts from a pool of
shared 512-token prefixes plus a unique 64-token suffix, 64 output tokens each (ignore_eos), and a KV cache small
enough that the prefixes evict each other. One ZeroMQ subscriber per replica (in this process, its own thread)
counts batches and events and checks the sequence numbers are gap-free from 0 to the last one published.
Reported per level: output tokens/s, server CPU µs per output token (from /proc, all server threads: the
publisher threads included; the engine loop polls sockets in short naps up to each deadline, so this moves with
the machine's load), the CPU of the server's side threads alone (publisher and ZeroMQ I/O: the events' own
cost, apart from the loop), the events-on/off CPU ratio, events/s received, gaps, and the hypervisor's steal
time during the level. A first section times vLLM's sha256 block hash against the simulator's internal key on
the sim_speed workload's prompts (why the simulation keeps its own key and hashes vLLM's way only for events).

Usage: python benchmarks/kv_events.py [--replicas 2] [--replica-processes 1] [--streams 8,32,64] [--seconds 20]
Writes benchmarks/results/kv_events.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port, steal_s, write_result  # noqa: E402

BS = 16
PREFIX_LEN, SUFFIX_LEN, OUT_LEN = 512, 64, 64






def cpu_s(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def side_threads_cpu_s(pid: int) -> float:
    """CPU of every server thread but the main one (the event loop): with events on, the publisher threads and
    ZeroMQ's I/O thread, i.e. the cost of hashing, encoding and sending, apart from the loop's deadline polling."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) != pid:
            try:
                total += cpu_s(pid, int(tid))
            except (OSError, ValueError):
                pass           # the thread ended
    return total


# -- the hash cost ----------------------------------------------------------------------------------------------
def hash_cost(num_prompts: int = 1000) -> dict:
    from kernelsight.loadgen.datasets import random_dataset
    from kernelsight.server.integrations.kv_events.hashing import hash_block_tokens, hash_function, none_hash
    from kernelsight.simcore.block_hash import BlockHasher

    samples = random_dataset(num_prompts, 1000, 200, 0.1, 128256, seed=0)
    prompts = [np.asarray(s.prompt_token_ids, dtype=np.uint64) for s in samples]
    hasher = BlockHasher(BS)
    t0 = time.perf_counter()
    nblocks = 0
    for p in prompts:
        n = len(p) // BS
        hasher.chain_tokens(0, 0, p[:n * BS])
        nblocks += n
    internal_s = time.perf_counter() - t0
    fn = hash_function("sha256")
    root = none_hash(fn, "0")
    t0 = time.perf_counter()
    for p in prompts:
        parent = root
        ids = p.tolist()
        for i in range(len(ids) // BS):
            parent = hash_block_tokens(fn, parent, ids[i * BS:(i + 1) * BS], None)
    vllm_s = time.perf_counter() - t0
    return {"prompts": num_prompts, "blocks": nblocks, "internal_us_per_block": 1e6 * internal_s / nblocks,
            "vllm_sha256_us_per_block": 1e6 * vllm_s / nblocks,
            "vllm_sha256_s_per_10k_requests": vllm_s * 10_000 / num_prompts,
            "internal_s_per_10k_requests": internal_s * 10_000 / num_prompts}


def pipeline_cost(num_requests: int = 2000, blocks: int = 1500) -> dict:
    """The events path in isolation, in CPU time: the benchmark's workload fast-forwarded through one engine with
    and without recording, then the recorded batches translated to vLLM's hashes and msgpack-encoded, all per
    output token (the server's per-token CPU is the yardstick)."""
    from kernelsight.engine_args import create_engine_config
    from kernelsight.server.integrations.kv_events.translate import HashTranslator
    from kernelsight.server.integrations.kv_events.wire import encode_batch
    from kernelsight.simcore.engine_config import EngineArgs, build_engine

    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=0,
                                          num_gpu_blocks_override=blocks, max_model_len=2048))

    def run(record: bool) -> tuple[float, list]:
        eng = build_engine(cfg, per_token_events=True)
        if record:
            eng.kv.enable_events()
        rng = np.random.default_rng(1)
        prefixes = [rng.integers(1000, 100_000, PREFIX_LEN).tolist() for _ in range(64)]
        for i in range(num_requests):
            p = prefixes[int(rng.integers(64))] + rng.integers(1000, 100_000, SUFFIX_LEN).tolist()
            eng.add_request(f"r{i}", p, OUT_LEN, ignore_eos=True, arrival_s=i * 0.02,
                            output_token_ids=rng.integers(1000, 100_000, OUT_LEN).tolist())
        batches = []
        t0 = time.process_time()
        while eng.step(max_steps=1) is not None:
            if record:
                ev = eng.kv.take_events()
                if ev:
                    batches.append((eng.now_s, ev))
        return time.process_time() - t0, batches

    sim_off, _ = run(False)
    sim_on, batches = run(True)
    t = HashTranslator("sha256", True, seed="0")
    t0 = time.process_time()
    wires = [(ts, t.translate(ev)) for ts, ev in batches]
    translate_s = time.process_time() - t0
    t0 = time.process_time()
    for ts, w in wires:
        if w:
            encode_batch(ts, w, 0)
    encode_s = time.process_time() - t0
    toks = num_requests * OUT_LEN
    return {"output_tokens": toks, "batches": len(batches), "events": sum(len(w) for _, w in wires),
            "blocks_hashed": t.hashed, "hashes_remembered": t.reused,
            "simulate_us_per_token": 1e6 * sim_off / toks, "record_us_per_token": 1e6 * (sim_on - sim_off) / toks,
            "translate_us_per_token": 1e6 * translate_s / toks, "encode_us_per_token": 1e6 * encode_s / toks}


# -- the server under load --------------------------------------------------------------------------------------
class Counter(threading.Thread):
    """One replica's subscriber: batches, events, and whether sequence numbers ran 0, 1, 2, ... without a gap."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.batches = self.events = self.gaps = 0
        self.first_seq = self.last_seq = -1
        self.stop = False

    def run(self) -> None:
        import msgpack
        while not self.stop:
            if not self.sock.poll(100):
                continue
            _, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.first_seq < 0:
                self.first_seq = seq
            elif seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = seq
            self.batches += 1
            self.events += len(msgpack.unpackb(payload)["events"])
        self.sock.close(linger=0)


async def load(urls: list[str], streams: int, seconds: float, seed: int, rate: float = 0.0) -> tuple[int, int]:
    """``streams`` closed-loop clients per replica for ``seconds``; returns (requests, output tokens). With
    ``rate`` > 0 each client also waits its turn (a request every streams/rate s, staggered), so a server that
    keeps up serves the same tokens per second with events on as off and CPU per token compares like for like."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1000, 100_000, PREFIX_LEN).tolist() for _ in range(64)]
    done = [0, 0, 0]
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=streams * len(urls) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        period = streams / rate if rate > 0 else 0.0
        start = time.perf_counter()

        async def client(url: str, k: int) -> None:
            r = np.random.default_rng([seed, k])
            nxt = start + period * (k % 1000) / streams
            while time.perf_counter() < end:
                if period:
                    await asyncio.sleep(max(nxt - time.perf_counter(), 0.0))
                    nxt += period
                prompt = prefixes[int(r.integers(len(prefixes)))] + r.integers(1000, 100_000, SUFFIX_LEN).tolist()
                body = {"model": "m", "prompt": prompt, "max_tokens": OUT_LEN, "ignore_eos": True}
                try:
                    resp = await c.post(url + "/v1/completions", json=body)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    # the server closes a connection idle for 5 s (uvicorn's keep-alive, as vLLM's). A client this
                    # starved of CPU reads a response seconds after it was sent, so the next request on that
                    # connection can go out after the close: the request was never read, so send it again
                    done[2] += 1
                    resp = await c.post(url + "/v1/completions", json=body)
                resp.raise_for_status()
                done[0] += 1
                done[1] += resp.json()["usage"]["completion_tokens"]
        await asyncio.gather(*(client(u, i * 1000 + j) for i, u in enumerate(urls) for j in range(streams)))
    if done[2]:
        print(f"  ({done[2]} request(s) re-sent after the server closed an idle keep-alive connection)", flush=True)
    return done[0], done[1]


def worker_pids(pid: int) -> list[int]:
    """The serving processes under ``kernelsight serve`` PID: its replica workers, or the process itself."""
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        kids = []
    return kids or [pid]


def run_level(replicas: int, streams: int, seconds: float, events: bool, blocks: int, rate: float = 0.0,
              processes: int = 1) -> dict:
    port = free_port()
    while any(free_port() == port + i for i in range(1, replicas)):   # a rough check that the range is free
        port = free_port()
    kv_port = free_port()
    cmd = [sys.executable, "-m", "kernelsight.server", "--host", "127.0.0.1", "--port", str(port),
           # the CPU figures below read each serving process and its threads (the supervisor's share is ~0)
           "--replicas", str(replicas), "--replica-processes", str(processes), "--max-model-len", "2048",
           "--num-gpu-blocks-override", str(blocks),
           "--served-model-name", "m", "--uvicorn-log-level", "warning", "--lateness-warn-ms", "0"]
    if events:
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_port}"})]
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(replicas)]
    counters: list[Counter] = []
    try:
        for u in urls:
            for _ in range(600):
                try:
                    if httpx.get(u + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
        if events:
            counters = [Counter(f"tcp://127.0.0.1:{kv_port + i}") for i in range(replicas)]
            for ctr in counters:
                ctr.start()
            time.sleep(0.5)            # let the subscriptions reach the publishers before the first batch
        asyncio.run(load(urls, 2, 3.0, seed=99))   # warm-up (imports, first allocations), not measured
        pids = worker_pids(proc.pid)

        def cpu_now() -> tuple[float, float]:
            return sum(cpu_s(p) for p in pids), sum(side_threads_cpu_s(p) for p in pids)

        (cpu0, side0), st0, t0 = cpu_now(), steal_s(), time.perf_counter()
        ev0 = [c.events for c in counters]
        reqs, toks = asyncio.run(load(urls, streams, seconds, seed=1, rate=rate))
        wall = time.perf_counter() - t0
        cpu1, side1 = cpu_now()
        cpu, side, st = cpu1 - cpu0, side1 - side0, steal_s() - st0
        time.sleep(1.0)                # the last batches
        evs = [c.events - e for c, e in zip(counters, ev0, strict=True)]
        row = {"replicas": replicas, "processes": len(pids), "streams_per_replica": streams, "rate_per_replica": rate,
               "events": events,
               "requests": reqs,
               "output_tokens": toks, "wall_s": wall, "tok_per_s": toks / wall, "server_cpu_s": cpu,
               "cpu_us_per_token": 1e6 * cpu / max(toks, 1), "side_threads_us_per_token": 1e6 * side / max(toks, 1),
               "steal_s": st}
        if events:
            row.update(events_received=sum(evs), events_per_s=sum(evs) / wall,
                       batches=sum(c.batches for c in counters), gaps=sum(c.gaps for c in counters),
                       first_seq=[c.first_seq for c in counters], last_seq=[c.last_seq for c in counters],
                       missed_batches=sum((c.last_seq + 1) - c.batches for c in counters))
        return row
    except Exception:
        alive = proc.poll() is None
        proc.terminate()
        try:
            err = proc.communicate(timeout=15)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = ""
        print(f"server {'alive' if alive else 'exited'}; its stderr ends:\n{err[-3000:]}", file=sys.stderr)
        raise
    finally:
        for c in counters:
            c.stop = True
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--streams", default="8,32,64", help="streams per replica, one level each")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=0.0,
                    help="requests/s per replica (0: as fast as the streams go); pace below capacity to compare "
                         "CPU per token at equal throughput")
    ap.add_argument("--replica-processes", type=int, default=1,
                    help="serve's --replica-processes (default 1)")
    ap.add_argument("--blocks", type=int, default=1500, help="KV blocks per engine (small: prefixes evict)")
    ap.add_argument("--repeat", type=int, default=2, help="off/on pairs per level, interleaved (the least CPU per "
                                                           "token of each is compared: load from others only adds)")
    ap.add_argument("--skip-hash-cost", action="store_true")
    ns = ap.parse_args()
    out: dict = {}
    if not ns.skip_hash_cost:
        h = hash_cost()
        out["hash_cost"] = h
        print(f"block hash over {h['blocks']:,} prompt blocks: internal key {h['internal_us_per_block']:.2f} µs/block, "
              f"vLLM sha256 {h['vllm_sha256_us_per_block']:.2f} µs/block "
              f"(+{h['vllm_sha256_s_per_10k_requests']:.1f} s on sim_speed's 10,000 requests)", flush=True)
        pc = pipeline_cost()
        out["pipeline"] = pc
        print(f"events path per output token (CPU): simulate {pc['simulate_us_per_token']:.1f} µs, recording "
              f"{pc['record_us_per_token']:+.2f} µs, vLLM hashes {pc['translate_us_per_token']:.2f} µs, msgpack "
              f"{pc['encode_us_per_token']:.2f} µs ({pc['events']:,} events in {pc['batches']:,} batches; "
              f"{pc['blocks_hashed']:,} blocks hashed, {pc['hashes_remembered']:,} remembered)", flush=True)
    rows = []
    print(f"{'N×M':>7} {'events':>6} {'tok/s':>8} {'cpu µs/tok':>10} {'threads':>8} {'on/off':>7} {'events/s':>9} "
          f"{'batches':>8} {'gaps':>5} {'missed':>6} {'steal s':>7}", flush=True)
    summary = []
    for m in [int(x) for x in ns.streams.split(",")]:
        best: dict[bool, float] = {}
        side_on: list[float] = []
        for _ in range(ns.repeat):
            for events in (False, True):
                r = run_level(ns.replicas, m, ns.seconds, events, ns.blocks, ns.rate, ns.replica_processes)
                rows.append(r)
                best[events] = min(best.get(events, float("inf")), r["cpu_us_per_token"])
                if events:
                    side_on.append(r["side_threads_us_per_token"])
                print(f"{ns.replicas}×{m:<4} {'on' if events else 'off':>6} {r['tok_per_s']:8.0f} "
                      f"{r['cpu_us_per_token']:10.1f} {r['side_threads_us_per_token']:8.2f} "
                      f"{r['cpu_us_per_token'] / best[False]:7.3f} "
                      f"{r.get('events_per_s', 0):9.0f} {r.get('batches', 0):8d} {r.get('gaps', 0):5d} "
                      f"{r.get('missed_batches', 0):6d} {r['steal_s']:7.2f}", flush=True)
        side = min(side_on)
        summary.append({"replicas": ns.replicas, "streams_per_replica": m, "best_cpu_us_per_token_off": best[False],
                        "best_cpu_us_per_token_on": best[True], "cost_pct": 100 * (best[True] / best[False] - 1),
                        "publisher_threads_us_per_token": side,
                        "publisher_threads_pct_of_off": 100 * side / best[False]})
        print(f"  {ns.replicas}×{m}: least CPU per token off {best[False]:.1f} µs, on {best[True]:.1f} µs "
              f"({summary[-1]['cost_pct']:+.1f}%); publisher + ZeroMQ threads {side:.2f} µs per token "
              f"({summary[-1]['publisher_threads_pct_of_off']:.1f}% of the off CPU)", flush=True)
    out["levels"] = rows
    out["summary"] = summary
    out["args"] = vars(ns)
    print(f"wrote {write_result('kv_events', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
