"""KV offloading to a CPU tier (simcore/kv_offload.py): capacity and block size as vLLM computes them, stores that
become loadable only once copied, lookups after a GPU miss, loads before the request's first step, the tier's LRU,
and the engine around it (cached tokens, TTFT, determinism, no leaked blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from kernelsight.simcore.engine import FIRST_TOKEN
from kernelsight.simcore.kv_events import HostBlocksRemoved, HostBlocksStored
from kernelsight.simcore.kv_offload import (
    CPU_TO_GPU,
    GIB,
    GPU_TO_CPU,
    KVOffload,
    OffloadConfig,
    offload_from_connector,
)
from kernelsight.simcore.kv_transfer import KVLink
from kernelsight.simcore.request import FinishReason, Request
from tests.conftest import make_config, make_engine

BS = 16
LLAMA8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2     # layers × KV heads × head dim × (K, V) × bf16


# -- configuration ----------------------------------------------------------------------------------------------
def test_capacity_is_the_total_over_tp_ranks():
    one = make_config(kv_offloading_size_gib=4.0).offload
    assert one.num_blocks == 4 * GIB // (LLAMA8B_KV_BYTES_PER_TOKEN * BS) == 2048
    assert one.block_size == BS and one.connector == "OffloadingConnector"
    # TP 2: each rank holds half of every block, and the 4 GiB are summed over both ranks: the same block count
    two = make_config(kv_offloading_size_gib=4.0, tensor_parallel_size=2).offload
    assert two.num_blocks == 2048 and two.kv_bytes_per_token_per_rank == LLAMA8B_KV_BYTES_PER_TOKEN / 2
    lm = make_config(kv_offloading_size_gib=4.0, kv_offloading_backend="lmcache").offload
    assert lm.connector == "LMCacheConnectorV1" and lm.block_size == 256 and lm.num_blocks == 2048 // 16
    assert make_config().offload is None


@pytest.mark.parametrize(("kw", "msg"), [
    ({"kv_offloading_size_gib": 0.0}, "cpu_bytes_to_use must be specified"),
    ({"kv_offloading_size_gib": 1.0, "kv_offloading_backend": "disk"}, "Unknown offloading backend: 'disk'"),
    ({"kv_offloading_size_gib": 1.0, "kv_offloading_block_size": 24}, "must be divisible by every KV cache group"),
])
def test_bad_offloading_args(kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_config(**kw)


def test_hybrid_model_offloading_refused():
    with pytest.raises(ValueError, match="not modelled"):
        make_config(model="openai/gpt-oss-20b", kv_offloading_size_gib=1.0)


def test_kv_transfer_config_maps_to_the_same_tier():
    native = offload_from_connector("OffloadingConnector",
                                    {"cpu_bytes_to_use": 2 * GIB, "block_size": 64, "offload_prompt_only": False}, 2)
    assert (native.size_gib, native.backend, native.block_size, native.offload_prompt_only) == (2.0, "native", 64,
                                                                                                 False)
    # LMCache's size is per rank (vLLM divides --kv-offloading-size by TP × PP for it)
    lm = offload_from_connector("LMCacheConnectorV1", {"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 3.0},
                                2)
    assert (lm.size_gib, lm.backend) == (6.0, "lmcache")
    assert offload_from_connector("NixlConnector", {}, 1) is None
    with pytest.raises(ValueError, match="cpu_bytes_to_use must be specified"):
        offload_from_connector("OffloadingConnector", {}, 1)


# -- the tier on its own ----------------------------------------------------------------------------------------
LINK = KVLink("pcie", 50e9, 10e-6)


def _tier(num_blocks: int, block_size: int = BS) -> KVOffload:
    cfg = OffloadConfig("native", num_blocks * block_size * 1000.0, block_size, num_blocks, 1000.0)
    return KVOffload(cfg, LINK, BS)


def _req(rid: str, n_blocks: int, base: int) -> tuple[Request, list[int]]:
    """A request whose prompt fills n_blocks (and one token more), with made-up block hashes (base + i)."""
    req = Request(rid, tuple(range(n_blocks * BS + 1)), 4, 4, FinishReason.LENGTH, 0.0)
    req.num_computed_tokens = req.prompt_len
    return req, [base + i for i in range(n_blocks)]


def _store(tier: KVOffload, req: Request, hashes: list[int], end_s: float) -> None:
    tier.store_computed([req], lambda r, n: hashes[:n], end_s)


class _Events:
    events: list | None = None


def test_a_store_is_loadable_once_its_copy_ends():
    tier = _tier(16)
    src = _Events()
    src.events = []
    tier.event_source = src
    a, ha = _req("a", 4, 100)
    _store(tier, a, ha, 1.0)
    copy_s = LINK.time_s(4 * BS * 1000.0)
    assert tier.stats.bytes[GPU_TO_CPU] == 4 * BS * 1000.0 and tier.stats.time_s[GPU_TO_CPU] == pytest.approx(copy_s)
    tier.advance(1.0 + copy_s / 2)
    assert tier.match(a, ha, 0, 1.0 + copy_s / 2) == 0 and src.events == []      # still being copied
    tier.advance(1.0 + copy_s)
    assert tier.match(a, ha, 0, 1.0 + copy_s) == 4 * BS
    assert src.events == [HostBlocksStored(ha, BS, "CPU")]
    # past a GPU hit of 1 block, only the rest is external
    assert tier.match(a, ha, BS, 2.0) == 3 * BS
    # the same blocks again: nothing new to copy
    b, _ = _req("b", 4, 0)
    _store(tier, b, ha, 3.0)
    assert tier.stats.transfers[GPU_TO_CPU] == 1


def test_copies_queue_on_one_stream_per_direction():
    tier = _tier(32)
    a, ha = _req("a", 4, 100)
    b, hb = _req("b", 4, 200)
    _store(tier, a, ha, 1.0)
    _store(tier, b, hb, 1.0)              # same step: b's copy starts when a's ends
    one = LINK.time_s(4 * BS * 1000.0)
    assert tier.d2h_free_s == pytest.approx(1.0 + 2 * one)
    tier.advance(10.0)
    end_a = tier.start_load(a, ha, 0, 4 * BS, 10.0)
    end_b = tier.start_load(b, hb, 0, 4 * BS, 10.0)
    assert end_a == pytest.approx(10.0 + one) and end_b == pytest.approx(10.0 + 2 * one)
    assert tier.stats.bytes[CPU_TO_GPU] == 8 * BS * 1000.0 and tier.stats.loads == 2


def test_lru_eviction_and_capacity():
    tier = _tier(4)
    src = _Events()
    src.events = []
    tier.event_source = src
    a, ha = _req("a", 2, 100)
    b, hb = _req("b", 2, 200)
    c, hc = _req("c", 2, 300)
    _store(tier, a, ha, 0.0)
    _store(tier, b, hb, 0.0)
    tier.advance(1.0)
    assert tier.num_stored == 4 and tier.usage == 1.0
    assert tier.match(a, ha, 0, 1.0) == 2 * BS          # a lookup touches a: b is now the least recently used
    _store(tier, c, hc, 1.0)
    tier.advance(2.0)
    assert tier.match(b, hb, 0, 2.0) == 0 and tier.match(a, ha, 0, 2.0) == 2 * BS
    assert tier.match(c, hc, 0, 2.0) == 2 * BS and tier.num_stored == 4 and tier.stats.evicted_blocks == 2
    assert HostBlocksRemoved(hb[::-1], "CPU") in src.events      # a suffix goes before its prefix


def test_blocks_being_loaded_are_not_evicted():
    tier = _tier(2)
    a, ha = _req("a", 2, 100)
    b, hb = _req("b", 2, 200)
    _store(tier, a, ha, 0.0)
    tier.advance(1.0)
    tier.start_load(a, ha, 0, 2 * BS, 1.0)
    assert tier.match(b, ha, 0, 1.0) is None            # another request needing those blocks waits for the load
    _store(tier, b, hb, 1.0)                             # no room: every block is being read
    assert tier.stats.stores_skipped_blocks == 2 and b.num_offloaded_blocks == 0
    tier.finish_load(a)
    _store(tier, b, hb, 2.0)                             # retried later: a's blocks are evictable again
    assert b.num_offloaded_blocks == 2 and tier.stats.evicted_blocks == 2


# -- the engine -------------------------------------------------------------------------------------------------
PROMPT = 2001        # 125 full blocks and one token


def _prompt(rng: np.random.Generator) -> list[int]:
    return rng.integers(0, 30000, PROMPT).tolist()


def _run(size_gib: float | None, *, events: bool = False, **kw):
    """A's prompt, then 5 others that evict it from a 300-block GPU cache, then A again."""
    eng = make_engine(per_token_events=False, num_gpu_blocks_override=300, max_model_len=4096,
                      kv_offloading_size_gib=size_gib, **kw)
    if events:
        eng.kv.enable_events()
    rng = np.random.default_rng(0)
    a = _prompt(rng)
    eng.add_request("a", a, 4, ignore_eos=True, arrival_s=0.0)
    for i in range(5):
        eng.add_request(f"f{i}", _prompt(rng), 4, ignore_eos=True, arrival_s=1.0 + i)
    eng.add_request("a2", a, 4, ignore_eos=True, arrival_s=10.0)
    first, cached, evs = {}, {}, []
    reqs = dict(eng._requests)
    while eng.has_unfinished():
        res = eng.step(max_steps=64)
        if res is None:
            break
        for ev in res.events:
            if ev.kind == FIRST_TOKEN:
                first[ev.request_id] = res.step_end_s[0]
        if events:
            evs += eng.kv.take_events()
    for rid, r in reqs.items():
        cached[rid] = r.num_cached_tokens
    return eng, first, cached, reqs, evs


