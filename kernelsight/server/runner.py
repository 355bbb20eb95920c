"""Run a kernelsight server in a background thread on 127.0.0.1 (tests, benchmarks, notebooks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any


class ServerThread:
    """``with ServerThread(["--max-model-len", "4096"]) as srv: srv.base_url`` — uvicorn on an ephemeral port,
    with its own event loop in a daemon thread; stopped (gracefully) on exit."""

    def __init__(self, argv: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0) -> None:
        from kernelsight.server.launch import build_server_apps
        from kernelsight.server.serve_args import serve_parser

        # in-process: spinning before deadlines would hold the GIL against the client threads
        ns = serve_parser().parse_args(["--deadline-spin-us", "0", *argv])
        apps, self.config = build_server_apps(ns)
        self.app = apps[0]
        self.state = self.app.state.ks
        self.host = host
        self._port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def bridge(self):
        return self.state.bridges[0]

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the server's loop (engine state is only touched there) and return its result."""
        async def run():
            return fn(*args)
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def start(self) -> ServerThread:
        import uvicorn

        from kernelsight.server.engine.fastpath import http_protocol
        from kernelsight.server.launch import ReplicaServer, http_keep_alive_s, uvicorn_shutdown_bound_s

        cfg = uvicorn.Config(self.app, host=self.host, port=self._port, log_level="warning", access_log=False,
                             lifespan="on", timeout_keep_alive=http_keep_alive_s(), http=http_protocol(),
                             timeout_graceful_shutdown=uvicorn_shutdown_bound_s(self.state.opts.shutdown_timeout_s))
        self._server = ReplicaServer(cfg)

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            task = self.loop.create_task(self._server.serve())
            self.loop.run_until_complete(task)
            self.loop.close()

        self._thread = threading.Thread(target=run, name="kernelsight-server", daemon=True)
        self._thread.start()
        for _ in range(600):
            if self._server.started:
                return self
            if not self._thread.is_alive():
                raise RuntimeError("server thread died during startup")
            self._thread.join(0.01)
        raise RuntimeError("server did not start within 6 s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
