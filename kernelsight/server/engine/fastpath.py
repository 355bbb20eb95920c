"""The stream fast path: token chunks rendered while a step runs and written by the engine loop at its deadline.

The general path wakes one handler task per stream per step, which renders its chunk and sends it through the
middleware stack, all after the deadline and one stream after another: with hundreds of streams the last chunk
of a step goes out many ms late. Here a streaming response registers itself with the engine bridge; the bridge
asks it to render the step in flight while it waits for the deadline (``FastStream.prepare``), and at the
deadline writes every stream's bytes back to back (``FastStream.flush``: one write per connection per step,
no task wake-up, no middleware). Anything unusual hands the stream back to its handler task, which continues on
the general path from the same rendering state, so both paths send the same bytes.

Writing synchronously relies on uvicorn internals, checked at run time (``sync_cycle``): with the httptools
protocol, ``RequestResponseCycle.send`` awaits only while the transport is paused (``flow.write_paused``), and
otherwise frames and writes a body chunk at once. Any other server, protocol or send wrapper takes the general
path; a paused transport (a slow client) hands back, so it never blocks the engine loop or other streams.

This module also stamps each request with the time its first bytes were read (``RECV_KEY``, see
``StampingHttpToolsProtocol``): the engine takes that as the arrival time, so the time a burst of requests
spends queued behind each other's parsing and validation counts as queueing in the simulated timeline instead
of being invisible to it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kernelsight.server.engine.admissions import admission_done, admission_started
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.wire.jsonio import dumps as _dumps

if TYPE_CHECKING:
    from kernelsight.server.engine.bridge import EngineBridge, Submission

_json_str = json.encoder.encode_basestring     # == dumps(str): compact JSON, ensure_ascii=False
_json_list = _dumps

RAW_SEND_KEY = "kernelsight.raw_send"     # scope key: the server's own ``send``, outside every middleware
RECV_KEY = "kernelsight.recv_s"           # scope key: perf_counter() when the request's first bytes were read

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _HttpToolsCycle
except ImportError:  # pragma: no cover - without httptools every stream takes the general path
    _HttpToolsCycle = None
    _HttpToolsProtocol = None


def sync_cycle(raw_send: Any) -> Any | None:
    """uvicorn's httptools request cycle behind ``raw_send`` if its send can be completed synchronously, else None.

    Checked: the send is the unwrapped bound method of httptools' ``RequestResponseCycle``, the response has
    started with chunked transfer encoding on a non-HEAD request (uvicorn 0.29-0.54 then write each body chunk
    at once, framed ``%x CRLF body CRLF``, unless ``flow.write_paused``), and the attributes read here exist.
    h11, another server or a wrapped send give None: the stream keeps the general path."""
    cycle = getattr(raw_send, "__self__", None)
    if _HttpToolsCycle is None or type(cycle) is not _HttpToolsCycle \
            or getattr(raw_send, "__func__", None) is not _HttpToolsCycle.send:
        return None
    try:
        ok = (cycle.response_started and not cycle.response_complete and not cycle.disconnected
              and cycle.chunked_encoding is True and cycle.scope.get("method") != "HEAD"
              and isinstance(cycle.flow.write_paused, bool) and callable(cycle.transport.write))
    except AttributeError:
        return None
    return cycle if ok else None


_SENT_TEXT = "\ue000"           # sentinels: rendered once through the general path to cut a chunk template
_SENT_IDS = [-7_777_777_777]


class FastStream:
    """One streaming response written by the engine loop (see the module doc).

    ``gen`` is the request's ``Generation``: ``gen._render(bridge, pending)`` renders the chunk for the
    sequence state after the step in flight, and ``gen.tail_done`` tells that [DONE] is rendered. Chunks in the
    middle of a stream (new text, not finished, chat role chunk sent) are filled into a template cut from that
    renderer's own output, so they match it byte for byte at a fraction of the cost."""

    __slots__ = ("gen", "bridge", "sub", "view", "cycle", "send", "transport", "pending", "framed", "completed",
                 "_tpl", "_want_ids")

    def __init__(self, gen: Any, bridge: EngineBridge, sub: Submission) -> None:
        self.gen = gen
        self.bridge = bridge
        self.sub = sub
        self.view = gen.views[0]
        self.cycle: Any = None
        self.send: Any = None
        self.transport: Any = None
        self.completed = False      # the last chunk went out with the end of the response (from the engine loop)
        self.pending = b""          # rendered, not yet written (the handler sends it if the stream is handed back)
        self.framed = b""           # the same as one HTTP/1.1 chunk
        self._want_ids = bool(getattr(gen.req, "return_token_ids", False))
        self._tpl = self._template()

    def _template(self) -> tuple[str, ...] | None:
        """(before text, [before ids,] after) of a middle chunk, cut from the general renderer's output."""
        gen, idx = self.gen, self.view.seq.index
        ids = _SENT_IDS if self._want_ids else None
        if gen.is_chat:
            chunk = gen._chat_chunk(idx, _SENT_TEXT, None, None, ids, None, "null")
        else:
            chunk = gen._cmpl_chunk(idx, _SENT_TEXT, None, None, False, ids, None, "null")
        t = _json_str(_SENT_TEXT)
        if chunk.count(t) != 1:
            return None
        head, tail = chunk.split(t)
        if not self._want_ids:
            return (head, tail)
        i = _json_list(_SENT_IDS)
        if tail.count(i) != 1:
            return None
        mid, tail = tail.split(i)
        return (head, mid, tail)

    # -- called by the bridge's engine loop -------------------------------------------------------------
    def prepare(self, released: int, finished: bool, finish_reason: str | None) -> bool:
        """Render the step that ends next (nothing is written yet); True if there is something to write."""
        v = self.view
        tpl = self._tpl
        if not finished and tpl is not None and released > v.consumed and not v.done \
                and (self.gen._role_sent or not self.gen.is_chat):
            toks, ids = v.seq.tokens, v.ids
            start = v.consumed
            if released == start + 1:          # the usual chunk: one token
                tid, delta = toks.token(start)
                ids.append(tid)
            else:
                pieces = []
                for i in range(start, released):
                    tid, piece = toks.token(i)
                    ids.append(tid)
                    pieces.append(piece)
                delta = "".join(pieces)
            v.text += delta
            v.consumed = released
            v.sent = len(v.text)
            if not delta and not self._want_ids:
                return bool(self.pending)
            if self._want_ids:
                text = tpl[0] + _json_str(delta) + tpl[1] + _json_list(ids[start:]) + tpl[2]
            else:
                text = tpl[0] + _json_str(delta) + tpl[1]
        else:
            text = self.gen._render(self.bridge, (released, finished, finish_reason))
        if text:
            self.pending += text.encode("utf-8")
            self.framed = b"%x\r\n%b\r\n" % (len(self.pending), self.pending)   # uvicorn's chunked framing
        return bool(self.pending)

    def flush(self) -> bool:
        """Write the prepared bytes now; False if that would mean waiting (the handler takes over)."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or cycle.flow.write_paused:
            return False
        if not self.gen.tail_done:
            self.transport.write(self.framed)
            self.pending = self.framed = b""
            return True
        # the last chunk ([DONE] included) ends the response through uvicorn's own send, which also does its
        # keep-alive bookkeeping: the client can send its next request right away, not after a handler wake-up
        coro = self.send({"type": "http.response.body", "body": self.pending, "more_body": False})
        try:
            coro.send(None)
        except StopIteration:
            self.completed = True
            self.pending = self.framed = b""
            return True
        coro.close()    # it suspended before writing anything (its only await precedes the write)
        return False

    # -- the handler task ----------------------------------------------------------------------------
    async def run(self, raw_send: Any, send: Callable[[dict], Awaitable[None]]) -> bool:
        """Wait while the bridge streams. True: the response is complete (nothing left to send); False: the
        caller continues on the general path (never attached, or handed back)."""
        cycle = sync_cycle(raw_send)
        sub, bridge, gen = self.sub, self.bridge, self.gen
        if cycle is None:
            return False
        self.cycle, self.send, self.transport = cycle, raw_send, cycle.transport
        if not bridge.attach_sink(sub, self):
            return False
        try:
            while not self.completed and sub.sink is self:
                await sub.event.wait()
                sub.event.clear()
        except BaseException:
            if self.completed:
                bridge.release(sub)
            else:
                bridge.abort(sub)    # client gone (or cancelled): free the request now
            raise
        finally:
            bridge.detach_sink(sub, self)
        if self.completed:
            # the response is complete: what is left (bookkeeping, unwinding the app) takes a turn of its own
            try:
                await turn_gate().wait()
            finally:
                bridge.release(sub)
            return True
        if self.pending:             # prepared, but the transport was paused at the deadline
            data, self.pending, self.framed = self.pending, b"", b""
            await send({"type": "http.response.body", "body": data, "more_body": True})
        if not gen.tail_done:
            sub.event.set()          # the general path re-checks what is already released before waiting
        return False


def capture_raw_send(app: Any) -> None:
    """Outermost pure-ASGI layer: keeps the server's own ``send`` in the scope, so a streaming response can
    write token chunks without going through every middleware's send wrapper; and admits requests one per
    event-loop turn (``turns.TurnGate``)."""
    inner = app.build_middleware_stack

    def build():
        downstream = inner()

        async def capture(scope, receive, send):
            if scope["type"] != "http":
                await downstream(scope, receive, send)
                return
            scope[RAW_SEND_KEY] = send
            admission_started(scope)
            try:
                await turn_gate().wait()
                await downstream(scope, receive, send)
            finally:
                admission_done(scope)
                # the scope closes reference cycles (the server's request cycle through its bound send; FastAPI's
                # exit stacks): emptying it once the response is over lets reference counting free a finished
                # request at once, leaving the cyclic GC (whose pauses the engine loop plans around) little to do
                scope.clear()
        return capture

    app.build_middleware_stack = build


# -- arrival stamps -------------------------------------------------------------------------------------
_reads = threading.local()       # one event loop per thread


def _reset_read_clock() -> None:
    _reads.t = None


def read_clock() -> float:
    """perf_counter() at the first socket read of this event-loop turn: every request read in one turn was
    waiting in its socket when the turn began, so they share that stamp (not one delayed by the others' parsing)."""
    t = getattr(_reads, "t", None)
    if t is None:
        t = _reads.t = time.perf_counter()
        asyncio.get_running_loop().call_soon(_reset_read_clock)
    return t


if _HttpToolsProtocol is not None:
    class StampingHttpToolsProtocol(_HttpToolsProtocol):
        """uvicorn's httptools protocol that records when each request's first bytes were read (``RECV_KEY``)."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            scope = getattr(self, "scope", None)
            if isinstance(scope, dict):
                scope[RECV_KEY] = read_clock()
else:  # pragma: no cover
    StampingHttpToolsProtocol = None  # type: ignore[assignment,misc]


def http_protocol() -> Any:
    """The ``http`` setting for uvicorn.Config: the stamping httptools protocol, or uvicorn's choice."""
    return StampingHttpToolsProtocol if StampingHttpToolsProtocol is not None else "auto"
