"""Speculative decoding over HTTP: accepted tokens arrive in bursts (one SSE chunk per step), /metrics counts drafts."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
# every draft accepted: each decode step yields 1 + 3 tokens
SPEC = {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [1.0, 1.0, 1.0]}
ARGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--num-gpu-blocks-override", "600",
        "--speculative-config", json.dumps(SPEC), MODEL]


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


async def test_stream_delivers_accepted_tokens_in_bursts_and_metrics_count_them(srv):
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as c:
        m0 = (await c.get("/metrics")).text
        for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total"):
            assert f'{name}{{engine="0",model_name="{MODEL}"}} 0.0' in m0, name
        for pos in range(3):
            assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{MODEL}",'
                    f'position="{pos}"}} 0.0') in m0
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 13, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200
        chunks = [json.loads(p[len("data: "):]) for p in r.text.split("\n\n") if p.startswith("data: {")]
        texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
        # synthetic tokens are " word" each: a chunk's token count is its number of spaces
        assert [t.count(" ") for t in texts] == [1, 4, 4, 4]
        assert chunks[-1]["usage"]["completion_tokens"] == 13
        m1 = (await c.get("/metrics")).text
    assert _metric(m1, "vllm:spec_decode_num_drafts_total") == 3
    assert _metric(m1, "vllm:spec_decode_num_draft_tokens_total") == 9
    assert _metric(m1, "vllm:spec_decode_num_accepted_tokens_total") == 9
    for pos in range(3):
        assert _metric(m1, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == 3
    assert _metric(m1, "vllm:generation_tokens_total") == 13
