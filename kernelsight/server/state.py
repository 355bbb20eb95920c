"""``ServerState``: what one app serves with (options, tokenizer, engine bridges, metrics, LoRA adapters), kept
as ``app.state.ks``; ``server_state`` gets it from a request."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

from fastapi import Request

from kernelsight.multimodal import MultimodalProcessor, processor_for_model
from kernelsight.profiles import load_preprocessor_config, load_video_preprocessor_config
from kernelsight.server.engine.bridge import EngineBridge
from kernelsight.server.engine.lockstep import LockstepDriver
from kernelsight.server.integrations.faults import (
    BUSY_MESSAGE,
    FAULT_TYPES,
    TOKEN_BACKLOG_MESSAGE,
    FaultConfig,
    FaultInjector,
)
from kernelsight.server.integrations.kv_events.publisher import KVEventPublisher
from kernelsight.server.integrations.kv_transfer import KVTransferAgent
from kernelsight.server.integrations.metrics import ServerMetrics
from kernelsight.server.integrations.sleep_mode import SleepMode
from kernelsight.server.model.logprobs import LogprobSynth
from kernelsight.server.model.tokenizer import ServerTokenizer
from kernelsight.server.options import ServerOptions
from kernelsight.server.wire.errors import APIError, bad_request, not_found
from kernelsight.server.wire.protocol.version import VLLM_VERSION
from kernelsight.simcore.engine_config import EngineConfig, build_dp_group, moe_group_timing
from kernelsight.simcore.kv_transfer import kv_link


class ServerState:
    def __init__(self, config: EngineConfig, opts: ServerOptions, tok: ServerTokenizer, replica_index: int = 0,
                 remote: Any = None) -> None:
        """``remote``: an API-server process's ``engine.remote.RemoteBridge``s, one per rank (--api-server-count):
        the engines, their metrics' engine side and their KV events live in the engine process; nothing engine-side
        is built here."""
        self.config = config
        self.opts = opts
        self.tok = tok
        self.max_model_len = config.scheduler.max_model_len
        self.model_name = opts.served_model_names[0]
        self.loras: dict[str, str] = dict(opts.lora_modules)
        cache_info = _cache_config_info(config, opts.prefix_caching_hash_algo)
        # --data-parallel-rank R: this process serves rank R alone (labelled engine="R", as vLLM's external LB mode)
        rank = config.args.data_parallel_rank
        first, n = (rank, 1) if rank is not None else (0, opts.data_parallel_size)
        self.metrics = ServerMetrics(self.model_name, n, self.max_model_len, [cache_info] * n, opts.enable_lora,
                                     opts.max_loras, fault_types=FAULT_TYPES, first_engine=first,
                                     hidden_metrics_version=opts.show_hidden_metrics_for_version)
        self.kv_publishers = [] if remote is not None else _kv_publishers(config, opts, replica_index,
                                                                          range(first, first + n))
        # a MoE model's ranks served together step in lockstep (vLLM's DP engine core): one group, one loop
        group = build_dp_group(config) if (remote is None and n > 1 and moe_group_timing(config) is not None) \
            else None
        self.bridges: list[Any] = list(remote) if remote is not None else [
            EngineBridge(config, tok, self.metrics.engines[i], opts.time_scale, opts.record_timings,
                         opts.deadline_spin_us * 1e-6, lateness_warn_s=opts.lateness_warn_ms * 1e-3,
                         engine_index=first + i, kv_publisher=self.kv_publishers[i] if self.kv_publishers else None,
                         engine=group.engines[i] if group is not None else None)
            for i in range(n)]
        self.lockstep = LockstepDriver(group, self.bridges) if group is not None else None
        self.kv_agents = _kv_transfer_agents(config, opts, self.bridges, first) if remote is None else []
        if remote is not None:
            # counted where /metrics is served: the engine process's registry
            first_remote = self.bridges[0]
            self.metrics.on_fault = lambda *a: first_remote.count("on_fault", *a)   # type: ignore[method-assign]
            self.metrics.on_admission_rejected = (                                  # type: ignore[method-assign]
                lambda *a: first_remote.count("on_admission_rejected", *a))
        elif config.speculative is not None:
            self.metrics.bind_spec_decode([lambda b=b: b.engine.spec_decoder.stats for b in self.bridges],
                                          config.speculative.num_speculative_tokens)
        if config.offload is not None:
            self.metrics.bind_offload([lambda b=b: b.engine.offload.stats for b in self.bridges])
        self.created = int(time.time())
        digest = hashlib.sha256(json.dumps(config.summary(), sort_keys=True, default=str).encode()).hexdigest()[:8]
        tp = config.args.tensor_parallel_size
        dp = opts.data_parallel_size
        self.fingerprint = (f"vllm-{VLLM_VERSION}" + (f"-tp{tp}" if tp > 1 else "") + (f"-dp{dp}" if dp > 1 else "")
                            + f"-{digest}")
        self.max_chars = self.max_model_len * 64   # text beyond this cannot fit (cheap pre-check before tokenizing)
        self.logprobs = LogprobSynth(tok)
        self.faults = FaultInjector(opts.faults, self.metrics.on_fault)
        self.sleep = SleepMode() if remote is None else _RemoteSleep(self.bridges[0])
        # images in prompts: the model's processor (None for a text-only model, which refuses them)
        self.mm_preprocessor = load_preprocessor_config(config.args.model)
        self.mm_video_preprocessor = load_video_preprocessor_config(config.args.model)
        self.mm_processor: MultimodalProcessor | None = processor_for_model(
            config.model, self.mm_preprocessor, opts.media.mm_processor_kwargs, self.mm_video_preprocessor)
        if self.mm_processor is not None and config.model.vision is not None:
            self.metrics.bind_mm_cache(config.model.vision)
        self.apply_replica_faults()

    def request_mm_processor(self, kwargs: Any) -> MultimodalProcessor | None:
        """The processor for one request's ``mm_processor_kwargs`` (over the served ones), as vLLM takes them."""
        if not kwargs or self.mm_processor is None:
            return self.mm_processor
        if not isinstance(kwargs, dict):
            raise bad_request("mm_processor_kwargs must be an object", "mm_processor_kwargs")
        try:
            return processor_for_model(self.config.model, self.mm_preprocessor,
                                       {**self.opts.media.mm_processor_kwargs, **kwargs}, self.mm_video_preprocessor)
        except ValueError as exc:
            raise bad_request(str(exc), "mm_processor_kwargs") from None

    def configure_faults(self, config: FaultConfig, reseed: bool) -> None:
        """New fault settings, live (the admin endpoint): the picker, and the replica states at once."""
        self.faults.configure(config, reseed)
        self.apply_replica_faults()

    def apply_replica_faults(self) -> None:
        cfg = self.faults.config
        for b in self.bridges:
            b.set_step_time_factor(cfg.slow_factor if cfg.slow else 1.0)

    def check_admission(self, n: int) -> None:
        """vLLM 0.33's admission limits (``AsyncLLM.check_admission``): 503 when ``n`` more sequences would take
        the unfinished ones (waiting + running, over every engine) past --max-num-queued-reqs, or while the prompts
        still in prefill total at least --max-num-queued-tokens."""
        opts = self.opts
        if opts.max_num_queued_reqs is not None:
            if sum(b.num_unfinished for b in self.bridges) + n > opts.max_num_queued_reqs:
                self.metrics.on_admission_rejected("max_num_queued_reqs")
                raise APIError(BUSY_MESSAGE, "Service Unavailable", 503)
        if opts.max_num_queued_tokens is not None:
            if sum(b.num_prefill_tokens() for b in self.bridges) >= opts.max_num_queued_tokens:
                self.metrics.on_admission_rejected("max_num_queued_tokens")
                raise APIError(TOKEN_BACKLOG_MESSAGE, "Service Unavailable", 503)

    def pick_bridge(self, request: Request) -> EngineBridge:
        """vLLM's DP balancing: the engine with the lowest waiting·4 + running, or X-data-parallel-rank."""
        if len(self.bridges) == 1:
            return self.bridges[0]
        rank = request.headers.get("x-data-parallel-rank")
        if rank is not None and rank.isdigit() and int(rank) < len(self.bridges):
            return self.bridges[int(rank)]
        return min(self.bridges, key=lambda b: 4 * b.engine.num_waiting + b.engine.num_running)

    def check_model(self, model: str | None) -> str | None:
        """None for the base model; the LoRA name for an adapter; 404 otherwise."""
        if model is None or model in self.opts.served_model_names:
            return None
        if model in self.loras:
            return model
        aliases = ", ".join(self.opts.served_model_names)
        raise not_found(f"The model `{model}` does not exist. Valid aliases: {aliases}.", "model")


