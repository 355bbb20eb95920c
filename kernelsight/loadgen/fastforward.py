"""Fast-forward: run a whole workload through the engine's virtual clock, no HTTP, and measure it the way
``vllm bench serve`` measures a server (TTFT/TPOT/ITL/E2EL from each request's send time).

Clients follow bench serve's arrival process: open loop at the scheduled times, or, with
``max_concurrency``, at most C requests in flight (a request waits for a free slot, then is sent).
"""

from __future__ import annotations

import csv
import gc
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.simcore.compiled import mypyc_attr
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, TOKENS, Engine, StepResult
from kernelsight.simcore.engine_config import EngineConfig, build_dp_group, build_engine
from kernelsight.simcore.kernels import FAMILIES
from kernelsight.simcore.spec_decode_step import spec_decode_summary

if TYPE_CHECKING:    # a P/D run's stages: only loadgen/pd_fastforward.py makes them
    from kernelsight.loadgen.pd_stages import TTFTStages

#: Steps a decode window may cover at once (bounded so a window's linear attention ramp stays exact).
MAX_WINDOW_STEPS = 256
TIMELINE_COLUMNS = ("time_s", "running", "waiting", "kv_cache_usage", "scheduled_tokens", "step_s")


class RunWatch(Protocol):
    """Follows a run as it goes and may end it early (``kernelsight plan``'s verdict watch, plan/verdict.py).

    Request indices are the caller's (``run_replicas``' ``samples`` order). ``engine_start`` names the requests an
    engine is about to serve; ``first_token`` and ``finished`` report each request's first-token and last-token
    times on that engine's clock (``finished`` with 0 tokens: the request failed); ``check`` is called after every
    engine window with the engine's clock and returns True to stop the whole run there; ``engine_end`` follows an
    engine that ran to its end. A watch only reads: a run it never stops is the run without it, step for step.
    """

    def engine_start(self, indices: Sequence[int]) -> None: ...
    def first_token(self, index: int, time_s: float) -> None: ...
    def finished(self, index: int, last_token_s: float, num_tokens: int) -> None: ...
    def check(self, now_s: float) -> bool: ...
    def engine_end(self) -> None: ...


@dataclass(slots=True)
class _Tracker:
    sample: SampleRequest
    send_s: float
    arrival_s: float
    first_step: int = -1
    segments: list[list[int]] = field(default_factory=list)   # [start step, count], contiguous runs
    finished: bool = False
    finish_reason: str = ""
    num_tokens: int = 0
    rank: int = 0                                              # data-parallel rank that served it
    index: int = 0                                             # position in the run's samples
    req: Any = None                                            # the engine's Request until it finishes
    cached_tokens: int | None = None                           # its prefix-cache hit (when the engine was read)
    session: int | None = None                                 # multi-turn: session and turn (loadgen/sessions.py)
    turn: int | None = None

    def add_tokens(self, start: int, count: int) -> None:
        segs = self.segments
        if segs and segs[-1][0] + segs[-1][1] == start:
            segs[-1][1] += count
        else:
            segs.append([start, count])
        self.num_tokens += count


@dataclass(slots=True)
class FastForwardResult:
    records: list[RequestRecord]
    duration_s: float
    wall_s: float
    num_steps: int
    breakdown_s: dict[str, float]
    num_preemptions: int
    prefix_cache_hit_rate: float
    finish_reasons: dict[str, int]
    timeline: list[tuple] | None = None
    ranks: list[dict[str, Any]] | None = None     # per data-parallel rank (DP > 1): see RankStats.summary
    pd: dict[str, Any] | None = None              # a P/D deployment (loadgen/pd_fastforward.py): link, instances
    spec_decode: dict[str, Any] | None = None     # speculative decoding: spec_decode_summary
    pd_stages: TTFTStages | None = None           # a P/D deployment: each request's TTFT by stage (per request)
    stopped_at_s: float | None = None             # a watch ended the run here (records are partial then)
    kv_offload: dict[str, Any] | None = None      # KV offloading's CPU tier: offload_summary

    def simulator_stats(self) -> dict[str, Any]:
        wall = max(self.wall_s, 1e-9)
        out = {"wall_s": round(self.wall_s, 4), "num_steps": self.num_steps,
               "simulated_s_per_wall_s": round(self.duration_s / wall, 2),
               "steps_per_wall_s": round(self.num_steps / wall, 1),
               "num_preemptions": self.num_preemptions,
               "prefix_cache_hit_rate": round(self.prefix_cache_hit_rate, 4),
               "finish_reasons": self.finish_reasons}
        if self.ranks is not None:
            out["data_parallel_ranks"] = self.ranks
        if self.kv_offload is not None:
            out["kv_offload"] = self.kv_offload
        if self.pd is not None:
            out["pd"] = self.pd
        if self.spec_decode is not None:
            out["spec_decode"] = self.spec_decode
        return out


