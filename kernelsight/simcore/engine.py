"""The event engine: arrivals and steps on a virtual clock.

One API serves both drivers: the real-time server (which sleeps until each step's virtual end time and
streams its tokens) and fast-forward (which calls ``step`` back to back). A call to :meth:`Engine.step`
runs one engine step, or, when allowed by ``max_steps``, a *window* of identical pure-decode steps:
nothing changes between them but context growth, so they are computed at once (event skipping). A window
always ends at the step during which the next arrival (or ``until_s``) falls, when a request finishes, or
before the KV cache runs out, so the result is the same as stepping one by one.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from kernelsight.simcore.kernels import FAMILIES
from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.kv_offload import KVOffload
from kernelsight.simcore.kv_transfer import KVTransferModel
from kernelsight.simcore.multimodal import MultimodalItem, check_mm_items
from kernelsight.simcore.output_len import OutputLengthModel
from kernelsight.simcore.request import FinishReason, Request, RequestStatus
from kernelsight.simcore.scheduler import Scheduler, SchedulerConfig
from kernelsight.simcore.spec_decode import SpecDecoder
from kernelsight.simcore.step_model import StepPricer

SCHEDULED = "scheduled"
FIRST_TOKEN = "first_token"
TOKENS = "tokens"
FINISHED = "finished"
PREEMPTED = "preempted"
#: vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default: a prefill instance frees blocks nobody pulled after this long.
NIXL_ABORT_REQUEST_TIMEOUT_S = 480.0


class ArrivalQueue:
    """Future arrivals by (time, seq_no): a heap, with a FIFO beside it for entries pushed in order (a driver that
    sends a whole workload up front), which pops them in O(1). Pops in the same order as one heap would."""

    __slots__ = ("_fifo", "_heap")

    def __init__(self) -> None:
        self._fifo: deque[tuple[float, int, Request]] = deque()
        self._heap: list[tuple[float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def push(self, entry: tuple[float, int, Request]) -> None:
        fifo = self._fifo
        if not fifo or entry[:2] >= fifo[-1][:2]:
            fifo.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def first(self) -> tuple[float, int, Request] | None:
        """The earliest entry (None: empty)."""
        fifo, heap = self._fifo, self._heap
        if heap and (not fifo or heap[0][:2] < fifo[0][:2]):
            return heap[0]
        return fifo[0] if fifo else None

    def pop(self) -> tuple[float, int, Request]:
        fifo, heap = self._fifo, self._heap
        if heap and (not fifo or heap[0][:2] < fifo[0][:2]):
            return heapq.heappop(heap)
        return fifo.popleft()


@dataclass(slots=True)
class RequestEvent:
    """Something that happened to one sequence.

    ``step_index`` is the global index of the step it happened in; ``tokens`` events cover ``num_tokens``
    tokens, one per consecutive step starting at ``step_index`` (with per-token events off, a run may
    start in an earlier result) — or, when ``burst`` is set (speculative decoding), all of them in that one
    step; ``first_token`` is always one token.
    """

    kind: str
    request_id: str
    step_index: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    parent_id: str | None = None
    index: int = 0
    burst: bool = False


@dataclass(slots=True)
class StepResult:
    start_s: float
    step_end_s: list[float]          # virtual end time of each step in this result
    first_step_index: int            # global index of the first step
    events: list[RequestEvent]
    num_scheduled_tokens: int        # per step (identical across a window)
    num_running: int
    num_waiting: int
    kv_usage: float                  # at the end of the result
    breakdown_s: np.ndarray          # seconds per family, summed over the steps

    @property
    def num_steps(self) -> int:
        return len(self.step_end_s)

    @property
    def end_s(self) -> float:
        return self.step_end_s[-1]


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    busy_s: float = 0.0
    breakdown_s: np.ndarray = field(default_factory=lambda: np.zeros(len(FAMILIES)))
    num_preemptions: int = 0


class Engine:
    """vLLM's engine core on a virtual clock."""

    def __init__(self, scheduler_config: SchedulerConfig, num_gpu_blocks: int, step_model: StepPricer,
                 seed: int = 0, output_length_model: OutputLengthModel | None = None,
                 per_token_events: bool = True, use_decode_group: bool = True,
                 kv_cache: KVCacheManager | None = None, spec_decoder: SpecDecoder | None = None) -> None:
        self.config = scheduler_config
        # a model-specific KV manager (the hybrid allocator) replaces the plain one; one that allocates more
        # than the full-attention table runs vLLM's per-request loop, not the decode group
        self.kv = kv_cache or KVCacheManager(num_gpu_blocks, scheduler_config.block_size,
                                             scheduler_config.enable_prefix_caching)
        if getattr(self.kv, "exact_loop_only", False):
            use_decode_group = False
        # the decode group is an exact optimization; turning it off is for equivalence tests
        self.scheduler = Scheduler(scheduler_config, self.kv, use_decode_group)
        # speculative decoding (None: off); its counters are vLLM's spec-decode metrics
        self.spec_decoder = spec_decoder
        if spec_decoder is not None:
            self.scheduler.enable_spec_decode(spec_decoder)
        self.step_model = step_model
        # the longest decode contexts of each step, when the step model prices their imbalance
        self.scheduler.decode_top_k = int(getattr(step_model, "decode_top_k", 0) or 0)
        # vLLM's async scheduling schedules step k while step k-1 runs (see _admit_cutoff_s)
        self.async_scheduling = bool(getattr(getattr(step_model, "config", None), "async_scheduling", False))
        self._last_step_start_s: float | None = None
        # True: a TOKENS event per sequence per step (the real-time server streams them). False: one
        # TOKENS event per run of consecutive steps, emitted when the run ends (fast-forward).
        self.per_token_events = per_token_events
        self.now_s = 0.0
        self.stats = EngineStats()
        self._lengths = (output_length_model or OutputLengthModel()).sampler(seed)
        self._arrivals = ArrivalQueue()
        self._seq = itertools.count()
        self._requests: dict[str, Request] = {}          # live sequences by id
        self._children: dict[str, list[str]] = {}        # parent id -> sequence ids (n > 1)
        self._pending_events: list[RequestEvent] = []     # aborts between steps
        # prefill/decode disaggregation (see ``add_request``'s hold_kv / remote_prefill)
        self.kv_transfer: KVTransferModel | None = None   # prices a decode side's pull; set by the builder
        self.abort_timeout_s = NIXL_ABORT_REQUEST_TIMEOUT_S
        self._held: dict[str, tuple[Request, float]] = {}   # prefill side: id -> (request, expiry), blocks kept
        self._releases: list[tuple[float, str]] = []         # prefill side: frees due at a time (pulls, timeouts)
        self._pull_blocked: list[Request] = []               # decode side: arrived, waiting for free blocks
        self._pulled: list[tuple[str, float]] = []           # decode side: (id, time) the prefill side may free
        self.num_pulls = 0
        self.pull_s_total = 0.0
        self.offload: KVOffload | None = None                # KV offloading's CPU tier (enable_offload)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int, *,
                    min_tokens: int = 0, ignore_eos: bool = False, n: int = 1, priority: int = 0,
                    arrival_s: float | None = None, extra_keys: tuple | None = None,
                    output_token_ids: Sequence[int] | None = None, hold_kv: bool = False,
                    remote_prefill: bool = False, mm_items: Sequence[MultimodalItem] = ()) -> list[str]:
        """Queue a request (arriving now, or at ``arrival_s`` on the virtual clock). Returns sequence ids.

        ``n > 1`` fans out into n sequences sharing the prompt (ids ``"{i}_{request_id}"`` as in vLLM).
        P/D disaggregation, as vLLM's NIXL connector: ``hold_kv`` (the prefill side, ``do_remote_decode``) keeps the
        blocks of a length finish until ``release_held`` or the abort timeout; ``remote_prefill`` (the decode side,
        ``do_remote_prefill``) allocates the prompt's blocks on arrival, pulls the KV not cached locally over
        ``kv_transfer``'s link, then computes only the last prompt token.
        ``mm_items``: the images/videos whose placeholder tokens the prompt holds, in prompt order (their encoder
        runs in the step that first schedules their tokens; needs a model with a vision encoder).
        """
        if remote_prefill and self.kv_transfer is None:
            raise ValueError("remote prefill needs a KV transfer model (engine.kv_transfer)")
        plen = len(prompt_token_ids)
        if plen == 0:
            raise ValueError("prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if request_id in self._requests or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if mm_items:
            check_mm_items(mm_items, plen)
        max_len = self.config.max_model_len
        if plen >= max_len:
            raise ValueError(f"prompt of {plen} tokens does not fit max_model_len={max_len}")
        t = self.now_s if arrival_s is None else arrival_s
        cutoff = self._admit_cutoff_s()
        # immutable: block hashes are taken over it (an int array is kept as is: hashing reads it directly)
        prompt = prompt_token_ids if hasattr(prompt_token_ids, "dtype") else tuple(prompt_token_ids)
        ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        if n > 1:
            self._children[request_id] = ids
        for i, sid in enumerate(ids):
            length, at_eos = self._lengths.draw(max_tokens, min_tokens, ignore_eos)
            reason = FinishReason.STOP if at_eos else FinishReason.LENGTH
            if plen + length > max_len:      # the context window ends generation
                length, reason = max_len - plen, FinishReason.LENGTH
            req = Request(sid, prompt, max_tokens, length, reason, t, priority, next(self._seq),
                          request_id if n > 1 else None, i, extra_keys, output_token_ids, hold_kv, remote_prefill,
                          mm_items=tuple(mm_items))
            self._requests[sid] = req
            self.kv.hash_prompt(req)
            if t <= cutoff and not remote_prefill:     # a pull starts at the next step (_admit_arrivals)
                self.scheduler.add(req)
            else:
                self._arrivals.push((t, req.seq_no, req))
        return ids

    def abort(self, request_id: str) -> bool:
        """Abort a sequence or all sequences of a parent id, wherever they are. False if unknown/done."""
        ids = self._children.pop(request_id, None) or [request_id]
        found = False
        for sid in ids:
            req = self._requests.pop(sid, None)
            if req is None or req.is_finished:
                continue
            found = True
            if req.kv_load_tokens:
                # loading from the CPU tier: its blocks are evictable again (the copy already queued still runs)
                req.kv_load_tokens = 0
                self.offload.finish_load(req)  # type: ignore[union-attr]  # loads exist only with a tier
            if req.remote_prefill and req.num_computed_tokens == 0 and req.num_preemptions == 0:
                # not yet taken in (``_pull_done``): vLLM notifies the prefill side of an aborted remote prefill, so it
                # frees the blocks at once
                ready = req.kv_ready_s
                self._pulled.append((sid, self.now_s if ready is None else min(ready, self.now_s)))
            join = req.decode_join_step
            if req.status is RequestStatus.WAITING and req.block_ids == [] and (
                    req.arrival_s > self.now_s or not self.scheduler.waiting.remove(req)):
                # still in the arrivals heap (to come, or held back a step by async scheduling): mark finished; it is
                # skipped when it surfaces
                req.status = RequestStatus.FINISHED
                req.finish_reason = FinishReason.ABORT
            else:
                run = self.scheduler.finish(req, FinishReason.ABORT)
                if run and not self.per_token_events:
                    self._pending_events.append(RequestEvent(TOKENS, sid, join, run, None, req.parent_id,
                                                             req.index))
            self._pending_events.append(RequestEvent(FINISHED, sid, self.scheduler.step_index, 0,
                                                     FinishReason.ABORT.value, req.parent_id, req.index))
        return found

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- state --------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those loading their prefix from the CPU tier included (vLLM keeps them in its waiting
        queue as WAITING_FOR_REMOTE_KVS)."""
        off = self.offload
        return len(self.scheduler.waiting) + (off.num_loading if off is not None else 0)

    @property
    def next_arrival_s(self) -> float | None:
        first = self._arrivals.first()
        return first[0] if first is not None else None

    def has_unfinished(self) -> bool:
        arrivals = self._arrivals
        while arrivals and arrivals.first()[2].is_finished:  # type: ignore[index]     # aborted before it surfaced
            arrivals.pop()
        return (bool(self.scheduler.running) or len(self.scheduler.waiting) > 0 or bool(self._arrivals)
                or bool(self._pull_blocked))

    def _admit_cutoff_s(self) -> float:
        """Latest arrival the next step can take in.

        With async scheduling vLLM's engine core schedules step k as soon as step k-2's output is in, i.e. when step
        k-1 starts on the GPU, and only then waits for k-1: a request that arrives while k-1 runs misses step k and
        starts in k+1, a step later than a synchronous engine would start it. An engine with nothing running
        schedules an arrival at once."""
        start = self._last_step_start_s
        if start is None or not self.async_scheduling or not self.scheduler.running:
            return self.now_s
        return start

    def _admit_arrivals(self) -> None:
        if self._releases and self._releases[0][0] <= self.now_s:
            self._free_released()
        if self._pull_blocked:
            self._retry_pulls()
        arrivals = self._arrivals
        cutoff = self._admit_cutoff_s()
        while arrivals and arrivals.first()[0] <= cutoff:  # type: ignore[index]
            _, _, req = arrivals.pop()
            if req.is_finished:
                continue
            if req.remote_prefill and not req.block_ids and req.num_preemptions == 0:
                if self._pull_blocked or not self._start_pull(req):
                    self._pull_blocked.append(req)      # FCFS behind earlier pulls waiting for blocks
                continue
            if req.kv_load_tokens:
                self._load_done(req)
                continue
            if req.kv_ready_s is not None and req.num_computed_tokens == 0 and req.block_ids:
                self._pull_done(req)
            self.scheduler.add(req)

    # -- P/D disaggregation -------------------------------------------------------------------------
    def _start_pull(self, req: Request) -> bool:
        """Decode side: blocks for the prompt now, the pull's end as the request's next arrival."""
        num_blocks = self.kv.allocate_for_pull(req)
        if num_blocks is None:
            return False
        assert self.kv_transfer is not None
        pull_s = self.kv_transfer.time_s(num_blocks)
        self.num_pulls += 1
        self.pull_s_total += pull_s
        req.kv_ready_s = self.now_s + pull_s
        self._arrivals.push((req.kv_ready_s, req.seq_no, req))  # type: ignore[arg-type]  # set by the load
        return True

    def _retry_pulls(self) -> None:
        blocked = self._pull_blocked
        while blocked:
            if blocked[0].is_finished:
                blocked.pop(0)
            elif self._start_pull(blocked[0]):
                blocked.pop(0)
            else:
                break

    def _pull_done(self, req: Request) -> None:
        """The pulled KV is in place: every prompt token but the last counts as computed (vLLM recomputes the last
        one to sample the first token), and the prefill side may free its copy."""
        self.kv.cache_pulled(req)
        req.num_computed_tokens = req.prompt_len - 1
        self._pulled.append((req.request_id, req.kv_ready_s or self.now_s))

    # -- KV offloading -------------------------------------------------------------------------------
    def enable_offload(self, offload: KVOffload) -> None:
        """Put a CPU tier behind the GPU's KV cache (``simcore/kv_offload.py``). Storing decode blocks (vLLM's
        ``offload_prompt_only: false``) needs each decode's progress step by step: the decode group is turned off."""
        self.offload = offload
        self.scheduler.offload = offload
        offload.event_source = self.kv.pool  # type: ignore[assignment]
        if not offload.config.offload_prompt_only:
            self.scheduler._group_allowed = self.scheduler._group_on = False

    def _load_done(self, req: Request) -> None:
        """The load from the CPU tier ended: the loaded blocks enter the GPU prefix cache and count as computed (all
        but the last prompt token at most, which vLLM recomputes to sample), and the request goes back to the head of
        the waiting queue (vLLM prepends the requests that waited for their KV)."""
        tokens = req.kv_load_tokens
        req.kv_load_tokens = 0
        self.offload.finish_load(req)  # type: ignore[union-attr]
        self.kv.cache_loaded(req, tokens)
        req.num_computed_tokens = min(tokens, req.num_tokens - 1)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.WAITING
        self.scheduler.waiting.add_front(req)

    def take_pulled(self) -> list[tuple[str, float]]:
        """Decode side: (request id, virtual time) of each pull completed (or abandoned) since the last call: the
        prefill side frees those blocks then (vLLM's NIXL completion notification)."""
        out, self._pulled = self._pulled, []
        return out

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """Prefill side: the blocks a finished request keeps for the decode side (None: not held)."""
        entry = self._held.get(request_id)
        return list(entry[0].block_ids) if entry is not None else None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release_held(self, request_id: str, at_s: float | None = None) -> bool:
        """Prefill side: the decode side pulled the blocks (at virtual ``at_s``; default now): free them then.
        False if the request holds nothing (already freed, expired, or unknown)."""
        if request_id not in self._held:
            return False
        if at_s is not None and at_s > self.now_s:
            heapq.heappush(self._releases, (at_s, request_id))
        else:
            self._free_held(request_id)
        return True

    def next_release_s(self) -> float | None:
        """When the next held blocks are due to be freed (a pull announced for later, or an abort timeout)."""
        rel = self._releases
        while rel and rel[0][1] not in self._held:
            heapq.heappop(rel)
        return rel[0][0] if rel else None

    def free_expired(self, now_s: float | None = None) -> int:
        """Free what is due at ``now_s`` (default: the engine clock; an idle server's clock follows wall time)."""
        if now_s is not None and now_s > self.now_s and not self.has_unfinished():
            self.now_s = now_s
        return self._free_released()

    def _free_released(self) -> int:
        now, freed = self.now_s, 0
        rel = self._releases
        while rel and rel[0][0] <= now:
            freed += self._free_held(heapq.heappop(rel)[1])
        return freed

    def _free_held(self, request_id: str) -> int:
        entry = self._held.pop(request_id, None)
        if entry is None:
            return 0
        self.kv.free(entry[0])
        return 1

    def _collect_held(self, end_s: float) -> None:
        sched = self.scheduler
        for req in sched.held:
            expiry = end_s + self.abort_timeout_s
            self._held[req.request_id] = (req, expiry)
            heapq.heappush(self._releases, (expiry, req.request_id))
        sched.held.clear()

    # -- stepping -----------------------------------------------------------------------------------
    def step(self, max_steps: int = 1, until_s: float | None = None) -> StepResult | None:
        """Run one step (or a window of up to ``max_steps`` identical decode steps).

        When nothing is runnable the clock first jumps to the next arrival. Returns None when there is
        no work at all (or the next arrival is after ``until_s``).
        """
        sched = self.scheduler
        if not sched.running:
            sched.seats_held = 0        # an engine with nothing running schedules after the last output is in
        first = self._arrivals.first()
        if self._releases or self._pull_blocked or (first is not None and first[0] <= self._admit_cutoff_s()):
            self._admit_arrivals()      # (else it has nothing to do: most steps)
        while not sched.running and not len(sched.waiting):
            nxt = self.next_arrival_s      # idle: jump to the next arrival (aborted ones are skipped)
            if nxt is None or (until_s is not None and nxt > until_s):
                return None
            self.now_s = max(self.now_s, nxt)
            self._admit_arrivals()

        events = self._pending_events
        self._pending_events = []
        offload = self.offload
        if offload is not None:
            offload.advance(self.now_s)     # stores that ended by now become loadable
            sched.clock_s = self.now_s
        out = sched.schedule()
        if out.loading:
            for req in out.loading:         # back as an arrival when its KV is in place (_load_done)
                self._arrivals.push((req.kv_ready_s, req.seq_no, req))  # type: ignore[arg-type]  # set by the load
        start = self.now_s
        first_index = sched.step_index
        per_token = self.per_token_events
        for req in out.preempted:
            events.append(RequestEvent(PREEMPTED, req.request_id, first_index, 0, None, req.parent_id, req.index))
        if not per_token:
            for req, join, run in out.dissolved:
                if run:
                    events.append(RequestEvent(TOKENS, req.request_id, join, run, None, req.parent_id, req.index))
        for req in out.admitted:
            if req.first_scheduled_s is None:
                req.first_scheduled_s = start
                events.append(RequestEvent(SCHEDULED, req.request_id, first_index, 0, None, req.parent_id,
                                           req.index))
        if not out.requests and not out.group_size:
            # Nothing could be scheduled (every block held, nothing running to preempt): only an abort or
            # a new arrival can change that, so jump to the next arrival instead of spinning.
            nxt = self.next_arrival_s
            rel = self.next_release_s() if self._held else None      # P/D: blocks kept for a decode side
            if rel is not None and (nxt is None or rel < nxt):
                nxt = rel
            if nxt is None or (until_s is not None and nxt > until_s and self._held):
                if self._held:
                    # only the decode side's pull (release_held) can free blocks before then: wait for it
                    self._pending_events = events
                    return None
                raise RuntimeError("scheduler made no progress and no arrival can change that")
            self._pending_events = events
            self.now_s = max(nxt, self.now_s)
            return self.step(max_steps, until_s)

        k = sched.window_limit(out, max_steps)
        ends = None
        if k > 1:
            durations, breakdown, ends = self._window(out, start, k, until_s)
        else:
            breakdown, total_s = self.step_model.step(out.batch)
            durations = [total_s]
        k = len(durations)
        if ends is None:
            ends = list(accumulate(durations, initial=start))[1:] if k > 1 else [start + durations[0]]
        snapshot = list(sched.members) if per_token else ()
        upd = sched.update(out, k)
        if offload is not None and out.requests:
            # the blocks this step filled go to the CPU tier on the copy stream, from the step's end
            offload.store_computed(out.requests, self.kv.block_hashes, ends[0])
        # async scheduling: the next step was scheduled before this one's output was in, so the seats of the requests
        # that finish in it were still taken then (vLLM frees them when it processes the output)
        sched.seats_held = len(upd.finished) if self.async_scheduling else 0
        for req in upd.first_tokens:
            req.first_token_s = ends[0]
            events.append(RequestEvent(FIRST_TOKEN, req.request_id, first_index, 1, None, req.parent_id,
                                       req.index))
        bursts = upd.bursts
        if bursts:
            for req in upd.tokens:
                n = bursts.get(req, 1)
                events.append(RequestEvent(TOKENS, req.request_id, first_index, n, None, req.parent_id, req.index,
                                           n > 1))
        else:
            for req in upd.tokens:
                events.append(RequestEvent(TOKENS, req.request_id, first_index, 1, None, req.parent_id,
                                           req.index))
        if per_token:
            for req in snapshot:
                events.append(RequestEvent(TOKENS, req.request_id, first_index, k, None, req.parent_id,
                                           req.index))
        else:
            for req, join, run in upd.runs:
                if run:
                    events.append(RequestEvent(TOKENS, req.request_id, join, run, None, req.parent_id,
                                               req.index))
        last_index = first_index + k - 1
        if sched.held:
            self._collect_held(ends[-1])
        for req in upd.finished:
            self._forget(req)
            events.append(RequestEvent(FINISHED, req.request_id, last_index, 0, req.finish_reason.value,  # type: ignore[union-attr]
                                       req.parent_id, req.index))
        return self._commit(start, ends, first_index, events, out.total_tokens, breakdown)

    def _window(self, out, start: float, k: int, until_s: float | None
                ) -> tuple[list[float], np.ndarray, list[float] | None]:
        """Durations of a window of up to k pure-decode steps, cut at the step during which the next
        arrival (or until_s) falls and where the KV cache can no longer feed the group; and the steps' end times
        when they were computed for that cut (None: not)."""
        b, ctx0, top = out.batch.num_decodes, out.batch.decode_context_tokens, out.batch.decode_context_top
        arrival = self.next_arrival_s
        if arrival is not None:
            # An arrival during the first step (whose time is the same in a window of any length) cuts the window
            # there, or a step later under async scheduling, whatever the rest of it: price only what is kept.
            durations, breakdown = self.step_model.decode_window(b, ctx0, 1, top)
            end = start + durations[0]
            if end >= arrival:
                k_cut = min(k, 2) if self.async_scheduling and arrival > start else 1
                if k_cut > 1 and until_s is not None and until_s <= end:
                    k_cut = 1
                k_cut = self.scheduler.extend_window(k_cut)
                if k_cut == 1:
                    return durations, breakdown, [end]
                durations, breakdown = self.step_model.decode_window(b, ctx0, k_cut, top)
                return durations, breakdown, None
        durations, breakdown = self.step_model.decode_window(b, ctx0, k, top)
        k_cut = k
        ends = None
        if arrival is not None or until_s is not None:
            ends = list(accumulate(durations, initial=start))
            if arrival is not None:
                k_cut = min(k, bisect.bisect_left(ends, arrival, 1))   # the step whose end reaches it
                if self.async_scheduling and arrival > start:
                    # it can start only after the step behind that one (_admit_cutoff_s): that step is the window's
                    k_cut = min(k, k_cut + 1)
            if until_s is not None:
                k_cut = min(k_cut, bisect.bisect_left(ends, until_s, 1))
        k_cut = self.scheduler.extend_window(k_cut)
        if k_cut != k:
            durations, breakdown = self.step_model.decode_window(b, ctx0, k_cut, top)
            return durations, breakdown, None
        return durations, breakdown, ends[1:] if ends is not None else None

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        if req.parent_id is not None:
            siblings = self._children.get(req.parent_id)
            if siblings is not None and all(s not in self._requests for s in siblings):
                del self._children[req.parent_id]

    def _commit(self, start: float, ends: list[float], first_index: int, events: list[RequestEvent],
                tokens: int, breakdown: np.ndarray) -> StepResult:
        self.now_s = ends[-1]
        self._last_step_start_s = ends[-2] if len(ends) > 1 else start
        st = self.stats
        st.num_steps += len(ends)
        st.busy_s += ends[-1] - start
        st.breakdown_s += breakdown
        st.num_preemptions = self.scheduler.num_preemptions
        return StepResult(start, ends, first_index, events, tokens, len(self.scheduler.running),
                          self.num_waiting, self.kv.usage, breakdown)