def test_prompt_evicted_from_gpu_comes_back_from_cpu():
    eng_off, first_off, cached_off, _, _ = _run(None)
    eng, first, cached, reqs, _ = _run(4.0)
    # without offloading the prompt is recomputed; with it the 125 offloaded blocks are loaded
    assert cached_off["a2"] == 0 and cached["a2"] == 2000
    ttft_off, ttft = first_off["a2"] - 10.0, first["a2"] - 10.0
    assert ttft < 0.5 * ttft_off
    # the request's first step starts after its load ended, and the load took its bytes over the link
    a2 = reqs["a2"]
    load_s = eng.offload.link.time_s(125 * BS * LLAMA8B_KV_BYTES_PER_TOKEN)
    assert a2.kv_ready_s == pytest.approx(10.0 + load_s) and a2.first_scheduled_s >= a2.kv_ready_s
    st = eng.offload.stats
    assert st.bytes[CPU_TO_GPU] == 125 * BS * LLAMA8B_KV_BYTES_PER_TOKEN
    # the stores: every prompt's full blocks, once
    assert st.bytes[GPU_TO_CPU] == 6 * 125 * BS * LLAMA8B_KV_BYTES_PER_TOKEN
    # the connector's counters: every request queries its tokens past its GPU hit; a2 alone hits
    assert st.external_queries_tokens == 7 * PROMPT and st.external_hits_tokens == 2000
    # the GPU's counters count a2 once, with no GPU hit
    assert eng.kv.prefix_queries_tokens == 7 * PROMPT and eng.kv.prefix_hits_tokens == 0
    # the other requests are as without offloading (stores overlap compute)
    assert {k: v for k, v in first.items() if k != "a2"} == {k: v for k, v in first_off.items() if k != "a2"}