def run_fast_forward(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float], *,
                     max_concurrency: int | None = None, ignore_eos: bool = True,
                     record_timeline: bool = False,
                     on_finished: Callable[[int], None] | None = None,
                     watch: RunWatch | None = None,
                     make_sender: Callable[[Any], Any] | None = None) -> FastForwardResult:
    """Simulate ``samples`` sent at ``arrivals_s`` (seconds from the start) and measure every request.

    ``on_finished(n)`` is called after each engine window with the number of requests it finished (progress).
    ``watch`` (one engine only, open loop: ``run_replicas`` calls its ``engine_start``) may stop the run early.
    ``make_sender(engine)`` (one engine only; ``samples`` and ``arrivals_s`` then unused) builds what sends the
    requests instead of the arrival-order sender: multi-turn sessions (``loadgen/session_fastforward.py``).
    """
    if len(samples) != len(arrivals_s):
        raise ValueError("one arrival time per sample is required")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be ≥ 1, got {max_concurrency}")
    wall0 = time.perf_counter()
    # The run allocates millions of small objects and frees few until the end: the cyclic GC would
    # rescan them over and over for nothing (nothing here makes reference cycles that outlive a step).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        # one rank of a group served on its own (--data-parallel-rank) is a single engine
        single = config.args.data_parallel_size == 1 or config.args.data_parallel_rank is not None
        if watch is not None and (not single or max_concurrency is not None):
            raise ValueError("a run watch follows one engine in an open loop")
        if make_sender is not None and not single:
            raise ValueError("multi-turn sessions run on one engine (no --data-parallel-size)")
        if not single:
            return _run_group(config, samples, arrivals_s, max_concurrency, ignore_eos, record_timeline, wall0,
                              on_finished)
        return _run(config, samples, arrivals_s, max_concurrency, ignore_eos, record_timeline, wall0, on_finished,
                    watch, make_sender)
    finally:
        if gc_was_enabled:
            gc.enable()


