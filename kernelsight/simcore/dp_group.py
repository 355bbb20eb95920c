"""A data-parallel group: N engines on one virtual clock behind one router, as vLLM runs ``-dp N``.

Each rank is a whole :class:`~kernelsight.simcore.engine.Engine` (own scheduler, queue and KV cache). The router
is vLLM's DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``): a request goes to the rank with
the lowest ``4·waiting + running`` (ties: the lowest rank), unless it names its rank. Like vLLM's front end it
routes on counts the coordinator publishes every 100 ms, plus one waiting request for each assignment it made
since (the published counts are the ranks' state at the first arrival after each 100 ms boundary).

How the ranks share time depends on the model (vLLM's ``DPEngineCoreProc``):

* dense model: the ranks are independent engines, each stepping on its own clock;
* MoE model: the ranks' MoE layers form one group (expert-parallel with ``--enable-expert-parallel``, else
  tensor-parallel over all DP×TP GPUs), so the ranks step in lockstep. Every forward pass pads each rank's rows
  to the largest rank's count, an idle rank runs a dummy batch, and the step lasts as long as the slowest rank's
  own work plus the MoE dispatch/combine collectives (:mod:`kernelsight.simcore.expert_parallel`).

A lockstep rank's engine is built with a :class:`LockstepStepModel`: the engine's own call only records the batch
it scheduled (priced 0 s); the group then prices all ranks' batches together and moves every rank's clock, step
end and statistics to the group's step end. The engine's hot loop is unchanged, and a group of one is never used
(a single engine is driven directly). The real-time server drives the same group (``server/engine/lockstep.py``); it
submits to the rank its front end picked, straight to that engine, and never lets an idle group's clock run ahead
of wall time (``step(until_s=...)``).

Speculative decoding (vLLM's DP attention + EP + MTP deployments): each rank drafts and verifies its own batch
(its own acceptance draws), but every forward pass of the step is a group pass: the target's verify pass (each
decode's ``1 + k`` tokens) and each of the drafter's passes (its first pass over the step's tokens, then ``k - 1``
passes of one row per request), each padded to the largest rank's rows, its MoE layers (an MTP module has one)
priced at the group's size with their own dispatch/combine (:func:`moe_passes`). A rank's own work is its
:class:`~kernelsight.simcore.spec_decode_step.SpecStepModel` step; an idle rank's dummy batch drafts too (vLLM's
dummy run calls the drafter's), so it also joins every draft pass.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine import FIRST_TOKEN, Engine, StepResult
from kernelsight.simcore.expert_parallel import all2all_s, ep_moe_kernels
from kernelsight.simcore.kernels import FAMILIES, FAMILY_INDEX, BatchShape
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING
from kernelsight.simcore.spec_decode_step import SpecStepModel
from kernelsight.simcore.step_model import EAGER, StepModel

#: vLLM's DP load-balancing weight of a waiting request against a running one.
WAITING_WEIGHT = 4
#: How often vLLM's DP coordinator publishes the engines' (waiting, running) counts to the front end
#: (``stats_update_interval_ms``); in between, the front end adds its own assignments to the last counts.
LB_STATS_INTERVAL_S = 0.1
_I_MOE = FAMILY_INDEX[K.MOE_GEMM]
#: A dummy batch (an idle rank of a lockstep group): one decode row whose attention reads one token.
DUMMY_BATCH = BatchShape((), 1, 1)


def moe_passes(sm: StepModel, batch: BatchShape) -> list[tuple[StepModel, int]]:
    """The forward passes of one step of ``sm`` over ``batch`` whose MoE layers run in the group, as (the pass's
    step model, its padded rows): the target's pass, then a speculative drafter's passes."""
    passes = [(sm, StepModel._graph_mode(sm, batch.num_tokens, batch.is_decode_only)[1])]   # own rows, unpadded
    if isinstance(sm, SpecStepModel):
        passes += sm.draft_passes(batch)
    return passes


class LockstepStepModel(StepModel):
    """A lockstep rank's step model. The engine's ``step`` call records the batch and returns zero time (the
    group fixes the clock afterwards); :meth:`priced` gives the real time with the rows padded to the group's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_batch: BatchShape | None = None
        self._pad_rows = 0
        self._zeros = np.zeros(len(FAMILIES))

    def step(self, batch: BatchShape) -> tuple[np.ndarray, float]:
        if not self._pad_rows:
            self.last_batch = batch
            return self._zeros.copy(), 0.0
        return super().step(batch)

    def _graph_mode(self, m: int, decode_only: bool) -> tuple[str, int]:
        # overrides the private hook, not graph_mode: StepModel.step calls _graph_mode directly (its hot path)
        mode, padded = super()._graph_mode(m, decode_only)
        if self._pad_rows > padded:
            pad_mode, padded = super()._graph_mode(self._pad_rows, True)
            if pad_mode == EAGER:
                mode = EAGER
        return mode, padded

    def padded_rows(self, batch: BatchShape) -> int:
        return StepModel._graph_mode(self, batch.num_tokens, batch.is_decode_only)[1]

    def priced(self, batch: BatchShape, pad_rows: int) -> tuple[np.ndarray, float]:
        """(seconds per family, total) of ``batch`` with its rows padded to at least ``pad_rows``."""
        self._pad_rows = max(pad_rows, 1)
        try:
            return super().step(batch)
        finally:
            self._pad_rows = 0


