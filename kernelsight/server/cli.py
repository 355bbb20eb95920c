"""``kernelsight serve``: the subcommand (``add_serve_parser`` attaches it to the main CLI). Its flags live in
``serve_args.py``, the servers it starts in ``launch.py``."""

from __future__ import annotations

import argparse
import logging
import sys

from kernelsight.profiles.accuracy import describe_expected_error
from kernelsight.server.serve_args import SERVE_DESCRIPTION, SERVE_HELP, add_serve_args, ignored_flags
from kernelsight.simcore.engine_config import EngineConfig


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(ns: argparse.Namespace) -> int:
    from kernelsight.server.launch import resolve_serve_config
    from kernelsight.server.listeners import bind_listeners
    from kernelsight.server.replica_processes import replica_groups, run_replica_processes

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    ignored = ignored_flags(ns)
    if ignored:
        print(f"kernelsight serve: accepted with no effect in a simulation: {', '.join(ignored)}", file=sys.stderr)
    if ns.grpc:      # vLLM's gRPC front end (server/wire/grpc/launch.py), its HTTP app beside it
        from kernelsight.server.wire.grpc.launch import cmd_serve_grpc
        return cmd_serve_grpc(ns)
    if ns.api_server_count > 1:
        from kernelsight.server.api_servers import api_server_count_refusal
        refusal = api_server_count_refusal(ns)
        if refusal is not None:
            print(f"kernelsight serve: error: not supported: {refusal}", file=sys.stderr)
            return 2
    host = ns.host or "0.0.0.0"
    # every port first: a taken one stops the start with one line, before anything is built
    socks = bind_listeners(host, ns.port, ns.replicas)
    try:
        if ns.api_server_count > 1:
            from kernelsight.server.api_servers import serve_api_servers
            return serve_api_servers(ns, socks[0], resolve_serve_config(ns))
        groups = replica_groups(ns.replicas, ns.replica_processes)
        if len(groups) == 1:
            return serve_replicas(ns, groups[0], socks, announce=True)
        config = resolve_serve_config(ns)       # once, here: a bad flag is one line, not one per worker
        print(f"kernelsight serve: {ns.replicas} replicas in {len(groups)} processes "
              f"({', '.join(str(len(g)) for g in groups)} each)", file=sys.stderr)
        return run_replica_processes(serve_replicas, [(ns, g, [socks[i] for i in g], k == 0, config)
                                                      for k, g in enumerate(groups)])
    finally:
        for sock in socks:
            sock.close()


def serve_replicas(ns: argparse.Namespace, indices: list[int], socks: list, announce: bool,
                   config: EngineConfig | None = None) -> int:
    """Serve replicas ``indices`` of --replicas on their bound listeners in this process until a signal stops them
    (``announce``: print the engine summary, once per command; ``config``: resolved already by the supervisor)."""
    import uvicorn

    from kernelsight.server.engine.fastpath import http_protocol
    from kernelsight.server.launch import (
        ReplicaServer,
        build_server_apps,
        event_loop_runner,
        http_keep_alive_s,
        serve_all,
        uvicorn_shutdown_bound_s,
    )

    apps, config = build_server_apps(ns, indices, config)
    host = ns.host or "0.0.0.0"
    if announce:
        s = config.summary()
        tok = apps[0].state.ks.tok
        print(f"kernelsight serve: {s['model']} on {s['hardware']} (TP {s['tensor_parallel_size']}, calibration "
              f"{config.calibration_label(s)}), time scale {ns.time_scale:g}; tokenizer: {tok.source.kind} "
              f"({tok.source.where})", file=sys.stderr)
        print(f"kernelsight serve: {describe_expected_error(s['calibration_tier'])}", file=sys.stderr)
        if s.get("calibration_note"):
            print(f"kernelsight serve: {s['calibration_note']}", file=sys.stderr)
        print(f"GPU KV cache size: {s['kv_cache_tokens']:,} tokens, Maximum concurrency for {s['max_model_len']:,} "
              f"tokens per request: {s['max_concurrency']:.2f}x", file=sys.stderr)
    servers = []
    for i, app in zip(indices, apps, strict=True):
        port = ns.port + i
        cfg = uvicorn.Config(app, host=host, port=port, log_level=ns.uvicorn_log_level,
                             timeout_keep_alive=http_keep_alive_s(), access_log=False, http=http_protocol(),
                             timeout_graceful_shutdown=uvicorn_shutdown_bound_s(ns.shutdown_timeout))
        servers.append(ReplicaServer(cfg))
        print(f"Starting vLLM API server {i} on http://{host}:{port}", file=sys.stderr)
    event_loop_runner()(serve_all(servers, socks))
    return 0