def test_no_blocks_leak_and_runs_are_deterministic():
    eng, first, cached, _, _ = _run(4.0)
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks - 1
    assert not eng.offload._loading and not eng.offload._keys_loading
    assert all(b.ref_cnt == 0 for b in eng.offload._blocks.values())
    again = _run(4.0)
    assert again[1] == first and again[2] == cached


def test_a_small_tier_keeps_the_most_recent_prompts():
    # 0.25 GiB = 128 blocks: one prompt's 125 blocks at a time, so a's are evicted by the next prompt
    eng, _, cached, _, evs = _run(0.25, events=True)
    assert eng.offload.config.num_blocks == 128 and cached["a2"] == 0
    assert eng.offload.stats.evicted_blocks > 0
    removed = [k for e in evs if isinstance(e, HostBlocksRemoved) for k in e.keys]
    stored = [k for e in evs if isinstance(e, HostBlocksStored) for k in e.keys]
    assert removed and set(removed) <= set(stored)


def test_abort_while_loading_frees_everything():
    eng = make_engine(per_token_events=False, num_gpu_blocks_override=300, max_model_len=4096,
                      kv_offloading_size_gib=4.0)
    rng = np.random.default_rng(1)
    a = _prompt(rng)
    eng.add_request("a", a, 2, ignore_eos=True, arrival_s=0.0)
    eng.add_request("f", _prompt(rng), 2, ignore_eos=True, arrival_s=1.0)
    eng.add_request("g", _prompt(rng), 2, ignore_eos=True, arrival_s=2.0)
    while eng.has_unfinished():
        eng.step()
    eng.add_request("long", list(range(50)), 500, ignore_eos=True, arrival_s=4.0)   # keeps the engine stepping
    eng.add_request("a2", a, 2, ignore_eos=True, arrival_s=5.0)
    a2 = eng.get_request("a2")
    while not a2.kv_load_tokens:
        eng.step()                           # until a2's load has started
    assert a2.kv_load_tokens == 2000 and a2.block_ids     # loaded blocks held, not yet taken in
    assert eng.num_waiting == 1 and eng.offload.num_loading == 1     # waiting for its KV, as vLLM counts it
    assert eng.abort("a2")
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks - 1
    assert not eng.offload._loading and all(b.ref_cnt == 0 for b in eng.offload._blocks.values())


