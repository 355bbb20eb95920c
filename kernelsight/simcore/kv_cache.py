"""Paged KV cache: a block pool with an LRU free queue, and prefix caching by chained block hashes.

Mirrors vLLM V1's ``block_pool`` / ``kv_cache_manager`` split:

* block 0 is the reserved null block, so ``num_gpu_blocks − 1`` blocks hold KV;
* a full block's hash is ``hash((parent_hash, block_tokens, extra_keys))`` (extra keys on the first block
  only), so equal hashes mean equal prefixes;
* freed blocks keep their hash and stay reusable until a new allocation evicts them, least recently
  freed first; a request's blocks are freed tail-first so its prefix outlives its suffix.
"""

from __future__ import annotations

import hashlib
from collections import deque

import numpy as np

from kernelsight.simcore.request import Request

_MASK = (1 << 64) - 1


class BlockHasher:
    """Chained block hashes, computed for a whole prompt at once with numpy.

        content_i = Σ_k token_k · K_k        mod 2⁶⁴   (K: fixed random odd 64-bit key per in-block offset)
        hash_i    = hash_{i−1} + content_i · R_i  mod 2⁶⁴   (R: fixed random odd key per block position)

    hash_i therefore depends on every token of blocks 0..i and their order, like vLLM's
    ``H((parent, tokens, extra))``: two different prefixes collide only if a random linear form vanishes
    on their difference (probability ≈ 2⁻⁶⁰ per pair for token-id differences). A 1,000-token prompt costs a
    handful of numpy calls instead of 60 Python tuple hashes. Keys come from a fixed seed, so hashes are
    identical across runs.
    """

    def __init__(self, block_size: int) -> None:
        rng = np.random.default_rng(0x6B65726E656C)
        self.block_size = block_size
        self._k = rng.integers(1, 2**63, size=block_size, dtype=np.uint64) | np.uint64(1)
        self._k_list = [int(x) for x in self._k]
        self._r = np.zeros(0, dtype=np.uint64)
        self._r_list: list[int] = []
        self._ensure_positions(4096)

    def _ensure_positions(self, n: int) -> None:
        if n <= len(self._r):
            return
        size = max(n, 2 * len(self._r))
        # regenerate from the seed: the first values are the same for any size, so hashes stay stable
        self._r = np.random.default_rng(0x706F73).integers(1, 2**63, size=size, dtype=np.uint64) | np.uint64(1)
        self._r_list = [int(x) for x in self._r]

    def start(self, extra_keys: tuple | None) -> int:
        """Chain seed: 0 without extra keys; extra keys (LoRA, cache salt) start a separate chain."""
        if extra_keys is None:
            return 0
        data = repr(extra_keys).encode()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def chain_tokens(self, parent: int, first_block: int, tokens: np.ndarray) -> list[int]:
        """Hashes of consecutive full blocks of ``tokens`` (uint64, length a multiple of block_size)."""
        nb = len(tokens) // self.block_size
        self._ensure_positions(first_block + nb)
        content = tokens.reshape(nb, self.block_size) @ self._k
        content *= self._r[first_block:first_block + nb]
        h = np.cumsum(content, dtype=np.uint64)
        h += np.uint64(parent)
        return h.tolist()

    def chain_one(self, parent: int, block_index: int, content: tuple) -> int:
        """Hash of one block from Python: known token ids hash exactly like ``chain_tokens``."""
        self._ensure_positions(block_index + 1)
        if all(type(t) is int for t in content):
            c = sum(t * k for t, k in zip(content, self._k_list, strict=True)) & _MASK
        else:                            # synthetic generated-token key: private to its request
            c = hash(content) & _MASK
        return (parent + c * self._r_list[block_index]) & _MASK