@mypyc_attr(allow_interpreted_subclasses=True)    # session_fastforward's sender extends it
class _Sender:
    """Sends the samples in arrival order, at most ``max_concurrency`` in flight (``in_flight`` is decremented by the
    run loop as requests finish), each at its arrival or, held back by the limit, when a slot frees.

    ``get_request`` (one engine: ``Engine.get_request``) lets each tracker read its request's prefix-cache hit when it
    finishes. ``pending`` is truthy while something is left to send; ``num_finished`` counts finished requests."""

    def __init__(self, samples: Sequence[SampleRequest], arrivals_s: Sequence[float], max_concurrency: int | None,
                 add_request: Callable[..., Any], ignore_eos: bool, watch: RunWatch | None = None,
                 get_request: Callable[[str], Any] | None = None) -> None:
        self.samples, self.arrivals_s, self.add_request, self.ignore_eos = samples, arrivals_s, add_request, ignore_eos
        self.watch = watch
        self.get_request = get_request
        self.pending = deque(sorted(range(len(samples)), key=lambda i: arrivals_s[i]))
        self.trackers: dict[str, _Tracker] = {}
        self.limit = max_concurrency if max_concurrency is not None else len(samples) + 1
        self.in_flight = 0
        self.num_finished = 0

    def send(self, now_s: float) -> None:
        pending, samples, arrivals_s = self.pending, self.samples, self.arrivals_s
        while pending and self.in_flight < self.limit:
            i = pending.popleft()
            s = samples[i]
            send_s = max(float(arrivals_s[i]), now_s)
            rid = f"ff-{i}"
            tr = self.trackers[rid] = _Tracker(s, send_s, float(arrivals_s[i]), index=i)
            prompt = s.token_array if s.token_array is not None else s.prompt_token_ids
            if s.mm_items:
                self.add_request(rid, prompt, s.expected_output_len, ignore_eos=self.ignore_eos, arrival_s=send_s,
                                 mm_items=s.mm_items)
            else:
                self.add_request(rid, prompt, s.expected_output_len, ignore_eos=self.ignore_eos, arrival_s=send_s)
            if self.get_request is not None:
                tr.req = self.get_request(rid)
            self.in_flight += 1

    def on_finished(self, tr: _Tracker, ends: list[float] | None) -> None:
        """A request finished (``ends``: the engine's step end times so far, when the loop passes them)."""

    def take_events(self, events: Sequence[Any], rank: int | None = None, ends: list[float] | None = None) -> bool:
        """Record an engine window's token and finish events (of DP rank ``rank``); True if a request finished.
        ``ends`` (the engine's step end times so far) is needed only with a watch and by the session sender."""
        trackers = self.trackers
        watch = self.watch
        freed = False
        for ev in events:
            tr = trackers[ev.request_id]
            if rank is not None:
                tr.rank = rank
            kind = ev.kind
            if kind == TOKENS:
                if ev.burst:
                    # speculative decoding: several tokens in one step reach the client as one chunk, which
                    # vllm bench serve times as one ITL (its TPOT divides by every token)
                    tr.add_tokens(ev.step_index, 1)
                    tr.num_tokens += ev.num_tokens - 1
                else:
                    tr.add_tokens(ev.step_index, ev.num_tokens)
            elif kind == FIRST_TOKEN:
                tr.first_step = ev.step_index
                tr.add_tokens(ev.step_index, 1)
                if tr.req is None and self.get_request is not None:
                    # a DP group routes at the arrival: the request exists from then on (one that finishes in the
                    # step of its first token is gone already, and reports no cached tokens)
                    tr.req = self.get_request(ev.request_id)
                if watch is not None:
                    watch.first_token(tr.index, ends[ev.step_index])  # type: ignore[index]  # given with a watch
            elif kind == FINISHED:
                tr.finished = True
                tr.finish_reason = ev.finish_reason or ""
                if tr.req is not None:
                    tr.cached_tokens = max(tr.req.num_cached_tokens, 0)
                    tr.req = None
                self.in_flight -= 1
                self.num_finished += 1
                freed = True
                self.on_finished(tr, ends)
                if watch is not None:
                    last = tr.segments[-1] if tr.segments else None
                    watch.finished(tr.index, ends[last[0] + last[1] - 1] if last else 0.0,  # type: ignore[index]
                                   tr.num_tokens)
        return freed


def _run(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
         max_concurrency: int | None, ignore_eos: bool, record_timeline: bool, wall0: float,
         on_finished: Callable[[int], None] | None = None, watch: RunWatch | None = None,
         make_sender: Callable[[Any], _Sender] | None = None) -> FastForwardResult:
    """One engine's run. ``make_sender(engine)`` replaces the arrival-order sender (multi-turn sessions)."""
    engine = build_engine(config, per_token_events=False)
    sender = (make_sender(engine) if make_sender is not None else
              _Sender(samples, arrivals_s, max_concurrency, engine.add_request, ignore_eos, watch, engine.get_request))
    pending, trackers, send = sender.pending, sender.trackers, sender.send
    send(0.0)
    ends: list[float] = []
    timeline: list[tuple] | None = [] if record_timeline else None
    window = MAX_WINDOW_STEPS
    stopped_at_s = None
    while True:
        res: StepResult | None = engine.step(max_steps=window)
        if res is None:
            if not pending:
                break
            send(engine.now_s)   # only reachable with nothing in flight
            continue
        ends.extend(res.step_end_s)
        n_before = sender.num_finished
        freed = sender.take_events(res.events, ends=ends)
        if timeline is not None:
            _extend_timeline(timeline, res)
        if on_finished is not None and sender.num_finished > n_before:
            on_finished(sender.num_finished - n_before)
        if watch is not None and watch.check(res.end_s):
            stopped_at_s = res.end_s
            break
        if freed and pending:
            send(res.end_s)

    ends_arr = np.asarray(ends)
    gaps = np.diff(ends_arr)   # one diff for all: a request's ITLs within one run of steps are a slice of it
    records = []
    reasons: dict[str, int] = {}
    for tr in trackers.values():
        reasons[tr.finish_reason] = reasons.get(tr.finish_reason, 0) + 1
        records.append(_record(tr, ends_arr, gaps))
    kv = engine.kv
    hit_rate = kv.prefix_hits_tokens / kv.prefix_queries_tokens if kv.prefix_queries_tokens else 0.0
    duration = max((r.start_s + r.latency_s for r in records if r.success), default=0.0)
    return FastForwardResult(
        records=records, duration_s=duration, wall_s=time.perf_counter() - wall0,
        num_steps=engine.stats.num_steps,
        breakdown_s=dict(zip(FAMILIES, engine.stats.breakdown_s.tolist(), strict=True)),
        num_preemptions=engine.stats.num_preemptions, prefix_cache_hit_rate=hit_rate,
        finish_reasons=reasons, timeline=timeline, spec_decode=spec_decode_summary([engine]),
        stopped_at_s=stopped_at_s, kv_offload=offload_summary([engine]))


