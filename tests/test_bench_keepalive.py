"""The keep-alive race between ``kernelsight bench`` and the server, driven to its boundary through real sockets.

vLLM's API server (and ``kernelsight serve``, as vLLM) closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``
seconds (5); ``vllm bench serve``'s aiohttp pool (and ours) keeps idle connections 60 s. A client whose event loop
is starved of CPU across the server's close does not yet know of the FIN when it takes the pooled connection, so
its next request goes out on a connection the server has closed: the server never reads it, and the client sees
a disconnect before any byte of a response. Here the client's loop is held (a blocking ``select`` on the pooled
socket, as a CPU-starved process would be held) until the FIN is in its socket, so the race is taken every time."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import stat
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")

from kernelsight.loadgen.client import (  # noqa: E402
    ClientStats,
    RequestSpec,
    bench_session,
    completions_payload,
    send_streaming_request,
)
from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"


def _spec(base_url: str, salt: int) -> RequestSpec:
    prompt = [1000 + 97 * salt + i for i in range(24)]
    return RequestSpec(base_url + "/v1/completions", completions_payload(MODEL, prompt, 4, True), {}, 24, False)


def _client_sockets_to(port: int) -> list[int]:
    """File descriptors of this process's TCP sockets connected to ``port`` (the client side: the server runs in a
    thread here, its own sockets have ``port`` as their local port)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue
        s = socket.socket(fileno=fd)
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                fds.append(fd)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            s.detach()
    return fds


def _wait_for_fin(sock: socket.socket, timeout_s: float) -> None:
    """Block this thread (and so the client's event loop) until the server's FIN is in ``sock``: the loop has not
    seen it, exactly as a starved client would not have."""
    readable, _, _ = select.select([sock], [], [], timeout_s)
    assert readable, "the server did not close the idle connection"
    assert sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"", "readable with data, not with the FIN"


async def _reuse_after_server_close(base_url: str, stats: ClientStats):
    async with bench_session(max_concurrency=1) as session:
        async with session.get(base_url + "/health") as resp:        # opens the connection the pool keeps
            assert resp.status == 200
            await resp.read()
        [fd] = _client_sockets_to(int(base_url.rsplit(":", 1)[1]))
        sock = socket.socket(fileno=fd)                               # a view of the pooled socket, not closed here
        try:
            _wait_for_fin(sock, timeout_s=30)
        finally:
            sock.detach()
        t0 = time.perf_counter()
        rec = await send_streaming_request(session, _spec(base_url, 1), bench_start_s=t0, queue_s=0.0, stats=stats)
        again = await send_streaming_request(session, _spec(base_url, 2), bench_start_s=t0, queue_s=0.0, stats=stats)
        return rec, again


def test_a_request_on_a_connection_the_server_closed_idle_is_sent_again(monkeypatch):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "1")      # vLLM's variable: the boundary in 1 s, not 5
    with ServerThread(["--max-model-len", "2048", "--time-scale", "50", "--uvicorn-log-level", "warning"]) as srv:
        stats = ClientStats()
        rec, again = asyncio.run(asyncio.wait_for(_reuse_after_server_close(srv.base_url, stats), timeout=60))
        served = _served(srv.base_url)
    assert rec.success, rec.error
    assert (rec.prompt_len, rec.output_len) == (24, 4)
    assert again.success, again.error
    assert stats.resent == 1                 # the one request that met the closed connection, counted
    # the server never read the lost attempt: two requests, each counted once
    assert served == {"vllm:request_success_total": 2.0, "vllm:prompt_tokens_total": 48.0}


def _served(base_url: str) -> dict[str, float]:
    import httpx

    want = {"vllm:request_success_total": 0.0, "vllm:prompt_tokens_total": 0.0}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            want[name] += float(line.rsplit(" ", 1)[1])
    return want


def test_keep_alive_is_vllms_variable_with_its_default(monkeypatch):
    from kernelsight.server.launch import http_keep_alive_s

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert http_keep_alive_s() == 5
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "300")
    assert http_keep_alive_s() == 300
    for bad in ("1.5", "-1", "soon"):          # vLLM reads it with int(): a fraction is refused there too
        monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", bad)
        with pytest.raises(ValueError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number"):
            http_keep_alive_s()


async def _closing_server_run() -> tuple:
    """A server that reads each request's head and closes the connection without a byte of answer (as one that
    crashed would): on a new connection, that is a failed request, not one to send again."""
    heads = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stats = ClientStats()
    try:
        async with bench_session(max_concurrency=1) as session:
            rec = await send_streaming_request(session, _spec(f"http://127.0.0.1:{port}", 3),
                                               bench_start_s=time.perf_counter(), queue_s=0.0, stats=stats)
    finally:
        server.close()
        await server.wait_closed()
    return rec, stats, heads


def test_a_disconnect_on_a_new_connection_stays_a_failed_request():
    rec, stats, heads = asyncio.run(asyncio.wait_for(_closing_server_run(), timeout=30))
    assert not rec.success and rec.error.startswith("ServerDisconnectedError"), rec.error
    assert stats.resent == 0
    assert len(heads) == 1 and heads[0].startswith(b"POST /v1/completions ")      # sent once
