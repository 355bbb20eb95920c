"""``simulate -dp N --replica-processes P``: a dense group's ranks in worker processes, advanced from one router
refresh to the next, give the one-process group's result bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.arrivals import arrival_times_s
from kernelsight.loadgen.datasets import random_dataset
from kernelsight.loadgen.dp_processes import run_group_in_processes, supports
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.simcore.engine_config import EngineArgs


def _same(one, many) -> None:
    assert len(one.records) == len(many.records)
    for a, b in zip(one.records, many.records, strict=True):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f.name
    for f in dataclasses.fields(one):
        if f.name not in ("records", "wall_s"):
            assert getattr(one, f.name) == getattr(many, f.name), f.name


def test_ranks_in_processes_give_the_one_process_group_bit_for_bit():
    """Three ranks over two workers: bursts, lulls that leave ranks idle, arrivals on the same instant (ties) and
    several in one 100 ms window; every record, ITL, rank statistic and the routing (requests per rank) match."""
    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", data_parallel_size=3,
                                          seed=5))
    assert supports(cfg, None, False)
    samples = random_dataset(240, 400, 30, 0.6, cfg.model.vocab_size, seed=5)
    arrivals = np.round(arrival_times_s(240, 40.0, 0.3, seed=5), 2)        # bursty, on a 10 ms grid: ties
    arrivals[100:] += 3.0                                                    # a lull: every rank goes idle
    one = run_fast_forward(cfg, samples, arrivals.tolist())
    finished: list[int] = []
    many = run_group_in_processes(cfg, samples, arrivals.tolist(), True, 2, on_finished=finished.append)
    assert sum(finished) == 240
    assert sorted(r["requests"] for r in many.ranks) != [0, 0, 240]          # the router did spread them
    _same(one, many)


def test_what_couples_the_ranks_keeps_the_group_in_one_process():
    dense = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", data_parallel_size=2))
    moe = create_engine_config(EngineArgs(model="Qwen/Qwen3-30B-A3B-Instruct-2507", hardware="h100",
                                          data_parallel_size=2, enable_expert_parallel=True))
    assert supports(dense, None, False)
    assert not supports(moe, None, False)            # lockstep: every forward pass is a group collective
    assert not supports(dense, 8, False)             # a closed loop: a send waits for a finish on any rank
    assert not supports(dense, None, True)           # a timeline interleaves the ranks' steps
    single = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100"))
    assert not supports(single, None, False)
