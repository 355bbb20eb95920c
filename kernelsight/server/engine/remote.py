"""One engine behind several API-server processes (``serve --api-server-count N``), as vLLM runs its engine core.

The engine process keeps the bridge (``engine/bridge.py``): the simulated engine, its real-time loop, /metrics and KV
events. Each API-server process parses, tokenizes and renders its own requests, and reaches the engine through
``RemoteBridge``, which offers the bridge's request interface over a ZeroMQ channel (DEALER → the engine's ROUTER,
msgpack frames). Output token ids are drawn from per-request keys (``model/output_tokens.py``), so the API side
draws the same ids as the engine side from the keys it sends: a step's update only carries counts.

Timing, as in vLLM: the engine releases a step's tokens at the step's wall deadline; its update reaches the API
process over the channel (vLLM: engine core → API server over ZeroMQ too), which then renders and writes them.
Arrival stamps travel as ``perf_counter`` values (CLOCK_MONOTONIC: one clock for every process of the host).

Channel messages (msgpack lists; the first item names the kind):

    API → engine   ["s", sub_id, submit kwargs]   ["a", sub_id] abort   ["r", sub_id] release
                   ["f", sub_id, seq index, tokens, reason] a stop string   ["m", metric method, args] a counter
    engine → API   ["u", [[sub_id, [[released, finished, reason, cached tokens], ...]], ...]] a step's updates
                   ["x", {"sleeping": bool, "closing": bool, "loads": [[waiting, running], ...]}] the engine's
                   state, on connect and on change (at most every STATE_POLL_S)

With ``-dp N`` the engine process serves every rank's bridge; an API server holds one ``RemoteBridge`` per rank
(each its own DEALER, its rank in every submission) and balances over them as vLLM's API servers do: on the waiting
and running counts the engine publishes, plus what it sent since (vLLM's DP coordinator publishes every 100 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kernelsight.server.engine.bridge import EngineBridge, Seq, SinkHolder, Submission
from kernelsight.server.model.output_tokens import OutputTokens
from kernelsight.server.model.tokenizer import ServerTokenizer
from kernelsight.simcore.multimodal import MultimodalItem

log = logging.getLogger("kernelsight.server")
_UNSEEDED = random.Random()
#: metric methods an API-server process may count on the engine's registry (the rest are the engine's own)
FORWARDED_METRICS = frozenset({"on_fault", "on_admission_rejected"})
#: how often the engine looks for a change of its sleep/closing state to broadcast
STATE_POLL_S = 0.01


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _item_wire(item: MultimodalItem) -> list:
    return [item.modality, item.offset, item.num_tokens, list(item.encoder_seq_lens), item.mm_hash,
            list(item.grid_thw)]


def _item_of(w: list) -> MultimodalItem:
    return MultimodalItem(w[0], w[1], w[2], tuple(w[3]), w[4], tuple(w[5]))   # type: ignore[arg-type]


# -- the engine side --------------------------------------------------------------------------------------------
class _RemoteEvent:
    """Stands in for a remote submission's ``asyncio.Event``: where the bridge would wake a local handler, the
    submission's state goes to its API process."""

    __slots__ = ("service", "client", "sub_id", "sub")

    def __init__(self, service: EngineService, client: bytes, sub_id: int, sub: Submission) -> None:
        self.service, self.client, self.sub_id, self.sub = service, client, sub_id, sub

    def set(self) -> None:
        self.service.queue_update(self.client, self.sub_id, self.sub)

    def clear(self) -> None:
        pass

    def is_set(self) -> bool:
        return False