def offload_summary(engines: list[Engine]) -> dict[str, Any] | None:
    """The CPU tier's counters over the engines (None without offloading): the connector's hit rate (tokens found
    on the CPU over those looked up past the GPU hit), the bytes and simulated seconds copied each way."""
    tiers = [e.offload for e in engines if e.offload is not None]
    if not tiers:
        return None
    q = sum(t.stats.external_queries_tokens for t in tiers)
    h = sum(t.stats.external_hits_tokens for t in tiers)
    return {"cpu_hit_rate": round(h / q, 4) if q else 0.0, "external_hit_tokens": h, "external_query_tokens": q,
            "loads": sum(t.stats.loads for t in tiers),
            "loaded_bytes": sum(t.stats.bytes["CPU_to_GPU"] for t in tiers),
            "stored_bytes": sum(t.stats.bytes["GPU_to_CPU"] for t in tiers),
            "load_s": round(sum(t.stats.time_s["CPU_to_GPU"] for t in tiers), 6),
            "store_s": round(sum(t.stats.time_s["GPU_to_CPU"] for t in tiers), 6),
            "evicted_blocks": sum(t.stats.evicted_blocks for t in tiers),
            "stores_skipped_blocks": sum(t.stats.stores_skipped_blocks for t in tiers)}


def _run_group(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
               max_concurrency: int | None, ignore_eos: bool, record_timeline: bool, wall0: float,
               on_finished: Callable[[int], None] | None = None) -> FastForwardResult:
    """``_run`` for ``data_parallel_size`` > 1: the group routes each request at its arrival; token times are
    read per rank (each rank numbers its own steps). The timeline is the group's: running and waiting summed over
    the ranks, KV usage their mean, scheduled tokens of the step(s) ending at that time."""
    group = build_dp_group(config, per_token_events=False)
    def get_request(rid: str) -> Any:
        rank = group.rank_of.get(rid)
        return None if rank is None else group.engines[rank].get_request(rid)

    sender = _Sender(samples, arrivals_s, max_concurrency, group.add_request, ignore_eos, get_request=get_request)
    pending, trackers, send = sender.pending, sender.trackers, sender.send
    send(0.0)
    ends: list[list[float]] = [[] for _ in range(group.size)]
    timeline: list[tuple] | None = [] if record_timeline else None
    gauges = [(0, 0, 0.0)] * group.size      # each rank's (running, waiting, KV usage) after its latest step
    while True:
        step = group.step(max_steps=MAX_WINDOW_STEPS)
        if step is None:
            if not pending:
                break
            send(max(e.now_s for e in group.engines))   # only reachable with nothing in flight
            continue
        n_before = sender.in_flight
        freed_at = None
        for rank, res in step:
            ends[rank].extend(res.step_end_s)
            if sender.take_events(res.events, rank):
                freed_at = res.end_s
            gauges[rank] = (res.num_running, res.num_waiting, res.kv_usage)
        if timeline is not None:
            running, waiting, kv = (sum(g[j] for g in gauges) for j in range(3))
            tokens = sum(res.num_scheduled_tokens for _, res in step)
            timeline.extend((end, running, waiting, kv / group.size, tokens) for end in step[0][1].step_end_s)
        if on_finished is not None and sender.in_flight < n_before:
            on_finished(n_before - sender.in_flight)
        if freed_at is not None and pending:
            send(freed_at)

    if timeline is not None:
        timeline = _group_timeline(timeline)
    ends_arr = [np.asarray(e) for e in ends]
    gaps_arr = [np.diff(e) for e in ends_arr]
    records = []
    reasons: dict[str, int] = {}
    for tr in trackers.values():
        reasons[tr.finish_reason] = reasons.get(tr.finish_reason, 0) + 1
        records.append(_record(tr, ends_arr[tr.rank], gaps_arr[tr.rank]))
    hits = sum(e.kv.prefix_hits_tokens for e in group.engines)
    queries = sum(e.kv.prefix_queries_tokens for e in group.engines)
    duration = max((r.start_s + r.latency_s for r in records if r.success), default=0.0)
    breakdown = sum((e.stats.breakdown_s for e in group.engines), np.zeros(len(FAMILIES)))
    return FastForwardResult(
        records=records, duration_s=duration, wall_s=time.perf_counter() - wall0,
        num_steps=sum(e.stats.num_steps for e in group.engines),
        breakdown_s=dict(zip(FAMILIES, breakdown.tolist(), strict=True)),
        num_preemptions=sum(e.stats.num_preemptions for e in group.engines),
        prefix_cache_hit_rate=hits / queries if queries else 0.0, finish_reasons=reasons, timeline=timeline,
        ranks=[{"rank": i, **st.summary()} for i, st in enumerate(group.stats)],
        spec_decode=spec_decode_summary(group.engines), kv_offload=offload_summary(group.engines))