@dataclass(frozen=True, slots=True)
class MoEGroupTiming:
    """What a lockstep step adds to the ranks' own work: the MoE layers' group-wide expert GEMMs (the busiest
    rank's) and the dispatch/combine collectives, both functions of the padded rows per rank."""

    expert_parallel: bool
    group_gpus: int            # DP × TP: the GPUs of the MoE group
    tp: int
    backend: str               # all2all backend (EP); the non-EP MoE group gathers and reduce-scatters
    load_imbalance: float | None   # busiest EP rank's share over the mean; None: from the routing distribution
    routing: str = DEFAULT_EXPERT_ROUTING
    _cache: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def moe_and_comm_s(self, sm: StepModel, rows_per_rank: int) -> tuple[float, float]:
        """(MoE expert-GEMM seconds of the busiest rank, dispatch+combine seconds) of one step."""
        # keyed by the pass's model too: a speculative drafter's passes (one MTP layer) share the cache
        key = (sm.model.name, sm.model.num_moe_layers, rows_per_rank)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        # the TP ranks of one DP rank hold the same rows: the group's distinct rows are DP × rows, gathered over
        # the DP ranks (each TP column in parallel); the MoE output's TP all-reduce is already in the step model
        model, dp = sm.model, self.group_gpus // self.tp
        if self.expert_parallel:
            kernels = ep_moe_kernels(model, rows_per_rank * dp, self.group_gpus, sm.precision, self.load_imbalance,
                                     self.routing)
            backend = self.backend
        else:   # experts tensor-parallel over all DP×TP GPUs, every rank's rows gathered
            kernels = K.moe_kernels(model, rows_per_rank * dp, self.group_gpus, sm.precision,
                                    model.num_moe_layers, routing=self.routing)
            backend = "allgather_reducescatter"
        moe_s = sum(sm.kernel_time_s(k) for k in kernels if k.family == K.MOE_GEMM)
        comm_s = all2all_s(backend, model, rows_per_rank, dp, sm.hw, sm.calib.comm, sm.precision)
        self._cache[key] = (moe_s, comm_s)
        return moe_s, comm_s

    def passes_s(self, passes: Sequence[tuple[StepModel, int]]) -> tuple[float, float]:
        """:meth:`moe_and_comm_s` summed over a step's passes ((step model, rows per rank) each)."""
        if len(passes) == 1:
            return self.moe_and_comm_s(*passes[0])
        moe_s = comm_s = 0.0
        for sm, rows in passes:
            m, c = self.moe_and_comm_s(sm, rows)
            moe_s += m
            comm_s += c
        return moe_s, comm_s


