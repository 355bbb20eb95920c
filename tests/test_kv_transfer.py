"""Prefill/decode disaggregation in simcore: the KV pull's time model, the prefill side's held blocks (freed on the
pull or after vLLM's abort timeout) and the decode side's pull-then-decode."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kernelsight import profiles
from kernelsight.simcore.engine import FINISHED, FIRST_TOKEN, NIXL_ABORT_REQUEST_TIMEOUT_S
from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.kv_transfer import default_link_kind, kv_link
from tests.conftest import make_engine

# Llama-3.1-8B's config.json: 32 layers, 8 KV heads of 128; bf16 KV cache
LLAMA8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def test_link_defaults_follow_the_gpu_profile():
    h100, l40s = profiles.load_hardware("h100"), profiles.load_hardware("l40s")
    assert default_link_kind(h100) == "nvlink" and default_link_kind(l40s) == "pcie"
    assert kv_link(h100).bytes_per_s == pytest.approx(0.8 * h100.intra_node_bytes_per_s)
    assert kv_link(l40s).bytes_per_s == pytest.approx(0.8 * l40s.pcie_bytes_per_s)
    with pytest.raises(ValueError, match="no NVLink"):
        kv_link(l40s, "nvlink")
    with pytest.raises(ValueError, match="unknown KV transfer link"):
        kv_link(h100, "carrier-pigeon")
    # network links are the same on every GPU; the override replaces the bandwidth (Gb/s -> bytes/s)
    assert kv_link(h100, "tcp") == kv_link(l40s, "tcp")
    rates = [kv_link(h100, kind).bytes_per_s for kind in ("tcp", "roce", "infiniband", "nvlink")]
    assert rates == sorted(rates)
    assert kv_link(h100, "roce", bandwidth_gbps=80).bytes_per_s == 10e9


@pytest.mark.parametrize("tp", [1, 2])
def test_pull_time_is_the_blocks_kv_bytes_over_the_link(tp):
    eng = make_engine(tensor_parallel_size=tp)
    model = eng.kv_transfer
    assert model.kv_bytes_per_token_per_rank == LLAMA8B_KV_BYTES_PER_TOKEN / tp   # each rank pulls its KV heads
    link = model.link
    blocks = 100
    expected = link.latency_s + blocks * 16 * LLAMA8B_KV_BYTES_PER_TOKEN / tp / link.bytes_per_s
    assert model.time_s(blocks) == pytest.approx(expected, rel=1e-12)
    assert model.time_s(0) == link.latency_s


def run_all(eng):
    """Step to the end; [first token time, finish reason, finish time] per request."""
    out: dict[str, list] = {}
    while (res := eng.step()) is not None:
        for ev in res.events:
            if ev.kind == FIRST_TOKEN:
                out.setdefault(ev.request_id, [None, None, None])[0] = res.end_s
            elif ev.kind == FINISHED:
                out.setdefault(ev.request_id, [None, None, None])[1:] = [ev.finish_reason, res.end_s]
    return out


def test_prefill_side_keeps_blocks_until_the_pull():
    eng = make_engine()
    free0 = eng.kv.num_free_blocks
    prompt = list(range(1000, 1000 + 1000))           # 1000 tokens: 63 blocks (62 full + 1 partial)
    eng.add_request("p", prompt, 1, hold_kv=True, ignore_eos=True)
    eng.add_request("plain", list(range(5000, 5300)), 1, ignore_eos=True)
    done = run_all(eng)
    assert done["p"][1] == "length" and done["plain"][1] == "length"
    held = eng.held_block_ids("p")
    assert held is not None and len(held) == math.ceil(1000 / 16)
    assert eng.held_block_ids("plain") is None          # no do_remote_decode: freed at finish
    assert eng.kv.pool.ref_cnt[held[0]] == 1
    assert eng.num_held == 1
    # a pull announced for later frees nothing before its time...
    t_pull = eng.now_s + 0.5
    assert eng.release_held("p", at_s=t_pull)
    eng.free_expired(t_pull - 0.1)
    assert eng.num_held == 1
    eng.free_expired(t_pull)
    assert eng.num_held == 0 and eng.kv.pool.ref_cnt[held[0]] == 0
    assert eng.kv.num_free_blocks == free0               # freed blocks stay as evictable prefix cache
    assert not eng.release_held("p")


def test_prefill_side_frees_unpulled_blocks_after_the_abort_timeout():
    eng = make_engine()
    eng.add_request("p", list(range(2000, 2500)), 1, hold_kv=True, ignore_eos=True)
    run_all(eng)
    finished_s = eng.now_s
    assert eng.num_held == 1 and eng.next_release_s() == pytest.approx(finished_s + NIXL_ABORT_REQUEST_TIMEOUT_S)
    eng.free_expired(finished_s + NIXL_ABORT_REQUEST_TIMEOUT_S - 1.0)
    assert eng.num_held == 1
    # a later arrival steps the engine past the timeout: the step frees the blocks first
    eng.add_request("later", [1, 2, 3, 4, 5], 2, ignore_eos=True, arrival_s=finished_s + NIXL_ABORT_REQUEST_TIMEOUT_S)
    run_all(eng)
    assert eng.num_held == 0 and eng.next_release_s() is None


def test_prefill_side_frees_at_once_when_the_request_did_not_hit_its_length():
    """vLLM delays the free only for a length-capped finish: an abort frees at once and returns no params."""
    eng = make_engine(max_num_batched_tokens=1024)
    free0 = eng.kv.num_free_blocks
    eng.add_request("p", list(range(3000, 6000)), 1, hold_kv=True, ignore_eos=True)
    eng.step()                                    # the first of three prefill chunks
    assert eng.kv.num_free_blocks < free0
    eng.abort("p")
    run_all(eng)
    assert eng.num_held == 0 and eng.kv.num_free_blocks == free0


def test_decode_side_pulls_then_computes_only_the_last_token():
    eng = make_engine()
    free0 = eng.kv.num_free_blocks
    plen = 1500
    arrival = 2.0
    eng.add_request("d", list(range(7000, 7000 + plen)), 8, remote_prefill=True, ignore_eos=True, arrival_s=arrival)
    done = run_all(eng)
    pull_s = eng.kv_transfer.time_s(math.ceil(plen / 16))
    _, first_step_s = eng.step_model.step(BatchShape((PrefillChunk(1, plen - 1, True),), 0, 0))
    assert done["d"][0] - arrival == pytest.approx(pull_s + first_step_s, rel=1e-9)
    assert eng.take_pulled() == [("d", pytest.approx(arrival + pull_s))]
    assert eng.num_pulls == 1 and eng.pull_s_total == pytest.approx(pull_s)
    assert done["d"][1] == "length" and eng.kv.num_free_blocks == free0      # decode side frees as usual
    # a local prefix hit is not pulled again: the same prompt pulls only the blocks it lacks
    eng.add_request("d2", list(range(7000, 7000 + plen)), 2, remote_prefill=True, ignore_eos=True)
    run_all(eng)
    assert eng.pull_s_total - pull_s == pytest.approx(eng.kv_transfer.time_s(math.ceil(plen / 16) - plen // 16))


def test_remote_prefill_is_faster_than_local_prefill():
    local, remote = make_engine(), make_engine()
    prompt = list(range(100, 4100))
    local.add_request("x", prompt, 2, ignore_eos=True)
    remote.add_request("x", prompt, 2, remote_prefill=True, ignore_eos=True)
    assert run_all(remote)["x"][0] < run_all(local)["x"][0]


def test_aborted_pull_frees_blocks_and_tells_the_prefill_side():
    eng = make_engine()
    eng.kv_transfer = dataclasses.replace(eng.kv_transfer, link=kv_link(profiles.load_hardware("h100"), "tcp"))
    free0 = eng.kv.num_free_blocks
    eng.add_request("d", list(range(9000, 11000)), 4, remote_prefill=True, ignore_eos=True)   # ~30 ms over TCP
    eng.add_request("other", [5, 6, 7], 30, ignore_eos=True)
    eng.step()                                    # the pull starts; "other" runs meanwhile
    assert eng.kv.num_free_blocks < free0 - 100
    assert eng.abort("d")
    assert [rid for rid, _ in eng.take_pulled()] == ["d"]
    run_all(eng)
    assert eng.kv.num_free_blocks == free0
    assert eng.take_pulled() == []


def test_pulls_wait_for_free_blocks_in_arrival_order():
    eng = make_engine(num_gpu_blocks_override=200, max_model_len=3200)
    free0 = eng.kv.num_free_blocks
    prompt_a, prompt_b = list(range(10, 2410)), list(range(20000, 22400))    # 150 blocks each: one fits at a time
    eng.add_request("a", prompt_a, 20, remote_prefill=True, ignore_eos=True)
    eng.add_request("b", prompt_b, 20, remote_prefill=True, ignore_eos=True)
    done = run_all(eng)
    pulled = dict(eng.take_pulled())
    assert done["a"][1] == done["b"][1] == "length"
    # b's pull starts only after a finished and freed its blocks
    assert pulled["a"] < done["a"][0] < done["a"][2] < pulled["b"] < done["b"][0]
    assert eng.kv.num_free_blocks == free0