def _kv_publishers(config: EngineConfig, opts: ServerOptions, replica_index: int,
                   ranks: range | None = None) -> list[KVEventPublisher]:
    """One publisher per DP rank this process serves (``ranks``: all of them, or --data-parallel-rank's one) when
    --kv-events-config publishes (vLLM offsets rank r's ports by r; replica i of --replicas continues after the
    ranks of the replicas before it). Any failure closes those already open."""
    cfg = opts.kv_events
    if cfg is None or not cfg.publishes:
        return []
    dp = opts.data_parallel_size
    pubs: list[KVEventPublisher] = []
    try:
        for rank in ranks if ranks is not None else range(dp):
            pubs.append(KVEventPublisher(cfg, rank, replica_index * dp + rank, hash_algo=opts.prefix_caching_hash_algo,
                                         array_like=opts.kv_events_array_like))
    except ValueError:
        for p in pubs:
            p.shutdown()
        raise
    return pubs


def _kv_transfer_agents(config: EngineConfig, opts: ServerOptions, bridges: list[EngineBridge],
                        first_rank: int) -> list[KVTransferAgent]:
    """--kv-transfer-config: each engine prices pulls over the chosen link and gets a connector agent."""
    cfg = opts.kv_transfer
    if cfg is None or not cfg.is_kv_transfer_instance or config.offload is not None:
        return []           # an offloading connector is the engine's CPU tier (EngineConfig.offload), not P/D
    link = kv_link(config.hardware, opts.kv_transfer_link, bandwidth_gbps=opts.kv_transfer_bandwidth_gbps,
                   latency_s=None if opts.kv_transfer_latency_us is None else opts.kv_transfer_latency_us * 1e-6)
    agents = []
    for i, b in enumerate(bridges):
        b.engine.kv_transfer = dataclasses.replace(b.engine.kv_transfer, link=link)
        b.kv_agent = KVTransferAgent(cfg, b.engine, first_rank + i, config.args.tensor_parallel_size)
        agents.append(b.kv_agent)
    return agents