class EngineService:
    """The engine process's end of the channel: submissions from API-server processes on one bridge."""

    def __init__(self, bridges: list[EngineBridge], address: str, state_of: Callable[[], dict[str, Any]],
                 metrics: Any = None) -> None:
        self.bridges = bridges
        self.address = address
        self.state_of = state_of
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.subs: dict[tuple[bytes, int], Submission] = {}
        self.bridge_of: dict[tuple[bytes, int], EngineBridge] = {}     # the rank a submission went to
        self.clients: set[bytes] = set()
        self._out: dict[bytes, list] = {}
        self._flush_scheduled = False
        self._tasks: list[asyncio.Task] = []
        self._last_state: dict[str, Any] = {}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve(), name="kernelsight-engine-service"),
                       loop.create_task(self._watch_state(), name="kernelsight-engine-state")]

    async def stop(self) -> None:
        self._broadcast_state(force=True)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.sock.close(0)
        self.ctx.term()

    # messages in
    async def _serve(self) -> None:
        while True:
            client, data = await self.sock.recv_multipart()
            if client not in self.clients:
                self.clients.add(client)
                self._send(client, ["x", self.state_of()])
            try:
                self._handle(client, _unpack(data))
            except Exception:  # noqa: BLE001 - one bad message must not stop the engine
                log.exception("engine service: a message from an API server failed")

    def _handle(self, client: bytes, msg: list) -> None:
        kind = msg[0]
        if kind == "s":
            sub_id, kw = msg[1], msg[2]
            bridge = self.bridges[kw.pop("rank", 0)]
            if "mm_items" in kw:
                kw["mm_items"] = [[_item_of(w) for w in items] for items in kw["mm_items"]]
            if kw.get("extra_keys") is not None:
                kw["extra_keys"] = tuple(kw["extra_keys"])
            sub = bridge.submit(**kw)
            sub.event = _RemoteEvent(self, client, sub_id, sub)    # type: ignore[assignment]
            self.subs[(client, sub_id)] = sub
            self.bridge_of[(client, sub_id)] = bridge
            state = self.state_of()
            if state.get("sleeping") or state.get("closing"):
                bridge.abort(sub)              # raced a sleep or a shutdown: the API side sees an abort
                sub.event.set()
        elif kind == "a":
            sub = self.subs.pop((client, msg[1]), None)
            if sub is not None:
                self.bridge_of.pop((client, msg[1])).abort(sub)
        elif kind == "r":
            sub = self.subs.pop((client, msg[1]), None)
            if sub is not None:
                self.bridge_of.pop((client, msg[1])).release(sub)
        elif kind == "f":
            sub = self.subs.get((client, msg[1]))
            if sub is not None:
                self.bridge_of[(client, msg[1])].finish_early(sub.seqs[msg[2]], msg[3], msg[4])
        elif kind == "m" and msg[1] in FORWARDED_METRICS and self.metrics is not None:
            getattr(self.metrics, msg[1])(*msg[2])

    # messages out
    def queue_update(self, client: bytes, sub_id: int, sub: Submission) -> None:
        states = [[s.released, s.finished, s.finish_reason,
                   s.req.num_cached_tokens if s.req is not None else -1] for s in sub.seqs]
        self._out.setdefault(client, []).append([sub_id, states])
        if sub.closed:        # aborted or released here: the API side will not name it again
            self.subs.pop((client, sub_id), None)
            self.bridge_of.pop((client, sub_id), None)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, {}
        for client, updates in out.items():
            self._send(client, ["u", updates])

    def _send(self, client: bytes, msg: list) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([client, _pack(msg)], flags=zmq.NOBLOCK)

    def _broadcast_state(self, force: bool = False) -> None:
        state = self.state_of()
        if force or state != self._last_state:
            self._last_state = state
            for c in self.clients:
                self._send(c, ["x", state])

    async def _watch_state(self) -> None:
        while True:
            self._broadcast_state()
            await asyncio.sleep(STATE_POLL_S)


# -- the API-server side ----------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class _RemoteReq:
    """What a handler reads of an engine request (the prefix-cache hit, once the engine reports it)."""

    prompt_len: int
    num_cached_tokens: int = -1


@dataclasses.dataclass(slots=True)
class RemoteLoad:
    """What an API server knows of one rank's queue (its ``engine`` for DP balancing): the counts the engine last
    published, plus the requests sent to the rank since."""

    num_waiting: int = 0
    num_running: int = 0


