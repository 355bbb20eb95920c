"""``kernelsight serve``'s flags — vLLM's engine and server flags plus the simulator's — and the ServerOptions they
make. Shared by the serve subcommand (``server/cli.py``), the in-process runner (``server/runner.py``) and the
container health check, none of which needs the others."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kernelsight.argtypes import OneLineParser, positive_int
from kernelsight.engine_args import add_engine_args, add_kv_link_args
from kernelsight.multimodal import options as mm_options
from kernelsight.server.integrations.faults import LLM_D_FAULTS, REQUEST_FAULTS, FaultConfig, parse_types
from kernelsight.server.integrations.kv_events.config import parse_kv_events_config
from kernelsight.server.integrations.kv_transfer import parse_kv_transfer_config
from kernelsight.server.options import MediaOptions, ServerOptions, env_allows_lora_updates

SERVE_HELP = "serve a vLLM-compatible OpenAI API whose token timing comes from the simulator"
SERVE_DESCRIPTION = ("A drop-in `vllm serve`: same flags and wire format; tokens are released when the simulated "
                     "GPU would emit them.")

# vLLM flags that change nothing in a simulation: accepted (so launch scripts run unchanged) with a notice.
IGNORED_VALUE_FLAGS = (
    "--download-dir", "--load-format", "--revision", "--code-revision", "--tokenizer-revision", "--tokenizer-mode",
    "--config-format", "--max-logprobs", "--guided-decoding-backend", "--speculative-config", "--compilation-config",
    "--kv-transfer-config", "--cpu-offload-gb", "--swap-space", "--pipeline-parallel-size",
    "--distributed-executor-backend",
    "--generation-config", "--override-generation-config", "--allowed-origins", "--allowed-methods",
    "--allowed-headers", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path",
    "--middleware", "--reasoning-parser", "--hf-overrides",
    "--stream-interval", "--max-log-len", "--response-role", "--max-lora-rank",
    "--lora-dtype", "--max-cpu-loras", "--max-seq-len-to-capture", "--worker-cls",
    "--override-pooler-config", "--structured-outputs-config",
    "--sse-keep-alive-interval", "--fingerprint-mode", "--max-num-partial-prefills",
    "--performance-mode", "--quantization-param-path", "--model-impl",
    "--otlp-traces-endpoint", "--collect-detailed-traces",
    "--data-parallel-rank", "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-backend",
    "--data-parallel-size-local", "--enable-expert-parallel", "--profiler-config",
)
IGNORED_BOOL_FLAGS = (
    "--trust-remote-code", "--disable-log-stats", "--disable-log-requests", "--enable-log-requests",
    "--disable-sliding-window",
    "--allow-credentials",
    "--disable-frontend-multiprocessing",
    "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint", "--disable-uvicorn-access-log",
    "--skip-tokenizer-init", "--disable-cascade-attn", "--enable-per-request-metrics",
    "--kv-cache-metrics", "--enable-log-outputs", "--enable-scale-out", "--headless",
    "--disable-log-stats-server",
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag: the model tag, the engine flags, vLLM's server flags, the simulator's, and the vLLM
    flags accepted for compatibility."""
    p.add_argument("model_tag", nargs="?", default=None, help="the model (as `vllm serve MODEL`); same as --model")
    add_engine_args(p)
    s = p.add_argument_group("server (as vllm serve)")
    s.add_argument("--host", default=None, help="bind address (default: all interfaces, as vLLM)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-server-count", "-asc", type=positive_int, default=1, metavar="N",
                   help="N API-server processes on the one port, in front of one engine process, as vLLM runs them: "
                        "each parses, tokenizes and renders its own requests; the engine's routes (/metrics, /health, "
                        "sleep, caches, LoRA, admin) are answered by the engine process (default: 1, one process)")
    s.add_argument("--grpc", action="store_true",
                   help="serve vLLM's gRPC engine service (vllm.grpc.engine.VllmEngine) on --host:--port instead of "
                        "the HTTP API, as `vllm serve --grpc`; the HTTP API (/metrics, /health) moves to "
                        "--grpc-http-port")
    s.add_argument("--grpc-http-port", type=int, default=None, metavar="PORT",
                   help="with --grpc: the port of the HTTP API, /metrics included (default: --port + --replicas; "
                        "0: no HTTP)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to; the first is reported (default: --model)")
    s.add_argument("--tokenizer", default=None, help="tokenizer directory or local HF-cache id (default: the model's)")
    s.add_argument("--chat-template", default=None, help="Jinja chat template (a file path or the template itself)")
    s.add_argument("--limit-mm-per-prompt", type=_limit_mm, default=None, metavar="JSON",
                   help="most images (videos, ...) one prompt may carry, as vLLM: '{\"image\": 4}' (default: 999 "
                        "each); more are refused with vLLM's 400")
    s.add_argument("--mm-processor-kwargs", type=_mm_kwargs, default=None, metavar="JSON",
                   help="the image processor's overrides, as vLLM: e.g. '{\"max_pixels\": 802816}' for Qwen-VL "
                        "(min_pixels, max_pixels, size), '{\"max_patches\": 4}' for Llama 4")
    s.add_argument("--media-io-kwargs", type=_media_io_kwargs, default=None, metavar="JSON",
                   help="the media loaders' settings, as vLLM: '{\"video\": {\"num_frames\": 16, \"fps\": 2}}' "
                        "(frames a video loader keeps: default 32, no fps cap)")
    s.add_argument("--enable-mm-embeds", action="store_true",
                   help="accept image_embeds content parts (torch.save payloads, read without unpickling), as vLLM")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="serve file:// image and video URLs from under this directory (default: refused, as vLLM)")
    s.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch http(s) media URLs only from these hosts (default: any; the fetch timeout is "
                        "VLLM_IMAGE_FETCH_TIMEOUT seconds, default 5, and VLLM_VIDEO_FETCH_TIMEOUT for videos, "
                        "default 30)")
    s.add_argument("--api-key", nargs="+", default=None, help="require `Authorization: Bearer KEY` on /v1 (env "
                                                               "VLLM_API_KEY also works)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    s.add_argument("--enable-force-include-usage", action="store_true", help="always send the streaming usage chunk")
    s.add_argument("--enable-request-id-headers", action="store_true", help="echo X-Request-Id in responses")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="write tokens in logprobs as 'token_id:<id>' (a request's return_tokens_as_token_ids wins)")
    s.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json")
    s.add_argument("--enable-lora", action="store_true", help="accept LoRA adapter names as models")
    s.add_argument("--max-loras", type=positive_int, default=1, help="adapters per batch (reported in metrics)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters known at start (NAME=PATH or JSON {\"name\":..,\"path\":..}); nothing is read")
    s.add_argument("--max-num-queued-reqs", type=positive_int, default=None,
                   help="reject a request with 503 when unfinished requests (waiting + running, n counts n) would "
                        "exceed this, as vLLM 0.33 (default: no limit)")
    s.add_argument("--max-num-queued-tokens", type=positive_int, default=None,
                   help="reject a request with 503 while the prompts of requests still in prefill total at least "
                        "this many tokens, as vLLM 0.33 (default: no limit)")
    s.add_argument("--kv-events-config", type=parse_kv_events_config, default=None, metavar="JSON",
                   help="publish KV-cache events over ZeroMQ, as vLLM: {\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": ..., \"topic\": ..., "
                        "\"buffer_steps\": ..., \"hwm\": ..., \"max_queue_size\": ..., \"publisher\": "
                        "\"zmq\"|\"null\"}; DP rank r (and replica i of --replicas, after the ranks of the "
                        "replicas before it) adds its offset to the ports")
    s.add_argument("--kv-transfer-config", type=parse_kv_transfer_config, default=None, metavar="JSON",
                   help="prefill/decode disaggregation, as vLLM's: {\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                        "\"kv_both\"} (kv_producer/kv_consumer/kv_both; engine_id, kv_connector_extra_config, ...); "
                        "requests' kv_transfer_params then follow the NIXL connector's protocol "
                        "(docs/router-testing.md: P/D)")
    s.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT stop accepting connections, let in-flight requests finish for up to this "
                        "long, then abort the rest (streams end with finish_reason \"abort\" and [DONE]); as vLLM's, "
                        "default 0: abort at once")
    s.add_argument("--enable-sleep-mode", action="store_true",
                   help="allow POST /sleep and /wake_up (registered, with /is_sleeping, under VLLM_SERVER_DEV_MODE=1 "
                        "as in vLLM); a sleeping server answers completions and chat with 503")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice \"auto\", the default when tools are given); "
                        "needs --tool-call-parser, as in vLLM")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="vLLM's tool-call parser name (hermes, llama3_json, ...): any name enables auto tool choice; "
                        "the simulated model emits Hermes-style calls")
    s.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                   help="pooling: serve the model as an embedding model (/v1/embeddings, /pooling, /score, /rerank "
                        "instead of completions and chat), as vLLM's --runner pooling")
    s.add_argument("--convert", choices=("auto", "none", "embed"), default="auto",
                   help="embed: adapt the model to embeddings (implies --runner pooling), as vLLM's --convert embed")
    s.add_argument("--task", choices=("auto", "generate", "embed", "embedding"), default="auto",
                   help="older vLLM's spelling: embed / embedding = --runner pooling --convert embed")
    s.add_argument("--show-hidden-metrics-for-version", type=_metrics_version, default=None, metavar="VERSION",
                   help="also expose the deprecated metric names a version up to 0.11 still had (e.g. 0.10: "
                        "vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_queries/_hits, "
                        "vllm:time_per_output_token_seconds), with their successors' values")
    sim = p.add_argument_group("simulator")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="virtual seconds per wall second (default: 1 = real time; 10 = ten times faster)")
    sim.add_argument("--output-mode", choices=("random", "echo"), default="random",
                     help="generated text: random vocabulary words (re-tokenize exactly) or the prompt echoed")
    sim.add_argument("--replicas", type=positive_int, default=1,
                     help="N independent servers on ports port..port+N-1 (each its own engine and /metrics)")
    sim.add_argument("--replica-processes", type=_processes, default=1, metavar="P|auto",
                     help="run the --replicas in P worker processes (contiguous groups; replica i keeps its port, "
                          "KV-event ports and metrics) so that a fleet uses several cores; auto: one per usable CPU, "
                          "at most one per replica (default: 1, every replica in this process)")
    sim.add_argument("--deadline-spin-us", type=float, default=1500.0,
                     help="wait out this long before each step deadline precisely (a blocking sleep, then a "
                          "short spin) instead of on the event loop's ms-coarse timers (default: 1500; 0 = event "
                          "loop timers only, for a server sharing its process)")
    sim.add_argument("--disable-stream-fast-path", action="store_true",
                     help="render and write every streamed chunk from its request's handler task (the general "
                          "path) instead of from the engine loop at the step deadline")
    sim.add_argument("--lateness-warn-ms", type=float, default=50.0,
                     help="log a warning (at most one per 30 s per engine) when the p99 lateness of the last 10 s of "
                          "token releases passes this many ms: timings then no longer follow the simulated GPU, "
                          "usually from CPU starvation (default: 50; 0 = never)")
    sim.add_argument("--kv-events-array-like", action="store_true",
                     help="encode KV events as positional arrays (vLLM <= 0.11's array_like structs) instead of "
                          "0.33's tagged maps")
    add_kv_link_args(sim)
    sim.add_argument("--record-timings", action="store_true",
                     help="keep per-request virtual token times, served at GET /kernelsight/timings")
    f = p.add_argument_group("fault injection (off by default; GET/POST /kernelsight/faults changes it live)")
    f.add_argument("--fault-rate", type=_unit_fraction, default=None,
                   help="probability that a completion or chat request gets one of the per-request --fault-types "
                        "(default: 0)")
    f.add_argument("--fault-types", nargs="+", default=None, metavar="TYPE",
                   help="comma- or space-separated: per-request 429, 500, 503, timeout, stream-abort, stream-stall, "
                        "invalid_api_key, context_length, invalid_request, model_not_found (the rate picks among "
                        "them); replica states slow, unready (on while listed, whatever the rate). Default with "
                        "--fault-rate: every per-request type")
    f.add_argument("--fault-seed", type=int, default=None, help="seed of the per-request picks (default: --seed)")
    f.add_argument("--fault-slow-factor", type=float, default=4.0,
                   help="'slow' multiplies every simulated step time by this (default: 4)")
    f.add_argument("--fault-stall-s", type=float, default=5.0,
                   help="wall seconds a 'stream-stall' pauses its stream half-way (default: 5)")
    f.add_argument("--fault-timeout-s", type=float, default=60.0,
                   help="wall seconds a 'timeout' request is held unanswered before its connection is dropped "
                        "(default: 60)")
    # llm-d-inference-sim's names, for suites written against it: a rate in percent, its failure type names
    f.add_argument("--failure-injection-rate", type=float, default=None, help=argparse.SUPPRESS)
    f.add_argument("--failure-types", nargs="+", default=None, help=argparse.SUPPRESS)
    ign = p.add_argument_group("accepted for compatibility (no effect in a simulation)")
    taken = set(p._option_string_actions)   # engine flags grow over time: never shadow a real one
    for flag in IGNORED_VALUE_FLAGS:
        if flag in taken:
            continue
        ign.add_argument(flag, nargs="?", const=True, default=None, dest=_ignored_dest(flag), help=argparse.SUPPRESS)
    for flag in IGNORED_BOOL_FLAGS:
        if flag in taken:
            continue
        ign.add_argument(flag, action="store_true", default=None, dest=_ignored_dest(flag), help=argparse.SUPPRESS)
    ign.add_argument("-pp", nargs="?", const=True, default=None, dest=_ignored_dest("--pipeline-parallel-size"),
                     help=argparse.SUPPRESS)
    ign.add_argument("-O", nargs="?", const=True, default=None, dest=_ignored_dest("--compilation-config"),
                     help=argparse.SUPPRESS)


