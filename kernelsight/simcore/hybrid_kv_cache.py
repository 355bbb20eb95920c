"""vLLM's hybrid KV-cache allocator for models mixing sliding-window and full-attention layers (gpt-oss).

vLLM (``kv_cache_utils`` / ``kv_cache_coordinator.HybridKVCacheCoordinator``) puts layers of one attention kind
into KV-cache groups of equal size; one block id then stands for one page in each layer of a group, so a block
holds ``group_size`` layers' KV and every group takes its blocks from one shared pool. A request holds a block
table per group:

* the full-attention group (group 0 here; ``Request.block_ids``) keeps every block until the request ends;
* the sliding-window group (group 1) frees the blocks that fall wholly outside the window before each allocation
  (``SlidingWindowManager.remove_skipped_blocks``: they become the null block in the table), and never allocates
  blocks the window has already passed when a request starts from a prefix hit.

Prefix caching follows the coordinator: the full-attention hit is the longest cached prefix; within it, the
sliding-window group needs only the last ``cdiv(window - 1, block_size)`` blocks before the hit's end cached
(searched right to left); the hit is the shorter of the two. A group's cached block is keyed by the block hash
and the group (vLLM's ``BlockHashWithGroupId``), so the same prefix is cached once per group.

Only one full-attention group and one sliding-window group are modelled (gpt-oss: as many sliding as full
layers); ``hybrid_layout`` refuses other layer mixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.kv_events import BlockStored
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.request import Request

FULL_GROUP = 0
SLIDING_GROUP = 1
_NULL_BLOCK = 0                   # the pool's reserved block 0 is vLLM's null block
_GROUP_SALT = 0x9E3779B97F4A7C15   # keys a sliding-window block apart from the full-attention block of one hash
_U64 = (1 << 64) - 1


def sliding_group_key(block_hash: int) -> int:
    """The prefix-cache key of the sliding-window group's block holding the content of ``block_hash``."""
    return ((block_hash ^ _GROUP_SALT) * 0xBF58476D1CE4E5B9) & _U64 or 1


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """How vLLM groups a hybrid model's layers: ``group_size`` layers per group, one group per attention kind."""

    group_size: int
    sliding_window: int

    def block_bytes(self, block_size: int, kv_bytes_per_token_per_layer: float) -> float:
        """Bytes of one pool block: a page in each of ``group_size`` layers."""
        return block_size * kv_bytes_per_token_per_layer * self.group_size


def hybrid_layout(model: ModelSpec) -> HybridLayout:
    """vLLM's grouping of a sliding/full mix; ValueError for mixes that need more than one group per kind."""
    n_sw = model.num_window_layers
    n_full = model.num_layers - n_sw
    if not model.is_hybrid_attention or model.sliding_window is None:
        raise ValueError(f"{model.name} does not mix sliding-window and full-attention layers")
    if n_sw != n_full:
        raise ValueError(f"{model.name}: {n_sw} sliding-window and {n_full} full-attention layers need several KV "
                         "cache groups per attention kind (vLLM's general hybrid grouping), which is not modelled")
    return HybridLayout(group_size=n_full, sliding_window=model.sliding_window)