class GroupMoEStepModel(StepModel):
    """A rank of a MoE data-parallel group stepped on its own clock (``serve --data-parallel-rank``): its MoE
    layers are priced as the group's, every rank assumed to run as many rows as this one, dispatch/combine
    included; the lockstep's waits for a slower rank and dummy batches are not seen from one rank. With speculative
    decoding (:class:`GroupMoESpecStepModel`) the drafter's passes are group passes too (:func:`moe_passes`)."""

    def __init__(self, *args: Any, moe: MoEGroupTiming, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moe = moe

    def step(self, batch: BatchShape) -> tuple[np.ndarray, float]:
        bd, total = super().step(batch)
        moe_s, comm_s = self.moe.passes_s(moe_passes(self, batch))
        total += moe_s - bd[_I_MOE] + comm_s
        bd[_I_MOE] = moe_s
        return bd, total


class GroupMoESpecStepModel(GroupMoEStepModel, SpecStepModel):
    """:class:`GroupMoEStepModel` of a rank that drafts and verifies (``serve --data-parallel-rank``): its
    :class:`SpecStepModel` step, then every pass's MoE layers (target and drafter) priced as the group's."""


class LockstepSpecStepModel(LockstepStepModel, SpecStepModel):
    """:class:`LockstepStepModel` of a rank that drafts and verifies: ``priced`` is its :class:`SpecStepModel`
    step (verification + drafting); the group swaps every pass's MoE layers for the group's."""


@dataclass(slots=True)
class RankStats:
    """One rank's share of a run: routing, its own work, lockstep overheads, queue and KV over time."""

    num_requests: int = 0
    num_steps: int = 0
    num_dummy_steps: int = 0          # lockstep steps it ran with nothing scheduled
    own_s: float = 0.0                # its own step time (kernels, launch, host; MoE at the group's size)
    all2all_s: float = 0.0            # MoE dispatch + combine
    sync_wait_s: float = 0.0          # waiting for a slower rank of the lockstep group
    breakdown_s: np.ndarray = field(default_factory=lambda: np.zeros(len(FAMILIES)))
    time_s: float = 0.0               # Σ step durations the samples below are weighted by
    waiting_s: float = 0.0            # Σ waiting · duration
    running_s: float = 0.0
    kv_usage_s: float = 0.0
    peak_waiting: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0

    def sample(self, duration_s: float, waiting: int, running: int, kv_usage: float) -> None:
        self.time_s += duration_s
        self.waiting_s += waiting * duration_s
        self.running_s += running * duration_s
        self.kv_usage_s += kv_usage * duration_s
        self.peak_waiting = max(self.peak_waiting, waiting)
        self.peak_running = max(self.peak_running, running)
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)

    def summary(self) -> dict[str, Any]:
        t = self.time_s or 1.0

        def r(x: float, nd: int) -> float:
            return round(float(x), nd)
        return {"requests": self.num_requests, "steps": self.num_steps, "dummy_steps": self.num_dummy_steps,
                "mean_waiting": r(self.waiting_s / t, 3), "peak_waiting": self.peak_waiting,
                "mean_running": r(self.running_s / t, 3), "peak_running": self.peak_running,
                "mean_kv_usage": r(self.kv_usage_s / t, 5), "peak_kv_usage": r(self.peak_kv_usage, 5),
                "own_step_s": r(self.own_s, 6), "all2all_s": r(self.all2all_s, 6),
                "sync_wait_s": r(self.sync_wait_s, 6),
                "breakdown_s": {f: r(s, 6) for f, s in zip(FAMILIES, self.breakdown_s, strict=True)
                                if s > 0}}