def _record(tr: _Tracker, ends: np.ndarray, gaps: np.ndarray) -> RequestRecord:
    """``gaps`` is ``np.diff(ends)``: the same subtractions ``np.diff`` of a contiguous run would make."""
    s = tr.sample
    if not tr.finished or tr.num_tokens == 0:
        return RequestRecord(False, s.prompt_len, 0, 0.0, [], 0.0, tr.send_s, tr.send_s - tr.arrival_s,
                             "request did not finish", session=tr.session, turn=tr.turn)
    if len(tr.segments) == 1:
        start, count = tr.segments[0]
        first, last = ends[start], ends[start + count - 1]
        itl = gaps[start:start + count - 1].copy()   # a copy: records must not pin the run's whole array
    else:
        times = np.concatenate([ends[a:a + c] for a, c in tr.segments])
        first, last, itl = times[0], times[-1], np.diff(times)
    return RequestRecord(True, s.prompt_len, tr.num_tokens, float(first) - tr.send_s, itl,
                         float(last) - tr.send_s, tr.send_s, tr.send_s - tr.arrival_s,
                         cached_tokens=tr.cached_tokens, session=tr.session, turn=tr.turn)


def _extend_timeline(rows: list[tuple], res: StepResult) -> None:
    prev = res.start_s
    for end in res.step_end_s:
        rows.append((round(end, 6), res.num_running, res.num_waiting, round(res.kv_usage, 5),
                     res.num_scheduled_tokens, round(end - prev, 7)))
        prev = end


def _group_timeline(rows: list[tuple]) -> list[tuple]:
    """Rows (end, running, waiting, kv, tokens) of a group's steps → TIMELINE_COLUMNS rows in time order, each
    row's step_s reaching back to the previous row (independent ranks' steps overlap: the rows tile time)."""
    rows.sort(key=lambda r: r[0])
    out = []
    prev = None
    for end, running, waiting, kv, tokens in rows:
        step_s = end - prev if prev is not None else 0.0
        out.append((round(end, 6), running, waiting, round(kv, 5), tokens, round(step_s, 7)))
        prev = end
    return out


def write_timeline(path: str | Path, rows: list[tuple]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TIMELINE_COLUMNS)
        w.writerows(rows)


