"""The engine's arrival queue pops in the order one heap of (time, seq_no) would, in-order pushes or not."""

from __future__ import annotations

import heapq
import random

from kernelsight.simcore.engine import ArrivalQueue
from kernelsight.simcore.request import FinishReason, Request


def _req() -> Request:
    return Request("r", [], 1, 1, FinishReason.LENGTH, 0.0)


def test_arrival_queue_pops_as_a_heap_under_mixed_pushes():
    rng = random.Random(3)
    q, heap = ArrivalQueue(), []
    t, seq = 0.0, 0
    popped, expected = [], []
    for _ in range(5000):
        r = rng.random()
        if r < 0.45:                                   # in order: a workload sent up front
            t += rng.random()
            entry = (t, seq, _req())
        elif r < 0.6:                                  # out of order: a pull's end, a load's end, an equal time
            entry = (t - rng.choice([0.0, rng.random() * 5]), seq, _req())
        else:
            if len(q):
                assert q.first() == heap[0]     # the same entry (Request compares by identity)
                popped.append(q.pop())
                expected.append(heapq.heappop(heap))
            continue
        seq += 1
        q.push(entry)
        heapq.heappush(heap, entry)
        assert len(q) == len(heap)
    while len(q):
        popped.append(q.pop())
        expected.append(heapq.heappop(heap))
    assert popped == expected
    assert q.first() is None
