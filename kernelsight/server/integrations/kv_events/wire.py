"""The msgpack payload of one KV-event batch, as vLLM's msgspec structs encode it.

vLLM 0.33 (``vllm/distributed/kv_events.py``): ``EventBatch`` and the events are msgspec structs with
``omit_defaults=True``; events are ``tag=True``, so each is a map whose first key is ``"type"`` (the class name),
followed by its fields in declaration order, fields left at their default omitted. Releases up to 0.11 set
``array_like=True`` on both: the batch is ``[ts, events, data_parallel_rank]`` and an event is
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(slots=True)
class WireStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None
    group_idx: int = 0                   # the KV-cache group: 0 full attention, 1 a hybrid model's sliding window
    sliding_window: int | None = None    # the group's window (kv_cache_spec_sliding_window)
    # where the blocks are: the GPU's prefix cache, or KV offloading's CPU tier, whose events vLLM's offloading
    # connector writes by hash only (no parent, no token ids, no LoRA, no group: those fields left at None)
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class WireRemoved:
    block_hashes: list[Any]
    group_idx: int = 0
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared


def _as_map(ev: WireEvent) -> dict[str, Any]:
    if isinstance(ev, WireStored) and ev.medium != MEDIUM_GPU:
        return {"type": "BlockStored", "block_hashes": ev.block_hashes, "parent_block_hash": None, "token_ids": [],
                "block_size": ev.block_size, "lora_id": None, "medium": ev.medium, "lora_name": None}
    if isinstance(ev, WireRemoved) and ev.medium != MEDIUM_GPU:
        return {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium}
    if isinstance(ev, WireStored):
        d: dict[str, Any] = {"type": "BlockStored", "block_hashes": ev.block_hashes,
                             "parent_block_hash": ev.parent_block_hash, "token_ids": ev.token_ids,
                             "block_size": ev.block_size, "lora_id": ev.lora_id, "medium": MEDIUM_GPU,
                             "lora_name": ev.lora_name}
        if ev.extra_keys is not None:
            d["extra_keys"] = ev.extra_keys
        # group 0 is full attention; a hybrid model's (gpt-oss) sliding-window layers are group 1
        d["group_idx"] = ev.group_idx
        if ev.sliding_window is None:
            d["kv_cache_spec_kind"] = "full_attention"
        else:
            d["kv_cache_spec_kind"] = "sliding_window"
            d["kv_cache_spec_sliding_window"] = ev.sliding_window
        return d
    if isinstance(ev, WireRemoved):
        return {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": MEDIUM_GPU,
                "group_idx": ev.group_idx}
    return {"type": "AllBlocksCleared"}


def _as_array(ev: WireEvent) -> list[Any]:
    if isinstance(ev, WireStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
                ev.medium]
    if isinstance(ev, WireRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[WireEvent], data_parallel_rank: int, array_like: bool = False) -> bytes:
    """One batch's payload frame (0.33's tagged maps, or the positional arrays of older releases)."""
    if array_like:
        obj: Any = [float(ts), [_as_array(e) for e in events], data_parallel_rank]
    else:
        obj = {"ts": float(ts), "events": [_as_map(e) for e in events], "data_parallel_rank": data_parallel_rank}
    return msgpack.packb(obj, use_bin_type=True)
