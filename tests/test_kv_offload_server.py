"""KV offloading over HTTP: on a server with a small GPU cache, a prompt evicted from the GPU comes back from the CPU
tier (cached_tokens covering it, a shorter simulated TTFT than recomputing it), /metrics counts the copies, and KV
events announce the CPU tier's blocks with medium "CPU"."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from kernelsight.server.runner import ServerThread  # noqa: E402
from tests.test_kv_events import Subscriber, _free_port  # noqa: E402

PROMPT = 321            # 20 full blocks of 16 and one token
BASE = ["--num-gpu-blocks-override", "48", "--max-model-len", "512", "--max-num-seqs", "4", "--time-scale", "50",
        "--served-model-name", "m", "--enable-prompt-tokens-details"]


def _prompt(i: int) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + PROMPT))


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _ttft_sum(c: httpx.Client) -> float:
    return _metric(c.get("/metrics").text, "vllm:time_to_first_token_seconds_sum")


def _cached_and_ttft(c: httpx.Client, prompt: list[int]) -> tuple[int, float]:
    """The request's cached_tokens and its simulated TTFT (the TTFT histogram's sum grows by it)."""
    before = _ttft_sum(c)
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], _ttft_sum(c) - before


def _evict_and_return(c: httpx.Client) -> tuple[tuple[int, float], tuple[int, float]]:
    first = _cached_and_ttft(c, _prompt(0))
    for i in range(1, 4):                   # 3 × 21 blocks through a 47-block GPU cache: prompt 0 is evicted
        _cached_and_ttft(c, _prompt(i))
    return first, _cached_and_ttft(c, _prompt(0))


def test_evicted_prompt_is_loaded_from_cpu_not_recomputed(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with ServerThread(BASE) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        (cold, cold_ttft), (again, again_ttft) = _evict_and_return(c)
        assert cold == 0 and again == 0                  # without offloading: recomputed
        assert "vllm:kv_offload_total_bytes" not in c.get("/metrics").text
    with ServerThread([*BASE, "--kv-offloading-size", "1"]) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as c:
        (cold2, cold2_ttft), (hit, hit_ttft) = _evict_and_return(c)
        assert cold2 == 0 and hit == PROMPT - 1          # the 20 offloaded blocks
        assert cold2_ttft == pytest.approx(cold_ttft)    # stores do not slow the step that computes the blocks
        # loading 20 blocks (40 MiB over PCIe, under a millisecond) and computing one token beats recomputing 320
        assert hit_ttft < again_ttft - 0.001
        text = c.get("/metrics").text
        block = 16 * 131072                              # Llama-3.1-8B bf16: 128 KiB per token
        assert _metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 4 * 20 * block
        assert _metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 20 * block
        assert _metric(text, "vllm:kv_offload_total_time_total", transfer_type="CPU_to_GPU") > 0
        assert _metric(text, "vllm:kv_offload_size_count", transfer_type="GPU_to_CPU") == 4
        # each store is one prompt's 20 blocks (40 MiB): in the 60 MB bucket, as prometheus_client writes its bounds
        assert _metric(text, "vllm:kv_offload_size_bucket", transfer_type="GPU_to_CPU", le="4e+07") == 0
        assert _metric(text, "vllm:kv_offload_size_bucket", transfer_type="GPU_to_CPU", le="6e+07") == 4
        assert _metric(text, "vllm:external_prefix_cache_queries_total") == 5 * PROMPT
        assert _metric(text, "vllm:external_prefix_cache_hits_total") == PROMPT - 1
        # the GPU's prefix cache saw no hit (the hit was the CPU tier's)
        assert _metric(text, "vllm:prefix_cache_hits_total") == 0
        assert re.search(r'vllm:cache_config_info\{[^}]*kv_offloading_backend="native"', text)
        # vLLM's reset with reset_external empties the CPU tier too: the prompt is recomputed
        assert c.post("/reset_prefix_cache", params={"reset_external": "true"}).json() == {"success": True}
        assert _cached_and_ttft(c, _prompt(0))[0] == 0


def test_kv_events_carry_medium_cpu(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    pub, replay = _free_port(), _free_port()
    events_cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    # the same tier through vLLM's connector config; 50 MiB hold 25 blocks: the CPU tier evicts too
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 50 * 2**20}}
    argv = [*BASE, "--kv-events-config", json.dumps(events_cfg), "--kv-transfer-config", json.dumps(transfer)]
    with ServerThread(argv) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        sub = Subscriber(zmq.Context.instance(), f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        try:
            _evict_and_return(c)
            sub.drain(until_seq=0)
            sub.batches.update(sub.replay_from(0))
            evs = sub.events()
        finally:
            sub.sub.close(0)
            sub.replay.close(0)
    gpu_stored = {h for e in evs if e["type"] == "BlockStored" and e["medium"] == "GPU" for h in e["block_hashes"]}
    cpu_stored = [e for e in evs if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    cpu_removed = [e for e in evs if e["type"] == "BlockRemoved" and e["medium"] == "CPU"]
    assert cpu_stored and cpu_removed
    # as vLLM's connector writes them: hashes only, the GPU's hashes of the same blocks
    assert all(e["parent_block_hash"] is None and e["token_ids"] == [] and e["block_size"] == 16
               and e["lora_id"] is None and "group_idx" not in e for e in cpu_stored)
    stored = {h for e in cpu_stored for h in e["block_hashes"]}
    assert stored <= gpu_stored
    assert {h for e in cpu_removed for h in e["block_hashes"]} <= stored
    assert all(set(e) == {"type", "block_hashes", "medium"} for e in cpu_removed)


def test_kv_transfer_config_and_flags_combine_as_vllm():
    from kernelsight.server.integrations.kv_transfer import parse_kv_transfer_config
    from kernelsight.server.launch import offload_engine_args
    from kernelsight.simcore.engine_config import EngineArgs

    off = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                               "kv_connector_extra_config": {"cpu_bytes_to_use": 2**31,
                                                                             "block_size": 32}}))
    args = offload_engine_args(EngineArgs(), off)
    assert (args.kv_offloading_size_gib, args.kv_offloading_backend, args.kv_offloading_block_size) == (2.0, "native",
                                                                                                       32)
    # --kv-offloading-size takes the connector over (its size wins; the native connector keeps the block size)
    args = offload_engine_args(EngineArgs(kv_offloading_size_gib=8.0), off)
    assert (args.kv_offloading_size_gib, args.kv_offloading_block_size) == (8.0, 32)
    nixl = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert offload_engine_args(EngineArgs(), nixl) == EngineArgs()
    with pytest.raises(ValueError, match="MultiConnector"):
        offload_engine_args(EngineArgs(kv_offloading_size_gib=8.0), nixl)
