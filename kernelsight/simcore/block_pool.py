"""The KV block pool: reference counts, an LRU free queue, and the prefix-cache map from block hash to block.

vLLM V1's ``block_pool``: block 0 is the reserved null block, so ``num_gpu_blocks − 1`` blocks hold KV; freed
blocks keep their hash and stay reusable until a new allocation evicts them, least recently freed first.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kernelsight.simcore.kv_events import AllBlocksCleared, BlockRemoved, KVEvent

#: allocations of at most this many blocks write their counts one by one (measured break-even with numpy: ~8-12)
_SCALAR_MAX = 8


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
        # Registrations by chain root (a request's first block hash) not yet in ``cached``: a chain enters the map
        # when its root is first looked up, so a prompt nobody shares never pays its ~60 dict inserts. Exact: a
        # lookup walks a chain from its root, and a root's keys are either all pending or all in ``cached``
        # (``_roots_in_map`` holds at least every root with a key there). ``_num_pending`` keeps
        # len(cached) + pending keys equal to what len(cached) would be with every registration applied, so the
        # stale-entry sweep runs at the same moments.
        self._pending: dict[int, list] = {}       # root -> [owner, end block index, [(blocks, keys), ...]]
        self._num_pending = 0
        self._roots_in_map: set[int] = set()
        self.block_root = np.zeros(num_blocks, dtype=np.uint64)    # the chain root a cached block was registered under
        self._free_seg = np.zeros(num_blocks, dtype=np.int64)      # segment holding the live free entry
        # [id, blocks, next, the blocks as an index array (allocations from one segment index with its slice)]
        self._segments: deque[list] = deque([[0, list(range(1, num_blocks)), 0, np.arange(1, num_blocks)]])
        self._next_segment = 1
        self._dirty: set[int] = set()     # segments holding entries taken back by cache hits
        self.num_free_blocks = num_blocks - 1
        # the blocks of the last ``allocate`` as an index array when it built one (None: it did not)
        self.last_allocated: np.ndarray | None = None
        # KV-cache events (vLLM's kv_event_queue): None while events are off, so the hot paths pay one test
        self.events: list[KVEvent] | None = None

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def free_blocks(self) -> list[int]:
        """The free queue in eviction order (for inspection; the hot paths never build it)."""
        out = []
        ref, fs = self.ref_cnt, self._free_seg
        for sid, blocks, pos, _ in self._segments:
            out += [b for b in blocks[pos:] if fs[b] == sid and ref[b] == 0]
        return out

    def allocate(self, n: int) -> list[int]:
        """Take the n least recently freed blocks (evicting their cached content). Caller checks n ≤ free."""
        self.last_allocated = None
        if n <= 0:
            return []
        segs, ref, dirty = self._segments, self.ref_cnt, self._dirty
        seg = segs[0]
        sid, blocks, pos, seg_arr = seg
        end = pos + n
        if sid not in dirty and end <= len(blocks):
            # the common case: one segment, every entry live (no block of it was taken back by a cache hit)
            out = blocks[pos:end]
            if end >= len(blocks):
                segs.popleft()
            else:
                seg[2] = end
            if n <= _SCALAR_MAX and self.events is None:
                # a few blocks (the decode group's needs of a step): scalar writes cost less than an index array
                bh = self.block_hash
                for b in out:
                    ref[b] = 1
                    bh[b] = 0
                self.num_free_blocks -= n
                return out
            arr = seg_arr[pos:end]
        else:
            fs = self._free_seg
            out = []
            pieces = []
            while len(out) < n:
                seg = segs[0]
                sid, blocks, pos, seg_arr = seg
                end = pos + (n - len(out))
                take = blocks[pos:end]
                piece = seg_arr[pos:end]
                seg[2] = pos + len(take)
                if seg[2] >= len(blocks):
                    segs.popleft()
                if sid in dirty:
                    piece = piece[(fs[piece] == sid) & (ref[piece] == 0)]
                    take = piece.tolist()
                # else no block of the segment was taken back by a cache hit: every entry is live
                out += take
                pieces.append(piece)
            arr = np.concatenate(pieces)
        ref[arr] = 1
        if self.events is not None:
            self._record_evictions(arr)
        self.block_hash[arr] = 0
        self.num_free_blocks -= n
        self.last_allocated = arr
        return out

    def allocate_one(self) -> int | None:
        """One block, without array overhead (the decode group needs one block at a time)."""
        segs = self._segments
        while segs:
            seg = segs[0]
            sid, blocks, pos = seg[0], seg[1], seg[2]
            n = len(blocks)
            if sid not in self._dirty:
                # no block of this segment was taken back by a cache hit: every remaining entry is live
                b = blocks[pos]
                if pos + 1 >= n:
                    segs.popleft()
                else:
                    seg[2] = pos + 1
                self.ref_cnt[b] = 1
                if self.events is not None and self.block_hash[b]:
                    self.events.append(BlockRemoved([int(self.block_hash[b])]))
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
                    if self.events is not None and self.block_hash[b]:
                        self.events.append(BlockRemoved([int(self.block_hash[b])]))
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
        left = ref[arr] - 1
        ref[arr] = left
        if np.count_nonzero(left):      # shared blocks stay held: only the last reference frees a block
            zeros = arr[left == 0]
            if not zeros.size:
                return
            freed = zeros.tolist()
        else:                           # the common case: every block was the request's alone
            zeros, freed = arr, list(blocks_in_eviction_order)
        sid = self._next_segment
        self._next_segment += 1
        self._free_seg[zeros] = sid
        self._segments.append([sid, freed, 0, zeros])
        self.num_free_blocks += len(freed)

    def lookup(self, h: int) -> int | None:
        """The block holding content hash h, if any (stale map entries are dropped here)."""
        b = self.cached.get(h)
        if b is None:
            if h not in self._pending:
                return None
            self._flush_root(h)
            b = self.cached.get(h)
            if b is None:
                return None
        if self.block_hash[b] != h:
            del self.cached[h]
            return None
        return b

    def register(self, blocks: list[int] | None, hashes: list[int] | None, root: int | None = None, owner: int = -1,
                 first_index: int = 0, hashes_array: np.ndarray | None = None,
                 blocks_array: np.ndarray | None = None) -> None:
        """Record freshly filled blocks in the prefix cache.

        With ``root`` (the first block hash of the chain the blocks continue, ``hashes`` its blocks
        ``first_index``.. of the request numbered ``owner``, unique per pool), the map entries wait until that root
        is looked up: lookups must then walk the chain from its root, as a prefix-cache query does.
        ``hashes_array``, ``blocks_array``: the same as arrays, when the caller has them so (``hashes`` and
        ``blocks`` may then be None: a pending chain keeps the arrays, made Python ints when it enters the map)."""
        idx = blocks_array if blocks_array is not None else np.array(blocks, dtype=np.int64)
        self.block_hash[idx] = hashes_array if hashes_array is not None else np.array(hashes, dtype=np.uint64)
        n = len(idx)
        if root is None:
            self.block_root[idx] = 0
            self.cached.update(zip(hashes if hashes is not None else hashes_array.tolist(),  # type: ignore[union-attr]
                                   blocks if blocks is not None else idx.tolist(), strict=True))
        else:
            self.block_root[idx] = root
            pend = self._pending.get(root)
            end = first_index + n
            keys = hashes if hashes is not None else hashes_array
            where = blocks if blocks is not None else idx
            if pend is not None and pend[0] == owner and first_index >= pend[1]:
                pend[1] = end                 # the same request's next blocks: keys unseen so far
                pend[2].append((where, keys))
                self._num_pending += n
            elif pend is None and root not in self._roots_in_map:
                self._pending[root] = [owner, end, [(where, keys)]]
                self._num_pending += n
            else:                             # another request's blocks under this root: keys may repeat
                if pend is not None:
                    self._flush_root(root)
                self._roots_in_map.add(root)
                self.cached.update(zip(hashes if hashes is not None else hashes_array.tolist(),  # type: ignore[union-attr]
                                       blocks if blocks is not None else idx.tolist(), strict=True))
        if len(self.cached) + self._num_pending > 8 * self.num_blocks + 4096:   # drop stale entries now and then
            held = np.flatnonzero(self.block_hash)
            self.cached = dict(zip(self.block_hash[held].tolist(), held.tolist(), strict=True))
            self._pending.clear()
            self._num_pending = 0
            roots = set(self.block_root[held].tolist())
            roots.discard(0)
            self._roots_in_map = roots

    def _flush_root(self, root: int) -> None:
        """A root's pending registrations enter the map, in registration order."""
        _, _, chunks = self._pending.pop(root)
        cached = self.cached
        for blocks, keys in chunks:
            self._num_pending -= len(blocks)
            cached.update(zip(keys if isinstance(keys, list) else keys.tolist(),
                              blocks if isinstance(blocks, list) else blocks.tolist(), strict=True))
        self._roots_in_map.add(root)

    def _record_evictions(self, blocks: np.ndarray) -> None:
        """The reallocated blocks that held cached content, in allocation order, as one record (vLLM queues one
        event per block as it pops the free queue: the publisher splits it so)."""
        held = self.block_hash[blocks]
        held = held[held != 0]
        if held.size:
            self.events.append(BlockRemoved(held.tolist()))   # type: ignore[union-attr]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): refused (False) while a request holds
        blocks, since their hashes would then go stale under it."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.block_hash[:] = 0
        self.block_root[:] = 0
        self.cached.clear()
        self._pending.clear()
        self._num_pending = 0
        self._roots_in_map.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
