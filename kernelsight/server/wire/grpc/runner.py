"""A kernelsight server with its gRPC service, in a background thread on 127.0.0.1 (tests, benchmarks): the HTTP
app (``server.runner.ServerThread``) and the ``VllmEngine`` service on the same event loop, so both front ends
drive the same engine bridges."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kernelsight.server.runner import ServerThread
from kernelsight.server.wire.grpc.launch import build_grpc_server


class GrpcServerThread(ServerThread):
    """``with GrpcServerThread(["--seed", "0"]) as srv: srv.grpc_target`` — HTTP on ``srv.base_url``, gRPC on
    ``srv.grpc_target`` (both ephemeral ports), one engine."""

    def __init__(self, argv: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(argv, host, port)
        self.grpc_server: Any = None
        self.grpc_port = 0
        self.servicer: Any = None

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def start(self) -> GrpcServerThread:
        super().start()
        assert self.loop is not None

        async def start_grpc() -> None:
            server, servicer, port = build_grpc_server(self.app, self.host, 0, notify_address=(self.host, self.port))
            await server.start()
            self.grpc_server, self.servicer, self.grpc_port = server, servicer, port

        asyncio.run_coroutine_threadsafe(start_grpc(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self.grpc_server is not None and self.loop is not None and not self.loop.is_closed():
            fut = asyncio.run_coroutine_threadsafe(self.grpc_server.stop(0), self.loop)
            fut.result(timeout=10)
            self.grpc_server = None
        super().stop()

    def __enter__(self) -> GrpcServerThread:
        return self.start()
