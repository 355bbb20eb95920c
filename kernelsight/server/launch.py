"""Running servers: one app per replica from parsed ``serve`` flags, uvicorn servers that share one signal handler,
and the event loop they run on (the serve subcommand and the in-process runner both start servers this way)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from kernelsight.engine_args import create_engine_config, engine_args_from
from kernelsight.server.integrations.kv_transfer import KVTransferConfig
from kernelsight.server.serve_args import server_options_from
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig
from kernelsight.simcore.kv_offload import offload_from_connector


def resolve_serve_config(ns: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed serve arguments, every flag checked (ValueError on a bad one). A supervisor
    resolves it once before forking replica processes, so a bad flag is one line rather than one per process."""
    if ns.model_tag:
        ns.model = ns.model_tag
    if not ns.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {ns.time_scale}")
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:     # vLLM refuses to start the same way
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    config = create_engine_config(offload_engine_args(engine_args_from(ns), ns.kv_transfer_config))
    http_keep_alive_s()                # a bad VLLM_HTTP_TIMEOUT_KEEP_ALIVE is one line at start, not per replica
    server_options_from(ns)            # its own checks (fault types, LoRA modules) before anything is built
    return config


def offload_engine_args(args: EngineArgs, kv_transfer: KVTransferConfig | None) -> EngineArgs:
    """KV offloading named by ``--kv-transfer-config`` (vLLM's OffloadingConnector or LMCacheConnectorV1) as engine
    args. ``--kv-offloading-size`` takes over the connector, as vLLM's does (its size and backend win; the native
    connector keeps the config's block_size and offload_prompt_only)."""
    connector = kv_transfer.kv_connector if kv_transfer is not None else None
    off = offload_from_connector(connector, kv_transfer.kv_connector_extra_config, args.tensor_parallel_size) \
        if connector else None
    if args.kv_offloading_size_gib is not None:
        if connector and off is None:
            raise ValueError(f"--kv-offloading-size with --kv-transfer-config {connector}: vLLM replaces the "
                             "connector by the offloading one (a MultiConnector of both is not modelled)")
        if off is not None and args.kv_offloading_backend == off.backend:
            return dataclasses.replace(args, kv_offloading_block_size=off.block_size,
                                       kv_offloading_prompt_only=off.offload_prompt_only)
        return args
    if off is None:
        return args
    return dataclasses.replace(args, kv_offloading_size_gib=off.size_gib, kv_offloading_backend=off.backend,
                               kv_offloading_block_size=off.block_size,
                               kv_offloading_prompt_only=off.offload_prompt_only)


def build_server_apps(ns: argparse.Namespace, replica_indices: Sequence[int] | None = None,
                      config: EngineConfig | None = None) -> tuple[list[Any], EngineConfig]:
    """(one FastAPI app per replica, engine config) from parsed serve arguments: every replica of --replicas, or
    those of ``replica_indices`` (a worker process's share: replica i is the same server in any process), with
    ``config`` when it was resolved already (``resolve_serve_config``)."""
    from kernelsight.server.app import build_app
    from kernelsight.server.model.tokenizer import load_tokenizer

    if config is None:
        config = resolve_serve_config(ns)
    tok = load_tokenizer(ns.model, ns.tokenizer, config.model.vocab_size)
    opts = server_options_from(ns)
    indices = range(ns.replicas) if replica_indices is None else replica_indices
    apps = [build_app(config, opts, tok, i) for i in indices]
    return apps, config


def event_loop_runner() -> Any:
    """uvloop when installed (uvicorn[standard] brings it; its transports write in C: ~2 µs less per streamed
    chunk than asyncio's, and the engine loop writes hundreds per step at once); asyncio otherwise."""
    if os.environ.get("KERNELSIGHT_EVENT_LOOP", "auto") != "asyncio":
        try:
            import uvloop
            return uvloop.run
        except ImportError:  # pragma: no cover - optional
            pass
    return asyncio.run