def _cache_config_info(config: EngineConfig, hash_algo: str = "sha256") -> dict[str, Any]:
    s = config.scheduler
    a = config.args
    return {"block_size": s.block_size, "cache_dtype": a.kv_cache_dtype, "calculate_kv_scales": False,
            "cpu_offload_gb": 0, "enable_prefix_caching": s.enable_prefix_caching,
            "gpu_memory_utilization": a.gpu_memory_utilization, "is_attention_free": False,
            "kv_sharing_fast_prefill": False, "num_cpu_blocks": None, "num_gpu_blocks": config.num_gpu_blocks,
            "num_gpu_blocks_override": a.num_gpu_blocks_override, "prefix_caching_hash_algo": hash_algo,
            "sliding_window": None, "swap_space": 4,
            "kv_offloading_backend": a.kv_offloading_backend, "kv_offloading_size": a.kv_offloading_size_gib}


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request`` (``build_app`` sets ``app.state.ks``)."""
    return request.app.state.ks


class _RemoteSleep(SleepMode):
    """An API-server process's view of the engine process's sleep mode (its /sleep and /wake_up are the engine's)."""

    def __init__(self, remote: Any) -> None:
        super().__init__()
        self._remote = remote

    @property
    def is_sleeping(self) -> bool:   # type: ignore[override]
        return self._remote.engine_sleeping
