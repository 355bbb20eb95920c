"""``serve --api-server-count N``: N API-server processes in front of one engine process, as vLLM runs them.

The parent binds the HTTP listener, then forks the engine process and N API-server processes, and supervises them as
``replica_processes`` does its workers (SIGTERM/SIGINT go on to all; one dying stops the rest).

* The engine process builds the server as one process would (engine, bridge, /metrics, KV events) and serves its whole
  app on a Unix socket, with ``engine.remote.EngineService`` taking the API servers' requests over ZeroMQ (IPC).
* Each API-server process accepts on the shared listener (the kernel spreads connections over them), parses,
  tokenizes and renders its requests, and submits them through ``engine.remote.RemoteBridge``; the engine's own routes
  go to the engine process (``wire.engine_proxy``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from kernelsight.simcore.engine_config import EngineConfig
from kernelsight.simcore.kv_offload import CONNECTORS


def api_server_count_refusal(ns: argparse.Namespace) -> str | None:
    """Why these flags cannot run with --api-server-count > 1 (None: they can)."""
    if ns.replicas > 1:
        return "--api-server-count with --replicas > 1 (start one server per replica instead)"
    if ns.grpc:
        return "--api-server-count with --grpc"
    kv = getattr(ns, "kv_transfer_config", None)
    if kv is not None and kv.kv_connector is not None and kv.kv_connector not in CONNECTORS.values():
        return "--api-server-count with --kv-transfer-config (P/D disaggregation)"   # offloading connectors are fine
    return None


def serve_api_servers(ns: argparse.Namespace, sock: Any, config: EngineConfig) -> int:
    from kernelsight.server.replica_processes import run_replica_processes

    work = tempfile.mkdtemp(prefix="kernelsight-api-")
    uds = os.path.join(work, "engine-http.sock")
    ipc = "ipc://" + os.path.join(work, "engine.ipc")
    print(f"kernelsight serve: {ns.api_server_count} API servers in front of one engine process", file=sys.stderr)
    try:
        roles = [("engine", (ns, config, uds, ipc))]
        roles += [("api", (ns, config, sock, uds, ipc, k)) for k in range(ns.api_server_count)]
        return run_replica_processes(_run_role, roles)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_role(role: str, args: tuple) -> int:
    return run_engine_process(*args) if role == "engine" else run_api_server(*args)


def run_engine_process(ns: argparse.Namespace, config: EngineConfig, uds: str, ipc: str) -> int:
    import uvicorn

    from kernelsight.server.engine.remote import EngineService
    from kernelsight.server.launch import (
        ReplicaServer,
        build_server_apps,
        event_loop_runner,
        serve_all,
        uvicorn_shutdown_bound_s,
    )

    apps, config = build_server_apps(ns, [0], config)
    app = apps[0]
    state = app.state.ks
    bridges = state.bridges

    def state_of() -> dict:
        return {"sleeping": state.sleep.is_sleeping, "closing": any(b.closing for b in bridges),
                "loads": [[b.engine.num_waiting, b.engine.num_running] for b in bridges]}

    service = EngineService(bridges, ipc, state_of, state.metrics)
    cfg = uvicorn.Config(app, uds=uds, log_level=ns.uvicorn_log_level, access_log=False,
                         timeout_graceful_shutdown=uvicorn_shutdown_bound_s(ns.shutdown_timeout))
    server = ReplicaServer(cfg)

    async def main() -> None:
        service.start()
        try:
            await serve_all([server])
        finally:
            await service.stop()

    event_loop_runner()(main())
    return 0


def run_api_server(ns: argparse.Namespace, config: EngineConfig, sock: Any, uds: str, ipc: str, index: int) -> int:
    import uvicorn

    from kernelsight.server.app import build_app
    from kernelsight.server.engine.fastpath import http_protocol
    from kernelsight.server.engine.remote import RemoteBridge
    from kernelsight.server.launch import (
        ReplicaServer,
        event_loop_runner,
        http_keep_alive_s,
        serve_all,
        uvicorn_shutdown_bound_s,
    )
    from kernelsight.server.model.tokenizer import load_tokenizer
    from kernelsight.server.serve_args import server_options_from
    from kernelsight.server.wire.engine_proxy import EngineProxy

    tok = load_tokenizer(ns.model, ns.tokenizer, config.model.vocab_size)
    opts = server_options_from(ns)
    # one remote bridge per data-parallel rank this server balances over (--data-parallel-rank: its one)
    ranks = [config.args.data_parallel_rank] if config.args.data_parallel_rank is not None \
        else range(opts.data_parallel_size)
    remotes = [RemoteBridge(tok, ipc, f"api-{index}-rank{r}".encode(), rank=i) for i, r in enumerate(ranks)]
    app = EngineProxy(build_app(config, opts, tok, 0, remote=remotes), uds)
    host = ns.host or "0.0.0.0"
    cfg = uvicorn.Config(app, log_level=ns.uvicorn_log_level, timeout_keep_alive=http_keep_alive_s(),
                         access_log=False, http=http_protocol(),
                         timeout_graceful_shutdown=uvicorn_shutdown_bound_s(ns.shutdown_timeout))
    print(f"Starting vLLM API server {index} on http://{host}:{ns.port}", file=sys.stderr)
    event_loop_runner()(serve_all([ReplicaServer(cfg)], [sock]))
    return 0
