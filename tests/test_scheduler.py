"""vLLM V1 scheduler semantics and invariants, checked step by step on the real engine."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, PREEMPTED, TOKENS, Engine
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.request import FinishReason, Request, RequestStatus
from tests.conftest import make_config, make_engine


def check_block_accounting(engine) -> None:
    """Every block is either free (ref 0) or held by exactly ref_cnt running requests; shared ⇒ cached."""
    pool = engine.kv.pool
    holders = Counter()
    for req in engine.scheduler.running:
        assert len(set(req.block_ids)) == len(req.block_ids), "a request holds a block twice"
        holders.update(req.block_ids)
    for req in engine.scheduler.waiting:
        assert req.block_ids == []
    free_list = pool.free_blocks()
    free = set(free_list)
    assert len(free) == len(free_list) == pool.num_free_blocks, "free queue holds a block twice or miscounts"
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt[b] == holders.get(b, 0), f"block {b}: ref {pool.ref_cnt[b]} vs {holders.get(b, 0)}"
        assert (b in free) == (pool.ref_cnt[b] == 0)
        if holders.get(b, 0) > 1:
            assert pool.block_hash[b] != 0, "a block shared without being a cached prefix block"


def random_workload(engine, n: int, seed: int, shared_prefix: int = 64, abort_some: bool = False):
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(shared_prefix)]
    ids = []
    for i in range(n):
        body = [rng.randrange(1000, 30000) for _ in range(rng.randint(1, 300))]
        prompt = (prefix if rng.random() < 0.5 else []) + body
        engine.add_request(f"r{i}", prompt, rng.randint(1, 120), ignore_eos=rng.random() < 0.5,
                           arrival_s=rng.random() * 2.0)
        ids.append(f"r{i}")
    return ids


@pytest.mark.parametrize("use_group", [True, False])
@pytest.mark.parametrize("max_steps", [1, 32])
def test_invariants_under_kv_pressure(use_group, max_steps):
    engine = make_engine(use_decode_group=use_group, num_gpu_blocks_override=120, max_num_batched_tokens=512,
                         max_num_seqs=48, max_model_len=1024)
    budget = engine.config.max_num_batched_tokens
    ids = random_workload(engine, 150, seed=7, abort_some=True)
    rng = random.Random(3)
    finished = set()
    preemptions = 0
    steps = 0
    while True:
        res = engine.step(max_steps=max_steps)
        if res is None:
            break
        steps += res.num_steps
        assert 0 < res.num_scheduled_tokens <= budget
        assert engine.num_running <= 48
        for ev in res.events:
            if ev.kind == FINISHED:
                finished.add(ev.request_id)
            elif ev.kind == PREEMPTED:
                preemptions += 1
        check_block_accounting(engine)
        if rng.random() < 0.05:                      # abort a random live request at a random time
            victim = rng.choice(ids)
            engine.abort(victim)
    assert preemptions > 0, "the workload was meant to exercise preemption"
    assert finished == set(ids)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1
    assert not engine.kv.pool.ref_cnt[1:].any()
    assert steps > 100


class _AllocationLog(KVCacheManager):
    """Logs each allocation: the preemptions counted when it was asked, whether it succeeded, the free blocks.
    (A subclass, not a patched method: compiled by ``kernelsight.accel`` the manager takes no instance attributes.)"""

    def allocate_slots(self, req, num_new, *a, **kw):
        ok = super().allocate_slots(req, num_new, *a, **kw)
        self.log.append((self.scheduler.num_preemptions, ok, self.num_free_blocks))
        return ok


def test_preemption_only_when_blocks_run_out():
    cfg = make_config(num_gpu_blocks_override=70, max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024)
    kv = _AllocationLog(cfg.num_gpu_blocks, cfg.scheduler.block_size, cfg.scheduler.enable_prefix_caching)
    kv.log = []
    engine = Engine(cfg.scheduler, cfg.num_gpu_blocks, build_step_model(cfg), seed=cfg.args.seed, kv_cache=kv)
    kv.scheduler = engine.scheduler
    random_workload(engine, 80, seed=11)
    while engine.step(max_steps=16) is not None:
        pass
    assert engine.scheduler.num_preemptions > 0
    # each preemption follows an allocation that failed for lack of blocks (the count rises only after a failure)
    for (before, ok, free), (after, _, _) in zip(kv.log, kv.log[1:], strict=False):
        if after > before:
            assert not ok and free < 64

    roomy = make_engine(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048)
    random_workload(roomy, 80, seed=11)
    while roomy.step(max_steps=16) is not None:
        pass
    assert roomy.scheduler.num_preemptions == 0


def test_shared_prefix_cuts_computed_tokens_by_cached_full_blocks():
    # a synchronous engine schedules "c" in the very next step (async scheduling: test_async_scheduling_lag)
    engine = make_engine(per_token_events=True, async_scheduling=False)
    prefix = list(range(1000, 1100))            # 100 tokens = 6 full blocks + 4
    engine.add_request("a", prefix, 5, ignore_eos=True)
    while engine.step() is not None:
        pass
    b_prompt = prefix + list(range(5000, 5050))
    engine.add_request("b", b_prompt, 5, ignore_eos=True)
    req = engine.get_request("b")
    res = engine.step()
    assert req.num_cached_tokens == 96

    assert res.num_scheduled_tokens == len(b_prompt) - 96
    # a prompt that is entirely cached still recomputes its last block (one token must produce logits)
    engine.add_request("c", prefix[:96], 5, ignore_eos=True)
    res = engine.step()
    assert engine.get_request("c").num_cached_tokens == 80
    assert res.num_scheduled_tokens >= 16


def test_prefix_cache_lru_reuse_after_free_and_eviction():
    kv = KVCacheManager(num_gpu_blocks=9, block_size=4)    # 8 usable blocks
    mk = lambda rid, toks: Request(rid, tuple(toks), 4, 4, FinishReason.LENGTH, 0.0)  # noqa: E731
    a = mk("a", range(16))                                  # 4 full blocks
    hits, n = kv.get_computed_blocks(a)
    assert n == 0 and kv.allocate_slots(a, 16)
    kv.free(a)                                              # cached blocks stay, free but reusable
    assert kv.num_free_blocks == 8
    a2 = mk("a2", list(range(16)) + [99])
    hits, n = kv.get_computed_blocks(a2)
    assert n == 16 and len(hits) == 4
    assert kv.allocate_slots(a2, 1, hits, n)
    kv.free(a2)
    big = mk("big", range(100, 132))                        # 8 blocks: evicts everything cached
    kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, 32)
    kv.free(big)
    hits, n = kv.get_computed_blocks(mk("a3", list(range(16)) + [7]))
    assert n == 0


def test_chunked_prefill_splits_long_prompts():
    engine = make_engine(max_num_batched_tokens=2048, max_num_seqs=16)
    engine.add_request("long", list(range(5000)), 4, ignore_eos=True)
    counts = []
    first_at = None
    while (res := engine.step()) is not None:
        counts.append(res.num_scheduled_tokens)
        if any(e.kind == FIRST_TOKEN for e in res.events):
            first_at = len(counts)
    assert counts[:3] == [2048, 2048, 904]
    assert first_at == 3
    assert counts[3:] == [1, 1, 1]


def test_decodes_go_before_new_prefills_and_budget_is_shared():
    engine = make_engine(max_num_batched_tokens=256, max_num_seqs=16, async_scheduling=False)
    engine.add_request("a", list(range(100)), 50, ignore_eos=True)
    engine.step()
    engine.add_request("b", list(range(1000, 1600)), 5, ignore_eos=True)
    res = engine.step()
    # a decodes (1 token), b gets the remaining 255 of the budget
    assert res.num_scheduled_tokens == 256
    assert engine.get_request("b").num_computed_tokens == 255


def test_max_num_seqs_limits_running():
    engine = make_engine(max_num_seqs=4)
    for i in range(10):
        engine.add_request(f"r{i}", list(range(i * 100, i * 100 + 20)), 30, ignore_eos=True)
    res = engine.step()
    assert res.num_running == 4 and res.num_waiting == 6


def test_priority_policy_admits_lowest_value_first():
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("low", list(range(10)), 3, ignore_eos=True, priority=5)
    engine.add_request("high", list(range(100, 110)), 3, ignore_eos=True, priority=-1)
    res = engine.step()
    scheduled = [e.request_id for e in res.events if e.kind == "scheduled"]
    assert scheduled == ["high"]


def test_fcfs_preempts_newest_and_requeues_it_first():
    engine = make_engine(num_gpu_blocks_override=12, max_num_batched_tokens=512, max_num_seqs=8,
                         max_model_len=160)
    engine.add_request("old", list(range(60)), 100, ignore_eos=True)
    engine.add_request("new", list(range(1000, 1060)), 100, ignore_eos=True)
    preempted = []
    while (res := engine.step()) is not None:
        preempted += [e.request_id for e in res.events if e.kind == PREEMPTED]
        if preempted:
            assert engine.scheduler.waiting.peek().request_id == "new"
            break
    assert preempted == ["new"]
    assert engine.get_request("new").status is RequestStatus.PREEMPTED


def test_token_events_cover_every_output_token():
    engine = make_engine(per_token_events=True)
    random_workload(engine, 40, seed=5)
    counts = Counter()
    while (res := engine.step(max_steps=8)) is not None:
        for ev in res.events:
            if ev.kind in (TOKENS, FIRST_TOKEN):
                counts[ev.request_id] += ev.num_tokens
    assert len(counts) == 40
    assert all(c >= 1 for c in counts.values())
