"""Graceful shutdown of ``kernelsight serve`` (a subprocess): SIGTERM with streams open. As vLLM's
``--shutdown-timeout``: 0 (the default) aborts in-flight requests at once, N lets them finish for up to N s. Either
way the process exits 0 within a bound, no new connection is accepted, and every stream ends cleanly: whole SSE
events, the last one ``data: [DONE]``, never a half-written line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

MODEL = "meta-llama/Llama-3.1-8B"
EXIT_BOUND_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kernelsight.server", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "4096", "--seed", "0", "--num-gpu-blocks-override", "2000", "--uvicorn-log-level",
           "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    t_end = time.monotonic() + 120     # a shared, loaded 2-core machine starts slowly
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not come up in 120 s")


def parse_events(raw: bytes) -> list[dict | str]:
    """Whole SSE events or an assertion: every event a complete ``data: ...`` line, the last ``[DONE]``."""
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), f"stream not ended cleanly: {text[-300:]!r}"
    events: list[dict | str] = []
    for ev in text.split("\n\n")[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, f"half-written or foreign event: {ev[:200]!r}"
        payload = ev[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def open_stream(c: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> bytes:
    body = {"model": MODEL, "prompt": "shut me down gently", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    chunks = []
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for b in r.aiter_raw():
                chunks.append(b)
                started.set()
    except httpx.RemoteProtocolError as exc:      # the connection dropped mid-response: not a clean end
        raise AssertionError(f"stream cut: {exc}; got {b''.join(chunks)[-200:]!r}") from exc
    return b"".join(chunks)


async def sigterm_with_streams(proc: subprocess.Popen, port: int, n: int, max_tokens: int) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30, limits=limits) as c:
        started = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.create_task(open_stream(c, max_tokens, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)    # every stream has chunks
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        bodies = await asyncio.gather(*tasks)
    rc = await asyncio.to_thread(proc.wait, EXIT_BOUND_S)
    elapsed = time.monotonic() - t0
    assert rc == 0, proc.stderr.read().decode()[-2000:]
    return bodies, elapsed


#: a MoE model's DP2+EP group (its ranks stepped by one lockstep loop), answering to MODEL's name
MOE_LOCKSTEP = ["--model", "Qwen/Qwen3-30B-A3B-Instruct-2507", "--hardware", "rtx-pro-6000", "-dp", "2",
                "--enable-expert-parallel", "--served-model-name", MODEL]


@pytest.mark.parametrize("extra", [[], MOE_LOCKSTEP], ids=["one-engine", "moe-dp2-lockstep"])
def test_sigterm_aborts_open_streams_at_once(extra):
    """Default --shutdown-timeout 0: streams of 3,000 tokens (~20 s of simulated H100 time) end within the bound,
    each with its tokens so far, a last chunk with finish_reason "abort", and [DONE]; the port is closed after."""
    port = free_port()
    proc = start_server(port, *extra)
    try:
        bodies, elapsed = asyncio.run(sigterm_with_streams(proc, port, n=6, max_tokens=3000))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < EXIT_BOUND_S
    for raw in bodies:
        events = parse_events(raw)
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        assert all("error" not in ch for ch in chunks)
        reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
        assert reasons[-1] == "abort" and set(reasons[:-1]) <= {None}
        assert len(chunks) < 3000, "the stream ran to its end: SIGTERM did not abort it"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.slow
def test_sigterm_with_shutdown_timeout_lets_streams_finish():
    """--shutdown-timeout 20: streams that need ~1.5 s more finish whole (finish_reason "length", every token)."""
    port = free_port()
    proc = start_server(port, "--shutdown-timeout", "20", "--time-scale", "1")
    try:
        bodies, elapsed = asyncio.run(sigterm_with_streams(proc, port, n=4, max_tokens=150))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < EXIT_BOUND_S
    for raw in bodies:
        chunks = [e for e in parse_events(raw)[:-1] if isinstance(e, dict)]
        assert len(chunks) == 150
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_request_after_the_abort_gets_503():
    """A request admitted once the engines stopped (shutdown's abort) gets vLLM's 503 in its error shape, not a
    wait on an engine that never steps again."""
    from kernelsight.server.runner import ServerThread

    with ServerThread(["--max-model-len", "512", "--seed", "0"]) as s:
        assert s.loop is not None
        asyncio.run_coroutine_threadsafe(s.bridge.stop(), s.loop).result(timeout=10)
        for body in ({"prompt": "late", "max_tokens": 4}, {"prompt": "late", "max_tokens": 4, "stream": True}):
            r = httpx.post(s.base_url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 503
            assert r.json() == {"error": {"message": "The server is shutting down and cannot accept new requests.",
                                          "type": "Service Unavailable", "param": None, "code": 503}}
