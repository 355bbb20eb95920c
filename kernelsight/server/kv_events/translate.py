"""Simulator KV events → vLLM's: the simulator's prefix-cache keys become vLLM's block hashes.

The block pool keys blocks with a fast internal hash (``simcore/block_hash.py``). vLLM's hash of a block is
computed here, once, when the block is stored (from its token ids and its parent's vLLM hash), and remembered
under the internal key, so that ``BlockRemoved`` names the hash ``BlockStored`` announced. An evicted block's
hash stays known a while longer (the last ``RETIRED_KEPT`` evicted keys): content that is evicted and computed
again, a shared prefix under cache pressure, is not hashed again (equal internal keys mean equal content, parent
chain and extra keys, so the vLLM hash is the same).
"""

from __future__ import annotations

import logging
from collections import deque

from kernelsight.server.kv_events.hashing import (
    external_hash,
    hash_block_tokens,
    hash_function,
    lora_name_of,
    none_hash,
    vllm_extra_keys,
)
from kernelsight.server.kv_events.wire import WireCleared, WireEvent, WireRemoved, WireStored
from kernelsight.simcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("kernelsight.server")

#: Evicted keys whose vLLM hash is remembered, oldest forgotten first (~100 bytes each).
RETIRED_KEPT = 65_536


class HashTranslator:
    """Keeps internal key → (vLLM hash, cached copies) for every block in the prefix cache."""

    def __init__(self, algo: str = "sha256", ints_on_wire: bool = True, seed: str | None = None) -> None:
        self.fn = hash_function(algo)
        self.none_hash = none_hash(self.fn, seed)
        self.ints = ints_on_wire
        self._vllm: dict[int, bytes] = {}
        self._copies: dict[int, int] = {}     # cached copies per key (0 / absent: retired, hash still known)
        self._retired: deque[int] = deque()
        self.hashed = self.reused = 0         # blocks hashed / whose hash was remembered
        self._lora_ids: dict[str, int] = {}   # vLLM's lora_int_id: 1, 2, ... in order of first use
        self.orphans = 0                      # stored blocks whose parent's hash was unknown (not published)

    def __len__(self) -> int:
        return len(self._copies)

    def vllm_hash(self, key: int) -> bytes | None:
        """The vLLM hash of a block in the prefix cache (None once its last copy is evicted)."""
        return self._vllm.get(key) if key in self._copies else None

    def _retire(self, key: int) -> None:
        ret = self._retired
        ret.append(key)
        if len(ret) > RETIRED_KEPT:
            old = ret.popleft()
            if old not in self._copies:
                self._vllm.pop(old, None)

    def translate(self, events: list[KVEvent]) -> list[WireEvent]:
        out: list[WireEvent] = []
        vllm, copies, ext, ints = self._vllm, self._copies, external_hash, self.ints
        for ev in events:
            if type(ev) is BlockStored:
                if ev.parent_key is None:
                    parent = self.none_hash
                else:
                    parent = vllm.get(ev.parent_key) if ev.parent_key in copies else None
                    if parent is None:
                        self.orphans += 1
                        if self.orphans == 1:
                            log.warning("kv events: a stored block's parent hash is unknown; not published")
                        continue
                bs = ev.block_size
                hashes = []
                extras: list[tuple | None] = []
                parent_ext = ext(parent, ints) if ev.parent_key is not None else None
                for i, key in enumerate(ev.keys):
                    extra = vllm_extra_keys(ev.extra_keys, ev.first_block_index + i)
                    h = vllm.get(key)
                    if h is None:
                        h = hash_block_tokens(self.fn, parent, ev.token_ids[i * bs:(i + 1) * bs], extra)
                        vllm[key] = h
                        self.hashed += 1
                    else:
                        self.reused += 1
                    copies[key] = copies.get(key, 0) + 1
                    hashes.append(ext(h, ints))
                    extras.append(extra)
                    parent = h
                lora = lora_name_of(ev.extra_keys)
                lora_id = self._lora_ids.setdefault(lora, len(self._lora_ids) + 1) if lora else None
                out.append(WireStored(hashes, parent_ext, ev.token_ids, bs, lora_id, lora,
                                      extras if any(e is not None for e in extras) else None))
            elif type(ev) is BlockRemoved:
                for key in ev.keys:
                    n = copies.get(key, 0) - 1
                    if n < 0:
                        continue
                    if n:
                        copies[key] = n
                    else:
                        del copies[key]
                        self._retire(key)
                    out.append(WireRemoved([ext(vllm[key], ints)]))
            elif type(ev) is AllBlocksCleared:
                for key in copies:
                    self._retire(key)
                copies.clear()
                out.append(WireCleared())
        return out
