"""vLLM V1's scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill/decode phases. Every step, each running request (in queue order) gets the tokens
it needs to catch up (1 for a decode, a chunk of the prompt for a partial prefill), then waiting requests
are admitted FCFS (or by priority) while the budget, ``max_num_seqs`` and the KV cache allow. When a
running request cannot get a block, the lowest-priority running request (the newest under FCFS) is
preempted by recompute: its blocks are freed and it returns to the front of the waiting queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.request import FinishReason, Request, RequestStatus

FCFS = "fcfs"
PRIORITY = "priority"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = FCFS
    long_prefill_token_threshold: int = 0
    # vLLM ≥ 0.19: admit a request only if its whole prompt fits in the free KV blocks
    reserve_full_prompt: bool = True


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request]
    num_scheduled_tokens: list[int]
    preempted: list[Request]
    admitted: list[Request]
    batch: BatchShape
    total_tokens: int

    @property
    def is_pure_decode(self) -> bool:
        return not self.batch.prefills and not self.preempted and not self.admitted


@dataclass(slots=True)
class StepUpdate:
    """What one executed step did to requests (consumed by the engine to emit events)."""

    first_tokens: list[Request] = field(default_factory=list)
    tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival, seq) under the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._deque) if self.policy == FCFS else len(self._heap)

    def add(self, req: Request) -> None:
        if self.policy == FCFS:
            self._deque.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_s, req.seq_no, req))

    def add_front(self, req: Request) -> None:
        """Preempted requests go back first (under priority, their key already orders them)."""
        if self.policy == FCFS:
            self._deque.appendleft(req)
        else:
            self.add(req)

    def peek(self) -> Request:
        return self._deque[0] if self.policy == FCFS else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == FCFS else heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> bool:
        if self.policy == FCFS:
            try:
                self._deque.remove(req)
            except ValueError:
                return False
            return True
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __iter__(self):
        return iter(self._deque) if self.policy == FCFS else (e[3] for e in sorted(self._heap))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.running: list[Request] = []
        self.waiting = WaitingQueue(config.policy)
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Take a request out of whichever queue holds it and free its blocks (abort or completion)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    def _pick_victim(self) -> Request:
        if self.config.policy == PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_s, r.seq_no))
        return self.running[-1]

    # -- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, kv = self.config, self.kv
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        admitted: list[Request] = []
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            req_preempted = False
            while not kv.allocate_slots(req, num_new):
                victim = self._pick_victim()
                vi = running.index(victim)
                running.pop(vi)
                if victim in scheduled:        # priority policy may evict an already-scheduled request
                    j = scheduled.index(victim)
                    budget += counts[j]
                    scheduled.pop(j)
                    counts.pop(j)
                if vi < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    req_preempted = True
                    break
            if req_preempted:
                break
            scheduled.append(req)
            counts.append(num_new)
            budget -= num_new
            i += 1

        if not preempted:
            waiting = self.waiting
            while len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting.peek()
                hits, num_cached = kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_cached
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                if cfg.reserve_full_prompt and not kv.can_fit(req, req.num_tokens, hits):
                    break
                if not kv.allocate_slots(req, num_new, hits, num_cached):
                    break
                waiting.pop()
                if req.num_preemptions == 0 and req.num_cached_tokens < 0:
                    kv.prefix_queries_tokens += req.num_tokens
                    kv.prefix_hits_tokens += num_cached
                    req.num_cached_tokens = num_cached
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                running.append(req)
                admitted.append(req)
                scheduled.append(req)
                counts.append(num_new)
                budget -= num_new

        prefills = []
        num_decodes = 0
        decode_ctx = 0
        for req, n in zip(scheduled, counts, strict=True):
            if n == 1 and req.num_output_tokens > 0:
                num_decodes += 1
                decode_ctx += req.num_computed_tokens + 1
            else:
                prefills.append(PrefillChunk(n, req.num_computed_tokens,
                                             req.num_computed_tokens + n >= req.num_tokens))
        batch = BatchShape(tuple(prefills), num_decodes, decode_ctx)
        return SchedulerOutput(scheduled, counts, preempted, admitted, batch,
                               cfg.max_num_batched_tokens - budget)

    def update(self, out: SchedulerOutput) -> StepUpdate:
        """Apply a finished step: advance computed tokens, sample one token where a sequence caught up."""
        upd = StepUpdate()
        for req, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue                      # a prefill chunk that did not reach the end: no token
            req.num_output_tokens += 1
            (upd.tokens if req.first_token_s is not None else upd.first_tokens).append(req)
            if req.num_output_tokens >= req.target_output_len:
                upd.finished.append(req)
        for req in upd.finished:
            self.finish(req, req.finish_reason_at_target)
        return upd

    # -- fast path: many identical decode steps ------------------------------------------------------
    def decode_window_limit(self, max_steps: int) -> int:
        """How many pure-decode steps (≤ max_steps) the current running set can take before anything
        other than context growth changes: a request finishing (its last step included) or blocks
        running out. Called right after ``schedule()`` returned a pure-decode step of all running."""
        k = max_steps
        for r in self.running:
            if r.remaining_output_tokens < k:
                k = r.remaining_output_tokens
        return max(k, 1)

    def blocks_fit(self, k: int) -> bool:
        """Whether every running request can hold k more tokens (beyond its computed ones)."""
        bs = self.kv.block_size
        need = 0
        for r in self.running:
            extra = -(-(r.num_computed_tokens + k) // bs) - len(r.block_ids)
            if extra > 0:
                need += extra
        return need <= self.kv.num_free_blocks

    def apply_decode_window(self, k: int) -> list[Request]:
        """Advance every running request by k decode steps at once; returns the requests that finished."""
        kv = self.kv
        finished = []
        for r in self.running:
            if not kv.allocate_slots(r, k):      # checked by blocks_fit: cannot fail
                raise RuntimeError("decode window overran the KV cache")
            r.num_computed_tokens += k
            r.num_output_tokens += k
            if r.num_output_tokens >= r.target_output_len:
                finished.append(r)
        for r in finished:
            self.finish(r, r.finish_reason_at_target)
        return finished

    def all_running_scheduled(self, out: SchedulerOutput) -> bool:
        return len(out.requests) == len(self.running)