class RemoteBridge(SinkHolder):
    """The bridge's request interface (submit, sinks, abort, release, stop strings) for an API-server process whose
    engine runs in the engine process (``EngineService``): one per data-parallel rank."""

    kv_agent = None            # P/D disaggregation is refused with --api-server-count
    kv_publisher = None
    timings: dict = {}

    def __init__(self, tokenizer: ServerTokenizer, address: str, identity: bytes, rank: int = 0) -> None:
        self.tok = tokenizer
        self.address = address
        self.identity = identity
        self.rank = rank
        self.engine = RemoteLoad()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._ids = itertools.count()
        self._subs: dict[int, Submission] = {}
        self._sub_ids: dict[int, int] = {}       # id(Submission) -> sub_id
        self._task: asyncio.Task | None = None
        self._closing = False
        self.engine_sleeping = False
        self.engine_closing = False
        self.remote_writes = 0                   # chunks written on arrival of the engine's update (fast path)

    # lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._receive(), name="kernelsight-remote-bridge")

    async def stop(self) -> None:
        self._closing = True
        for sub in list(self._subs.values()):
            self.abort(sub)
            sub.event.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.sock.close(0)
        self.ctx.term()

    @property
    def closing(self) -> bool:
        return self._closing or self.engine_closing

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_unfinished(self) -> int:
        return sum(1 for sub in self._subs.values() for s in sub.seqs if not s.finished)

    def num_prefill_tokens(self) -> int:
        return sum(s.req.prompt_len for sub in self._subs.values() for s in sub.seqs
                   if s.released == 0 and not s.finished and s.req is not None)

    def set_step_time_factor(self, factor: float) -> None:
        """Replica faults act on the engine process's bridge (its /kernelsight/faults)."""

    def refresh_gauges(self) -> None:
        """The gauges are the engine process's."""

    def wake(self) -> None:
        pass

    # requests
    def submit(self, prompts: list[list[int]], max_tokens: list[int], n: int = 1, *, min_tokens: int = 0,
               ignore_eos: bool = False, priority: int = 0, extra_keys: tuple | None = None,
               keys: list[int] | None = None, echo_output: bool = False, label: str | None = None,
               arrival_wall_s: float | None = None, hold_kv: bool = False, remote_prefill: bool = False,
               outputs: list[list[int]] | None = None, output_pieces: list[str] | None = None,
               mm_items: list | None = None) -> Submission:
        if hold_kv or remote_prefill:
            raise ValueError("P/D disaggregation is not served with --api-server-count")
        if keys is None:     # the engine must draw the same ids: the keys are chosen here
            keys = [_UNSEEDED.getrandbits(63) for _ in prompts]
        sub_id = next(self._ids)
        seqs: list[Seq] = []
        for p, (prompt, mt) in enumerate(zip(prompts, max_tokens, strict=True)):
            for i in range(n):
                fixed = outputs[p] if outputs is not None else prompt if echo_output else None
                tokens = OutputTokens(self.tok, keys[p] + 7919 * i, mt, fixed,
                                      output_pieces if outputs is not None else None)
                seqs.append(Seq(f"{sub_id}/{p * n + i}", p * n + i, tokens, _RemoteReq(len(prompt))))  # type: ignore[arg-type]
        sub = Submission([str(sub_id)], seqs, max(max_tokens) if max_tokens else 0)
        self._subs[sub_id] = sub
        self._sub_ids[id(sub)] = sub_id
        self.engine.num_waiting += n * len(prompts)     # until the engine's next published counts
        kw: dict[str, Any] = {"rank": self.rank, "prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens),
                              "n": n,
                              "min_tokens": min_tokens, "ignore_eos": ignore_eos, "priority": priority,
                              "extra_keys": list(extra_keys) if extra_keys is not None else None, "keys": keys,
                              "echo_output": echo_output, "label": label, "arrival_wall_s": arrival_wall_s,
                              "outputs": outputs, "output_pieces": output_pieces}
        if mm_items:
            kw["mm_items"] = [[_item_wire(it) for it in items] for items in mm_items]
        self._send(["s", sub_id, kw])
        return sub

    def _close(self, sub: Submission) -> int | None:
        sub.sink = None
        if sub.closed:
            return None
        sub.closed = True
        sub_id = self._sub_ids.pop(id(sub), None)
        if sub_id is not None:
            self._subs.pop(sub_id, None)
        return sub_id

    def abort(self, sub: Submission) -> None:
        sub_id = self._close(sub)
        if sub_id is None:
            return
        for s in sub.seqs:
            if not s.finished:
                s.finished, s.finish_reason = True, "abort"
        self._send(["a", sub_id])

    def abort_all(self) -> None:
        for sub in list(self._subs.values()):
            self.abort(sub)
            sub.event.set()

    def release(self, sub: Submission) -> None:
        sub_id = self._close(sub)
        if sub_id is not None:
            self._send(["r", sub_id])

    def finish_early(self, seq: Seq, num_tokens: int, reason: str = "stop") -> None:
        if seq.finished:
            return
        seq.finished, seq.finish_reason = True, reason
        for sub_id, sub in self._subs.items():
            if seq in sub.seqs:
                self._send(["f", sub_id, sub.seqs.index(seq), num_tokens, reason])
                return

    def count(self, method: str, *args: Any) -> None:
        """A counter of the engine process's /metrics, counted from here (faults, admission refusals)."""
        self._send(["m", method, list(args)])

    def _send(self, msg: list) -> None:
        if self._closing and msg[0] == "s":
            return
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(_pack(msg), flags=zmq.NOBLOCK)

    # updates in
    async def _receive(self) -> None:
        while True:
            msg = _unpack(await self.sock.recv())
            if msg[0] == "u":
                self._apply(msg[1])
            elif msg[0] == "x":
                self.engine_sleeping = bool(msg[1].get("sleeping"))
                self.engine_closing = bool(msg[1].get("closing"))
                loads = msg[1].get("loads") or ()
                if self.rank < len(loads):
                    self.engine.num_waiting, self.engine.num_running = loads[self.rank]

    def _apply(self, updates: list) -> None:
        woken: list[Submission] = []
        for sub_id, states in updates:
            sub = self._subs.get(sub_id)
            if sub is None:
                continue
            for seq, (released, finished, reason, cached) in zip(sub.seqs, states, strict=False):
                if seq.finished and seq.finish_reason in ("abort", "stop") and not finished:
                    continue          # finished here (a stop string) before the engine heard of it
                seq.released = released
                if finished and not seq.finished:
                    seq.finished, seq.finish_reason = True, reason
                if cached >= 0 and seq.req is not None:
                    seq.req.num_cached_tokens = cached
            sink = sub.sink
            if sink is not None:
                s = sub.seqs[0]
                try:
                    ready = sink.prepare(s.released, s.finished, s.finish_reason)
                    if ready and sink.flush():
                        self.remote_writes += 1
                    elif ready:
                        sub.sink = None          # a paused transport: the handler writes from here on
                        woken.append(sub)
                except Exception:  # noqa: BLE001 - one bad stream must not stop the others
                    log.exception("rendering a stream chunk failed; aborting the request")
                    self.abort(sub)
                    woken.append(sub)
                if sub.done:
                    woken.append(sub)
            else:
                woken.append(sub)
        for sub in woken:
            sub.event.set()
