"""When the serving process runs Python's cyclic garbage collector.

Automatic collections land anywhere: in the middle of a burst of admissions or of a step's writes, where the
event loop reads no socket while they run. And they are costly for objects that are not garbage at all: with 256
streams in flight a gen-1 collection walks ~40k live handler objects (coroutine frames, exit stacks, response
cycles) for ~30 ms every few seconds, and even young collections took 1-14 ms, only to promote live objects.

The serving path itself leaves no cyclic garbage: the outermost ASGI layer empties each request's scope when it
ends, which breaks the server's and FastAPI's per-request cycles, so reference counting frees a finished request
at once (tested). ``kernelsight serve`` therefore takes the collector over (:func:`take_over_gc`): it freezes
everything built at start-up, switches automatic collection off, and the engine loops collect only

* when idle, if at least ``GC_IDLE_OBJECTS`` new container objects accumulated (:func:`collect_when_idle`);
* under load, once ``GC_DUE_OBJECTS`` accumulated (what a client leaking cycles would build up: exceptions
  from disconnects, say), in the slack before a deadline if the collection's expected duration fits, or
  regardless at ``GC_OVERDUE_FACTOR`` times that: memory stays bounded whatever clients do
  (:func:`collect_in_slack`).

"Accumulated" is ``gc.get_count()[0]``: container objects allocated minus freed since the last collection.
Library users and tests keep Python's automatic GC (:func:`gc_owner` is False for them).
"""

from __future__ import annotations

import gc
import time

#: Net new container objects after which a collection is due under load (a few tens of MB at most).
GC_DUE_OBJECTS = 100_000
#: A due collection waits for slack until the count reaches this multiple of ``GC_DUE_OBJECTS``, then runs anyway.
GC_OVERDUE_FACTOR = 4
#: Net new container objects worth a collection when nothing is in flight (below it, an idle collection would
#: only delay the reading of the next request: a closed-loop client sends it within a ms).
GC_IDLE_OBJECTS = 10_000
#: A collection runs in the slack before a deadline only if its expected duration times this margin fits.
GC_SLACK_MARGIN = 1.5


class _State:
    taken_over = False
    cost_s = 0.05            # running mean of a collection's duration (seeded pessimistically)


_state = _State()


def gc_owner() -> bool:
    """True when this process switched automatic cyclic GC off (``kernelsight serve`` does, after start-up) and
    the engine loops collect instead."""
    return _state.taken_over and not gc.isenabled()


def take_over_gc() -> None:
    """Freeze everything built so far (tokenizer, tables, the app: it lives for the process, and no collection
    should walk it again) and switch automatic cyclic GC off."""
    gc.collect()
    gc.freeze()
    gc.disable()
    _state.taken_over = True


def pending_objects() -> int:
    """Container objects allocated minus freed since the last collection."""
    return gc.get_count()[0]


def collect() -> int:
    """Collect every unfrozen generation, timed (the running mean plans the next ones under load)."""
    t0 = time.perf_counter()
    found = gc.collect()
    _state.cost_s = 0.7 * _state.cost_s + 0.3 * (time.perf_counter() - t0)
    return found


def collect_in_slack(slack_s: float) -> None:
    """Collect if due and its expected duration fits in ``slack_s`` before the next deadline, or if overdue."""
    n = pending_objects()
    if n >= GC_OVERDUE_FACTOR * GC_DUE_OBJECTS or (n >= GC_DUE_OBJECTS and _state.cost_s * GC_SLACK_MARGIN < slack_s):
        collect()


def collect_when_idle() -> None:
    """Nothing in flight: collect if enough accumulated to be worth it."""
    if pending_objects() >= GC_IDLE_OBJECTS:
        collect()
