"""KV-cache events as plain data: what the block pool did, recorded where it happens and drained once per step.

vLLM's block pool queues ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` when it caches full blocks,
evicts a cached block, or resets the prefix cache, and the engine core publishes the queue after each step. The
simulated pool records the same three facts here. Hashes are the simulator's own prefix-cache keys
(``block_hash.py``): the publisher (``server/kv_events``) turns them into vLLM's hashes from the token ids carried
by ``BlockStored``, so the simulation pays nothing for vLLM's hash functions unless events are on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one request entered the prefix cache.

    ``parent_key`` is the key of the block just before the first one (None when the first one starts the
    sequence); ``first_block_index`` is its position in the request (vLLM's cache salt joins block 0 only)."""

    keys: list[int]
    parent_key: int | None
    token_ids: list[int]
    block_size: int
    first_block_index: int
    extra_keys: tuple | None
    group_idx: int = 0       # the KV-cache group (hybrid models: 0 full attention, 1 sliding window)
    sliding_window: int | None = None   # the group's window when it is a sliding-window group
    # per block, the content hashes of the multimodal items it holds placeholders of (None: a text-only request)
    mm_keys: list[tuple[str, ...]] | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted (reallocated), in eviction order, one key per block: one allocation's evictions
    share a record (vLLM emits one event per block; the publisher splits the record)."""

    keys: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


@dataclass(slots=True)
class HostBlocksStored:
    """Blocks finished their copy into the KV-offloading tier (``simcore/kv_offload.py``): vLLM's offloading connector
    announces them by hash only (no parent, no token ids), with the tier's ``medium`` ("CPU"). ``keys`` are the
    simulator's keys of blocks the GPU prefix cache announced before."""

    keys: list[int]
    block_size: int
    medium: str


@dataclass(slots=True)
class HostBlocksRemoved:
    """Blocks were evicted from the KV-offloading tier."""

    keys: list[int]
    medium: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | HostBlocksStored | HostBlocksRemoved
