"""``kernelsight serve --grpc``: vLLM's gRPC launch (``vllm serve --grpc``, ``python -m
vllm.entrypoints.grpc_server``) over kernelsight's engines.

As vLLM: the ``VllmEngine`` service listens on ``--host:--port`` (replica i of ``--replicas`` on ``--port + i``),
with vLLM's server options (unbounded message sizes, client keepalive pings tolerated every 10 s); SIGTERM/SIGINT
stop it after ``--shutdown-timeout`` of draining (what is still in flight then ends with finish_reason "abort").
Beside it, on the same event loop and engines, the HTTP app keeps ``/metrics``, ``/health`` and the rest of the API
reachable on ``--grpc-http-port`` (default: the port after the gRPC ones; 0: none)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from kernelsight.server.launch import SHUTDOWN_GRACE_S, drain_engines
from kernelsight.server.wire.grpc.servicer import VllmEngineServicer

#: vLLM's gRPC server options (vllm/entrypoints/grpc_server.py)
GRPC_SERVER_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
)


def build_grpc_server(app: Any, host: str, port: int, notify_address: tuple[str, int] | None = None,
                      start_unix_s: float | None = None) -> tuple[Any, VllmEngineServicer, int]:
    """(grpc.aio server, its servicer, the bound port) serving ``app``'s engines; call on the loop that runs them.
    ValueError with one line when the address cannot be bound."""
    server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS))
    servicer = VllmEngineServicer(app.state.ks, start_unix_s, notify_address)
    pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError as exc:
        raise ValueError(f"cannot listen on {where} (gRPC): {exc}") from None
    if not bound:
        raise ValueError(f"cannot listen on {where} (gRPC): address in use or not this machine's")
    return server, servicer, bound


def http_port_of(ns: argparse.Namespace) -> int:
    """The HTTP app's first port beside the gRPC service: --grpc-http-port, else the one after the gRPC ports."""
    return ns.port + ns.replicas if ns.grpc_http_port is None else ns.grpc_http_port


def cmd_serve_grpc(ns: argparse.Namespace) -> int:
    """``serve --grpc``: every replica in this process (gRPC and HTTP front ends on one loop per process)."""
    from kernelsight.server.launch import build_server_apps, event_loop_runner
    from kernelsight.server.listeners import bind_listeners

    if ns.replica_processes != 1:
        raise ValueError("--grpc serves its --replicas in one process: leave out --replica-processes")
    host = ns.host or "0.0.0.0"
    http_port = http_port_of(ns)
    for sock in bind_listeners(host, ns.port, ns.replicas):    # a taken gRPC port is one line before any build
        sock.close()
    socks = bind_listeners(host, http_port, ns.replicas) if http_port else []
    try:
        apps, config = build_server_apps(ns)
        s = config.summary()
        print(f"kernelsight serve: {s['model']} on {s['hardware']} (TP {s['tensor_parallel_size']}), time scale "
              f"{ns.time_scale:g}; tokenizer: {apps[0].state.ks.tok.source.kind}", file=sys.stderr)
        event_loop_runner()(serve_grpc_replicas(ns, apps, host, socks, http_port))
    finally:
        for sock in socks:
            sock.close()
    return 0


async def serve_grpc_replicas(ns: argparse.Namespace, apps: list[Any], host: str, socks: list[Any],
                              http_port: int) -> None:
    """Serve until SIGTERM/SIGINT: the gRPC servers, the HTTP servers (when ``socks``), then the drain."""
    import uvicorn

    from kernelsight.server.engine.fastpath import http_protocol
    from kernelsight.server.gc_policy import take_over_gc
    from kernelsight.server.launch import ReplicaServer, http_keep_alive_s, uvicorn_shutdown_bound_s

    start_unix_s = time.time()
    grpc_servers = []
    for i, app in enumerate(apps):
        notify = (host if host not in ("0.0.0.0", "::") else "127.0.0.1", http_port + i) if socks else None
        server, _, port = build_grpc_server(app, host, ns.port + i, notify, start_unix_s)
        grpc_servers.append(server)
        print(f"Starting vLLM gRPC server {i} on {host}:{port}", file=sys.stderr)
    http_servers = []
    for i, app in enumerate(apps[:len(socks)]):
        cfg = uvicorn.Config(app, host=host, port=http_port + i, log_level=ns.uvicorn_log_level,
                             timeout_keep_alive=http_keep_alive_s(), access_log=False, http=http_protocol(),
                             timeout_graceful_shutdown=uvicorn_shutdown_bound_s(ns.shutdown_timeout))
        http_servers.append(ReplicaServer(cfg))
        print(f"Starting vLLM API server {i} (HTTP: /metrics, /health) on http://{host}:{http_port + i}",
              file=sys.stderr)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    http_tasks = [asyncio.ensure_future(srv.serve(sockets=[sock])) for srv, sock in zip(http_servers, socks,
                                                                                         strict=True)]
    while not all(srv.started for srv in http_servers) and not any(t.done() for t in http_tasks):
        await asyncio.sleep(0.02)
    for app in apps:             # without HTTP no lifespan starts them (starting twice is a no-op)
        for b in app.state.ks.bridges:
            b.start()
    for server in grpc_servers:
        await server.start()
    print("Server is ready to accept requests", file=sys.stderr)
    take_over_gc()
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, *http_tasks], return_when=asyncio.FIRST_COMPLETED)
    # vLLM's shutdown: no new RPCs, in-flight ones drain for --shutdown-timeout, then the engines abort the rest
    grace_s = ns.shutdown_timeout + SHUTDOWN_GRACE_S
    await asyncio.gather(*(s.stop(grace_s) for s in grpc_servers),
                         *(drain_engines(app, ns.shutdown_timeout) for app in apps))
    for srv in http_servers:
        srv.should_exit = True
    await asyncio.gather(*http_tasks, return_exceptions=True)
    stopped.cancel()
