"""``kernelsight serve -dp N``: N engines behind one front end, labelled engine="0".."N-1" in /metrics and balanced
least-loaded; ``--data-parallel-rank R`` serves rank R alone."""

from __future__ import annotations

import re

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.runner import ServerThread  # noqa: E402

ARGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--num-gpu-blocks-override", "600", "--time-scale", "20"]


def _success_by_engine(metrics: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$', metrics, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
        out[engine] = out.get(engine, 0.0) + float(m.group(2))
    return out


def test_two_engines_are_labelled_and_both_serve():
    with ServerThread(["-dp", "2", *ARGS]) as srv:
        assert len(srv.state.bridges) == 2
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            body = {"model": "meta-llama/Llama-3.1-8B", "prompt": "hello there", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            # a long stream holds engine 0 busy (named by header); the next request goes to the idle engine 1
            with c.stream("POST", "/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}) as r:
                lines = r.iter_lines()
                next(lines)
                e0, e1 = (b.engine for b in srv.state.bridges)
                assert srv.call(lambda: (e0.num_running + e0.num_waiting, e1.num_running)) == (1, 0)
                short = c.post("/v1/completions", json={**body, "max_tokens": 3, "stream": False})
                assert short.status_code == 200
                for _ in lines:
                    pass
            metrics = c.get("/metrics").text
    assert 'engine="0"' in metrics and 'engine="1"' in metrics
    assert _success_by_engine(metrics) == {"0": 1.0, "1": 1.0}


def test_one_rank_per_process_is_labelled_with_its_rank():
    with ServerThread(["-dp", "2", "--data-parallel-rank", "1", *ARGS]) as srv:
        assert len(srv.state.bridges) == 1
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/v1/completions", json={"model": "meta-llama/Llama-3.1-8B", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            metrics = c.get("/metrics").text
    assert 'engine="1"' in metrics and 'engine="0"' not in metrics
    assert _success_by_engine(metrics) == {"1": 1.0}
