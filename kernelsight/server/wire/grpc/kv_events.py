"""``SubscribeKvEvents``: the batches an engine's KV-event publisher sends on its ZeroMQ socket, as
``smg.grpc.common.KvEventBatch`` messages on a gRPC stream. The servicer listens to the publisher in process
(``KVEventPublisher.listeners``) instead of connecting a SUB socket to it, as vLLM's servicer does: same batches,
same sequence numbers, no second encode/decode. As vLLM's servicer, it follows data-parallel rank 0's publisher
(the first this server runs) and streams live batches from the subscription on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from smg_grpc_proto.generated import common_pb2

from kernelsight.server.integrations.kv_events.publisher import KVEventPublisher
from kernelsight.server.integrations.kv_events.wire import MEDIUM_GPU, WireCleared, WireEvent, WireRemoved, WireStored

log = logging.getLogger("kernelsight.server")

#: batches held for one slow subscriber before new ones are dropped (its sequence numbers then show the gap)
QUEUE_BATCHES = 100_000
_U64 = (1 << 64) - 1


def as_int64(value: int | bytes) -> int:
    """A block hash as the proto's int64: the low 64 bits of an int hash, or of a bytes hash read big-endian,
    two's complement (the gateway uses it as a node identity only)."""
    v = int.from_bytes(value, "big") if isinstance(value, bytes) else int(value)
    v &= _U64
    return v - (1 << 64) if v >> 63 else v


def event_message(ev: WireEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(ev, WireStored) and ev.medium != MEDIUM_GPU:
        # KV offloading's CPU tier: blocks by hash only, in host memory
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(block_hash=as_int64(h), block_size=ev.block_size)
                                                   for h in ev.block_hashes],
                                           tier=common_pb2.KV_CACHE_TIER_HOST, medium=ev.medium)
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(ev, WireRemoved) and ev.medium != MEDIUM_GPU:
        removed = common_pb2.KvBlocksRemoved(block_hashes=[as_int64(h) for h in ev.block_hashes],
                                             tier=common_pb2.KV_CACHE_TIER_HOST, medium=ev.medium)
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    if isinstance(ev, WireStored):
        bs = ev.block_size
        blocks = []
        for i, h in enumerate(ev.block_hashes):
            block = common_pb2.KvBlock(block_hash=as_int64(h), token_ids=ev.token_ids[i * bs:(i + 1) * bs],
                                       block_size=bs)
            if ev.lora_id is not None:
                block.lora_id = ev.lora_id
            blocks.append(block)
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=common_pb2.KV_CACHE_TIER_DEVICE, medium=MEDIUM_GPU,
                                           group_idx=ev.group_idx)
        if ev.parent_block_hash is not None:
            stored.parent_block_hash = as_int64(ev.parent_block_hash)
        if ev.sliding_window is None:
            stored.kv_cache_spec_kind = "full_attention"
        else:
            stored.kv_cache_spec_kind = "sliding_window"
            stored.kv_cache_spec_sliding_window = ev.sliding_window
        if ev.lora_name is not None:
            stored.lora_name = ev.lora_name
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(ev, WireRemoved):
        removed = common_pb2.KvBlocksRemoved(block_hashes=[as_int64(h) for h in ev.block_hashes],
                                             tier=common_pb2.KV_CACHE_TIER_DEVICE, medium=MEDIUM_GPU,
                                             group_idx=ev.group_idx)
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    assert isinstance(ev, WireCleared)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class KvEventStream:
    """One subscriber's stream: the publisher's batches queued as they are sent (on the engine loop, no
    conversion there), turned into messages by the RPC's own task."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self.queue: asyncio.Queue[tuple[int, float, list[WireEvent]]] = asyncio.Queue(QUEUE_BATCHES)
        self.dropped = 0
        self._event_id = 0

    def _on_batch(self, seq: int, ts: float, events: list[WireEvent]) -> None:
        try:
            self.queue.put_nowait((seq, ts, events))
        except asyncio.QueueFull:
            self.dropped += 1

    async def batches(self) -> AsyncIterator[common_pb2.KvEventBatch]:
        self.publisher.listeners.append(self._on_batch)
        try:
            while True:
                seq, ts, events = await self.queue.get()
                yield self.message(seq, ts, events)
        finally:
            self.publisher.listeners.remove(self._on_batch)

    def message(self, seq: int, ts: float, events: list[WireEvent]) -> common_pb2.KvEventBatch:
        out: list[Any] = []
        for ev in events:
            self._event_id += 1
            out.append(event_message(ev, self._event_id))
        return common_pb2.KvEventBatch(sequence_number=seq, timestamp=ts, events=out, dp_rank=self.publisher.rank)