def _metrics_version(text: str) -> str:
    """A release as vLLM takes it (``0.10``, ``0.10.2``): dotted numbers."""
    parts = text.strip().lstrip("v").split(".")
    if len(parts) < 2 or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"expected a version like 0.10, got {text!r}")
    return ".".join(parts)


def _processes(text: str) -> int | None:
    """--replica-processes: a positive count, or ``auto`` (None: one per usable CPU)."""
    return None if text == "auto" else positive_int(text)


def _unit_fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def fault_config_from(ns: argparse.Namespace) -> FaultConfig:
    """The fault settings of parsed ``serve`` flags (ValueError on a bad type or value)."""
    rate = ns.fault_rate
    if ns.failure_injection_rate is not None:
        if rate is not None:
            raise ValueError("give --fault-rate or --failure-injection-rate, not both")
        rate = ns.failure_injection_rate / 100.0
    items = (ns.fault_types or []) + (ns.failure_types or [])
    types = parse_types(items)
    if not items and rate:
        # a rate without types: any per-request fault; llm-d-inference-sim's flag means any of its own (error) types
        types = LLM_D_FAULTS if ns.failure_injection_rate is not None else REQUEST_FAULTS
    return FaultConfig(rate=rate or 0.0, types=types, seed=ns.seed if ns.fault_seed is None else ns.fault_seed,
                       slow_factor=ns.fault_slow_factor, stall_s=ns.fault_stall_s, timeout_s=ns.fault_timeout_s)