class DPGroup:
    """N engines behind vLLM's least-loaded router; independent, or in lockstep when ``moe`` is given (every
    engine then built with a :class:`LockstepStepModel`)."""

    def __init__(self, engines: Sequence[Engine], moe: MoEGroupTiming | None = None) -> None:
        if len(engines) < 1:
            raise ValueError("a data-parallel group needs at least one engine")
        self.engines = list(engines)
        self.moe = moe
        if moe is not None and not all(isinstance(e.step_model, LockstepStepModel) for e in self.engines):
            raise TypeError("lockstep ranks need a LockstepStepModel")
        self.stats = [RankStats() for _ in self.engines]
        self.rank_of: dict[str, int] = {}
        self._pending: list[tuple[float, int, str, tuple, dict[str, Any]]] = []
        self._pending_ids: set[str] = set()
        self._seq = itertools.count()
        self.now_s = 0.0               # the lockstep clock (independent ranks keep their own)
        self._lb_counts: list[list[int]] = [[0, 0] for _ in self.engines]   # the front end's (waiting, running)
        self._lb_next_s = 0.0          # when the coordinator publishes fresh counts next
        self.step_time_factor = 1.0    # lockstep: every step lasts this many times its simulated time

    @property
    def size(self) -> int:
        return len(self.engines)

    # -- routing ---------------------------------------------------------------------------------------
    def pick_rank(self, counts: Sequence[Sequence[int]] | None = None) -> int:
        """vLLM's choice: lowest 4·waiting + running over ``counts`` (default: the ranks' current state), the
        lowest rank among equals."""
        if counts is None:
            counts = [(e.num_waiting, e.num_running) for e in self.engines]
        return min(range(self.size), key=lambda i: (WAITING_WEIGHT * counts[i][0] + counts[i][1], i))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int, *,
                    arrival_s: float, rank: int | None = None, **kwargs: Any) -> None:
        """Queue a request arriving at ``arrival_s``; it is routed when the clock reaches that time (to ``rank``
        if given, as vLLM's ``X-data-parallel-rank``)."""
        if rank is not None and not 0 <= rank < self.size:
            raise ValueError(f"data-parallel rank {rank} out of range [0, {self.size})")
        if request_id in self.rank_of or request_id in self._pending_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._pending_ids.add(request_id)
        kwargs = dict(kwargs, rank=rank)
        heapq.heappush(self._pending, (float(arrival_s), next(self._seq), request_id, (prompt_token_ids,
                                                                                       max_tokens), kwargs))

    def _route_until(self, t: float) -> None:
        """Route every pending request that has arrived by ``t``; each rank's clock is at ``t`` or later then
        (a busy rank's step ends after it, an idle rank waits for it), so the request joins its waiting queue."""
        while self._pending and self._pending[0][0] <= t:
            arrival, _, rid, (prompt, max_tokens), kwargs = heapq.heappop(self._pending)
            self._pending_ids.discard(rid)
            for e in self.engines:
                if not _has_work(e):
                    e.now_s = max(e.now_s, arrival)
            rank = kwargs.pop("rank")
            if rank is None:
                if arrival >= self._lb_next_s:       # a publication since the last routing: fresh counts
                    self._lb_counts = [[e.num_waiting, e.num_running] for e in self.engines]
                    self._lb_next_s = (arrival // LB_STATS_INTERVAL_S + 1) * LB_STATS_INTERVAL_S
                rank = self.pick_rank(self._lb_counts)
                self._lb_counts[rank][0] += 1
            self.engines[rank].add_request(rid, prompt, max_tokens, arrival_s=arrival, **kwargs)
            self.rank_of[rid] = rank
            self.stats[rank].num_requests += 1

    def has_unfinished(self) -> bool:
        return bool(self._pending) or any(e.has_unfinished() for e in self.engines)

    @property
    def next_arrival_s(self) -> float | None:
        return self._pending[0][0] if self._pending else None

    # -- stepping --------------------------------------------------------------------------------------
    def step(self, max_steps: int = 1, until_s: float | None = None) -> list[tuple[int, StepResult]] | None:
        """Advance the group by one step: of the rank furthest behind (independent), or of every rank
        (lockstep). Returns (rank, result) pairs, or None when no work is left. ``until_s`` (lockstep only; the
        real-time server passes its wall-mapped now): an idle group does not jump its clock past it, None then."""
        if self.moe is not None:
            return self._lockstep(until_s)
        while True:
            nxt = self._pending[0][0] if self._pending else None
            busy = [(e.now_s, i) for i, e in enumerate(self.engines) if _has_work(e)]
            if busy:
                t, i = min(busy)
                if nxt is None or t < nxt:
                    res = self.engines[i].step(max_steps, until_s=nxt)
                    if res is not None:
                        self._account(i, res, res.end_s - res.start_s)
                        return [(i, res)]
            if nxt is None:
                return None
            self._route_until(nxt)

    def _account(self, i: int, res: StepResult, duration_s: float) -> None:
        st = self.stats[i]
        st.num_steps += res.num_steps
        st.own_s += duration_s
        st.breakdown_s += res.breakdown_s
        st.sample(duration_s, res.num_waiting, res.num_running, res.kv_usage)

    def _lockstep(self, until_s: float | None = None) -> list[tuple[int, StepResult]] | None:
        moe = self.moe
        assert moe is not None
        engines = self.engines
        while True:
            self._route_until(self.now_s)
            start = self.now_s
            if any(_ready(e, start) for e in engines):
                results: list[tuple[int, StepResult]] = []
                batches: list[BatchShape | None] = []
                for i, e in enumerate(engines):
                    res = e.step(1, until_s=start) if _ready(e, start) else None
                    if res is not None:
                        results.append((i, res))
                    batches.append(e.step_model.last_batch if res is not None else None)  # type: ignore[attr-defined]
                if results:
                    break
                # only requests that no longer need a step (aborted before they surfaced, a P/D pull started):
                # nothing runs, no rank's clock moves
            nxt = self.next_event_s()
            if nxt is None or (until_s is not None and nxt > until_s):
                return None
            self.now_s = max(self.now_s, nxt)
            for e in engines:
                e.now_s = max(e.now_s, self.now_s)
        models: list[LockstepStepModel] = [e.step_model for e in engines]         # type: ignore[misc]
        passes = _group_passes([moe_passes(sm, b if b is not None else DUMMY_BATCH)
                                for sm, b in zip(models, batches, strict=True)])
        rows = passes[0][1]
        moe_s, comm_s = moe.passes_s(passes)
        own: list[tuple[np.ndarray, float]] = []
        for sm, b in zip(models, batches, strict=True):
            bd, total = sm.priced(b if b is not None else DUMMY_BATCH, rows)
            total += moe_s - bd[_I_MOE]    # the expert GEMMs run at the group's size, not the rank's
            bd[_I_MOE] = moe_s
            own.append((bd, total))
        if isinstance(models[0], SpecStepModel):
            _regroup_spec_accounting(moe, models, passes)
        slowest = max(t for _, t in own)
        duration = slowest + comm_s
        f = self.step_time_factor
        if f != 1.0:        # a degraded group (the server's "slow" fault): every part of the step slows alike
            slowest, comm_s, duration = slowest * f, comm_s * f, duration * f
            own = [(bd * f, total * f) for bd, total in own]
        end = start + duration
        by_rank = dict(results)
        for i, e in enumerate(engines):
            bd, total = own[i]
            st = self.stats[i]
            st.all2all_s += comm_s
            st.sync_wait_s += slowest - total
            st.own_s += total
            res = by_rank.get(i)
            e.now_s = end
            if res is None:
                st.num_dummy_steps += 1
                st.sample(duration, e.num_waiting, e.num_running, e.kv.usage)
                continue
            res.step_end_s[0] = end
            res.breakdown_s = bd
            e.stats.busy_s += duration
            e.stats.breakdown_s += bd
            for ev in res.events:
                if ev.kind == FIRST_TOKEN:
                    req = e.get_request(ev.request_id)
                    if req is not None:
                        req.first_token_s = end
            st.num_steps += 1
            st.breakdown_s += bd
            st.sample(duration, res.num_waiting, res.num_running, res.kv_usage)
        self.now_s = end
        return results

    def next_event_s(self) -> float | None:
        """The earliest arrival still to come: one the group routes, or one a rank's engine holds itself (the
        server submits straight to a rank; a P/D pull ends as its request's next arrival)."""
        times = [t for t in (e.next_arrival_s for e in self.engines) if t is not None]
        if self._pending:
            times.append(self._pending[0][0])
        return min(times, default=None)

    def idle_until(self, t: float) -> None:
        """Move an idle group's clock (and every rank's) on to ``t``: the real-time server's clock follows wall
        time while nothing runs. A group with queued work keeps its clock."""
        if any(_has_work(e) for e in self.engines) or t <= self.now_s:
            return
        self.now_s = t
        for e in self.engines:
            e.now_s = max(e.now_s, t)


def _group_passes(per_rank: Sequence[Sequence[tuple[StepModel, int]]]) -> list[tuple[StepModel, int]]:
    """The group's passes of one lockstep step: pass i of every rank padded to the largest rank's rows (a rank
    with fewer passes joins the rest with a dummy pass, as vLLM's collectives need every rank in each)."""
    out = []
    for i in range(max(len(p) for p in per_rank)):
        rows = [p[i] for p in per_rank if i < len(p)]
        out.append((rows[0][0], max(r for _, r in rows)))
    return out


def _regroup_spec_accounting(moe: MoEGroupTiming, models: Sequence[StepModel],
                             passes: Sequence[tuple[StepModel, int]]) -> None:
    """Each speculating rank's verify/draft seconds (and its decode-only steps' counterfactual without drafts, padded
    to the largest rank's plain rows) with the group's MoE GEMMs and all-to-alls, not its own rows'."""
    per_pass = [sum(moe.moe_and_comm_s(m, r)) for m, r in passes]
    plain_rows = [sm.last_plain_rows for sm in models if sm.last_plain_rows is not None]   # type: ignore[attr-defined]
    plain_s = sum(moe.moe_and_comm_s(models[0], max(plain_rows))) if plain_rows else None
    for sm in models:
        sm.regroup(per_pass[0], sum(per_pass[1:]), plain_s)                  # type: ignore[attr-defined]


def _has_work(e: Engine) -> bool:
    """Queued work, or an arrival the rank holds that is due (async scheduling defers one that came in mid-step)."""
    if e.num_running > 0 or e.num_waiting > 0:
        return True
    nxt = e.next_arrival_s
    return nxt is not None and nxt <= e.now_s


def _ready(e: Engine, t: float) -> bool:
    """The rank has something for a step starting at ``t``: queued work, or an arrival it holds itself by then."""
    if e.num_running > 0 or e.num_waiting > 0:
        return True
    nxt = e.next_arrival_s
    return nxt is not None and nxt <= t


__all__ = ["DUMMY_BATCH", "LB_STATS_INTERVAL_S", "WAITING_WEIGHT", "DPGroup", "GroupMoESpecStepModel",
           "GroupMoEStepModel", "LockstepSpecStepModel", "LockstepStepModel", "MoEGroupTiming", "RankStats",
           "moe_passes"]
