"""The engine arguments of a measured vLLM run, read from its ``meta.json`` (the shared e2e run schema).

A run records what it was launched with (``engine_kwargs``: only the flags given) and, when the harness saved
it, what vLLM resolved them to (``resolved_config``: every scheduler / cache / parallel / model setting after
vLLM's own defaults for that version and GPU). The resolved values win: a run of a vLLM release whose defaults
differ from the simulator's (async scheduling, batch-token budget) is then simulated as it ran. Settings neither
records keep :class:`~kernelsight.simcore.engine_config.EngineArgs`' defaults.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kernelsight.simcore.engine_config import EngineArgs

#: EngineArgs field → where a run records it: (resolved_config section, key), then the engine_kwargs key.
RUN_ARG_SOURCES: dict[str, tuple[tuple[str, str] | None, str]] = {
    "model": (("model_config", "model"), "model"),
    "tensor_parallel_size": (("parallel_config", "tensor_parallel_size"), "tensor_parallel_size"),
    "max_num_seqs": (("scheduler_config", "max_num_seqs"), "max_num_seqs"),
    "max_num_batched_tokens": (("scheduler_config", "max_num_batched_tokens"), "max_num_batched_tokens"),
    "max_model_len": (("model_config", "max_model_len"), "max_model_len"),
    "gpu_memory_utilization": (("cache_config", "gpu_memory_utilization"), "gpu_memory_utilization"),
    "block_size": (("cache_config", "block_size"), "block_size"),
    "enable_prefix_caching": (("cache_config", "enable_prefix_caching"), "enable_prefix_caching"),
    "enable_chunked_prefill": (("scheduler_config", "enable_chunked_prefill"), "enable_chunked_prefill"),
    "quantization": (("model_config", "quantization"), "quantization"),
    "kv_cache_dtype": (("cache_config", "cache_dtype"), "kv_cache_dtype"),
    "dtype": (("model_config", "dtype"), "dtype"),
    "seed": (("model_config", "seed"), "seed"),
    "scheduling_policy": (("scheduler_config", "policy"), "scheduling_policy"),
    "enforce_eager": (("model_config", "enforce_eager"), "enforce_eager"),
    "max_cudagraph_capture_size": (("compilation_config", "max_cudagraph_capture_size"), "max_cudagraph_capture_size"),
    "long_prefill_token_threshold": (("scheduler_config", "long_prefill_token_threshold"),
                                     "long_prefill_token_threshold"),
    "async_scheduling": (("scheduler_config", "async_scheduling"), "async_scheduling"),
    "data_parallel_size": (("parallel_config", "data_parallel_size"), "data_parallel_size"),
    "enable_expert_parallel": (("parallel_config", "enable_expert_parallel"), "enable_expert_parallel"),
    "all2all_backend": (("parallel_config", "all2all_backend"), "all2all_backend"),
    "disable_custom_all_reduce": (("parallel_config", "disable_custom_all_reduce"), "disable_custom_all_reduce"),
    # the run's --speculative-config as given (vLLM's resolved speculative_config holds objects, not JSON)
    "speculative_config": (None, "speculative_config"),
}


def _normalized(name: str, value: Any) -> Any:
    if name == "dtype" and isinstance(value, str):
        return value.removeprefix("torch.")   # the resolved config prints torch dtypes: torch.bfloat16
    if name == "speculative_config" and isinstance(value, str):
        return json.loads(value)              # recorded as the command line's JSON text
    return value


def engine_args_from_run(meta: Mapping[str, Any], **overrides: Any) -> EngineArgs:
    """EngineArgs a run was served with (``overrides``, e.g. ``hardware`` and ``calibration``, set the rest).

    The legacy ``kv_cache`` block of the schema (block size, prefix caching, memory utilization) is read too, for
    runs without a resolved config."""
    resolved = meta.get("resolved_config") or {}
    given = dict(meta.get("kv_cache") or {})
    given.update(meta.get("engine_kwargs") or {})
    known = {f.name for f in fields(EngineArgs)}
    values: dict[str, Any] = {}
    for name, (where, key) in RUN_ARG_SOURCES.items():
        section = resolved.get(where[0]) if where else None
        if isinstance(section, Mapping) and section.get(where[1]) is not None:
            values[name] = _normalized(name, section[where[1]])
        elif given.get(key) is not None:
            values[name] = _normalized(name, given[key])
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"not engine arguments: {', '.join(sorted(unknown))}")
    values.update(overrides)
    return EngineArgs(**values)
