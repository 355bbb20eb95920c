"""One heavy piece of Python per event-loop turn, so that sockets are read between any two of them.

The event loop polls sockets only between turns, and a turn runs every callback that is ready when it starts.
Requests are stamped when their bytes are read (``fastpath.read_clock``): a long turn delays the stamp, and so the
simulated arrival, of every request that comes in meanwhile. The work of a few hundred µs that can wait a turn
goes through the loop's :class:`TurnGate`, which lets one piece run per turn:

* a request handler's admission (routing, parsing, validation, submission);
* the engine loop's slices of rendering and bookkeeping (ahead of the queue: they have a deadline);
* the wind-down of a finished streaming handler (its response is already complete).

The total work is the same; only its interleaving with socket reads changes. An engine loop holds the gate (no
grants) while it polls sockets in the last stretch before a deadline, so that no handler delays the writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections import deque
from collections.abc import Iterator

#: Holds block grants for at most this long in a row: engine loops of one event loop (data parallel, replicas)
#: hold in turn before their own deadlines, and overlapping holds must not starve the handlers.
MAX_HELD_S = 0.002


class TurnGate:
    """Grants waiters one per event-loop turn, in FIFO order (``first=True`` jumps the queue)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._scheduled = False
        self._holds = 0
        self._held_since_s = 0.0

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, first: bool = False) -> None:
        """Return in a later turn that runs no other granted waiter."""
        fut: asyncio.Future[None] = self._loop.create_future()
        if first:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._grant)
        await fut

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No grant while inside (a waiter granted just before may still resume once); overlapping holds let
        one through every MAX_HELD_S."""
        if not self._holds:
            self._held_since_s = time.perf_counter()
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if self._waiters and not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._grant)

    def _grant(self) -> None:
        if self._holds:
            now = time.perf_counter()
            if now - self._held_since_s < MAX_HELD_S:
                self._scheduled = False     # a release schedules it again
                return
            self._held_since_s = now
        # a granted waiter resumes in the next turn, and so does this callback: it grants the following one, which
        # resumes a turn later, after a socket poll
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():          # a cancelled waiter (client gone) is skipped
                fut.set_result(None)
                break
        if waiters:
            self._loop.call_soon(self._grant)
        else:
            self._scheduled = False


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnGate] = weakref.WeakKeyDictionary()


def turn_gate() -> TurnGate:
    """The running loop's gate (replicas served by one loop share it: they share its turns)."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = TurnGate(loop)
    return gate
