"""The encoder cache: encoder outputs kept between the step that computes an item and the steps that consume its
embeddings, shared by content hash, as vLLM V1's ``EncoderCacheManager`` keeps them.

Sizes are in LM embeddings (an item's placeholder tokens). An item is computed once and then referenced by every
request that holds it; when no request references it any more it stays cached but *freeable*, and is evicted (oldest
freed first) only when a new item needs the room, so a later request with the same image skips its encoder pass.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size         # not held by anything
        self.num_freeable_slots = cache_size     # free + held only by unreferenced (evictable) entries
        self.cached: dict[str, set[str]] = {}    # mm_hash -> ids of the requests that reference it
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()   # unreferenced entries, oldest first
        self.num_computed = 0                    # encoder passes over items (what the cache did not save)
        self.num_hits = 0                        # items found cached

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """True if the item's output is cached; the request then references it (it is no longer evictable)."""
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:                             # was freeable: take it back
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        if request_id not in refs:
            refs.add(request_id)
            self.num_hits += 1
        return True

    def can_allocate(self, num_tokens: int, compute_budget: int, num_tokens_to_schedule: int) -> bool:
        """Whether an item of ``num_tokens`` embeddings fits this step's encoder budget and the cache (evicting
        unreferenced entries, oldest first, if that makes room)."""
        if num_tokens > compute_budget:
            return False
        need = num_tokens + num_tokens_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.sizes[mm_hash]
            self.num_free_slots += size
        return True

    def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Room for an item the encoder computes this step, referenced by the request."""
        self.cached.setdefault(mm_hash, set()).add(request_id)
        self.sizes[mm_hash] = num_tokens
        self.num_free_slots -= num_tokens
        self.num_freeable_slots -= num_tokens
        self.num_computed += 1

    def free_input(self, request_id: str, mm_hash: str) -> None:
        """The request no longer needs the item (its embeddings are in the KV cache, or it left)."""
        refs = self.cached.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            size = self.sizes[mm_hash]
            self.freeable[mm_hash] = size
            self.num_freeable_slots += size

    def free(self, request_id: str, mm_hashes: list[str]) -> None:
        for h in mm_hashes:
            self.free_input(request_id, h)

    def reset(self) -> None:
        """Forget every unreferenced entry (vLLM's reset of the multimodal caches)."""
        while self.freeable:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.sizes[mm_hash]
            self.num_free_slots += size
