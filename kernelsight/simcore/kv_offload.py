"""KV offloading to host memory: a CPU tier of KV blocks behind the GPU's, as vLLM's ``OffloadingConnector`` keeps it
(``--kv-offloading-size`` / ``--kv-offloading-backend``; vllm/v1/kv_offload and kv_connector/v1/offloading).

What is modelled, after vLLM's connector:

* **capacity**: ``--kv-offloading-size`` GiB is the total over the TP ranks (vLLM's ``cpu_bytes_to_use``); an offloaded
  block holds ``block_size`` tokens of every layer on every rank, so the tier holds
  ``size // (kv_bytes_per_token × ranks × block_size)`` blocks. The offloaded block size is the GPU's unless
  ``kv_connector_extra_config.block_size`` (a multiple of it) says otherwise.
* **stores** as blocks are computed: after each step, every scheduled request's blocks that the step filled (its
  prompt's only, vLLM's ``offload_prompt_only`` default) are prepared for store (already stored ones skipped, LRU
  blocks evicted; a store that cannot evict enough is skipped, as vLLM's ``prepare_store`` returning None) and copied
  on a device-to-host stream that starts when the step ends and runs one copy after another. A stored block can be
  looked up only once its copy has finished (vLLM's ``complete_store``).
* **lookups after a GPU prefix-cache miss**: a waiting request's blocks past its GPU hit are looked up in order; the
  run of ready blocks is the external hit (at least one offloaded block), and every looked-up block is touched (LRU).
* **loads before the step that needs them**: the hit is allocated on the GPU and copied on a host-to-device stream
  (one copy after another) from the step it is scheduled in; the request takes no token budget until its load ends,
  then waits its turn at the head of the queue (vLLM's ``WAITING_FOR_REMOTE_KVS``, then the prepended waiting request).
  A request whose hit is being loaded for another request waits for that load (vLLM delays it), and so does every
  request while ``max_num_seqs`` loads are in flight (vLLM's cap on concurrent loads).
* **the CPU LRU**: blocks being loaded are not evictable; touching (a lookup, a store of the same prefix) refreshes.
* **transfers** are priced over the GPU's PCIe link (``kv_transfer.kv_link(hw, "pcie")``: the profile's PCIe
  bandwidth per direction times a bulk-copy share, plus a copy latency): each TP rank copies its own shard over its
  own link at once, so a copy takes one rank's bytes over one link. The copies overlap compute fully.

Decode blocks are stored only with ``offload_prompt_only: false``, which turns the scheduler's decode group off (each
decode's progress is then known step by step).

Not modelled: the copies' share of HBM bandwidth (they do not slow steps); host memory bandwidth shared by the ranks;
vLLM holding a finished request's GPU blocks until its stores finish; ARC eviction (LRU only); secondary tiers.

The LMCache backend (``--kv-offloading-backend lmcache``: vLLM's ``LMCacheConnectorV1`` with its local CPU backend,
``lmcache.max_local_cpu_size`` = the size per rank) is priced the same way over the same link, with LMCache's own
granularity: 256-token chunks (its ``chunk_size`` default), stored and looked up whole. Its KV events are not emitted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kernelsight.simcore.kv_events import HostBlocksRemoved, HostBlocksStored, KVEvent
from kernelsight.simcore.kv_transfer import KVLink
from kernelsight.simcore.request import Request

NATIVE = "native"
LMCACHE = "lmcache"
BACKENDS: tuple[str, ...] = (NATIVE, LMCACHE)
#: vLLM's connector class for each backend (what --kv-transfer-config names)
CONNECTORS: dict[str, str] = {NATIVE: "OffloadingConnector", LMCACHE: "LMCacheConnectorV1"}
MEDIUM_CPU = "CPU"
#: LMCache's default chunk size (tokens): its unit of storage and lookup
LMCACHE_CHUNK_TOKENS = 256
GIB = 1 << 30
GPU_TO_CPU = "GPU_to_CPU"
CPU_TO_GPU = "CPU_to_GPU"
#: vLLM's ``vllm:kv_offload_size`` histogram buckets (bytes per transfer)
TRANSFER_SIZE_BUCKETS: tuple[float, ...] = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """A resolved CPU tier: its backend, capacity and block size."""

    backend: str
    cpu_bytes: float                 # total over the TP ranks
    block_size: int                  # tokens per offloaded block
    num_blocks: int
    kv_bytes_per_token_per_rank: float
    offload_prompt_only: bool = True

    @property
    def connector(self) -> str:
        return CONNECTORS[self.backend]

    def summary(self) -> dict:
        return {"kv_offloading_backend": self.backend, "kv_connector": self.connector,
                "kv_offloading_size_gib": self.cpu_bytes / GIB, "cpu_blocks": self.num_blocks,
                "cpu_block_size": self.block_size}


def resolve_offload(size_gib: float | None, backend: str, gpu_block_size: int, kv_bytes_per_token_per_rank: float,
                    num_ranks: int, block_size: int | None = None, offload_prompt_only: bool = True
                    ) -> OffloadConfig | None:
    """The CPU tier of ``--kv-offloading-size`` (None: offloading off), validated as vLLM validates it."""
    if size_gib is None:
        return None
    if backend not in BACKENDS:
        raise ValueError(f"Unknown offloading backend: '{backend}'. Available backends: {', '.join(BACKENDS)}")
    if not size_gib > 0:
        # vLLM's CPUOffloadingSpec: cpu_bytes_to_use = size × 2^30 must be set (a zero is "not specified")
        raise ValueError("cpu_bytes_to_use must be specified in kv_connector_extra_config "
                         f"(--kv-offloading-size must be > 0 GiB, got {size_gib})")
    if backend == LMCACHE:
        obs = LMCACHE_CHUNK_TOKENS if block_size is None else block_size
    else:
        obs = gpu_block_size if block_size is None else block_size
        if obs % gpu_block_size:
            raise ValueError("If 'block_size' is specified in kv_connector_extra_config, it must be divisible by "
                             f"every KV cache group block size (got {obs}, GPU block size {gpu_block_size}).")
    if obs < 1:
        raise ValueError(f"offloaded block_size must be >= 1, got {obs}")
    cpu_bytes = size_gib * GIB
    bytes_per_block = kv_bytes_per_token_per_rank * num_ranks * obs
    num_blocks = int(cpu_bytes // bytes_per_block) if bytes_per_block > 0 else 0
    return OffloadConfig(backend, cpu_bytes, obs, num_blocks, kv_bytes_per_token_per_rank, offload_prompt_only)


@dataclass(slots=True)
class _HostBlock:
    ready_s: float           # when its store finishes (inf: not yet scheduled)
    ref_cnt: int = 0         # loads reading it


@dataclass(slots=True)
class OffloadStats:
    """vLLM's offloading counters (``vllm:kv_offload_*``) and the connector's prefix-cache counters (tokens)."""

    bytes: dict[str, float] = field(default_factory=lambda: {GPU_TO_CPU: 0.0, CPU_TO_GPU: 0.0})
    time_s: dict[str, float] = field(default_factory=lambda: {GPU_TO_CPU: 0.0, CPU_TO_GPU: 0.0})
    # transfers by size bucket (TRANSFER_SIZE_BUCKETS, then +Inf), per direction
    size_counts: dict[str, list[int]] = field(default_factory=lambda: {
        GPU_TO_CPU: [0] * (len(TRANSFER_SIZE_BUCKETS) + 1), CPU_TO_GPU: [0] * (len(TRANSFER_SIZE_BUCKETS) + 1)})
    transfers: dict[str, int] = field(default_factory=lambda: {GPU_TO_CPU: 0, CPU_TO_GPU: 0})
    external_queries_tokens: int = 0    # vllm:external_prefix_cache_queries
    external_hits_tokens: int = 0       # vllm:external_prefix_cache_hits
    stores_skipped_blocks: int = 0      # blocks whose store found no room
    evicted_blocks: int = 0
    loads: int = 0

    def record(self, direction: str, num_bytes: float, seconds: float) -> None:
        self.bytes[direction] += num_bytes
        self.time_s[direction] += seconds
        self.transfers[direction] += 1
        counts = self.size_counts[direction]
        for i, bound in enumerate(TRANSFER_SIZE_BUCKETS):
            if num_bytes <= bound:
                counts[i] += 1
                return
        counts[-1] += 1

    @property
    def hit_rate(self) -> float:
        return self.external_hits_tokens / self.external_queries_tokens if self.external_queries_tokens else 0.0


class KVOffload:
    """One engine's CPU tier: the LRU of host blocks, the two copy streams and the loads in flight.

    Keys are the simulator's block hashes of the last GPU block each offloaded block covers (chained, so a key names
    the whole prefix up to it)."""

    def __init__(self, config: OffloadConfig, link: KVLink, gpu_block_size: int, max_loads: int = 1 << 30) -> None:
        self.config = config
        self.max_loads = max_loads   # loads in flight at most (vLLM: max_num_seqs); more wait a step
        self.link = link
        self.gpu_block_size = gpu_block_size
        self.factor = config.block_size // gpu_block_size if config.block_size % gpu_block_size == 0 else 0
        self.capacity = config.num_blocks
        self._blocks: OrderedDict[int, _HostBlock] = OrderedDict()   # LRU first
        self._pending: list[tuple[float, list[int]]] = []              # stores in flight: (end, keys), by end
        self._storing: set[int] = set()                                 # their keys
        self._loading: dict[Request, list[int]] = {}                    # request -> the keys its load reads
        self._keys_loading: dict[int, int] = {}                         # key -> loads reading it
        self.d2h_free_s = 0.0        # the device-to-host stream is busy until then
        self.h2d_free_s = 0.0
        self.stats = OffloadStats()
        self.event_source = None     # what holds the engine's KV-event list (the block pool): ``.events``, or None
        self.emit_events = config.backend == NATIVE

    @property
    def events(self) -> list[KVEvent] | None:
        """The engine's KV-event list while events are on (drained and replaced each step, so looked up each time)."""
        src = self.event_source
        return src.events if src is not None else None

    # -- keys ---------------------------------------------------------------------------------------
    def _keys(self, hashes: list[int], start: int, end: int) -> list[int]:
        """Keys of offloaded blocks start..end-1 from the request's GPU block hashes."""
        f = self.factor
        if f == 1:
            return hashes[start:end]
        if f:
            return [hashes[(i + 1) * f - 1] for i in range(start, end)]
        # a chunk that is no multiple of the GPU block (LMCache's 256 under an unusual --block-size): its last token's
        # GPU block stands for it when that block is full
        obs, bs = self.config.block_size, self.gpu_block_size
        return [hashes[((i + 1) * obs) // bs - 1] for i in range(start, end)]

    def _num_full(self, num_tokens: int) -> int:
        return num_tokens // self.config.block_size

    @property
    def num_loading(self) -> int:
        """Requests whose load is in flight."""
        return len(self._loading)

    @property
    def num_stored(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        return len(self._blocks) / self.capacity if self.capacity else 0.0

    # -- time -----------------------------------------------------------------------------------------
    def advance(self, now_s: float) -> None:
        """Finish the stores whose copies ended by ``now_s``: their blocks become loadable (one event per store)."""
        pending = self._pending
        if not pending or pending[0][0] > now_s:
            return
        i = 0
        while i < len(pending) and pending[i][0] <= now_s:
            _, keys = pending[i]
            self._storing.difference_update(keys)
            blocks = self._blocks
            done = [k for k in keys if k in blocks]
            events = self.events
            if done and events is not None and self.emit_events:
                events.append(HostBlocksStored(done, self.config.block_size, MEDIUM_CPU))
            i += 1
        del pending[:i]

    def _bytes(self, num_blocks: int) -> float:
        return num_blocks * self.config.block_size * self.config.kv_bytes_per_token_per_rank

    # -- lookups and loads ----------------------------------------------------------------------------
    def match(self, req: Request, hashes: list[int], num_computed_tokens: int, now_s: float) -> int | None:
        """Tokens past ``num_computed_tokens`` (the GPU hit) the CPU tier can load: whole offloaded blocks, 0 for
        none; None when some of them are being loaded for another request (the request waits for that load)."""
        if len(self._loading) >= self.max_loads:
            return None             # vLLM's back-pressure on loads: asked again at a later step
        obs = self.config.block_size
        n_blocks = self._num_full(len(hashes) * self.gpu_block_size)
        if n_blocks * obs - num_computed_tokens < obs:
            return 0
        start = num_computed_tokens // obs
        blocks = self._blocks
        keys = self._keys(hashes, 0, n_blocks)
        for k in reversed(keys):    # vLLM touches every block of the request before the lookup, the first last
            if k in blocks:         # (most recent: a prefix outlives its suffix)
                blocks.move_to_end(k)
        hits = 0
        for k in keys[start:]:
            b = blocks.get(k)
            if b is None or b.ready_s > now_s:
                break
            hits += 1
        ext = (start + hits) * obs - num_computed_tokens
        if ext < obs:               # less than an offloaded block past the GPU hit: not worth a load (as vLLM)
            return 0
        if self._keys_loading and any(k in self._keys_loading for k in keys[start:start + hits]):
            return None
        return ext

    def start_load(self, req: Request, hashes: list[int], num_computed_tokens: int, num_load_tokens: int,
                   now_s: float) -> float:
        """Begin the host-to-device copy of a match; returns when it ends (the request's KV is then in place)."""
        obs = self.config.block_size
        start = num_computed_tokens // obs
        end = (num_computed_tokens + num_load_tokens) // obs
        keys = self._keys(hashes, start, end)
        blocks, loading = self._blocks, self._keys_loading
        for k in keys:
            blocks[k].ref_cnt += 1
            loading[k] = loading.get(k, 0) + 1
        self._loading[req] = keys
        begin = max(now_s, self.h2d_free_s)
        num_bytes = self._bytes(len(keys))
        dur = self.link.time_s(num_bytes)
        self.h2d_free_s = begin + dur
        self.stats.record(CPU_TO_GPU, num_bytes, dur)
        self.stats.loads += 1
        return begin + dur

    def finish_load(self, req: Request) -> None:
        """The load ended (or its request was aborted): its blocks are evictable again."""
        keys = self._loading.pop(req, None)
        if not keys:
            return
        blocks, loading = self._blocks, self._keys_loading
        for k in keys:
            b = blocks.get(k)
            if b is not None:
                b.ref_cnt -= 1
            n = loading.get(k, 0) - 1
            if n > 0:
                loading[k] = n
            else:
                loading.pop(k, None)

    def record_query(self, num_tokens: int, num_gpu_hit_tokens: int, num_external_tokens: int) -> None:
        """vLLM's connector prefix-cache stats of one admitted request (first admission only)."""
        queries = num_tokens - num_gpu_hit_tokens
        if queries:
            self.stats.external_queries_tokens += queries
            self.stats.external_hits_tokens += num_external_tokens

    # -- stores ---------------------------------------------------------------------------------------
    def store_computed(self, reqs: list[Request], hashes_of, step_end_s: float) -> None:
        """After a step: store the blocks each request's step filled (``hashes_of(req, n)``: its first n GPU block
        hashes). One device-to-host copy per request, queued on the stream from the step's end."""
        obs = self.config.block_size
        prompt_only = self.config.offload_prompt_only
        for req in reqs:
            limit = req.prompt_len if prompt_only else req.num_tokens
            total = min(req.num_computed_tokens, limit)
            n_blocks = total // obs
            start = req.num_offloaded_blocks
            if n_blocks <= start:
                continue
            hashes = hashes_of(req, (n_blocks * obs) // self.gpu_block_size)
            keys = self._keys(hashes, 0, n_blocks)
            stored = self._prepare_store(keys[start:])
            if stored is None:
                self.stats.stores_skipped_blocks += n_blocks - start
                continue
            req.num_offloaded_blocks = n_blocks
            if not stored:
                continue
            blocks = self._blocks
            for k in reversed(keys):        # vLLM then touches the request's blocks, the first last
                if k in blocks:
                    blocks.move_to_end(k)
            begin = max(step_end_s, self.d2h_free_s)
            num_bytes = self._bytes(len(stored))
            dur = self.link.time_s(num_bytes)
            end = begin + dur
            self.d2h_free_s = end
            self.stats.record(GPU_TO_CPU, num_bytes, dur)
            for k in stored:
                self._blocks[k].ready_s = end
            self._storing.update(stored)
            self._pending.append((end, stored))     # the stream is FIFO: ends are in order

    def _prepare_store(self, keys: list[int]) -> list[int] | None:
        """vLLM's ``prepare_store``: the keys not yet held get blocks, evicting least recently used idle ready ones
        (never one of ``keys``); None (no change) when not enough can be evicted."""
        blocks = self._blocks
        new = [k for k in dict.fromkeys(keys) if k not in blocks]
        if not new:
            return []
        need = len(blocks) + len(new) - self.capacity
        if need > 0:
            protected, storing = set(keys), self._storing
            victims = []
            for k, b in blocks.items():
                if len(victims) == need:
                    break
                # a block whose store has not finished is not evictable (vLLM's ref_cnt -1 until complete_store)
                if b.ref_cnt == 0 and k not in storing and k not in protected:
                    victims.append(k)
            if len(victims) < need:
                return None
            for k in victims:
                del blocks[k]
            self.stats.evicted_blocks += len(victims)
            events = self.events
            if events is not None and self.emit_events:
                events.append(HostBlocksRemoved(victims, MEDIUM_CPU))
        for k in new:
            blocks[k] = _HostBlock(float("inf"))
        return new

    def reset(self) -> None:
        """Forget every stored block (vLLM's reset_cache, with the GPU prefix cache's reset)."""
        self._blocks.clear()
        self._pending.clear()
        self._storing.clear()


@dataclass(frozen=True, slots=True)
class ConnectorOffload:
    """What an offloading ``--kv-transfer-config`` asks for, as the engine flags carry it."""

    size_gib: float
    backend: str
    block_size: int | None
    offload_prompt_only: bool


def offload_from_connector(connector: str, extra_config: dict, num_ranks: int) -> ConnectorOffload | None:
    """The CPU tier a ``--kv-transfer-config`` names (vLLM's ``OffloadingConnector`` with ``cpu_bytes_to_use`` total
    over the ranks, or ``LMCacheConnectorV1`` with ``lmcache.max_local_cpu_size`` GB per rank); None for another
    connector. ValueError for a missing or bad size."""
    if connector == CONNECTORS[NATIVE]:
        spec = extra_config.get("spec_name", "CPUOffloadingSpec")
        if spec != "CPUOffloadingSpec":
            raise ValueError(f"OffloadingConnector spec_name {spec!r}: only the CPU tier (CPUOffloadingSpec) is "
                             "modelled")
        cpu_bytes = extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes:
            raise ValueError("cpu_bytes_to_use must be specified in kv_connector_extra_config")
        block_size = extra_config.get("block_size")
        policy = extra_config.get("eviction_policy", "lru")
        if policy != "lru":
            raise ValueError(f"OffloadingConnector eviction_policy {policy!r}: only 'lru' is modelled")
        try:
            return ConnectorOffload(float(cpu_bytes) / GIB, NATIVE, None if block_size is None else int(block_size),
                                    bool(extra_config.get("offload_prompt_only", True)))
        except (TypeError, ValueError):
            raise ValueError("kv_connector_extra_config: cpu_bytes_to_use and block_size must be numbers") from None
    if connector == CONNECTORS[LMCACHE]:
        if not extra_config.get("lmcache.local_cpu", True):
            raise ValueError("LMCacheConnectorV1 without lmcache.local_cpu: only LMCache's local CPU backend is "
                             "modelled")
        per_rank = extra_config.get("lmcache.max_local_cpu_size", 5.0)    # LMCache's default, GB per rank
        chunk = extra_config.get("lmcache.chunk_size")
        try:
            return ConnectorOffload(float(per_rank) * num_ranks, LMCACHE, None if chunk is None else int(chunk), True)
        except (TypeError, ValueError):
            raise ValueError("kv_connector_extra_config: lmcache.max_local_cpu_size and lmcache.chunk_size must be "
                             "numbers") from None
    return None
