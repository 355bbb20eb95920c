"""The reliability suite at full size against ``kernelsight serve`` subprocesses, as one table (issue #27):

- fuzz: every route of the server's OpenAPI schema (tests/test_fuzz.py's schemathesis run, --fuzz-examples cases
  per route and mode): no 5xx, every 4xx in vLLM's error shape;
- storm: 1,000 streams dropped after 1-5 chunks while 32 others run: the 32 finish intact;
- overload: 2,000 concurrent requests against --max-num-seqs 256: each completes or gets vLLM's error;
- shutdown: SIGTERM with 16 streams open: exit 0 within 10 s, every stream ended by [DONE];
- soak: benchmarks/soak.py's mixed load for --soak-s;
- 256 streams (256 prompt tokens, 200 out) at time scale 1, quiet and again beside a CPU hog busy on one core:
  release lateness from /metrics and the server's CPU per delivered token (/proc/PID/stat utime+stime).

After every case the engine must be idle (running = waiting = 0, KV usage 0 in /metrics): else "leaked".
Writes benchmarks/results/reliability.json. Takes ~10 min on 2 shared cores.

    python benchmarks/reliability.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import steal_s, write_result  # noqa: E402
from _server_proc import (  # noqa: E402
    MODEL,
    ServerProc,
    cpu_s,
    generation_tokens,
    lateness_quantiles,
    leaked,
    scrape,
    wait_idle,
)
from soak import soak  # noqa: E402

SERVER_ARGS = ["--max-model-len", "2048", "--seed", "0", "--max-num-seqs", "256"]


def row(case: str, tried: int, n5xx: int, errors: int, idle: dict | None, **extra: Any) -> dict[str, Any]:
    return {"case": case, "tried": tried, "5xx": n5xx, "errors": errors,
            "leaked": None if idle is None else leaked(idle), **extra}


# -- fuzz ------------------------------------------------------------------------------------------------------
def case_fuzz(srv: ServerProc, examples: int) -> dict[str, Any]:
    from test_fuzz import fuzz_all
    err = None
    try:
        total = fuzz_all(srv.base_url, examples)
    except AssertionError as exc:        # the first bad answer stops the run: report it
        total, err = {"cases": 0, "5xx": 1}, str(exc)[:300]
    return row("fuzz (schemathesis)", total["cases"], total.get("5xx", 0), int(err is not None),
               wait_idle(srv.base_url), detail=err or f"{total.get('2xx', 0)} 2xx, {total.get('4xx', 0)} 4xx")


# -- disconnect storm ------------------------------------------------------------------------------------------
async def _storm(base_url: str, n_bad: int, n_good: int) -> tuple[int, int, int]:
    rng = random.Random(0)
    good_body = {"model": MODEL, "prompt": "a healthy stream", "max_tokens": 48, "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    errors = n5xx = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0), limits=limits) as c:
        sem = asyncio.Semaphore(100)

        async def bad(i: int) -> None:
            nonlocal errors, n5xx
            body = {"model": MODEL, "prompt": f"doomed stream {i} " * rng.randint(1, 40), "max_tokens": 1500,
                    "ignore_eos": True, "stream": True}
            stop_after, seen = rng.randint(1, 5), 0
            async with sem:
                try:
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        n5xx += r.status_code >= 500
                        async for b in r.aiter_raw():
                            seen += b.count(b"data: ")
                            if seen >= stop_after:
                                break
                except httpx.HTTPError:
                    errors += 1

        async def good() -> bool:
            async with c.stream("POST", "/v1/completions", json=good_body) as r:
                raw = b"".join([b async for b in r.aiter_raw()]).decode()
            events = raw.split("\n\n")[:-1]
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            return (r.status_code == 200 and events[-1] == "data: [DONE]" and len(chunks) == 48
                    and chunks[-1]["choices"][0]["finish_reason"] == "length")

        bad_tasks = [asyncio.create_task(bad(i)) for i in range(n_bad)]
        intact = await asyncio.gather(*(good() for _ in range(n_good)))
        await asyncio.gather(*bad_tasks)
    return sum(intact), errors, n5xx


def case_storm(srv: ServerProc, n_bad: int = 1000, n_good: int = 32) -> dict[str, Any]:
    gen0 = generation_tokens(scrape(srv.base_url))
    intact, errors, n5xx = asyncio.run(_storm(srv.base_url, n_bad, n_good))
    idle = wait_idle(srv.base_url)
    generated = generation_tokens(scrape(srv.base_url)) - gen0
    return row(f"disconnect storm ({n_bad} dropped + {n_good})", n_bad + n_good, n5xx, errors + n_good - intact,
               idle, detail=f"{intact}/{n_good} healthy intact; {generated:.0f} tokens generated "
                            f"(run to the end the dropped ones would make {n_bad * 1500:,})")


# -- overload --------------------------------------------------------------------------------------------------
async def _overload(base_url: str, n: int) -> tuple[int, int, int, int]:
    ok = vllm_err = n5xx = other = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one() -> None:
            nonlocal ok, vllm_err, n5xx, other
            try:
                async with s.post("/v1/completions", json={"model": MODEL, "prompt": "overload me", "max_tokens": 16,
                                                           "ignore_eos": True}) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200 and body["usage"]["completion_tokens"] == 16:
                        ok += 1
                    elif r.status >= 500:
                        n5xx += 1
                    elif "error" in body and body["error"].get("code") == r.status:
                        vllm_err += 1
                    else:
                        other += 1
            except (TimeoutError, aiohttp.ClientError):
                other += 1
        await asyncio.gather(*(one() for _ in range(n)))
    return ok, vllm_err, n5xx, other


def case_overload(srv: ServerProc, n: int = 2000) -> dict[str, Any]:
    ok, vllm_err, n5xx, other = asyncio.run(_overload(srv.base_url, n))
    return row(f"overload ({n:,} at once, max-num-seqs 256)", n, n5xx, other, wait_idle(srv.base_url),
               detail=f"{ok} completed, {vllm_err} vLLM errors")


# -- shutdown --------------------------------------------------------------------------------------------------
async def _shutdown(srv: ServerProc, n: int) -> tuple[int, float, int | None]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    clean = 0
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=30, limits=limits) as c:
        started = [asyncio.Event() for _ in range(n)]

        async def stream(ev: asyncio.Event) -> bool:
            # 1,500 tokens: ~10 s of simulated H100 time, far from done when the signal comes
            body = {"model": MODEL, "prompt": "shut down", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            buf = b""
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        ev.set()
                        return False
                    async for b in r.aiter_raw():
                        buf += b
                        ev.set()
            except httpx.HTTPError:
                return False
            text = buf.decode()
            events = text.split("\n\n")[:-1]
            return (text.endswith("data: [DONE]\n\n") and all(e.startswith("data: ") for e in events)
                    and '"finish_reason":"abort"' in events[-2])

        tasks = [asyncio.create_task(stream(e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        t0 = time.monotonic()
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        clean = sum(await asyncio.gather(*tasks))
    try:
        rc = await asyncio.to_thread(srv.proc.wait, 30)
    except subprocess.TimeoutExpired:
        rc = None
    return clean, time.monotonic() - t0, rc


def case_shutdown(n: int = 16) -> dict[str, Any]:
    srv = ServerProc(SERVER_ARGS).start()
    try:
        clean, exit_s, rc = asyncio.run(_shutdown(srv, n))
    finally:
        srv.stop()
    return row(f"SIGTERM with {n} streams open", n, 0, (n - clean) + int(rc != 0 or exit_s > 10), None,
               detail=f"exit code {rc} after {exit_s:.2f} s; {clean}/{n} streams ended cleanly by [DONE]")


# -- 256 streams, quiet and under a CPU hog ----------------------------------------------------------------------
async def _streams(base_url: str, n: int, in_len: int, out_len: int) -> tuple[int, int]:
    tokens = errors = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one(i: int) -> None:
            nonlocal tokens, errors
            rng = random.Random(i)
            body = {"model": MODEL, "prompt": [rng.randrange(1000, 100_000) for _ in range(in_len)],
                    "max_tokens": out_len, "ignore_eos": True, "stream": True}
            got, buf = 0, b""
            try:
                async with s.post("/v1/completions", json=body) as r:
                    async for b in r.content.iter_any():
                        buf += b
                got = buf.count(b'"text":')
                errors += not buf.endswith(b"data: [DONE]\n\n") or got != out_len
            except aiohttp.ClientError:
                errors += 1
            tokens += got
        await asyncio.gather(*(one(i) for i in range(n)))
    return tokens, errors


def case_streams(srv: ServerProc, label: str, n: int = 256, in_len: int = 256, out_len: int = 200) -> dict[str, Any]:
    before, cpu0, st0, t0 = scrape(srv.base_url), cpu_s(srv.pid), steal_s(), time.monotonic()
    tokens, errors = asyncio.run(_streams(srv.base_url, n, in_len, out_len))
    cpu1, st1, wall = cpu_s(srv.pid), steal_s(), time.monotonic() - t0
    late = lateness_quantiles(before, scrape(srv.base_url))
    return row(f"{n} streams {in_len} in / {out_len} out, {label}", n, 0, errors, wait_idle(srv.base_url),
               lateness_p50_ms=late["p50_ms"], lateness_p99_ms=late["p99_ms"],
               cpu_us_per_token=1e6 * (cpu1 - cpu0) / max(tokens, 1), tokens=tokens, wall_s=wall,
               vm_steal_s=st1 - st0)


def start_hog(cpu: int) -> subprocess.Popen:
    """A process spinning on one core (pinned to ``cpu``), the other left to the server and the client."""
    def pin() -> None:
        os.sched_setaffinity(0, {cpu})
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)


# -- report ----------------------------------------------------------------------------------------------------
def fmt(v: Any, spec: str = "{}") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return spec.format(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'case':48s} {'tried':>6s} {'5xx':>4s} {'errors':>6s} {'leaked':>6s} {'RSS grow':>8s} "
            f"{'late p50':>8s} {'late p99':>8s} {'CPU/tok':>8s}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['case'][:48]:48s} {r['tried']:6d} {r['5xx']:4d} {r['errors']:6d} {fmt(r['leaked']):>6s} "
              f"{fmt(r.get('rss_growth_pct'), '{:+.1f}%'):>8s} {fmt(r.get('lateness_p50_ms'), '{:.1f}ms'):>8s} "
              f"{fmt(r.get('lateness_p99_ms'), '{:.1f}ms'):>8s} {fmt(r.get('cpu_us_per_token'), '{:.0f}us'):>8s}")
    for r in rows:
        if r.get("detail"):
            print(f"  {r['case']}: {r['detail']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz-examples", type=int, default=100, help="cases per route and mode (default: 100)")
    ap.add_argument("--soak-s", type=float, default=120.0, help="the short soak's length (default: 120 s)")
    ap.add_argument("--hog-cpu", type=int, default=0, help="the core the CPU hog spins on (default: 0)")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    st0, t0 = steal_s(), time.monotonic()
    with ServerProc(SERVER_ARGS) as srv:
        print(f"server pid {srv.pid} at {srv.base_url}", flush=True)
        for name, fn in (("256-quiet", lambda: case_streams(srv, "quiet")),
                         ("256-hog", None),
                         ("fuzz", lambda: case_fuzz(srv, a.fuzz_examples)),
                         ("storm", lambda: case_storm(srv)),
                         ("overload", lambda: case_overload(srv))):
            if name == "256-hog":
                hog = start_hog(a.hog_cpu)
                try:
                    time.sleep(1.0)           # the hog is spinning before the run starts
                    rows.append(case_streams(srv, f"CPU hog on core {a.hog_cpu}"))
                finally:
                    hog.kill()
                    hog.wait()
                quiet, hogged = rows[-2]["cpu_us_per_token"], rows[-1]["cpu_us_per_token"]
                rows[-1]["cpu_per_token_hog_over_quiet"] = hogged / quiet
                rows[-1]["detail"] = (f"CPU per token {hogged:.0f} us vs {quiet:.0f} us quiet: "
                                      f"{hogged / quiet:.2f}x (bound 2x)")
            else:
                assert fn is not None
                rows.append(fn())
            print(f"  done: {rows[-1]['case']}", flush=True)
        rep = asyncio.run(soak(srv, a.soak_s, 15.0, 16, echo=False))
        late = [v for v in rep["lateness_p99_ms_by_interval"] if v is not None]
        rows.append(row(f"soak {a.soak_s:.0f} s (mixed load, 16 clients)", sum(rep["actions"].values()), 0,
                        rep["errors"], rep["idle_gauges_after"], rss_growth_pct=rep["rss_growth_pct"],
                        lateness_p99_ms=max(late) if late else None,
                        detail=f"open fds {rep['fd_growth_pct']:+.1f}% after warm-up; lateness p99 per 15 s "
                               f"interval {', '.join(f'{v:.0f}' for v in late)} ms"))
    rows.append(case_shutdown())
    steal = steal_s() - st0
    print()
    print_table(rows)
    print(f"\nwall {time.monotonic() - t0:.0f} s, VM steal {steal:.1f} s over the run ({os.cpu_count()} CPUs)")
    path = write_result("reliability", {"rows": rows, "vm_steal_s": steal, "soak": rep})
    print(f"wrote {path}")
    bad = any(r["5xx"] or r["errors"] or r["leaked"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
