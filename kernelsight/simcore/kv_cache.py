"""Paged KV cache: a block pool with an LRU free queue, and prefix caching by chained block hashes.

Mirrors vLLM V1's ``block_pool`` / ``kv_cache_manager`` split:

* block 0 is the reserved null block, so ``num_gpu_blocks − 1`` blocks hold KV;
* a full block's hash is ``hash((parent_hash, block_tokens, extra_keys))`` (extra keys on the first block
  only), so equal hashes mean equal prefixes;
* freed blocks keep their hash and stay reusable until a new allocation evicts them, least recently
  freed first; a request's blocks are freed tail-first so its prefix outlives its suffix.
"""

from __future__ import annotations

from collections import OrderedDict

from kernelsight.simcore.request import Request

NONE_HASH = hash(("kernelsight-none-hash",))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Insertion order = LRU order; block 0 (null block) is never handed out.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}   # hash -> block id
        self.ref_cnt[0] = 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        out = []
        free_queue, block_hash, cached = self.free_queue, self.block_hash, self.cached
        for _ in range(n):
            b, _ = free_queue.popitem(last=False)
            h = block_hash[b]
            if h is not None:          # evict its cached content
                if cached.get(h) == b:
                    del cached[h]
                block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def release(self, blocks_in_eviction_order: list[int]) -> None:
        for b in blocks_in_eviction_order:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache(self, block: int, h: int) -> None:
        if self.block_hash[block] is None:
            self.block_hash[block] = h
            self.cached.setdefault(h, block)


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        # prefix-cache counters as vLLM reports them (queries/hits in tokens)
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else NONE_HASH
            extra = req.extra_keys if i == 0 else None
            hashes.append(hash((parent, req.block_content(i, bs), extra)))
        return hashes

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, never the whole sequence (one token must be computed)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(req, max_blocks)
        cached = self.pool.cached
        hits = []
        for i in range(max_blocks):
            b = cached.get(hashes[i])
            if b is None:
                break
            hits.append(b)
        if req.num_preemptions == 0:
            self.prefix_queries_tokens += req.num_tokens
            self.prefix_hits_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def can_fit(self, req: Request, total_tokens: int, new_computed_blocks: list[int]) -> bool:
        to_alloc = self.blocks_needed(total_tokens) - len(req.block_ids) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        return to_alloc + evictable_hits <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
                       num_new_computed_tokens: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and no change) when blocks run out."""
        new_computed_blocks = new_computed_blocks or []
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        pool = self.pool
        to_alloc = -(-total // self.block_size) - len(req.block_ids) - len(new_computed_blocks)
        if new_computed_blocks:
            evictable_hits = sum(1 for b in new_computed_blocks if pool.ref_cnt[b] == 0)
            if to_alloc + evictable_hits > len(pool.free_queue):
                return False
            pool.touch(new_computed_blocks)
            req.block_ids.extend(new_computed_blocks)
            req.num_hashed_blocks_cached = len(req.block_ids)
        elif to_alloc > len(pool.free_queue):
            return False
        if to_alloc > 0:
            req.block_ids.extend(pool.allocate(to_alloc))
        if self.enable_caching:
            self._cache_full_blocks(req, total)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register blocks that become full once ``num_tokens`` are computed (vLLM does it at allocation)."""
        full = num_tokens // self.block_size
        start = req.num_hashed_blocks_cached
        if full <= start:
            return
        hashes = self._ensure_hashes(req, full)
        for i in range(start, full):
            self.pool.cache(req.block_ids[i], hashes[i])
        req.num_hashed_blocks_cached = full

    def free(self, req: Request) -> None:
        """Release all of a request's blocks, tail first (so its prefix is evicted last)."""
        if req.block_ids:
            self.pool.release(req.block_ids[::-1])
            req.block_ids = []
        req.num_hashed_blocks_cached = 0
