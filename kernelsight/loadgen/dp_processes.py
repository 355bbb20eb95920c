"""A dense model's ``-dp N`` group with its ranks in worker processes, advanced in windows of conservative lookahead.

The ranks of a dense model's group share nothing but the router (``simcore/dp_group.py``): vLLM's front end routes a
request on the (waiting, running) counts its coordinator published last plus its own assignments since, and the group
takes those counts at the first arrival after each 100 ms boundary. Every arrival up to the next such refresh is
therefore routed from one snapshot and the router's own tally: once each rank has reached a refresh arrival and
reported its counts, the router decides the whole window at once, and each rank runs on alone, in its own process,
to the next refresh. A rank's run is a function of its own requests and of the group's arrival instants (where the
group wakes an idle rank's clock and cuts a rank's decode windows), both of which its worker knows, so the ranks
step exactly as the one-process group steps them and the result is the one-process run's, bit for bit (but the wall
time).

What cannot be split this way runs in one process (``supports``): a MoE model's group steps in lockstep (every
forward pass is a group collective: no rank can run ahead of another), a closed loop (``--max-concurrency``: a send
waits for a finish on any rank), a timeline (its rows interleave the ranks' steps), speculative decoding and KV
offloading (their summaries read the engines at the end).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import MAX_WINDOW_STEPS, FastForwardResult, _record, _Sender, _Tracker
from kernelsight.simcore.dp_group import LB_STATS_INTERVAL_S, WAITING_WEIGHT, RankStats
from kernelsight.simcore.engine import Engine
from kernelsight.simcore.engine_config import EngineConfig, build_dp_group
from kernelsight.simcore.kernels import FAMILIES

__all__ = ["supports", "run_group_in_processes"]


def supports(config: EngineConfig, max_concurrency: int | None, record_timeline: bool) -> bool:
    """Whether a ``-dp N`` run can be split over processes with the same result (see the module's docstring)."""
    from kernelsight.simcore.engine_config import moe_group_timing

    return (config.args.data_parallel_size > 1 and config.args.data_parallel_rank is None
            and max_concurrency is None and not record_timeline and config.speculative is None
            and config.offload is None and moe_group_timing(config) is None)


class _Rank:
    """One rank's engine driven as the one-process group drives it: stepped (windows cut at the group's next
    arrival) until its clock reaches that arrival, which is then routed: an idle rank's clock moves to it, and the
    request joins this rank if the router sent it here."""

    def __init__(self, engine: Engine, rank: int, times: list[float], order: list[int],
                 samples: Sequence[SampleRequest], ignore_eos: bool) -> None:
        self.engine, self.rank, self.times, self.order = engine, rank, times, order
        self.samples, self.ignore_eos = samples, ignore_eos
        self.mine: set[int] = set()              # positions (in arrival order) routed to this rank
        self.ptr = 0                             # the next arrival (position) to route
        self.stats = RankStats()
        self.sender = _Sender([], [], None, engine.add_request, ignore_eos, get_request=engine.get_request)
        self.ends: list[float] = []

    def _has_work(self) -> bool:
        e = self.engine
        if e.num_running > 0 or e.num_waiting > 0:
            return True
        nxt = e.next_arrival_s
        return nxt is not None and nxt <= e.now_s

    def advance(self, stop: int | None) -> int:
        """Run until the arrival at position ``stop`` is the next to route (None: to the end). Returns how many of
        this rank's requests finished on the way."""
        e, times, n = self.engine, self.times, len(self.times)
        done0 = self.sender.num_finished
        while True:
            nxt = times[self.ptr] if self.ptr < n else None
            if self._has_work() and (nxt is None or e.now_s < nxt):
                res = e.step(MAX_WINDOW_STEPS, until_s=nxt)
                if res is not None:
                    self.ends.extend(res.step_end_s)
                    self.sender.take_events(res.events, self.rank)
                    st, dur = self.stats, res.end_s - res.start_s
                    st.num_steps += res.num_steps
                    st.own_s += dur
                    st.breakdown_s += res.breakdown_s
                    st.sample(dur, res.num_waiting, res.num_running, res.kv_usage)
                    continue
            if nxt is None or self.ptr == stop:
                return self.sender.num_finished - done0
            self._route(self.ptr, nxt)
            self.ptr += 1

    def _route(self, pos: int, arrival: float) -> None:
        e = self.engine
        if not self._has_work():
            e.now_s = max(e.now_s, arrival)
        if pos in self.mine:
            i = self.order[pos]
            s = self.samples[i]
            rid = f"ff-{i}"
            self.sender.trackers[rid] = _Tracker(s, arrival, arrival, index=i)
            prompt = s.token_array if s.token_array is not None else s.prompt_token_ids
            if s.mm_items:
                e.add_request(rid, prompt, s.expected_output_len, arrival_s=arrival, ignore_eos=self.ignore_eos,
                              mm_items=s.mm_items)
            else:
                e.add_request(rid, prompt, s.expected_output_len, arrival_s=arrival, ignore_eos=self.ignore_eos)
            self.stats.num_requests += 1

    def result(self) -> dict[str, Any]:
        ends = np.asarray(self.ends)
        gaps = np.diff(ends)
        e = self.engine
        return {"records": {tr.index: (_record(tr, ends, gaps), tr.finish_reason)
                            for tr in self.sender.trackers.values()},
                "stats": self.stats, "num_steps": e.stats.num_steps, "breakdown_s": e.stats.breakdown_s,
                "num_preemptions": e.stats.num_preemptions, "hits": e.kv.prefix_hits_tokens,
                "queries": e.kv.prefix_queries_tokens}


class _Ranks:
    """Some ranks of the group, run one after the other in this process."""

    def __init__(self, config: EngineConfig, ranks: list[int], times: list[float], order: list[int],
                 samples: Sequence[SampleRequest], ignore_eos: bool) -> None:
        group = build_dp_group(config, per_token_events=False)
        self.ranks = {r: _Rank(group.engines[r], r, times, order, samples, ignore_eos) for r in ranks}

    def go(self, assignments: list[tuple[int, int]], stop: int | None) -> tuple[int, dict[int, Any]]:
        """Route the assignments (position → rank) to these ranks and run them to ``stop``: their finished requests
        and (waiting, running) counts, or with ``stop`` None (the end) their results."""
        mine = self.ranks
        for pos, r in assignments:
            if r in mine:
                mine[r].mine.add(pos)
        finished = sum(rk.advance(stop) for rk in mine.values())
        if stop is None:
            return finished, {r: rk.result() for r, rk in mine.items()}
        return finished, {r: (rk.engine.num_waiting, rk.engine.num_running) for r, rk in mine.items()}


def _worker(conn: Any, config: EngineConfig, ranks: list[int], times: list[float], order: list[int],
            samples: Sequence[SampleRequest], ignore_eos: bool) -> None:
    """Serves ``(assignments, stop)`` messages for its ranks (``_Ranks.go``) until ``stop`` is None."""
    import gc

    gc.disable()      # as run_fast_forward: many small objects, no cycles that outlive a step
    try:
        local = _Ranks(config, ranks, times, order, samples, ignore_eos)
        while True:
            assignments, stop = conn.recv()
            conn.send(local.go(assignments, stop))
            if stop is None:
                return
    except BaseException as exc:         # the parent re-raises it: a worker never hangs the run
        conn.send(("error", repr(exc)))
        raise
    finally:
        conn.close()


def run_group_in_processes(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
                           ignore_eos: bool, workers: int,
                           on_finished: Callable[[int], None] | None = None) -> FastForwardResult:
    """``fastforward._run_group``'s result for an open-loop dense ``-dp N`` run, its ranks spread over ``workers``
    processes (contiguous groups of ranks; this process runs the first group while the others run theirs)."""
    import gc
    wall0 = time.perf_counter()
    size = config.args.data_parallel_size
    workers = max(1, min(workers, size))
    order = sorted(range(len(samples)), key=lambda i: arrivals_s[i])      # the group's routing order
    times = [float(arrivals_s[i]) for i in order]
    per = [list(range(size))[w * size // workers:(w + 1) * size // workers] for w in range(workers)]
    ctx = mp.get_context("fork")      # the workers inherit the samples instead of unpickling them
    pipes, procs = [], []
    for ranks in per[1:]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, config, ranks, times, order, samples, ignore_eos), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)

    gc_was_enabled = gc.isenabled()
    local: _Ranks | None = None

    def exchange(assignments: list[tuple[int, int]], stop: int | None) -> dict[int, Any]:
        for conn in pipes:
            conn.send((assignments, stop))
        assert local is not None
        finished, out = local.go(assignments, stop)
        for conn in pipes:
            msg = conn.recv()
            if msg[0] == "error":
                raise RuntimeError(f"a data-parallel worker failed: {msg[1]}")
            finished += msg[0]
            out.update(msg[1])
        if on_finished is not None and finished:
            on_finished(finished)
        return out

    try:
        gc.disable()
        local = _Ranks(config, per[0], times, order, samples, ignore_eos)
        n = len(times)
        assignments: list[tuple[int, int]] = []
        j = 0
        while j < n:
            # a refresh: every rank at arrival j, its counts the router's snapshot until the next 100 ms boundary
            counts = exchange(assignments, j)
            tally = [[counts[r][0], counts[r][1]] for r in range(size)]
            next_refresh_s = (times[j] // LB_STATS_INTERVAL_S + 1) * LB_STATS_INTERVAL_S
            assignments = []
            k = j
            while k < n and (k == j or times[k] < next_refresh_s):
                r = min(range(size), key=lambda i: (WAITING_WEIGHT * tally[i][0] + tally[i][1], i))
                tally[r][0] += 1
                assignments.append((k, r))
                k += 1
            j = k
        results = exchange(assignments, None)
    finally:
        if gc_was_enabled:
            gc.enable()
        for conn in pipes:
            conn.close()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()

    records = []
    reasons: dict[str, int] = {}
    by_index = {i: rec for r in range(size) for i, rec in results[r]["records"].items()}
    for i in order:
        rec, reason = by_index[i]
        reasons[reason] = reasons.get(reason, 0) + 1
        records.append(rec)
    hits = sum(results[r]["hits"] for r in range(size))
    queries = sum(results[r]["queries"] for r in range(size))
    duration = max((r.start_s + r.latency_s for r in records if r.success), default=0.0)
    breakdown = sum((results[r]["breakdown_s"] for r in range(size)), np.zeros(len(FAMILIES)))
    return FastForwardResult(
        records=records, duration_s=duration, wall_s=time.perf_counter() - wall0,
        num_steps=sum(results[r]["num_steps"] for r in range(size)),
        breakdown_s=dict(zip(FAMILIES, breakdown.tolist(), strict=True)),
        num_preemptions=sum(results[r]["num_preemptions"] for r in range(size)),
        prefix_cache_hit_rate=hits / queries if queries else 0.0, finish_reasons=reasons, timeline=None,
        ranks=[{"rank": r, **results[r]["stats"].summary()} for r in range(size)], spec_decode=None, kv_offload=None)