def run_replicas(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
                 replicas: int = 1, *, max_concurrency: int | None = None, ignore_eos: bool = True,
                 record_timeline: bool = False,
                 on_finished: Callable[[int], None] | None = None,
                 watch: RunWatch | None = None, processes: int | None = 1,
                 ray_address: str | None = None) -> FastForwardResult:
    """``replicas`` independent engines of ``config`` behind a round-robin router: the i-th request in arrival
    order goes to engine ``i mod replicas``.

    ``processes``: the engines run in this many worker processes (None: one per usable CPU; at most one per engine;
    1: all in this one). Each engine is the same computation wherever it runs, so the merged result is the one
    process's, bit for bit (but ``wall_s``); ``on_finished`` then hears of an engine's requests when it ends. A run
    with a ``watch`` runs in this process. ``ray_address`` (``auto``, ``ray://HOST:10001``, or ``local``: a Ray
    instance here with ``processes`` CPUs, 1 or None meaning every usable CPU) runs each engine as a Ray task
    instead, with the same result.

    The simulator has no shared front end, so this is the model of data parallelism and replicas alike: no
    load-aware routing, no cross-replica prefix cache, ``max_concurrency`` split evenly between the engines.
    Records come back in the order of ``samples``; the duration is the longest engine's; the timeline, when
    recorded, is engine 0's (the engines see statistically identical streams).

    ``watch`` (open loop, one-rank engines) sees the engines one after the other, in request indices of
    ``samples``; when it stops one, the engines after it are not run and the result holds the records so far.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be ≥ 1, got {replicas}")
    if replicas == 1:
        if watch is not None:
            watch.engine_start(range(len(samples)))
        res = run_fast_forward(config, samples, arrivals_s, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                               record_timeline=record_timeline, on_finished=on_finished, watch=watch)
        if watch is not None and res.stopped_at_s is None:
            watch.engine_end()
        return res
    if len(samples) != len(arrivals_s):
        raise ValueError("one arrival time per sample is required")
    order = sorted(range(len(samples)), key=lambda i: arrivals_s[i])
    parts = [order[r::replicas] for r in range(replicas)]
    conc = None if max_concurrency is None else max(1, -(-max_concurrency // replicas))
    records: list[RequestRecord | None] = [None] * len(samples)
    wall0 = time.perf_counter()
    results = []
    stopped_at_s = None
    workers = min(replica_workers(processes), sum(1 for idx in parts if idx))
    done = None
    if ray_address is not None and watch is None:
        done = _run_parts_on_ray(config, samples, arrivals_s, parts, conc, ignore_eos, record_timeline, on_finished,
                                 ray_address, replica_workers(None if processes == 1 else processes))
    elif workers > 1 and watch is None:
        done = _run_parts_in_processes(config, samples, arrivals_s, parts, workers, conc, ignore_eos,
                                       record_timeline, on_finished)
    for r, idx in enumerate(parts):
        if not idx:
            continue
        if done is not None:
            res = done[r]
        else:
            part_watch = None if watch is None else _IndexedWatch(watch, idx)
            res = run_fast_forward(config, [samples[i] for i in idx], [arrivals_s[i] for i in idx],
                                   max_concurrency=conc, ignore_eos=ignore_eos,
                                   record_timeline=record_timeline and r == 0, on_finished=on_finished,
                                   watch=part_watch)
        for i, rec in zip(idx, res.records, strict=False):   # a stopped engine holds records of those sent
            records[i] = rec
        results.append((len(idx), res))
        if res.stopped_at_s is not None:
            stopped_at_s = res.stopped_at_s
            break
        if watch is not None:
            watch.engine_end()
    n_total = sum(n for n, _ in results)
    reasons: dict[str, int] = {}
    breakdown = dict.fromkeys(FAMILIES, 0.0)
    for _, res in results:
        for k, count in res.finish_reasons.items():
            reasons[k] = reasons.get(k, 0) + count
        for k, v in res.breakdown_s.items():
            breakdown[k] += v
    return FastForwardResult(
        records=[r for r in records if r is not None], duration_s=max(res.duration_s for _, res in results),
        wall_s=time.perf_counter() - wall0, num_steps=sum(res.num_steps for _, res in results),
        breakdown_s=breakdown, num_preemptions=sum(res.num_preemptions for _, res in results),
        # weighted by requests: each engine's own hit rate is over its own token queries
        prefix_cache_hit_rate=sum(n * res.prefix_cache_hit_rate for n, res in results) / max(n_total, 1),
        finish_reasons=reasons, timeline=results[0][1].timeline,
        spec_decode=results[0][1].spec_decode,   # engine 0's, as the timeline
        stopped_at_s=stopped_at_s, kv_offload=_sum_offload([res.kv_offload for _, res in results]))


def _sum_offload(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The replicas' offload summaries added up (the hit rate from the summed tokens)."""
    given = [p for p in parts if p is not None]
    if not given:
        return None
    out = {k: sum(p[k] for p in given) for k in given[0] if k != "cpu_hit_rate"}
    q = out["external_query_tokens"]
    return {"cpu_hit_rate": round(out["external_hit_tokens"] / q, 4) if q else 0.0, **out}


