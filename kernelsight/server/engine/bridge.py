"""The real-time driver: one asyncio task steps the simulated engine and releases tokens on wall deadlines.

Virtual time maps to wall time as ``wall0 + virtual_s / time_scale`` (absolute deadlines: lateness in one
step never accumulates). Each loop turn: run one engine step (its scheduling sees every request that
arrived before this boundary), sleep until the step's end deadline, then release the step's tokens to
the waiting handlers together, as vLLM's engine core emits one output batch per step. Streams on the fast
path (``kernelsight.server.engine.fastpath``) render their chunk while the loop waits for the deadline, and the loop
writes them itself right at the deadline, before any other bookkeeping. Requests that
arrive while a step is in flight enter the engine's waiting queue with their true (wall-mapped) arrival
time and are scheduled at the next boundary. When nothing is in flight the engine clock follows wall
time: a new arrival is stamped with the wall-mapped virtual now, so idle gaps are real.

When the loop falls behind (the process does not get the CPU it needs: other jobs on its cores, a container CPU
limit, VM steal), the policy is *release as soon as possible, deadlines stay absolute*: a step whose deadline has
passed is released at once, with no wait and no spin toward it (``_sleep_until`` returns straight away), the read
window before the next step is skipped (``read_window_s`` subtracts the lag), and the next step keeps its place on
the virtual clock. Lateness therefore does not accumulate inside a step, but the virtual clock keeps running: a
loop behind by L seconds stays behind until steps compute faster than they simulate, and every token in between
goes out up to L late. Nothing is dropped or re-timed. Each release's lateness is observed once per step
(``observe_release``): ``kernelsight:release_lateness_seconds`` and ``kernelsight:virtual_clock_lag_seconds`` in
/metrics, and a rate-limited warning on the ``kernelsight.server`` logger (``server/engine/lateness.py``,
``--lateness-warn-ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kernelsight.server.engine.admissions import admissions_pending
from kernelsight.server.engine.lateness import LatenessWatch
from kernelsight.server.engine.step_scale import ScaledStepModel
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.gc_policy import collect_in_slack, collect_when_idle, gc_owner
from kernelsight.server.integrations.kv_events.publisher import KVEventPublisher
from kernelsight.server.integrations.kv_transfer import KVTransferAgent
from kernelsight.server.integrations.metrics import EngineMetrics
from kernelsight.server.model.output_tokens import OutputTokens
from kernelsight.server.model.tokenizer import ServerTokenizer
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, TOKENS, Engine, StepResult
from kernelsight.simcore.engine_config import EngineConfig, build_engine
from kernelsight.simcore.request import FinishReason, Request

log = logging.getLogger("kernelsight.server")
#: Draw keys of requests without a seed (a Generator per request cost ~20 µs of the admission path).
_UNSEEDED = random.Random()


@dataclass(eq=False, slots=True)
class Seq:
    """One engine sequence as a handler sees it."""

    seq_id: str
    index: int
    tokens: OutputTokens
    req: Request | None = None
    released: int = 0                 # tokens released by finished engine steps
    finished: bool = False
    finish_reason: str | None = None
    last_token_v: float = 0.0
    token_times_v: list[float] | None = None    # virtual release time of each token (when recording)


class LockstepDriverLike(Protocol):
    """What steps a bridge's engine together with other ranks' (``server.engine.lockstep.LockstepDriver``)."""

    is_running: bool

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def set_step_time_factor(self, factor: float) -> None: ...


class StreamSink(Protocol):
    """A streaming response the engine loop writes directly (``kernelsight.server.engine.fastpath.FastStream``)."""

    def prepare(self, released: int, finished: bool, finish_reason: str | None) -> bool:
        """Render the state after the step in flight (before its deadline); True if there is data to write."""

    def flush(self) -> bool:
        """Write the prepared data at the deadline without waiting; False if it could not (hand back)."""


@dataclass(eq=False)
class Submission:
    """The engine requests behind one HTTP request (one per prompt); handlers await ``event``."""

    engine_ids: list[str]
    seqs: list[Seq]
    max_tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    sink: StreamSink | None = None    # the stream fast path: chunks are written by the engine loop itself

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)


#: The read window before computing a step: at most this long, and only while the window plus the step's
#: expected computing time stay under this share of the shortest recent step's wall duration (closed-loop clients
#: answer a step's tokens within a few ms: a client reading 256 streams takes that long to get to the last one).
READ_WINDOW_S = 0.005
READ_WINDOW_SHARE = 0.5
#: ... and it ends at least this long (plus the expected computing time) before the next step's earliest deadline.
READ_WINDOW_MARGIN_S = 0.0005
#: Fast-path streams rendered between two reads of the sockets.
PREPARE_SLICE = 64
#: Events booked per loop turn after a step's writes, and finished requests counted (see ``EngineBridge._dispatch``).
DISPATCH_SLICE = 64
RECORD_SLICE = 8
#: The last stretch before a deadline: naps this long with a socket poll between them, then a spin this long.
POLL_NAP_S = 0.0001
FINAL_SPIN_S = 0.00015


class SinkHolder:
    """The stream fast path's hand-over, the same for a bridge and a remote one: a one-sequence stream's chunks are
    written where the step's tokens are released (the engine loop; an API server's channel reader)."""

    def attach_sink(self, sub: Submission, sink: StreamSink) -> bool:
        """Let the releasing loop write this one-sequence stream itself from the next step on."""
        if sub.closed or sub.done or len(sub.seqs) != 1 or sub.sink is not None:
            return False
        sub.sink = sink
        return True

    def detach_sink(self, sub: Submission, sink: StreamSink | None = None) -> None:
        if sink is None or sub.sink is sink:
            sub.sink = None


class EngineBridge(SinkHolder):
    """Drives one simulated engine in real time (scaled by ``time_scale``)."""

    def __init__(self, config: EngineConfig, tokenizer: ServerTokenizer, metrics: EngineMetrics | None = None,
                 time_scale: float = 1.0, record_timings: bool = False, spin_s: float = 0.0015, *,
                 lateness_warn_s: float = 0.05, engine_index: int = 0,
                 kv_publisher: KVEventPublisher | None = None, engine: Engine | None = None) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.config = config
        self.tok = tokenizer
        # ``engine``: a rank of a lockstep data-parallel group (``server/engine/lockstep.py``), built with its group
        self.engine: Engine = engine if engine is not None else build_engine(config, per_token_events=True)
        # the loop that steps this engine when it is not the bridge's own: a MoE group's lockstep driver
        self.driver: LockstepDriverLike | None = None
        self.metrics = metrics
        self.time_scale = time_scale
        # wait out the last stretch before a deadline precisely: event-loop timers are ms-coarse (uvloop rounds
        # delays to whole ms on a ms clock, so they fire up to ~1.5 ms off)
        self.spin_s = spin_s
        self.record_timings = record_timings
        self.timings: dict[str, dict] = {}    # engine id -> virtual arrival and token times (when recording)
        self._seqs: dict[str, Seq] = {}
        self._subs_of: dict[str, Submission] = {}
        self._ids = itertools.count()
        self._wall0 = time.perf_counter()
        self._epoch_minus_perf = time.time() - time.perf_counter()   # perf_counter → Unix time (KV events' ts)
        # KV-cache events: the pool records them only when a publisher takes them (one test on its hot paths)
        self.kv_publisher = kv_publisher
        if kv_publisher is not None:
            self.engine.kv.enable_events()
        self.kv_agent: KVTransferAgent | None = None   # --kv-transfer-config: P/D disaggregation (ServerState)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.num_steps = 0
        self.late_s_max = 0.0                 # worst lateness of a release vs its deadline
        self.lateness = LatenessWatch(lateness_warn_s, str(engine_index))
        self._released_v = 0.0                # virtual end of the last released step
        self.fast_writes = 0                  # chunks written by the engine loop (stream fast path)
        self.fast_handbacks = 0               # fast streams handed back to their handler (paused transport)
        self._busy_s = 0.0                    # running mean wall time of computing + rendering one step
        self._step_walls_s: deque[float] = deque([0.0], maxlen=8)   # wall durations of the last steps
        if metrics is not None:
            metrics.bind_clock_lag(self.virtual_clock_lag_s)

    # -- clock ----------------------------------------------------------------------------------
    def virtual_now(self) -> float:
        return (time.perf_counter() - self._wall0) * self.time_scale

    def wall_of(self, virtual_s: float) -> float:
        return self._wall0 + virtual_s / self.time_scale

    def unix_time_of(self, virtual_s: float) -> float:
        return self._epoch_minus_perf + self.wall_of(virtual_s)

    def publish_kv_events(self, virtual_s: float) -> None:
        """Hand the KV events recorded since the last call to the publisher, stamped with ``virtual_s`` as Unix
        time (vLLM stamps a step's batch with time.time() after the step)."""
        pub = self.kv_publisher
        if pub is not None:
            events = self.engine.kv.take_events()
            if events:
                pub.publish(self.unix_time_of(virtual_s), events)

    def virtual_clock_lag_s(self) -> float:
        """Wall seconds the engine's virtual clock (the end of its latest computed step) trails wall time: 0 when
        idle (nothing in flight, everything released) or when the step in flight is not due yet."""
        eng = self.engine
        if not eng.has_unfinished() and self._released_v >= eng.now_s:
            return 0.0
        return max(time.perf_counter() - self.wall_of(eng.now_s), 0.0)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.driver is not None:       # one loop steps every rank of the group (idempotent)
            self.driver.start()
            return
        if self._task is None:
            self._wake = asyncio.Event()
            self._wall0 = time.perf_counter() - self.engine.now_s / self.time_scale
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kernelsight-engine")
            if self.kv_publisher is not None:
                self.kv_publisher.start()

    def join_loop(self, wall0: float, wake: asyncio.Event) -> None:
        """A lockstep driver steps this engine: its wall-clock origin and wake-up are the group's."""
        self._wall0 = wall0
        self._wake = wake
        if self.kv_publisher is not None:
            self.kv_publisher.start()

    async def stop(self) -> None:
        self._closing = True
        if self.driver is not None:
            await self.driver.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sid in list(self._seqs):      # wake anyone still waiting: they see an abort
            seq = self._seqs.pop(sid)
            seq.finished, seq.finish_reason = True, "abort"
        for sub in set(self._subs_of.values()):
            sub.sink = None
            sub.event.set()
        self._subs_of.clear()
        if self.kv_publisher is not None:
            await asyncio.to_thread(self.kv_publisher.shutdown)   # joins the replay thread (bounded wait)

    @property
    def closing(self) -> bool:
        """Stopped or stopping: a request submitted now would never be scheduled."""
        return self._closing

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the sequences that have no token out yet (vLLM's admission count: the whole prompt,
        chunks already computed and prefix hits included)."""
        return sum(s.req.prompt_len for s in self._seqs.values() if s.released == 0 and s.req is not None)

    def set_step_time_factor(self, factor: float) -> None:
        """Every step computed from now on takes ``factor`` times its simulated time (the "slow" fault)."""
        if self.driver is not None:        # a lockstep group slows as a whole (its ranks' steps end together)
            self.driver.set_step_time_factor(factor)
            return
        eng = self.engine
        if not isinstance(eng.step_model, ScaledStepModel):
            if factor == 1.0:
                return
            eng.step_model = ScaledStepModel(eng.step_model)
        eng.step_model.factor = factor

    @property
    def is_running(self) -> bool:
        if self.driver is not None:
            return self.driver.is_running
        return self._task is not None and not self._task.done()

    # -- requests -------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1, *, min_tokens: int = 0,
               ignore_eos: bool = False, priority: int = 0, extra_keys: tuple | None = None,
               keys: list[int] | None = None, echo_output: bool = False, label: str | None = None,
               arrival_wall_s: float | None = None, hold_kv: bool = False,
               remote_prefill: bool = False, outputs: list[list[int]] | None = None,
               output_pieces: list[str] | None = None) -> Submission:
        """Queue one engine request per prompt (each fanning out into n sequences).

        ``arrival_wall_s``: perf_counter() when the request reached the server (default: now). The time it then
        spent waiting for parsing and validation (behind a burst of others) is queueing in the simulated timeline.
        ``outputs``: per prompt, the token ids its sequences emit (a structured output or tool call drawn up front);
        ``output_pieces``: their texts when decoding them one by one is not exact (``output_tokens.exact_pieces``).
        """
        eng = self.engine
        v = self.virtual_now()
        if arrival_wall_s is not None:
            v = min(v, max((arrival_wall_s - self._wall0) * self.time_scale, 0.0))
        # nothing to step before this request (idle, or only KV pulls in flight): wake the loop
        idle = not eng.num_running and not eng.num_waiting
        # the true (wall-mapped) arrival, even when it is before now_s: mid-step (also while the step in flight
        # finishes every request, so the engine already looks idle) the request joins at the next boundary and
        # waits for it, as in vLLM; if the loop lags behind wall time it joins the first step starting later
        arrival = v
        seqs: list[Seq] = []
        ids: list[str] = []
        for p, (prompt, mt) in enumerate(zip(prompts, max_tokens, strict=True)):
            eid = f"r{next(self._ids)}"
            outs = []
            for i in range(n):
                key = keys[p] + 7919 * i if keys is not None else _UNSEEDED.getrandbits(63)
                fixed = outputs[p] if outputs is not None else prompt if echo_output else None
                outs.append(OutputTokens(self.tok, key, mt, fixed, output_pieces if outputs is not None else None))
            seq_ids = eng.add_request(eid, prompt, mt, min_tokens=min(min_tokens, mt), ignore_eos=ignore_eos, n=n,
                                      priority=priority, arrival_s=arrival, extra_keys=extra_keys,
                                      output_token_ids=outs[0] if n == 1 else None, hold_kv=hold_kv,
                                      remote_prefill=remote_prefill)
            ids.append(eid)
            for i, sid in enumerate(seq_ids):
                req = eng.get_request(sid)
                if req is not None and outputs is not None and req.target_output_len == len(outputs[p]):
                    req.finish_reason_at_target = FinishReason.STOP     # a drawn output ends whole: at its EOS
                if req is not None and n > 1:
                    req.output_token_ids = outs[i]    # per-choice ids (the engine takes one list per call)
                seq = Seq(sid, p * n + i, outs[i], req, last_token_v=arrival)
                if self.record_timings:
                    seq.token_times_v = []
                    # keyed by the response id (and choice index when there are several)
                    key = (label or eid) if len(prompts) * n == 1 else f"{label or eid}/{p * n + i}"
                    self.timings[key] = {"arrival_s": arrival, "token_times_s": seq.token_times_v}
                seqs.append(seq)
                self._seqs[sid] = seq
            if self.metrics is not None:
                self.metrics.on_new_request(n, mt)
        sub = Submission(ids, seqs, max(max_tokens) if max_tokens else 0)
        for s in seqs:
            self._subs_of[s.seq_id] = sub
        if idle and self._wake is not None:
            self._wake.set()
        return sub

    def _close(self, sub: Submission) -> bool:
        """Drop the bridge's bookkeeping of ``sub`` once; False if it was already closed."""
        sub.sink = None
        if sub.closed:
            return False
        sub.closed = True
        for s in sub.seqs:
            self._seqs.pop(s.seq_id, None)
            self._subs_of.pop(s.seq_id, None)
        return True

    def abort(self, sub: Submission) -> None:
        """The client went away: free the requests' KV blocks and slots now (no finished-request stats)."""
        if not self._close(sub):
            return
        for s in sub.seqs:
            if not s.finished:
                s.finished, s.finish_reason = True, "abort"
        for eid in sub.engine_ids:
            self.engine.abort(eid)
        if self.kv_agent is not None:
            self.kv_agent.announce_pulls()      # an aborted remote prefill frees the prefill side's blocks
        self.refresh_gauges()

    def abort_all(self) -> None:
        """Abort every request in flight (sleep mode's ``mode=abort``): blocks freed, handlers woken to see it."""
        for sub in set(self._subs_of.values()):
            self.abort(sub)
            sub.event.set()

    def release(self, sub: Submission) -> None:
        """The handler is done with a finished submission (drops bookkeeping for n > 1 parents)."""
        if not self._close(sub):
            return
        if len(sub.seqs) > len(sub.engine_ids):
            for eid in sub.engine_ids:
                self.engine.abort(eid)   # no-op for finished parents; clears the engine's n>1 bookkeeping

    def finish_early(self, seq: Seq, num_tokens: int, reason: str = "stop") -> None:
        """A stop string ended the sequence after ``num_tokens`` tokens: abort it in the engine, count a stop."""
        if seq.finished:
            return
        seq.finished, seq.finish_reason = True, reason
        self._seqs.pop(seq.seq_id, None)
        self._subs_of.pop(seq.seq_id, None)
        self.engine.abort(seq.seq_id)
        self._record_finish(seq, reason, seq.last_token_v, num_tokens)
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        if self.metrics is not None:
            e = self.engine
            self.metrics.set_gauges(e.num_running, e.num_waiting, e.kv.usage)

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        eng = self.engine
        assert self._wake is not None
        while not self._closing:
            if not eng.has_unfinished():
                self._wake.clear()
                self.refresh_gauges()
                if gc_owner():
                    collect_when_idle()   # costs nobody a deadline
                due = eng.next_release_s() if eng.num_held else None
                if due is None:
                    await self._wake.wait()
                elif not await self._wait_wake(due):
                    eng.free_expired(self.virtual_now())     # P/D: unpulled blocks past their abort timeout
                    self.refresh_gauges()
                continue
            await self._read_window()
            await turn_gate().wait(first=True)     # the step's computation takes a turn of its own
            try:
                t_busy = time.perf_counter()
                # with KV pulls in flight the engine must not jump its clock to their end: wait for it instead
                res = eng.step(max_steps=1, until_s=self.virtual_now() if self.kv_agent is not None else None)
            except Exception:  # noqa: BLE001 - keep serving; the failing requests are aborted
                log.exception("engine step failed; aborting in-flight requests")
                for sub in set(self._subs_of.values()):
                    self.abort(sub)
                    sub.event.set()
                continue
            if res is None:
                nxt = eng.next_arrival_s      # only future arrivals (or KV pulls) left: wait for the first one
                if nxt is None:
                    if self.kv_agent is not None:        # pulls waiting for blocks that held ones keep
                        self._wake.clear()
                        await self._wait_wake(eng.next_release_s())
                        eng.free_expired(self.virtual_now())
                    continue
                if self.kv_agent is None:
                    await asyncio.sleep(max(self.wall_of(nxt) - time.perf_counter(), 0.0))
                else:
                    self._wake.clear()
                    await self._wait_wake(nxt)
                continue
            if self.kv_agent is not None:
                self.kv_agent.announce_pulls()
            # yield between the phases of a step's work (here and after the writes): sockets are read (arrival
            # stamps) and one request is admitted between them, not after several ms of engine work
            await asyncio.sleep(0)
            # fast-path streams: render this step's chunks now, while the simulated GPU "runs" it
            ready = await self._prepare(res)
            deadline = self.wall_of(res.end_s)
            self._busy_s = 0.8 * self._busy_s + 0.2 * (time.perf_counter() - t_busy)
            self._step_walls_s.append((res.end_s - res.start_s) / self.time_scale)
            if gc_owner():
                collect_in_slack(deadline - time.perf_counter())
            await self._sleep_until(deadline)
            if ready:
                self._flush(ready)       # first: the writes are what clients time
                await asyncio.sleep(0)
            await self._dispatch(res)
            # let handlers write this step's chunks before the next step's scheduling work
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    def wake(self) -> None:
        """Something outside a submission can let the engine progress (a P/D pull freed held blocks)."""
        if self._wake is not None:
            self._wake.set()

    async def _wait_wake(self, until_v: float | None) -> bool:
        """Wait for a submission's wake-up or the virtual time ``until_v`` (None: no limit); True if woken."""
        assert self._wake is not None
        if until_v is None:
            await self._wake.wait()
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), max(self.wall_of(until_v) - time.perf_counter(), 0.0))
        except TimeoutError:
            return False
        return True

    def read_window_s(self, now: float) -> float:
        """How long the loop may keep reading sockets before computing the next step (≤ 0: not at all)."""
        # the next step is not known before it is computed: the shortest recent one bounds it (a decode step
        # after a long prefill one is short)
        shortest = min(self._step_walls_s)
        # time already past the last step's end (its writes and bookkeeping; more after a late release, e.g. when
        # the hypervisor paused the VM): the next deadline is that much closer, and a loop behind the clock must
        # catch up at once, not read first (traced: 4-5 ms windows while 20-30 ms late stretched one stall over
        # ten steps)
        lag = now - self.wall_of(self.engine.now_s)
        return min(READ_WINDOW_SHARE * shortest, shortest - max(lag, 0.0) - READ_WINDOW_MARGIN_S) - self._busy_s

    async def _read_window(self, has_work: bool | None = None) -> None:
        """Before computing the next step, keep the loop reading sockets for a moment when the step leaves room.

        Requests are stamped when their bytes are read, and the loop reads nothing while it computes and renders
        a step (~1-2 ms each at 256 streams). Closed-loop clients (benchmarks, agents) send their next request
        right after a step's tokens go out, i.e. exactly then: reading first keeps their stamps true. The step
        is unaffected: its start is already fixed on the virtual clock, and requests arriving meanwhile are
        future arrivals it does not admit."""
        room = self.read_window_s(time.perf_counter())
        if has_work is None:
            has_work = self.engine.has_unfinished()
        if room <= 0.0002 or not has_work:
            return
        t0 = time.perf_counter()
        await asyncio.sleep(min(READ_WINDOW_S, room))
        # requests already read but not yet submitted (a burst waits at the admission gate, one handler per loop
        # turn): let them through first, so those that arrived before this step's start join it, as in vLLM,
        # and no step computation blinds the reads of the rest of the burst
        while admissions_pending() and time.perf_counter() - t0 < room:
            await asyncio.sleep(0)

    async def _sleep_until(self, deadline: float) -> None:
        late_s, now = await self.wait_deadline(deadline)
        self.observe_release(late_s, now)

    async def wait_deadline(self, deadline: float) -> tuple[float, float]:
        """Wait for the wall ``deadline``; (seconds late, perf_counter now) once it passed."""
        delay = deadline - time.perf_counter()
        if delay > self.spin_s:
            await asyncio.sleep(delay - self.spin_s)     # the loop's timers are only ~1 ms accurate
        # the last stretch: blocking naps (~0.1 ms accurate, they leave the core to others) with a socket poll after
        # each, so that requests arriving now are stamped now, the turn gate held so that no handler's admission
        # runs in it and delays the writes; then a short spin
        with turn_gate().held():
            while True:
                rest = deadline - time.perf_counter() - FINAL_SPIN_S
                if rest <= 0:
                    break
                time.sleep(min(rest, POLL_NAP_S))
                if deadline - time.perf_counter() > FINAL_SPIN_S + POLL_NAP_S / 2:
                    await asyncio.sleep(0)
        # no spin once the deadline has passed: a late loop releases at once (see the module docstring)
        while time.perf_counter() < deadline:
            pass
        now = time.perf_counter()
        return now - deadline, now

    def observe_release(self, late_s: float, now_s: float) -> None:
        """A step's tokens go out ``late_s`` wall seconds after their deadline, at ``now_s``: the worst lateness,
        the /metrics histogram (one observation per step, none per token) and the warning's window."""
        if late_s > self.late_s_max:
            self.late_s_max = late_s
        if self.metrics is not None:
            self.metrics.on_release(late_s)
        self.lateness.observe(late_s, now_s)

    async def _prepare(self, res: StepResult) -> list[Submission]:
        """Fast-path streams touched by this step render their chunk (nothing is observable until ``_flush``);
        the loop reads sockets between slices of them (arrival stamps)."""
        subs = self._subs_of
        seqs = self._seqs
        pend: dict[Submission, list] = {}
        for ev in res.events:
            sub = subs.get(ev.request_id)
            if sub is None or sub.sink is None:
                continue
            p = pend.get(sub)
            if p is None:
                seq = seqs.get(ev.request_id)
                if seq is None:
                    continue
                p = pend[sub] = [seq.released, False, None, False]
            kind = ev.kind
            if kind == TOKENS or kind == FIRST_TOKEN:
                p[0] += ev.num_tokens
                p[3] = p[3] or kind == FIRST_TOKEN
            elif kind == FINISHED:
                p[1] = True
                p[2] = ev.finish_reason
        first: list[Submission] = []
        rest: list[Submission] = []
        gate = turn_gate()
        for i, (sub, (released, finished, reason, is_first)) in enumerate(pend.items()):
            if i and i % PREPARE_SLICE == 0:
                await gate.wait(first=True)
            sink = sub.sink
            try:
                if sink is not None and sink.prepare(released, finished, reason):
                    (first if is_first else rest).append(sub)
            except Exception:  # noqa: BLE001 - one bad stream must not stop the others: abort it
                log.exception("rendering a stream chunk failed; aborting the request")
                self.abort(sub)
                sub.event.set()
        # the write order: first tokens (TTFT), then the other streams newest first (the engine lists the running
        # batch oldest first): a stream's place in the order then drifts only by the few streams admitted per step,
        # so consecutive chunks of one stream see almost the same lateness (ITL)
        rest.reverse()
        return first + rest

    def _flush(self, ready: list[Submission]) -> None:
        # no cyclic-GC pause in the middle of the write burst (a gen-1 collection takes ms): it runs after it
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._write_all(ready)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _write_all(self, ready: list[Submission]) -> None:
        for sub in ready:
            sink = sub.sink
            if sink is None:             # aborted during the wait
                continue
            try:
                ok = sink.flush()
            except Exception:  # noqa: BLE001 - the handler's own send reports it
                log.exception("fast-path stream write failed; handing the stream back")
                ok = False
            if ok:
                self.fast_writes += 1
            else:
                self.fast_handbacks += 1
                sub.sink = None
                sub.event.set()

    async def _dispatch(self, res: StepResult) -> None:
        """Book a released step: token counts, virtual token times, metrics, finished requests, handler wake-ups.

        It runs right after the writes, i.e. exactly when closed-loop clients that just got their last chunk
        send their next request; at 256 streams it is ~1 ms of Python, so it goes in slices with a socket read
        between them (arrival stamps), as ``_prepare`` does."""
        self.num_steps += 1
        end = self._released_v = res.end_s
        seqs = self._seqs
        subs = self._subs_of
        m = self.metrics
        itls: dict[float, int] = {}               # ITL -> count: a decode step's sequences mostly share one
        generated = 0
        finished: list[tuple[Seq, str]] = []
        done_fast: dict[Submission, None] = {}    # insertion-ordered set
        woken: dict[Submission, None] = {}        # handlers that write their own chunks (no fast path)
        events = res.events
        gate = turn_gate()
        for i, ev in enumerate(events):
            if i and i % DISPATCH_SLICE == 0:
                await gate.wait(first=True)
            seq = seqs.get(ev.request_id)
            if seq is None:
                continue
            kind = ev.kind
            if kind == TOKENS or kind == FIRST_TOKEN:
                k = ev.num_tokens
                seq.released += k
                generated += k
                if m is not None:
                    if kind == FIRST_TOKEN:
                        req = seq.req
                        m.on_first_token(end - (req.arrival_s if req else seq.last_token_v),
                                         req.prompt_len if req else 0)
                    else:
                        itl = end - seq.last_token_v
                        itls[itl] = itls.get(itl, 0) + 1
                seq.last_token_v = end
                if seq.token_times_v is not None:
                    seq.token_times_v.append(end)
            elif kind == FINISHED:
                seq.finished = True
                seq.finish_reason = ev.finish_reason
                seqs.pop(ev.request_id, None)
                finished.append((seq, ev.finish_reason or "stop"))
            else:
                continue
            sub = subs.get(ev.request_id)
            if sub is None:
                continue
            if sub.sink is None:
                woken[sub] = None
            elif kind == FINISHED:                # fast-path streams wake their handler only at the end
                done_fast[sub] = None
        for i, (seq, reason) in enumerate(finished):
            if i % RECORD_SLICE == 0:      # ~25 µs each (a dozen histogram observations)
                await gate.wait(first=True)
            self._record_finish(seq, reason, end, seq.released)
        if m is not None:
            if itls:
                m.on_itls(itls)
            kv = self.engine.kv
            m.on_step(res.num_running, res.num_waiting, res.kv_usage, res.num_scheduled_tokens, generated,
                      kv.prefix_queries_tokens, kv.prefix_hits_tokens, self.engine.scheduler.num_preemptions)
        # woken only once the whole step is booked: a handler must see all of it (the finish reason goes on the
        # chunk with the last token) and its request already counted in the metrics
        for sub in woken:
            sub.event.set()
        for sub in done_fast:
            if sub.done:
                sub.event.set()       # the handler winds down in a turn of its own (FastStream.run)
        if self.kv_publisher is not None:
            # the step's cache changes, once its tokens are out and its handlers woken; a turn of their own
            # (hashing and encoding a step's batch is ~0.1-0.4 ms), before the next step is computed
            await gate.wait(first=True)
            self.publish_kv_events(end)

    def _record_finish(self, seq: Seq, reason: str, finish_v: float, num_generated: int) -> None:
        if self.metrics is None or seq.req is None:
            return
        r = seq.req
        self.metrics.on_finished(reason, arrival_s=r.arrival_s, scheduled_s=r.first_scheduled_s,
                                 first_token_s=r.first_token_s, finish_s=finish_v, prompt_len=r.prompt_len,
                                 num_generated=num_generated, num_cached=r.num_cached_tokens,
                                 num_preemptions=r.num_preemptions)