def _limit_mm(text: str) -> dict[str, int]:
    try:
        return mm_options.parse_limit_mm_per_prompt(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _media_io_kwargs(text: str) -> dict[str, Any]:
    try:
        return mm_options.parse_media_io_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mm_kwargs(text: str) -> dict[str, Any]:
    try:
        return mm_options.parse_mm_processor_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def serve_parser(prog: str = "kernelsight serve") -> OneLineParser:
    """A stand-alone parser of ``serve``'s flags (what follows ``kernelsight serve``)."""
    p = OneLineParser(prog=prog, description=SERVE_DESCRIPTION)
    add_serve_args(p)
    return p


def ignored_flags(ns: argparse.Namespace) -> list[str]:
    """The compatibility flags given on the command line, as ``--flag`` names."""
    return sorted("--" + k[len("ignored__"):].replace("_", "-") for k, v in vars(ns).items()
                  if k.startswith("ignored__") and v is not None)


def _ignored_dest(flag: str) -> str:
    return "ignored__" + flag.lstrip("-").replace("-", "_")


def _lora_modules(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            d = json.loads(item)
            out[d["name"]] = d.get("path", "")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
            out[name] = path
    return out


def server_options_from(ns: argparse.Namespace) -> ServerOptions:
    """The serve-only settings of parsed ``serve`` flags (reads the chat template file and VLLM_API_KEY)."""
    chat_template = ns.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    local_media = ns.allowed_local_media_path
    if local_media:       # vLLM checks it at start
        if not os.path.exists(local_media):
            raise ValueError(f"Invalid `--allowed-local-media-path`: The path {local_media} does not exist.")
        if not os.path.isdir(local_media):
            raise ValueError(f"Invalid `--allowed-local-media-path`: The path {local_media} must be a directory.")
    api_keys = list(ns.api_key or [])
    if not api_keys and os.environ.get("VLLM_API_KEY"):
        api_keys = [os.environ["VLLM_API_KEY"]]
    return ServerOptions(
        served_model_names=list(ns.served_model_name or [ns.model]), model_root=ns.model, api_keys=api_keys,
        time_scale=ns.time_scale, output_mode=ns.output_mode,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        enable_force_include_usage=ns.enable_force_include_usage,
        enable_request_id_headers=ns.enable_request_id_headers, enable_lora=ns.enable_lora, max_loras=ns.max_loras,
        lora_modules=_lora_modules(ns.lora_modules) if ns.enable_lora else {},
        allow_runtime_lora_updating=env_allows_lora_updates(), data_parallel_size=ns.data_parallel_size,
        record_timings=ns.record_timings, deadline_spin_us=ns.deadline_spin_us,
        stream_fast_path=not ns.disable_stream_fast_path,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids, lateness_warn_ms=ns.lateness_warn_ms,
        shutdown_timeout_s=ns.shutdown_timeout, disable_fastapi_docs=ns.disable_fastapi_docs,
        chat_template=chat_template, faults=fault_config_from(ns),
        max_num_queued_reqs=ns.max_num_queued_reqs, max_num_queued_tokens=ns.max_num_queued_tokens,
        kv_events=ns.kv_events_config, kv_events_array_like=ns.kv_events_array_like,
        prefix_caching_hash_algo=ns.prefix_caching_hash_algo, enable_sleep_mode=ns.enable_sleep_mode,
        show_hidden_metrics_for_version=ns.show_hidden_metrics_for_version, kv_transfer=ns.kv_transfer_config,
        kv_transfer_link=ns.kv_transfer_link, kv_transfer_bandwidth_gbps=ns.kv_transfer_bandwidth_gbps,
        kv_transfer_latency_us=ns.kv_transfer_latency_us,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
        pooling=ns.runner == "pooling" or ns.convert == "embed" or ns.task in ("embed", "embedding"),
        media=MediaOptions(limit_mm_per_prompt=ns.limit_mm_per_prompt or {},
                           mm_processor_kwargs=ns.mm_processor_kwargs or {},
                           allowed_local_media_path=ns.allowed_local_media_path,
                           allowed_media_domains=tuple(ns.allowed_media_domains or ()),
                           media_io_kwargs=ns.media_io_kwargs or {},
                           enable_mm_embeds=bool(ns.enable_mm_embeds)))
