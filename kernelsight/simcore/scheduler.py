"""vLLM V1's scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill/decode phases. Every step, each running request (in queue order) gets the tokens
it needs to catch up (1 for a decode, a chunk of the prompt for a partial prefill), then waiting requests
are admitted FCFS (or by priority) while the budget, ``max_num_seqs`` and the KV cache allow. When a
running request cannot get a block, the lowest-priority running request (the newest under FCFS) is
preempted by recompute: its blocks are freed and it returns to the front of the waiting queue.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from kernelsight.simcore.encoder_cache import EncoderCacheManager
from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.kv_offload import KVOffload
from kernelsight.simcore.multimodal import MultimodalItem
from kernelsight.simcore.request import FinishReason, Request, RequestStatus
from kernelsight.simcore.spec_decode import SpecDecoder

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
    # multimodal: the encoder's compute budget per step and the encoder cache's size, in LM embeddings (vLLM's
    # compute_encoder_budget: the larger of max_num_batched_tokens and the largest item; 0: max_num_batched_tokens,
    # grown to any larger item), and whether a chunk may end inside an item (--disable-chunked-mm-input: no)
    encoder_budget_tokens: int = 0
    disable_chunked_mm_input: bool = False

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # rebuilt through __init__ (plan's and --replica-processes' workers get it pickled): compiled by mypyc
        # (kernelsight.accel) a frozen class refuses the field-by-field __setstate__ of a slots dataclass
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request]
    num_scheduled_tokens: list[int]
    preempted: list[Request]
    admitted: list[Request]
    batch: BatchShape
    total_tokens: int
    group_size: int = 0               # decode-group members that take a token this step
    # members dissolved back to per-request scheduling (or preempted) this step: (req, join step, tokens)
    dissolved: list[tuple[Request, int, int]] = field(default_factory=list)
    # speculative decoding: draft tokens each scheduled request verifies (parallel to ``requests``; empty without)
    num_draft_tokens: list[int] = field(default_factory=list)
    # KV offloading: requests taken out of the waiting queue to load their prefix from the CPU tier (kv_ready_s set)
    loading: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class StepUpdate:
    """What one executed step did to requests (consumed by the engine to emit events)."""

    first_tokens: list[Request] = field(default_factory=list)
    tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    runs: list[tuple[Request, int, int]] = field(default_factory=list)  # group members' (req, join, tokens)
    bursts: dict[Request, int] = field(default_factory=dict)   # speculative decoding: tokens > 1 in one step


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
    """Schedules steps; steady decoders are tracked as a group so a step costs O(changes), not O(batch).

    A running request that is decoding takes exactly one token per step until it finishes, is preempted
    or aborted. Such requests join the *decode group*: their progress is implied by the global step
    index (``computed = computed_at_join + steps since join``), and only two heaps are touched per step:
    the steps at which members need a new KV block, and the steps at which they finish. Requests that
    are prefilling (or everything, in the exact slow mode used under KV pressure) are "individuals",
    scheduled one by one exactly as vLLM does. The group is only used when it cannot change the result:
    all members fit the token budget, and their block needs fit the free blocks; otherwise it is
    dissolved and vLLM's per-request loop (with preemption) runs until the pressure is gone.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, use_decode_group: bool = True) -> None:
        self.config = config
        self.kv = kv
        self.running: list[Request] = []          # admission order (preemption picks from the end)
        self.individuals: list[Request] = []      # running requests outside the decode group, same order
        self.waiting = WaitingQueue(config.policy)
        self.num_preemptions = 0
        self.held: list[Request] = []             # finished with their blocks kept (P/D prefill side), for the engine
        self.step_index = 0                       # index of the next step to run
        # decode group
        self.members: dict[Request, None] = {}
        self._ctx_base = 0                        # Σ over members of (computed_at_join + 1 − join_step)
        self._finish_heap: list[tuple[int, int, int, Request]] = []
        # members' block needs by due step: step -> [(seq_no, join step, request)], and the due steps as a heap of
        # ints (a tuple heap of every need compared tuples on each of ~125k pushes of the sim_speed workload)
        self._dues: dict[int, list[tuple[int, int, Request]]] = {}
        self._due_steps: list[int] = []
        self._members_with_ids = 0                # members whose generated ids are known (their blocks get cached)
        # members' (context − step index), sorted: their longest contexts at any step (see decode_top_k)
        self._ctx_offsets: list[int] = []
        # how many of the longest decode contexts each step's BatchShape carries (the step model's decode_top_k)
        self.decode_top_k = 0
        # seats of requests that finished in the step before, not yet free to an async-scheduled engine (Engine.step)
        self.seats_held = 0
        # multi-token chunks per request (threshold) break the "prefills are a suffix" ordering the
        # group relies on, so that configuration always runs the exact per-request loop
        self._group_allowed = use_decode_group and config.long_prefill_token_threshold == 0
        self._group_on = self._group_allowed
        self.spec: SpecDecoder | None = None
        # KV offloading's CPU tier (None: off) and the virtual time of the step being scheduled (for its lookups)
        self.offload: KVOffload | None = None
        self.clock_s = 0.0
        self.encoder_budget = max(config.encoder_budget_tokens, config.max_num_batched_tokens)
        self.encoder_cache = EncoderCacheManager(self.encoder_budget)

    def enable_spec_decode(self, spec: SpecDecoder) -> None:
        """Speculative decoding: decodes verify draft tokens and gain a varying number of tokens per step, which the
        decode group (one token per member per step) cannot express, so every request is scheduled one by one."""
        self.spec = spec
        self._group_allowed = self._group_on = False
        self.kv.drop_last_hit_block = spec.config.uses_eagle

    # -- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def finish(self, req: Request, reason: FinishReason) -> int:
        """Take a request out of whichever queue holds it and free its blocks (abort or completion).

        Returns how many group tokens it had produced since joining (0 if it was not a member).
        """
        if req.status is RequestStatus.FINISHED:
            return 0
        run = 0
        if req.status is RequestStatus.RUNNING:
            if req.decode_join_step >= 0:
                run = self._leave_group(req)
            else:
                self.individuals.remove(req)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.mm_items:
            self.encoder_cache.free(req.request_id, [it.mm_hash for it in req.mm_items])
        if req.hold_kv and reason is FinishReason.LENGTH:
            self.held.append(req)     # vLLM's NIXL connector delays the free until the decode side reads them
        else:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return run

    def _preempt(self, req: Request) -> None:
        if req.mm_items:
            self.encoder_cache.free(req.request_id, [it.mm_hash for it in req.mm_items])
        self.kv.free(req, preempted=True)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    def _pick_victim(self) -> Request:
        if self.config.policy == PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_s, r.seq_no))
        return self.running[-1]

    # -- decode group -------------------------------------------------------------------------------
    def _join_group(self, req: Request, join_step: int) -> None:
        req.decode_join_step = join_step
        self.members[req] = None
        if req.output_token_ids is not None:
            self._members_with_ids += 1
        self._ctx_base += req.num_computed_tokens + 1 - join_step
        bisect.insort(self._ctx_offsets, req.num_computed_tokens + 1 - join_step)
        if req.target_output_len > req.num_output_tokens:
            last = join_step + req.target_output_len - req.num_output_tokens - 1
            heapq.heappush(self._finish_heap, (last, req.seq_no, join_step, req))
        due = join_step + len(req.block_ids) * self.kv.block_size - req.num_computed_tokens
        self._add_due(due, (req.seq_no, join_step, req))

    def _add_due(self, due: int, entry: tuple[int, int, Request]) -> None:
        bucket = self._dues.get(due)
        if bucket is None:
            self._dues[due] = [entry]
            heapq.heappush(self._due_steps, due)
        else:
            bucket.append(entry)

    def _leave_group(self, req: Request, drop_need: bool = True) -> int:
        """Materialize a member's progress at the current step index; returns tokens produced in the group.
        Its pending block need leaves the due table too (``drop_need``), so the table holds live needs only."""
        join = req.decode_join_step
        run = self.step_index - join
        if drop_need:
            # the need is due when the member's blocks run out: each block it took moved it one block on
            due = join + len(req.block_ids) * self.kv.block_size - req.num_computed_tokens
            self._dues[due].remove((req.seq_no, join, req))
        self._ctx_base -= req.num_computed_tokens + 1 - join
        offsets = self._ctx_offsets
        del offsets[bisect.bisect_left(offsets, req.num_computed_tokens + 1 - join)]
        req.num_computed_tokens += run
        req.num_output_tokens += run
        req.decode_join_step = -1
        del self.members[req]
        if req.output_token_ids is not None:
            self._members_with_ids -= 1
        return run

    def group_runs_on_dissolve(self) -> list[tuple[Request, int, int]]:
        """Dissolve the group (all members back to the exact per-request loop). Returns their runs."""
        runs = []
        for req in list(self.members):
            join = req.decode_join_step
            runs.append((req, join, self._leave_group(req, drop_need=False)))   # the table is cleared below
        self._finish_heap.clear()
        self._dues.clear()
        self._due_steps.clear()
        self.individuals = list(self.running)
        self._group_on = False
        return runs

    def _allocate_group_blocks(self, last_step: int) -> int:
        """Give members every block they need for steps ≤ last_step, in due order (then admission order), while
        blocks last. Returns the first step whose needs could not be met (last_step + 1 when all were).

        Without KV events and with no member whose generated ids are known (so nothing is registered between two
        allocations), the needs are collected first and their blocks taken in one pool call, which hands out the
        same blocks in the same order as one call per need; otherwise each need takes its block (and its member's
        full blocks are cached) in turn, so events interleave as vLLM's would."""
        steps = self._due_steps
        if not steps or steps[0] > last_step:
            return last_step + 1           # most steps: nobody needs a block
        kv = self.kv
        pool = kv.pool
        one_by_one = pool.events is not None or (kv.enable_caching and self._members_with_ids > 0)
        dues, add_due, running = self._dues, self._add_due, RequestStatus.RUNNING
        bs = kv.block_size
        free = pool.num_free_blocks
        takers: list[Request] = []
        first_unmet = last_step + 1
        while steps and steps[0] <= last_step:
            due = steps[0]
            bucket = dues[due]
            if not one_by_one and len(takers) + len(bucket) <= free:
                # every need of this step is met: its live entries move on to their next block's step at once
                heapq.heappop(steps)
                del dues[due]
                live = bucket              # members drop their need on leaving: every entry is live
                if live:
                    live.sort()            # admission order within a step (seq_no is unique per live need)
                    takers += [e[2] for e in live]
                    nxt = due + bs
                    later = dues.get(nxt)
                    if later is None:
                        dues[nxt] = live
                        heapq.heappush(steps, nxt)
                    else:
                        later += live
                continue
            bucket.sort()                  # admission order within a step (seq_no is unique per live need)
            nxt = due + bs
            for j in range(len(bucket)):
                entry = bucket[j]
                _, join, req = entry
                if req.decode_join_step != join or req.status is not running:
                    continue               # stale: the request left the group
                if one_by_one:
                    b = pool.allocate_one()
                    if b is None:
                        first_unmet = due
                        break
                    req.block_ids.append(b)
                    if req.output_token_ids is not None and kv.enable_caching:
                        # tokens computed once step `due` runs: everything before the new block is full
                        kv._cache_full_blocks(req, req.num_computed_tokens + (due - join) + 1)
                elif len(takers) == free:
                    first_unmet = due
                    break
                else:
                    takers.append(req)
                add_due(nxt, entry)
            else:
                heapq.heappop(steps)
                del dues[due]
                continue
            dues[due] = bucket[j:]         # the unmet needs stay due
            break
        if takers:
            for req, b in zip(takers, pool.allocate(len(takers)), strict=True):
                req.block_ids.append(b)
        return first_unmet

    def _group_block_need(self, step: int) -> int:
        return sum(1 for due, bucket in self._dues.items() if due <= step
                   for _, join, req in bucket if req.decode_join_step == join)

    # -- multimodal inputs --------------------------------------------------------------------------
    def _schedule_encoder_inputs(self, req: Request, num_computed: int, num_new: int, budget: int,
                                 ) -> tuple[list[MultimodalItem], int, int]:
        """The items whose encoder must run for ``req``'s next ``num_new`` tokens, and the token count cut to what
        the encoder budget and cache allow (vLLM's ``_try_schedule_encoder_inputs``): an item whose placeholders
        overlap the chunk runs unless its tokens are already computed or its output is cached; one that does not
        fit ends the chunk just before it. Returns (items, num_new, remaining encoder budget)."""
        cache = self.encoder_cache
        out: list[MultimodalItem] = []
        to_schedule = 0
        end = num_computed + num_new
        for item in req.mm_items:
            start, n = item.offset, item.num_tokens
            if start >= end:
                break
            if start + n <= num_computed:
                continue                       # its embeddings are in the KV cache already (or a prefix hit)
            if cache.check_and_update_cache(req.request_id, item.mm_hash):
                continue
            if self.config.disable_chunked_mm_input and num_computed < start and end < start + n:
                num_new = start - num_computed
                break
            if n > cache.cache_size:
                # larger than any budget sized so far: vLLM sizes both to the largest item the model takes
                cache.num_free_slots += n - cache.cache_size
                cache.num_freeable_slots += n - cache.cache_size
                self.encoder_budget = cache.cache_size = n
                budget = max(budget, n) if not out else budget
            if not cache.can_allocate(n, budget, to_schedule):
                num_new = start - num_computed if num_computed < start else 0
                break
            to_schedule += n
            budget -= n
            out.append(item)
        return out, num_new, budget

    def _allocate_encoder_inputs(self, req: Request, items: list[MultimodalItem]) -> None:
        for item in items:
            self.encoder_cache.allocate(req.request_id, item.mm_hash, item.num_tokens)

    def _free_consumed_encoder_inputs(self, req: Request) -> None:
        """Items whose every embedding is in the KV cache no longer need their encoder output."""
        for item in req.mm_items:
            if item.offset + item.num_tokens <= req.num_computed_tokens:
                self.encoder_cache.free_input(req.request_id, item.mm_hash)

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
        dissolved: list[tuple[Request, int, int]] = []
        S = self.step_index

        if self.members:
            n_members = len(self.members)
            # a member needs at most one block per step, so the heap scan only runs under pressure
            if n_members > budget or (kv.num_free_blocks < n_members
                                      and self._group_block_need(S) > kv.num_free_blocks):
                dissolved = self.group_runs_on_dissolve()
            else:
                self._allocate_group_blocks(S)
                budget -= len(self.members)
        elif (not self._group_on and self._group_allowed and len(running) <= budget
              and kv.num_free_blocks >= len(running)):
            self._group_on = True          # pressure gone: decoders rejoin as they sample

        individuals = self.individuals
        if not individuals and not len(self.waiting):
            # only the decode group runs (most steps): the batch is its count and context sum
            num_decodes = len(self.members)
            top: tuple[int, ...] = ()
            top_k = self.decode_top_k
            if top_k and num_decodes:
                longest = [o + S for o in self._ctx_offsets[-top_k:]]
                longest.sort(reverse=True)
                top = tuple(longest[:top_k])
            batch = BatchShape((), num_decodes, self._ctx_base + num_decodes * S, decode_context_top=top)
            return SchedulerOutput([], [], [], [], batch, cfg.max_num_batched_tokens - budget, num_decodes, dissolved)
        spec = self.spec
        lookahead = spec.num_lookahead_tokens if spec is not None else 0
        drafts_of: dict[Request, int] = {}
        enc_budget = self.encoder_budget
        encoder_of: dict[Request, list[MultimodalItem]] = {}   # items whose encoder runs this step, by request
        i = 0
        while i < len(individuals) and budget > 0:
            req = individuals[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if spec is not None and num_new == 1 and req.num_output_tokens > 0:
                num_new += spec.num_drafts_for(req.num_computed_tokens, cfg.max_model_len)
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            enc: list[MultimodalItem] = []
            if req.mm_items and num_new > 0:
                enc, num_new, enc_left = self._schedule_encoder_inputs(req, req.num_computed_tokens, num_new,
                                                                       enc_budget)
            if num_new <= 0:
                i += 1
                continue
            req_preempted = False
            while not (kv.allocate_slots(req, num_new, None, 0, lookahead) if lookahead
                       else kv.allocate_slots(req, num_new)):
                victim = self._pick_victim()
                if victim.decode_join_step >= 0:
                    run_join = victim.decode_join_step
                    dissolved.append((victim, run_join, self._leave_group(victim)))
                    budget += 1
                    running.remove(victim)
                else:
                    running.remove(victim)
                    vi = individuals.index(victim)
                    individuals.pop(vi)
                    if victim in scheduled:    # priority policy may evict an already-scheduled request
                        j = scheduled.index(victim)
                        budget += counts[j]
                        scheduled.pop(j)
                        counts.pop(j)
                        for item in encoder_of.pop(victim, ()):
                            enc_budget += item.num_tokens
                    if vi < i:
                        i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    req_preempted = True
                    break
            if req_preempted:
                break
            if enc:
                self._allocate_encoder_inputs(req, enc)
                encoder_of[req] = enc
                enc_budget = enc_left
            scheduled.append(req)
            counts.append(num_new)
            budget -= num_new
            if spec is not None and req.num_output_tokens > 0 and num_new > 1 and \
                    req.num_computed_tokens + num_new > req.num_tokens:
                drafts_of[req] = req.num_computed_tokens + num_new - req.num_tokens
            i += 1

        loading: list[Request] = []
        if not preempted:
            waiting = self.waiting
            offload = self.offload
            while len(waiting) and budget > 0 and len(running) + self.seats_held < cfg.max_num_seqs:
                req = waiting.peek()
                if req.block_ids:
                    # its prompt's KV is in place, pulled from the prefill instance (P/D) or loaded from the CPU tier
                    hits: list[int] = []
                    num_cached, new_cached = req.num_computed_tokens, 0
                else:
                    hits, num_cached = kv.get_computed_blocks(req)
                    new_cached = num_cached
                    if offload is not None:
                        started = self._offload_lookup(req, hits, num_cached)
                        if started is None:
                            break             # no room, or its blocks are being loaded for another request
                        if started:
                            waiting.pop()     # loads outside the batch; back at the head when its KV is in place
                            loading.append(req)
                            continue
                num_new = req.num_tokens - num_cached
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                enc = []
                if req.mm_items:
                    enc, num_new, enc_left = self._schedule_encoder_inputs(req, num_cached, num_new, enc_budget)
                    if num_new <= 0:
                        break
                if cfg.reserve_full_prompt and not kv.can_fit(req, req.num_tokens, hits):
                    break
                if not kv.allocate_slots(req, num_new, hits, new_cached, lookahead):
                    break
                if enc:
                    self._allocate_encoder_inputs(req, enc)
                    encoder_of[req] = enc
                    enc_budget = enc_left
                waiting.pop()
                if req.num_preemptions == 0 and req.num_cached_tokens < 0:
                    kv.prefix_queries_tokens += req.num_tokens
                    kv.prefix_hits_tokens += num_cached
                    req.num_cached_tokens = num_cached
                    if offload is not None:
                        offload.record_query(req.num_tokens, num_cached, 0)
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                running.append(req)
                individuals.append(req)
                admitted.append(req)
                scheduled.append(req)
                counts.append(num_new)
                budget -= num_new

        encoder_items = tuple(item for items in encoder_of.values() for item in items)
        prefills = []
        num_decodes = len(self.members)
        decode_ctx = self._ctx_base + num_decodes * S
        if drafts_of:
            out = self._spec_output(scheduled, counts, preempted, admitted, budget, dissolved, drafts_of,
                                    encoder_items)
            out.loading = loading
            return out
        top_k = self.decode_top_k
        # individuals' decode contexts, when the step model wants the longest
        others: list[int] | None = [] if top_k else None
        for req, n in zip(scheduled, counts, strict=True):
            if n == 1 and req.num_output_tokens > 0:
                num_decodes += 1
                decode_ctx += req.num_computed_tokens + 1
                if others is not None:
                    others.append(req.num_computed_tokens + 1)
            else:
                prefills.append(PrefillChunk(n, req.num_computed_tokens,
                                             req.num_computed_tokens + n >= req.num_tokens))
        top = ()
        if top_k and num_decodes:
            longest = [o + S for o in self._ctx_offsets[-top_k:]]
            if others:
                longest += others
            longest.sort(reverse=True)
            top = tuple(longest[:top_k])
        batch = BatchShape(tuple(prefills), num_decodes, decode_ctx, decode_context_top=top,
                           encoder_items=encoder_items)
        return SchedulerOutput(scheduled, counts, preempted, admitted, batch,
                               cfg.max_num_batched_tokens - budget, len(self.members), dissolved, loading=loading)

    def _offload_lookup(self, req: Request, hits: list[int], num_cached: int) -> bool | None:
        """KV offloading, after the GPU prefix-cache lookup: start loading the CPU tier's hit past ``hits`` (True),
        find none (False), or wait (None: its blocks do not fit, or another request's load is reading them)."""
        offload = self.offload
        kv = self.kv
        bs = kv.block_size
        hashes = kv.block_hashes(req, req.num_tokens // bs)
        ext = offload.match(req, hashes, num_cached, self.clock_s)  # type: ignore[union-attr]
        if ext is None:
            return None
        if not ext:
            return False
        target = num_cached + ext
        if self.config.reserve_full_prompt and not kv.can_fit(req, req.num_tokens, hits):
            return None
        if not kv.allocate_for_load(req, hits, target):
            return None
        first = req.num_preemptions == 0 and req.num_cached_tokens < 0
        if first:
            # vLLM records both lookups when the load is allocated; the request is not counted again once loaded
            kv.prefix_queries_tokens += req.num_tokens
            kv.prefix_hits_tokens += num_cached
            offload.record_query(req.num_tokens, num_cached, ext)  # type: ignore[union-attr]
        req.kv_load_tokens = target
        req.kv_ready_s = offload.start_load(req, hashes, num_cached, ext, self.clock_s)  # type: ignore[union-attr]
        return True

    def _spec_output(self, scheduled: list[Request], counts: list[int], preempted: list[Request],
                     admitted: list[Request], budget: int, dissolved: list[tuple[Request, int, int]],
                     drafts_of: dict[Request, int], encoder_items: tuple[MultimodalItem, ...] = ()
                     ) -> SchedulerOutput:
        """The step's output when decodes carry draft tokens: each verifies 1 + drafts tokens (no decode group)."""
        prefills = []
        num_decodes = decode_ctx = num_spec = 0
        drafts = []
        for req, n in zip(scheduled, counts, strict=True):
            d = drafts_of.get(req, 0)
            drafts.append(d)
            if req.num_output_tokens > 0 and n == 1 + d:
                num_decodes += 1
                num_spec += d
                decode_ctx += req.num_computed_tokens + n
            else:
                prefills.append(PrefillChunk(n, req.num_computed_tokens,
                                             req.num_computed_tokens + n >= req.num_tokens))
        batch = BatchShape(tuple(prefills), num_decodes, decode_ctx, num_spec, encoder_items=encoder_items)
        return SchedulerOutput(scheduled, counts, preempted, admitted, batch,
                               self.config.max_num_batched_tokens - budget, 0, dissolved, drafts)

    def window_limit(self, out: SchedulerOutput, max_steps: int) -> int:
        """Steps (≥ 1) this schedule can be repeated unchanged: only a decode group, nothing admitted,
        preempted or prefilling, capped by the first member to finish (its last step included)."""
        if max_steps <= 1 or out.requests or out.preempted or not self.members:
            return 1
        k = max_steps
        heap = self._finish_heap
        while heap and (heap[0][3].decode_join_step != heap[0][2]
                        or heap[0][3].status is not RequestStatus.RUNNING):
            heapq.heappop(heap)
        if heap:
            k = min(k, heap[0][0] - self.step_index + 1)
        return max(k, 1)

    def extend_window(self, k: int) -> int:
        """Allocate the group's blocks for steps 1..k−1 of a window; returns how many steps fit."""
        if k <= 1:
            return 1
        first_unmet = self._allocate_group_blocks(self.step_index + k - 1)
        return max(1, min(k, first_unmet - self.step_index))

    def _verify_drafts(self, out: SchedulerOutput, upd: StepUpdate) -> None:
        """Rejection sampling of a step's drafts: each verifying request keeps its accepted drafts (their KV stays
        computed; the rejected ones' slots are rewritten later) and gains 1 + accepted tokens, at most to its end.
        Afterwards its state is that of a plain one-token decode, which the common path below completes."""
        spec = self.spec
        bursts = upd.bursts
        for j, (req, d) in enumerate(zip(out.requests, out.num_draft_tokens, strict=True)):
            if not d or req.status is not RequestStatus.RUNNING:
                continue
            accepted = spec.accept(req.seq_no, req.num_output_tokens, d)  # type: ignore[union-attr]
            gained = min(1 + accepted, req.target_output_len - req.num_output_tokens)
            # the common path adds the scheduled count and one output token: leave it exactly that to add
            req.num_computed_tokens += (1 + accepted) - out.num_scheduled_tokens[j] + (gained - 1) - accepted
            req.num_output_tokens += gained - 1
            if gained > 1:
                bursts[req] = gained

    def update(self, out: SchedulerOutput, num_steps: int = 1) -> StepUpdate:
        """Apply executed steps: advance tokens, sample where a sequence caught up, finish, join the group."""
        upd = StepUpdate()
        S = self.step_index
        if out.num_draft_tokens:
            self._verify_drafts(out, upd)
        running = RequestStatus.RUNNING
        individual_finished: list[Request] = []
        if out.requests:
            tokens, first_tokens, finished = upd.tokens, upd.first_tokens, upd.finished
            for req, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
                if req.status is not running:
                    continue
                req.num_computed_tokens += n
                if req.mm_items:
                    self._free_consumed_encoder_inputs(req)
                if req.num_computed_tokens < req.num_tokens:
                    continue                      # a prefill chunk that did not reach the end: no token
                req.num_output_tokens += 1
                (tokens if req.first_token_s is not None else first_tokens).append(req)
                if req.num_output_tokens >= req.target_output_len:
                    finished.append(req)
            individual_finished = list(finished)
        last = S + num_steps - 1
        heap = self._finish_heap
        finished_members = []
        while heap and heap[0][0] <= last:
            _, _, join, req = heapq.heappop(heap)
            if req.decode_join_step == join and req.status is running:
                finished_members.append(req)
        self.step_index = S + num_steps
        for req in finished_members:
            join = req.decode_join_step
            run = self.finish(req, req.finish_reason_at_target)
            upd.runs.append((req, join, run))
            upd.finished.append(req)
        for req in individual_finished:
            self.finish(req, req.finish_reason_at_target)
        if self._group_on and (upd.first_tokens or upd.tokens):
            for req in upd.first_tokens + upd.tokens:
                if req.status is running:
                    self.individuals.remove(req)
                    self._join_group(req, self.step_index)
        return upd