def test_decode_blocks_stored_when_not_prompt_only():
    eng = make_engine(per_token_events=False, num_gpu_blocks_override=300, max_model_len=4096,
                      kv_offloading_size_gib=1.0, kv_offloading_prompt_only=False)
    eng.add_request("a", list(range(100, 132)), 40, ignore_eos=True)     # 2 prompt blocks, 72 tokens at the end
    while eng.has_unfinished():
        eng.step()
    assert eng.offload.num_stored == 4       # 2 prompt blocks and the 2 decode blocks filled before the last token


def test_chunks_larger_than_gpu_blocks():
    tier = KVOffload(OffloadConfig("native", 8 * 64 * 1000.0, 64, 8, 1000.0), LINK, BS)   # 4 GPU blocks per chunk
    a, ha = _req("a", 8, 100)            # 8 GPU blocks = 2 chunks
    _store(tier, a, ha, 0.0)
    tier.advance(1.0)
    assert tier.num_stored == 2 and tier.stats.bytes[GPU_TO_CPU] == 2 * 64 * 1000.0
    assert tier.match(a, ha, 0, 1.0) == 128
    assert tier.match(a, ha, 64, 1.0) == 64
    # a GPU hit of 5 blocks leaves 48 tokens of the second chunk: less than a chunk, not loaded (as vLLM)
    assert tier.match(a, ha, 80, 1.0) == 0


def test_loads_in_flight_are_capped():
    tier = KVOffload(OffloadConfig("native", 16 * BS * 1000.0, BS, 16, 1000.0), LINK, BS, max_loads=1)
    a, ha = _req("a", 2, 100)
    b, hb = _req("b", 2, 200)
    _store(tier, a, ha, 0.0)
    _store(tier, b, hb, 0.0)
    tier.advance(1.0)
    tier.start_load(a, ha, 0, 2 * BS, 1.0)
    assert tier.match(b, hb, 0, 1.0) is None      # vLLM's max_num_seqs loads at once: b is asked again later
    tier.finish_load(a)
    assert tier.match(b, hb, 0, 1.0) == 2 * BS
