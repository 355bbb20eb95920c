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

from kernelsight.server.integrations.kv_events.hashing import (
    external_hash,
    hash_block_tokens,
    hash_function,
    lora_name_of,
    none_hash,
    vllm_extra_keys,
)
from kernelsight.server.integrations.kv_events.wire import WireCleared, WireEvent, WireRemoved, WireStored
from kernelsight.simcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HostBlocksRemoved,
    HostBlocksStored,
    KVEvent,
)

log = logging.getLogger("kernelsight.server")

#: Evicted keys whose vLLM hash is remembered, oldest forgotten first (~100 bytes each).
RETIRED_KEPT = 65_536


class HashTranslator:
    """Keeps internal key → (vLLM hash, cached copies) for every block in the prefix cache."""

    def __init__(self, algo: str = "sha256", ints_on_wire: bool = True, seed: str | None = None) -> None:
        self.fn = hash_function(algo)
        self.none_hash = none_hash(self.fn, seed)
        self.ints = ints_on_wire
        self._vllm: dict[int, tuple[bytes, int | bytes]] = {}   # key -> (vLLM hash, as on the wire)
        self._copies: dict[int, int] = {}     # cached copies per key (absent: retired, hash still known)
        self._retired: deque[int] = deque()
        self.hashed = self.reused = 0         # blocks hashed / whose hash was remembered
        self._lora_ids: dict[str, int] = {}   # vLLM's lora_int_id: 1, 2, ... in order of first use
        self.orphans = 0                      # stored blocks whose parent's hash was unknown (not published)
        self._group: dict[int, tuple[int, int]] = {}   # key -> (group, window) for keys outside group 0
        self._host: dict[int, int | bytes] = {}        # key -> wire hash of blocks in the offloading tier

    def __len__(self) -> int:
        return len(self._copies)

    def vllm_hash(self, key: int) -> bytes | None:
        """The vLLM hash of a block in the prefix cache (None once its last copy is evicted)."""
        return self._vllm[key][0] if key in self._copies else None

    def _trim_retired(self) -> None:
        ret, copies, vllm = self._retired, self._copies, self._vllm
        while len(ret) > RETIRED_KEPT:
            old = ret.popleft()
            if old not in copies:
                vllm.pop(old, None)

    def translate(self, events: list[KVEvent]) -> list[WireEvent]:
        # the per-block loop is the publisher thread's main cost: locals, and the wire form kept with the hash
        out: list[WireEvent] = []
        vllm, copies, retired = self._vllm, self._copies, self._retired
        for ev in events:
            kind = type(ev)
            if kind is BlockRemoved:
                for key in ev.keys:
                    n = copies.get(key, 0) - 1
                    if n < 0:
                        continue
                    if n:
                        copies[key] = n
                    else:
                        del copies[key]
                        retired.append(key)
                    group = self._group.get(key)
                    out.append(WireRemoved([vllm[key][1]], group[0] if group else 0))
            elif kind is BlockStored:
                out_ev = self._stored(ev)
                if out_ev is not None:
                    out.append(out_ev)
            elif kind is HostBlocksStored:
                out_ev = self._host_stored(ev)
                if out_ev is not None:
                    out.append(out_ev)
            elif kind is HostBlocksRemoved:
                host = self._host
                wire = [host.pop(key) for key in ev.keys if key in host]
                if wire:
                    out.append(WireRemoved(wire, 0, ev.medium))
            elif kind is AllBlocksCleared:
                retired.extend(copies)
                copies.clear()
                out.append(WireCleared())
        if len(retired) > RETIRED_KEPT:
            self._trim_retired()
        return out

    def _host_stored(self, ev: HostBlocksStored) -> WireStored | None:
        """Blocks stored in the offloading tier: named by the hash the GPU's BlockStored announced (kept here while
        the tier holds them, whatever the GPU evicts meanwhile)."""
        vllm, host = self._vllm, self._host
        wire = []
        for key in ev.keys:
            got = vllm.get(key)
            if got is None:
                self.orphans += 1       # never announced on the GPU (events turned on later): not published
                continue
            host[key] = got[1]
            wire.append(got[1])
        if not wire:
            return None
        return WireStored(wire, None, [], ev.block_size, None, None, None, medium=ev.medium)

    def _stored(self, ev: BlockStored) -> WireStored | None:
        vllm, copies = self._vllm, self._copies
        if ev.parent_key is None:
            parent, parent_wire = self.none_hash, None
        else:
            got = vllm.get(ev.parent_key) if ev.parent_key in copies else None
            if got is None:
                self.orphans += 1
                if self.orphans == 1:
                    log.warning("kv events: a stored block's parent hash is unknown; not published")
                return None
            parent, parent_wire = got
        bs, fn, sim_extra, first, mm = ev.block_size, self.fn, ev.extra_keys, ev.first_block_index, ev.mm_keys
        tokens = ev.token_ids
        wire: list[int | bytes] = []
        extras: list[tuple | None] | None = [] if sim_extra or mm else None
        extra = None
        for i, key in enumerate(ev.keys):
            if extras is not None:
                extra = vllm_extra_keys(sim_extra, first + i, mm[i] if mm else ())
                extras.append(extra)
            got = vllm.get(key)
            if got is None:
                h = hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], extra)
                got = vllm[key] = (h, external_hash(h, self.ints))
                self.hashed += 1
            else:
                self.reused += 1
            copies[key] = copies.get(key, 0) + 1
            wire.append(got[1])
            parent = got[0]
        lora = lora_name_of(sim_extra)
        lora_id = self._lora_ids.setdefault(lora, len(self._lora_ids) + 1) if lora else None
        if extras is not None and all(e is None for e in extras):
            extras = None
        window = None
        if ev.group_idx:
            window = ev.sliding_window
            for key in ev.keys:
                self._group[key] = (ev.group_idx, window or 0)
        return WireStored(wire, parent_wire, tokens, bs, lora_id, lora, extras, ev.group_idx, window)
