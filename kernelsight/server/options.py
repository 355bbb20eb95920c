"""Serve-only settings: ``ServerOptions`` (engine settings live in EngineConfig), and whether the environment
allows loading LoRA adapters at run time."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kernelsight.server.integrations.faults import FaultConfig
from kernelsight.server.integrations.kv_events.config import KVEventsConfig
from kernelsight.server.integrations.kv_transfer import KVTransferConfig

DEFAULT_LIMIT_PER_PROMPT = 999        # vLLM's default per modality


@dataclass(frozen=True)
class MediaOptions:
    """The serve flags of images in prompts."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)   # per modality: the loaders' settings
    enable_mm_embeds: bool = False

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)


@dataclass
class ServerOptions:
    """Serve-only settings (engine settings live in EngineConfig)."""

    served_model_names: list[str]
    model_root: str
    api_keys: list[str] = field(default_factory=list)
    time_scale: float = 1.0
    output_mode: str = "random"                 # random | echo
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    lora_modules: dict[str, str] = field(default_factory=dict)
    allow_runtime_lora_updating: bool = False
    data_parallel_size: int = 1
    record_timings: bool = False
    disable_fastapi_docs: bool = False
    chat_template: str | None = None
    max_log_len: int | None = None
    deadline_spin_us: float = 1500.0
    stream_fast_path: bool = True
    return_tokens_as_token_ids: bool = False
    lateness_warn_ms: float = 50.0             # log when the recent p99 release lateness passes this; 0: never
    faults: FaultConfig = field(default_factory=FaultConfig)      # fault injection (off by default)
    max_num_queued_reqs: int | None = None     # vLLM 0.33's admission limits (None: unlimited)
    max_num_queued_tokens: int | None = None
    kv_events: KVEventsConfig | None = None    # --kv-events-config
    kv_events_array_like: bool = False         # positional-array encoding (vLLM <= 0.11) instead of tagged maps
    prefix_caching_hash_algo: str = "sha256"   # the hash KV events carry (vLLM's --prefix-caching-hash-algo)
    shutdown_timeout_s: float = 0.0            # on SIGTERM: wait this long for in-flight requests, then abort them
    enable_sleep_mode: bool = False            # /sleep and /wake_up act (dev mode registers them)
    show_hidden_metrics_for_version: str | None = None   # e.g. "0.10": the deprecated metric names come back
    kv_transfer: KVTransferConfig | None = None          # --kv-transfer-config: P/D disaggregation
    kv_transfer_link: str | None = None                  # --kv-transfer-link (None: the GPU profile's default)
    kv_transfer_bandwidth_gbps: float | None = None
    kv_transfer_latency_us: float | None = None
    enable_auto_tool_choice: bool = False      # with tool_call_parser: tool_choice "auto" is allowed
    tool_call_parser: str | None = None
    pooling: bool = False                      # --runner pooling / --convert embed: an embedding model's routes
    media: MediaOptions = field(default_factory=MediaOptions)   # images in prompts: limits, processor kwargs, fetch


def env_allows_lora_updates() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