#: vLLM's default for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (uvicorn's timeout_keep_alive of its API server)
HTTP_KEEP_ALIVE_S = 5


def http_keep_alive_s() -> int:
    """Seconds an idle keep-alive connection stays open: vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (an int, default
    5), which it hands uvicorn as ``timeout_keep_alive``. A client that reuses a connection idle this long races
    the server's close (``kernelsight bench`` re-sends such a request: ``loadgen/client.py``)."""
    raw = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "").strip()
    if not raw:
        return HTTP_KEEP_ALIVE_S
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number of seconds >= 0, got {raw!r}")
    return value


#: uvicorn's own bound on waiting for connections, beyond --shutdown-timeout: the engines' abort ends every stream
#: within a step or two, so this only matters if a handler hangs; then uvicorn cancels it and the process exits.
SHUTDOWN_GRACE_S = 5.0

log = logging.getLogger("kernelsight.server")


def uvicorn_shutdown_bound_s(shutdown_timeout_s: float) -> float:
    """``timeout_graceful_shutdown`` for uvicorn.Config: the drain, then a grace for the aborted streams' ends."""
    return shutdown_timeout_s + SHUTDOWN_GRACE_S


async def drain_engines(app: Any, timeout_s: float) -> None:
    """vLLM's ``--shutdown-timeout`` policy for one replica, once it stopped accepting connections: let in-flight
    requests finish for up to ``timeout_s`` (0: not at all), then abort the rest. An aborted stream gets its last
    chunk (finish_reason "abort") and [DONE], a waiting non-streaming request its answer so far; a request admitted
    after the abort gets a 503. Its KV blocks are freed either way."""
    bridges = app.state.ks.bridges
    t_end = time.monotonic() + timeout_s
    while any(b.num_unfinished for b in bridges) and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    left = sum(b.num_unfinished for b in bridges)
    if left:
        log.info("shutdown: aborting %d in-flight sequence(s) (--shutdown-timeout %g s)", left, timeout_s)
    for b in bridges:
        await b.stop()


try:
    import uvicorn as _uv

    class ReplicaServer(_uv.Server):
        """Signals are handled once for all replicas (graceful shutdown on SIGTERM/SIGINT); on shutdown the
        engines drain for --shutdown-timeout, then abort (``drain_engines``) while uvicorn closes connections."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.app
            timeout_s = app.state.ks.opts.shutdown_timeout_s
            # uvicorn closes the listeners and idle connections, then waits for the open ones: those end when the
            # drain below finishes or aborts their requests
            drain = asyncio.ensure_future(drain_engines(app, timeout_s))
            try:
                await super().shutdown(sockets)
            finally:
                if not drain.done():
                    drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain
except ImportError:  # pragma: no cover - serve needs the server extra
    ReplicaServer = None  # type: ignore[assignment,misc]


async def serve_all(servers: list[Any], sockets: Sequence[Any] | None = None) -> None:
    """Run the replicas' servers (on their already bound ``sockets``, one each, if given) until a signal stops them
    all, then hand the cyclic GC to the engine loops."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for srv in servers:
            srv.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)
    if sockets is None:
        tasks = [asyncio.ensure_future(srv.serve()) for srv in servers]
    else:
        tasks = [asyncio.ensure_future(srv.serve(sockets=[sock]))
                 for srv, sock in zip(servers, sockets, strict=True)]
    while not all(srv.started for srv in servers) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.02)
    # everything built by now (tokenizer vocab, engine tables, the app, uvicorn and its imports: ~100k objects)
    # lives for the process: keep it out of the cyclic GC, whose full collections would otherwise walk it (a
    # ~100 ms pause, in every stream's p99) while serving
    from kernelsight.server.gc_policy import take_over_gc

    take_over_gc()       # from here the engine loops collect, in the slack before their deadlines
    await asyncio.gather(*tasks)