class BlockPool:
    """KV blocks with reference counts, an LRU free queue and the prefix-cache map, in bulk form.

    Block 0 is vLLM's reserved null block. The free queue is a FIFO of *segments*: each release appends
    one segment (the request's freed blocks, tail first), allocation takes from the oldest segment. A
    block taken back by a cache hit while free is not searched for: its entry goes stale, recognised by
    ``ref_cnt > 0`` or by a newer segment id in ``_free_seg``. The prefix-cache map ``hash -> block`` is
    likewise checked against ``block_hash`` on lookup, so evicting a block is one array write. The order
    in which blocks are reused is exactly vLLM's LRU order; the bookkeeping is numpy array operations per
    request instead of Python work per block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int64)
        self.ref_cnt[0] = 1
        self.block_hash = np.zeros(num_blocks, dtype=np.uint64)   # 0 = holds no cached content
        self.cached: dict[int, int] = {}                            # hash -> block (validated on lookup)
        self._free_seg = np.zeros(num_blocks, dtype=np.int64)      # segment holding the live free entry
        self._segments: deque[list] = deque([[0, list(range(1, num_blocks)), 0]])  # [id, blocks, next]
        self._next_segment = 1
        self._dirty: set[int] = set()     # segments holding entries taken back by cache hits
        self.num_free_blocks = num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def free_blocks(self) -> list[int]:
        """The free queue in eviction order (for inspection; the hot paths never build it)."""
        out = []
        ref, fs = self.ref_cnt, self._free_seg
        for sid, blocks, pos in self._segments:
            out += [b for b in blocks[pos:] if fs[b] == sid and ref[b] == 0]
        return out

    def allocate(self, n: int) -> list[int]:
        """Take the n least recently freed blocks (evicting their cached content). Caller checks n ≤ free."""
        if n <= 0:
            return []
        segs, ref, fs = self._segments, self.ref_cnt, self._free_seg
        parts = []
        got = 0
        while got < n:
            seg = segs[0]
            sid, blocks, pos = seg
            take = blocks[pos:pos + (n - got)]
            seg[2] = pos + len(take)
            if seg[2] >= len(blocks):
                segs.popleft()
            arr = np.array(take, dtype=np.int64)
            arr = arr[(fs[arr] == sid) & (ref[arr] == 0)]
            parts.append(arr)
            got += len(arr)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        ref[out] = 1
        self.block_hash[out] = 0
        self.num_free_blocks -= n
        return out.tolist()

    def allocate_one(self) -> int | None:
        """One block, without array overhead (the decode group needs one block at a time)."""
        segs = self._segments
        while segs:
            seg = segs[0]
            sid, blocks, pos = seg
            n = len(blocks)
            if sid not in self._dirty:
                # no block of this segment was taken back by a cache hit: every remaining entry is live
                b = blocks[pos]
                if pos + 1 >= n:
                    segs.popleft()
                else:
                    seg[2] = pos + 1
                self.ref_cnt[b] = 1
                self.block_hash[b] = 0
                self.num_free_blocks -= 1
                return b
            ref, fs = self.ref_cnt, self._free_seg
            while pos < n:
                b = blocks[pos]
                pos += 1
                if fs[b] == sid and ref[b] == 0:
                    if pos >= n:
                        segs.popleft()
                    else:
                        seg[2] = pos
                    ref[b] = 1
                    self.block_hash[b] = 0
                    self.num_free_blocks -= 1
                    return b
            segs.popleft()
        return None

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cache-hit blocks; free ones leave the queue (their entry goes stale)."""
        arr = np.array(blocks, dtype=np.int64)
        was_free = arr[self.ref_cnt[arr] == 0]
        if was_free.size:
            self.num_free_blocks -= int(was_free.size)
            self._dirty.update(self._free_seg[was_free].tolist())   # their segments now hold stale entries
        self.ref_cnt[arr] += 1

    def release(self, blocks_in_eviction_order: list[int]) -> None:
        arr = np.array(blocks_in_eviction_order, dtype=np.int64)
        ref = self.ref_cnt
        ref[arr] -= 1
        zeros = arr[ref[arr] == 0]
        if zeros.size:
            sid = self._next_segment
            self._next_segment += 1
            self._free_seg[zeros] = sid
            self._segments.append([sid, zeros.tolist(), 0])
            self.num_free_blocks += int(zeros.size)

    def lookup(self, h: int) -> int | None:
        """The block holding content hash h, if any (stale map entries are dropped here)."""
        b = self.cached.get(h)
        if b is None:
            return None
        if self.block_hash[b] != h:
            del self.cached[h]
            return None
        return b

    def register(self, blocks: list[int], hashes: list[int]) -> None:
        """Record freshly filled blocks in the prefix cache."""
        self.block_hash[np.array(blocks, dtype=np.int64)] = np.array(hashes, dtype=np.uint64)
        self.cached.update(zip(hashes, blocks, strict=True))
        if len(self.cached) > 8 * self.num_blocks + 4096:   # drop stale entries now and then
            held = np.flatnonzero(self.block_hash)
            self.cached = dict(zip(self.block_hash[held].tolist(), held.tolist(), strict=True))


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
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
        if len(hashes) >= num_full_blocks:
            return hashes
        bs = self.block_size
        hasher = self.hasher
        if not hashes:
            prompt_blocks = len(req.prompt_token_ids) // bs
            if prompt_blocks:
                prompt = req.prompt_token_ids
                if isinstance(prompt, np.ndarray):
                    tokens = prompt[: prompt_blocks * bs].astype(np.uint64)
                else:
                    tokens = np.fromiter(prompt, dtype=np.uint64, count=prompt_blocks * bs)
                hashes.extend(hasher.chain_tokens(hasher.start(req.extra_keys), 0, tokens))
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else hasher.start(req.extra_keys)
            hashes.append(hasher.chain_one(parent, i, req.block_content(i, bs)))
        return hashes

    def hash_prompt(self, req: Request) -> None:
        """Hash the prompt's full blocks now (vLLM does it when a request is created): a request's arrival, not
        the step that first schedules it, pays for it."""
        if self.enable_caching:
            self._ensure_hashes(req, len(req.prompt_token_ids) // self.block_size)

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
        hashes = self._ensure_hashes(req, max_blocks)
        lookup = self.pool.lookup
        hits = []
        for i in range(max_blocks):
            b = lookup(hashes[i])
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
            if to_alloc + evictable_hits > pool.num_free_blocks:
                return False
            pool.touch(new_computed_blocks)
            req.block_ids.extend(new_computed_blocks)
            req.num_hashed_blocks_cached = len(req.block_ids)
        elif to_alloc > pool.num_free_blocks:
            return False
        if to_alloc > 0:
            req.block_ids.extend(pool.allocate(to_alloc))
        if self.enable_caching:
            self._cache_full_blocks(req, total)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register blocks that become full once ``num_tokens`` are computed (vLLM does it at allocation)."""
        full = self.shareable_blocks(req, num_tokens)
        start = req.num_hashed_blocks_cached
        if full <= start:
            return
        # freshly allocated blocks carry no hash yet; a duplicate hash (the same prefix computed twice at
        # once) maps to the newest block
        self.pool.register(req.block_ids[start:full], self._ensure_hashes(req, full)[start:full])
        req.num_hashed_blocks_cached = full

    def free(self, req: Request, preempted: bool = False) -> None:
        """Release all of a request's blocks, tail first (so its prefix is evicted last).

        A preempted request first registers every computed full block, so that its recompute can hit
        them (including generated blocks that only it can ever match)."""
        if preempted and self.enable_caching and req.block_ids:
            full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
            start = req.num_hashed_blocks_cached
            if full > start:
                self.pool.register(req.block_ids[start:full], self._ensure_hashes(req, full)[start:full])
        if req.block_ids:
            self.pool.release(req.block_ids[::-1])
            req.block_ids = []
        req.num_hashed_blocks_cached = 0