def max_request_kv_blocks(layout: HybridLayout, block_size: int, max_model_len: int,
                          max_num_batched_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens can hold at once (vLLM's ``max_memory_usage_bytes``): every
    block in the full group, the window plus one step's chunk (and one block of slack) in the sliding group."""
    full = math.ceil(max_model_len / block_size)
    sw_tokens = min(layout.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return full + math.ceil(sw_tokens / block_size) + 1


class _HybridHits(list):
    """A prefix hit: the full-attention group's blocks, with the sliding-window group's table in ``sw``."""

    sw: list[int]


class HybridKVCacheManager(KVCacheManager):
    """Block tables for a full-attention group (``req.block_ids``) and a sliding-window group over one pool."""

    #: the engine's decode group allocates full-attention blocks only: run vLLM's per-request loop instead
    exact_loop_only = True

    def __init__(self, num_gpu_blocks: int, block_size: int, sliding_window: int,
                 enable_caching: bool = True) -> None:
        super().__init__(num_gpu_blocks, block_size, enable_caching)
        self.sliding_window = sliding_window
        # contiguous cached blocks a sliding-window hit needs (the new token is in its own window: -1)
        self._sw_hit_blocks = max(math.ceil((sliding_window - 1) / block_size), 1)
        self._sw: dict[str, list[int]] = {}         # request id -> sliding-window table (0 = null: freed)
        self._sw_cached: dict[str, int] = {}        # request id -> leading sliding-window blocks registered

    def sliding_blocks(self, req: Request) -> list[int]:
        """The request's sliding-window block table (null entries are 0)."""
        return self._sw.get(req.request_id, [])

    # -- freeing outside the window ---------------------------------------------------------------------
    def _remove_skipped_blocks(self, table: list[int], num_computed_tokens: int) -> None:
        """Blocks wholly before the window of the next token go back to the pool (vLLM's order: last one first)."""
        skipped = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        removed = []
        for i in range(min(skipped, len(table)) - 1, -1, -1):
            if table[i] == _NULL_BLOCK:
                break              # everything before it was nulled by an earlier call
            removed.append(table[i])
            table[i] = _NULL_BLOCK
        if removed:
            self.pool.release(removed)

    # -- prefix caching -------------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self._ensure_hashes(req, max_blocks)
        lookup = self.pool.lookup
        full: list[int] = []
        for i in range(max_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            full.append(b)
        # sliding window: right to left within the full hit, the first run of enough contiguous cached blocks
        n = len(full)
        sw = [_NULL_BLOCK] * n
        run = 0
        found = False
        for i in range(n - 1, -1, -1):
            b = lookup(sliding_group_key(hashes[i]))
            if b is None:
                run = 0
                continue
            sw[i] = b
            run += 1
            if run >= self._sw_hit_blocks:
                del sw[i + run:]
                found = True
                break
        if not found:
            del sw[run:]           # a run from block 0 is a hit even if shorter than the window
        hits = _HybridHits(full[:len(sw)])
        hits.sw = sw
        return hits, len(sw) * bs       # counted by the scheduler once the request is admitted

    def _to_allocate(self, req: Request, total: int, hits: list[int], num_new_computed_tokens: int
                     ) -> tuple[int, int, list[int]]:
        """(full-group blocks, sliding-group blocks, the hit's real sliding blocks) to allocate for ``total``."""
        need = -(-total // self.block_size)
        sw_hits = getattr(hits, "sw", [])
        table = self._sw.get(req.request_id, ())
        to_full = need - len(req.block_ids) - len(hits)
        # blocks the window has passed once the computed (and hit) tokens are in are never allocated
        skipped = max(req.num_computed_tokens + num_new_computed_tokens - self.sliding_window + 1, 0) \
            // self.block_size
        to_sw = need - max(len(table) + len(sw_hits), skipped)
        return max(to_full, 0), max(to_sw, 0), [b for b in sw_hits if b != _NULL_BLOCK]

    def can_fit(self, req: Request, total_tokens: int, new_computed_blocks: list[int]) -> bool:
        to_full, to_sw, sw_real = self._to_allocate(req, total_tokens, new_computed_blocks, 0)
        ref = self.pool.ref_cnt
        evictable = sum(1 for b in new_computed_blocks if ref[b] == 0) + sum(1 for b in sw_real if ref[b] == 0)
        return to_full + to_sw + evictable <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> bool:
        hits = new_computed_blocks if new_computed_blocks is not None else []
        rid = req.request_id
        table = self._sw.setdefault(rid, [])
        if table:
            self._remove_skipped_blocks(table, req.num_computed_tokens)
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        # a speculative drafter's lookahead slots are allocated in every group (vLLM's coordinator), never cached
        to_full, to_sw, sw_real = self._to_allocate(req, total + num_lookahead_tokens, hits, num_new_computed_tokens)
        pool = self.pool
        ref = pool.ref_cnt
        evictable = sum(1 for b in hits if ref[b] == 0) + sum(1 for b in sw_real if ref[b] == 0)
        if to_full + to_sw + evictable > pool.num_free_blocks:
            return False
        if hits:
            pool.touch(list(hits))
            req.block_ids.extend(hits)
            req.num_hashed_blocks_cached = len(req.block_ids)
        sw_hits = getattr(hits, "sw", [])
        if sw_real:
            pool.touch(sw_real)
        if sw_hits:
            table.extend(sw_hits)
            self._sw_cached[rid] = len(table)
        skipped = max(req.num_computed_tokens + num_new_computed_tokens - self.sliding_window + 1, 0) \
            // self.block_size
        if len(table) < skipped:
            table.extend([_NULL_BLOCK] * (skipped - len(table)))
        if to_full:
            req.block_ids.extend(pool.allocate(to_full))
        if to_sw:
            table.extend(pool.allocate(to_sw))
        if self.enable_caching:
            self._cache_full_blocks(req, total)
            self._cache_sliding_blocks(req, table, total)
        return True

    def _cache_sliding_blocks(self, req: Request, table: list[int], num_tokens: int, preempted: bool = False) -> None:
        """Register the sliding-window group's newly full blocks (null entries are skipped, as vLLM does); a
        preempted request registers every computed full block, as the full-attention group does."""
        rid = req.request_id
        full = num_tokens // self.block_size if preempted else self.shareable_blocks(req, num_tokens)
        full = min(full, len(table))
        start = self._sw_cached.get(rid, 0)
        if full <= start:
            return
        hashes = self._ensure_hashes(req, full)
        idx = [i for i in range(start, full) if table[i] != _NULL_BLOCK]
        if idx:
            keys = [sliding_group_key(hashes[i]) for i in idx]
            self.pool.register([table[i] for i in idx], keys)
            events = self.pool.events
            if events is not None:
                self._record_sliding_stored(req, idx, keys, events)
        self._sw_cached[rid] = full

    def _record_sliding_stored(self, req: Request, idx: list[int], keys: list[int], events: list) -> None:
        """One BlockStored per run of consecutive registered blocks, tagged with the sliding-window group."""
        bs = self.block_size
        run_start = 0
        for j in range(1, len(idx) + 1):
            if j < len(idx) and idx[j] == idx[j - 1] + 1:
                continue
            lo, hi = idx[run_start], idx[j - 1] + 1
            tokens = self._known_tokens(req, lo * bs, hi * bs)
            n = len(tokens) // bs
            if n:
                # vLLM announces the content hash (the same as the full-attention group's) with group_idx 1; the
                # parent is named by the full-attention block's key, whose hash the publisher knows
                parent = req.block_hashes[lo - 1] if lo else None
                events.append(BlockStored(keys[run_start:run_start + n], parent, tokens[:n * bs], bs, lo,
                                          req.extra_keys, SLIDING_GROUP, self.sliding_window))
            run_start = j

    def free(self, req: Request, preempted: bool = False) -> None:
        """Both groups' blocks back to the pool, full-attention group first (vLLM frees its managers in group
        order); a preempted request's full-attention blocks are registered first too, since the sliding group's
        stored events name them as parents."""
        rid = req.request_id
        table = self._sw.pop(rid, [])
        super().free(req, preempted)
        if preempted and self.enable_caching and table:
            self._cache_sliding_blocks(req, table, req.num_computed_tokens, preempted=True)
        self._sw_cached.pop(rid, None)
        live = [b for b in table if b != _NULL_BLOCK]
        if live:
            self.pool.release(live[::-1])