def replica_workers(processes: int | None) -> int:
    """``processes`` as a count: None is one per usable CPU."""
    if processes is not None:
        return max(1, processes)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:       # not Linux
        return os.cpu_count() or 1


# a worker process's run: (config, samples, arrivals, max_concurrency, ignore_eos), sent once per worker
_WORKER_RUN: tuple | None = None


def _init_replica_worker(run: tuple) -> None:
    global _WORKER_RUN
    _WORKER_RUN = run


def _run_replica_part(idx: list[int], record_timeline: bool) -> FastForwardResult:
    assert _WORKER_RUN is not None
    config, samples, arrivals_s, conc, ignore_eos = _WORKER_RUN
    return run_fast_forward(config, [samples[i] for i in idx], [arrivals_s[i] for i in idx], max_concurrency=conc,
                            ignore_eos=ignore_eos, record_timeline=record_timeline)


def _run_parts_in_processes(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
                            parts: list[list[int]], workers: int, conc: int | None, ignore_eos: bool,
                            record_timeline: bool, on_finished: Callable[[int], None] | None
                            ) -> dict[int, FastForwardResult]:
    """Each non-empty part's ``run_fast_forward`` in a pool of ``workers`` processes, by replica index."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, initializer=_init_replica_worker,
                             initargs=((config, samples, arrivals_s, conc, ignore_eos),)) as pool:
        futures = {pool.submit(_run_replica_part, idx, record_timeline and r == 0): r
                   for r, idx in enumerate(parts) if idx}
        done = {}
        for f in as_completed(futures):
            res = done[futures[f]] = f.result()
            if on_finished is not None:
                on_finished(len(res.records))
    return done


def _run_part(config: EngineConfig, samples: list[SampleRequest], arrivals_s: list[float], conc: int | None,
              ignore_eos: bool, record_timeline: bool) -> FastForwardResult:
    """One engine's share of a replicas run (a Ray task: it gets only its own samples)."""
    return run_fast_forward(config, samples, arrivals_s, max_concurrency=conc, ignore_eos=ignore_eos,
                            record_timeline=record_timeline)


def _run_parts_on_ray(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float],
                      parts: list[list[int]], conc: int | None, ignore_eos: bool, record_timeline: bool,
                      on_finished: Callable[[int], None] | None, address: str, local_cpus: int
                      ) -> dict[int, FastForwardResult]:
    """Each non-empty part's ``run_fast_forward`` as a Ray task of one CPU, by replica index. The config goes to
    the object store once; each task's samples are its own part's (a 1,000,000-request fleet is not sent whole to
    each of its engines)."""
    from kernelsight.loadgen.ray_cluster import connect_ray

    ray = connect_ray(address, local_cpus)
    remote = ray.remote(num_cpus=1)(_run_part)
    config_ref = ray.put(config)
    refs = {remote.remote(config_ref, [samples[i] for i in idx], [arrivals_s[i] for i in idx], conc,
                          ignore_eos, record_timeline and r == 0): r
            for r, idx in enumerate(parts) if idx}
    done: dict[int, FastForwardResult] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            res = done[refs[ref]] = ray.get(ref)
            if on_finished is not None:
                on_finished(len(res.records))
    return done


class _IndexedWatch:
    """One engine's view of a replicas run's watch: its local request indices mapped to the run's."""

    __slots__ = ("_watch", "_idx")

    def __init__(self, watch: RunWatch, idx: list[int]) -> None:
        self._watch, self._idx = watch, idx
        watch.engine_start(idx)

    def engine_start(self, indices: Sequence[int]) -> None:
        raise AssertionError("run_replicas starts each engine's watch itself")

    def first_token(self, index: int, time_s: float) -> None:
        self._watch.first_token(self._idx[index], time_s)

    def finished(self, index: int, last_token_s: float, num_tokens: int) -> None:
        self._watch.finished(self._idx[index], last_token_s, num_tokens)

    def check(self, now_s: float) -> bool:
        return self._watch.check(now_s)

    def engine_end(self) -> None:
        self._watch.engine_end()
