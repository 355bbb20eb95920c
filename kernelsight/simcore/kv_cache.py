"""Paged KV cache: per-request block tables over the block pool, and prefix caching by chained block hashes.

Mirrors vLLM V1's ``kv_cache_manager`` (this module) / ``block_pool`` (``block_pool.py``) split, with the block
hash in ``block_hash.py``:

* a full block's hash is ``hash((parent_hash, block_tokens, extra_keys))`` (extra keys on the first block
  only), so equal hashes mean equal prefixes;
* a request's blocks are freed tail-first so its prefix outlives its suffix (the pool evicts least recently
  freed first).
"""

from __future__ import annotations

import numpy as np

from kernelsight.simcore.block_hash import BlockHasher
from kernelsight.simcore.block_pool import BlockPool
from kernelsight.simcore.compiled import mypyc_attr
from kernelsight.simcore.kv_events import BlockStored, KVEvent
from kernelsight.simcore.request import Request


def mm_block_keys(req: Request, first_block: int, num_blocks: int, block_size: int) -> list[tuple[str, ...]]:
    """Per block, the content hashes of the images/videos whose placeholders it holds (vLLM's multimodal extra
    keys): two prompts with equal placeholder ids but different images never share a block."""
    out: list[tuple[str, ...]] = []
    items = req.mm_items
    for b in range(first_block, first_block + num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        out.append(tuple(it.mm_hash for it in items if it.offset < hi and it.offset + it.num_tokens > lo))
    return out


@mypyc_attr(allow_interpreted_subclasses=True)    # hybrid_kv_cache's manager extends it
class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
        self.enable_caching = enable_caching
        # prefix-cache counters as vLLM reports them (queries/hits in tokens)
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # EAGLE-family speculative decoding: vLLM drops the last block of a prefix hit, whose hidden states the
        # drafter needs recomputed (KVCacheManager(use_eagle=True))
        self.drop_last_hit_block = False

    # -- KV-cache events --------------------------------------------------------------------------
    def enable_events(self) -> None:
        """Record KV-cache events from now on (``take_events`` drains them after each step)."""
        if self.pool.events is None:
            self.pool.events = []

    @property
    def events_enabled(self) -> bool:
        return self.pool.events is not None

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (vLLM's ``take_events``)."""
        ev = self.pool.events
        if not ev:
            return []
        self.pool.events = []
        return ev

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: False (nothing changed) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def _register(self, req: Request, start: int, full: int, new_blocks: tuple[int, np.ndarray] | None = None
                  ) -> None:
        """Blocks start..full-1 of ``req`` enter the prefix cache (one BlockStored for them when recording).
        ``new_blocks``: (index in the block table, index array) of the blocks the pool just allocated for it."""
        block_arr = None
        if new_blocks is not None and start >= new_blocks[0]:
            block_arr = new_blocks[1][start - new_blocks[0]:full - new_blocks[0]]
        arr = req.prompt_block_hashes
        events = self.pool.events
        if events is None and arr is not None and full <= len(arr):
            # prompt blocks: the pool takes their hashes as the array (Python ints only if the chain is ever looked
            # up); the root is the list's first entry
            root = self._ensure_hashes(req, 1)[0]
            self.pool.register(req.block_ids[start:full] if block_arr is None else None, None, root, req.seq_no,
                               start, arr[start:full], block_arr)
            return
        hashes = self._ensure_hashes(req, full)[start:full]
        self.pool.register(req.block_ids[start:full], hashes, req.block_hashes[0], req.seq_no, start,
                           arr[start:full] if arr is not None and full <= len(arr) else None, block_arr)
        if events is not None:
            tokens = self._known_tokens(req, start * self.block_size, full * self.block_size)
            n = len(tokens) // self.block_size      # blocks of synthetic generated keys carry no token ids
            if n:
                events.append(BlockStored(hashes[:n], req.block_hashes[start - 1] if start else None,
                                          tokens[:n * self.block_size], self.block_size, start, req.extra_keys,
                                          mm_keys=mm_block_keys(req, start, n, self.block_size)
                                          if req.mm_items else None))

    @staticmethod
    def _known_tokens(req: Request, lo: int, hi: int) -> list[int]:
        """Token ids lo..hi-1 of ``req`` as far as the engine knows them (generated ids only when given)."""
        prompt = req.prompt_token_ids
        plen = len(prompt)
        head = prompt[lo:min(hi, plen)] if lo < plen else ()
        out = head.tolist() if hasattr(head, "tolist") else list(head)
        if hi > plen and req.output_token_ids is not None:
            outs = req.output_token_ids
            out += list(outs[max(lo - plen, 0):min(hi - plen, len(outs))])
        return out

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = req.block_hashes
        if len(hashes) >= num_full_blocks:
            return hashes
        bs = self.block_size
        hasher = self.hasher
        arr = req.prompt_block_hashes
        if arr is not None:
            # the prompt's hashes were computed at once; the list holds as many as were asked for so far
            if len(hashes) < len(arr):
                hashes.extend(arr[len(hashes):num_full_blocks].tolist())
        elif not hashes:
            prompt_blocks = len(req.prompt_token_ids) // bs
            if prompt_blocks:
                prompt = req.prompt_token_ids
                if isinstance(prompt, np.ndarray):
                    head = prompt[: prompt_blocks * bs]
                    # int64 ids read as uint64 in place: the same bits astype would copy
                    tokens = head.view(np.uint64) if head.dtype == np.int64 else head.astype(np.uint64)
                else:
                    tokens = np.fromiter(prompt, dtype=np.uint64, count=prompt_blocks * bs)
                extras = None
                if req.mm_items:
                    extras = np.fromiter((hasher.extra_key(k) for k in mm_block_keys(req, 0, prompt_blocks, bs)),
                                         dtype=np.uint64, count=prompt_blocks)
                arr = hasher.chain_tokens_array(hasher.start(req.extra_keys), 0, tokens, extras)
                req.prompt_block_hashes = arr
                hashes.extend(arr[:num_full_blocks].tolist())
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else hasher.start(req.extra_keys)
            extra = hasher.extra_key(mm_block_keys(req, i, 1, bs)[0]) if req.mm_items else 0
            hashes.append(hasher.chain_one(parent, i, req.block_content(i, bs), extra))
        return hashes

    def hash_prompt(self, req: Request) -> None:
        """Hash the prompt's full blocks now (vLLM does it when a request is created): a request's arrival, not
        the step that first schedules it, pays for it."""
        if self.enable_caching and len(req.prompt_token_ids) >= self.block_size:
            self._ensure_hashes(req, 1)      # hashes every prompt block; the list holds what is asked for later

    def shareable_blocks(self, req: Request, num_tokens: int) -> int:
        """Full blocks whose content another request could also have: prompt blocks, and generated
        blocks whose token ids are known. Blocks keyed by (request, position) are registered only when
        the request is preempted, the one time they can be hit again."""
        full = num_tokens // self.block_size
        if req.output_token_ids is None:
            return min(full, len(req.prompt_token_ids) // self.block_size)
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        return min(full, known // self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, never the whole sequence (one token must be computed)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        lookup = self.pool.lookup
        hits: list[int] = []
        # the chain is walked from its root: a miss there (most prompts) needs no other hash as a Python int
        if not max_blocks:
            return hits, 0
        b = lookup(self._ensure_hashes(req, 1)[0])
        if b is None:
            return hits, 0
        hits.append(b)
        hashes = self._ensure_hashes(req, max_blocks)
        for i in range(1, max_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            hits.append(b)
        if self.drop_last_hit_block and hits:
            hits.pop()
        # the prefix-cache counters are the scheduler's, once per admitted request (as vLLM records them after a
        # successful allocation): a request retried step after step is queried once
        return hits, len(hits) * self.block_size

    def can_fit(self, req: Request, total_tokens: int, new_computed_blocks: list[int]) -> bool:
        to_alloc = self.blocks_needed(total_tokens) - len(req.block_ids) - len(new_computed_blocks)
        if not new_computed_blocks:
            return to_alloc <= self.pool.num_free_blocks
        evictable_hits = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        return to_alloc + evictable_hits <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens (plus ``num_lookahead_tokens`` slots a speculative drafter
        writes past them, as vLLM's); False (and no change) when blocks run out."""
        new_computed_blocks = new_computed_blocks or []
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        pool = self.pool
        to_alloc = -(-(total + num_lookahead_tokens) // self.block_size) - len(req.block_ids) - len(new_computed_blocks)
        if new_computed_blocks:
            evictable_hits = sum(1 for b in new_computed_blocks if pool.ref_cnt[b] == 0)
            if to_alloc + evictable_hits > pool.num_free_blocks:
                return False
            pool.touch(new_computed_blocks)
            req.block_ids.extend(new_computed_blocks)
            req.num_hashed_blocks_cached = len(req.block_ids)
        elif to_alloc > pool.num_free_blocks:
            return False
        new_blocks = None
        if to_alloc > 0:
            first_new = len(req.block_ids)
            req.block_ids.extend(pool.allocate(to_alloc))
            if pool.last_allocated is not None:
                new_blocks = (first_new, pool.last_allocated)
        if self.enable_caching:
            # draft tokens are not the request's tokens yet: only verified ones enter the prefix cache (vLLM caches
            # min(computed + new, request.num_tokens))
            self._cache_full_blocks(req, total if total <= req.num_tokens else req.num_tokens, new_blocks)
        return True

    def allocate_for_pull(self, req: Request) -> int | None:
        """P/D decode side: blocks for the whole prompt, the local prefix hit reused, the rest to be pulled from the
        prefill instance. Returns the number of blocks to pull, or None (and no change) when they do not fit.

        The pulled blocks enter the prefix cache only once their data has arrived (``cache_pulled``), as vLLM caches
        them when the load completes."""
        hits, _ = self.get_computed_blocks(req)
        pool = self.pool
        to_alloc = self.blocks_needed(req.prompt_len) - len(hits)
        if to_alloc + sum(1 for b in hits if pool.ref_cnt[b] == 0) > pool.num_free_blocks:
            return None
        pool.touch(hits)
        req.block_ids = hits + (pool.allocate(to_alloc) if to_alloc > 0 else [])
        req.num_hashed_blocks_cached = len(hits)
        req.num_cached_tokens = len(hits) * self.block_size
        if req.num_preemptions == 0:
            self.prefix_queries_tokens += req.num_tokens
            self.prefix_hits_tokens += req.num_cached_tokens
        return to_alloc

    def block_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The request's first ``num_full_blocks`` block hashes (computed as needed, prefix caching on or off)."""
        return self._ensure_hashes(req, num_full_blocks)

    def allocate_for_load(self, req: Request, hits: list[int], num_tokens: int) -> bool:
        """KV offloading: blocks for the first ``num_tokens`` tokens, the GPU hit reused, the rest to be loaded from
        the CPU tier. False (no change) when they do not fit. The loaded blocks enter the prefix cache only once the
        load ends (``cache_loaded``), as vLLM caches them then (``delay_cache_blocks``)."""
        pool = self.pool
        to_alloc = self.blocks_needed(num_tokens) - len(hits)
        if to_alloc + sum(1 for b in hits if pool.ref_cnt[b] == 0) > pool.num_free_blocks:
            return False
        if hits:
            pool.touch(hits)
        req.block_ids = hits + (pool.allocate(to_alloc) if to_alloc > 0 else [])
        req.num_hashed_blocks_cached = len(hits)
        return True

    def cache_loaded(self, req: Request, num_tokens: int) -> None:
        """The loaded KV is in place: its full blocks become prefix-cache hits for others."""
        if self.enable_caching:
            self._cache_full_blocks(req, num_tokens)

    def cache_pulled(self, req: Request) -> None:
        """The pulled KV is in place: its full prompt blocks become prefix-cache hits for others."""
        if self.enable_caching:
            self._cache_full_blocks(req, req.prompt_len)

    def _cache_full_blocks(self, req: Request, num_tokens: int,
                           new_blocks: tuple[int, np.ndarray] | None = None) -> None:
        """Register blocks that become full once ``num_tokens`` are computed (vLLM does it at allocation)."""
        full = self.shareable_blocks(req, num_tokens)
        start = req.num_hashed_blocks_cached
        if full <= start:
            return
        # freshly allocated blocks carry no hash yet; a duplicate hash (the same prefix computed twice at
        # once) maps to the newest block
        self._register(req, start, full, new_blocks)
        req.num_hashed_blocks_cached = full

    def free(self, req: Request, preempted: bool = False) -> None:
        """Release all of a request's blocks, tail first (so its prefix is evicted last).

        A preempted request first registers every computed full block, so that its recompute can hit
        them (including generated blocks that only it can ever match)."""
        if preempted and self.enable_caching and req.block_ids:
            full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
            start = req.num_hashed_blocks_cached
            if full > start:
                self._register(req, start, full)
        if req.block_ids:
            self.pool.release(req.block_ids[::-1])
            req.block_ids = []
        req.num_hashed_blocks_cached = 0
