"""``kernelsight serve --api-server-count N``: N API-server processes on one port in front of one engine process,
as vLLM runs them. Requests parsed in any API server reach the one engine (its /metrics counts them all), a seeded
request gives the same text and the same simulated token times as on a one-process server, the engine's routes
answer from every connection, sleep mode refuses generation in every API server, and SIGTERM stops them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from kernelsight.server.runner import ServerThread  # noqa: E402
from tests.conftest import free_port_run  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
FLAGS = ["--model", MODEL, "--hardware", "h100", "--max-model-len", "2048", "--num-gpu-blocks-override", "512",
         "--record-timings", "--seed", "7"]


def _serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kernelsight.server", *FLAGS, "--host", "127.0.0.1", "--deadline-spin-us", "0",
           "--uvicorn-log-level", "warning", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_ready(proc: subprocess.Popen, url: str, deadline_s: float = 120) -> None:
    """Healthy (the engine process answers through an API server) and accepting generation."""
    t_end = time.monotonic() + deadline_s
    with httpx.Client(timeout=2.0) as c:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < t_end, "not ready"
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


@pytest.fixture(scope="module")
def asc_server():
    port = free_port_run(1)
    proc = _serve("--port", str(port), "--api-server-count", "2", "--enable-sleep-mode",
                  env={"VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _seeded(client: httpx.Client, url: str, seed: int) -> dict:
    r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": [200 + seed] * 24, "max_tokens": 6,
                                                    "seed": seed, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_engine_process_and_n_api_servers_share_the_port(asc_server):
    proc, url = asc_server
    assert len(_children(proc.pid)) == 3          # the engine process and two API servers
    before = _metric(url, "vllm:generation_tokens_total")
    # separate connections: the kernel hands them to either API server; every request reaches the one engine
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda s: _seeded(httpx.Client(timeout=60), url, s), range(16)))
    assert all(o["usage"]["completion_tokens"] == 6 for o in outs)
    assert _metric(url, "vllm:generation_tokens_total") - before == 16 * 6


def test_a_seeded_request_matches_a_one_process_server(asc_server):
    _, url = asc_server
    with httpx.Client(timeout=60) as c:
        remote = _seeded(c, url, 3)
        timings = c.get(url + "/kernelsight/timings").json()["requests"][remote["id"]]
    with ServerThread(FLAGS) as srv, httpx.Client(timeout=60) as c:
        local_url = srv.base_url
        local = _seeded(c, local_url, 3)
        local_t = c.get(local_url + "/kernelsight/timings").json()["requests"][local["id"]]
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    assert remote["usage"] == local["usage"]
    # on an idle engine the same steps: equal simulated gaps between tokens; the first token after arrival differs
    # only by when the idle engine's clock picked the request up (wall time, in either server)
    gaps = lambda t: [round(b - a, 9) for a, b in zip(t["token_times_s"], t["token_times_s"][1:], strict=False)]  # noqa: E731
    assert gaps(timings) == gaps(local_t) and len(timings["token_times_s"]) == 6
    ttft = lambda t: t["token_times_s"][0] - t["arrival_s"]  # noqa: E731
    assert ttft(timings) == pytest.approx(ttft(local_t), abs=2e-3)


def test_a_stream_goes_out_whole_with_done(asc_server):
    _, url = asc_server
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_sleep_on_the_engine_refuses_generation_in_every_api_server(asc_server):
    _, url = asc_server
    with httpx.Client(timeout=30) as c:
        assert c.post(url + "/sleep?level=1").status_code == 200
        assert c.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        t_end = time.monotonic() + 10
        refused = 0
        while refused < 8:                       # both API servers learn it (a broadcast within ms)
            assert time.monotonic() < t_end, "an API server kept serving while the engine slept"
            with httpx.Client(timeout=30) as fresh:    # a new connection each: either API server
                r = fresh.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            refused = refused + 1 if r.status_code == 503 else 0
        assert c.post(url + "/wake_up").status_code == 200
        t_end = time.monotonic() + 10
        while True:
            with httpx.Client(timeout=30) as fresh:
                if fresh.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                              "max_tokens": 2}).status_code == 200:
                    break
            assert time.monotonic() < t_end


def test_sigterm_stops_the_engine_and_every_api_server(asc_server):
    proc, url = asc_server
    kids = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def test_unsupported_combinations_stop_with_one_line():
    proc = _serve("--port", str(free_port_run(2)), "--api-server-count", "2", "--replicas", "2")
    assert proc.wait(60) == 2
    err = proc.stderr.read().decode().strip().splitlines()
    assert err[-1] == ("kernelsight serve: error: not supported: --api-server-count with --replicas > 1 "
                       "(start one server per replica instead)")


def _per_engine(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out


def test_api_servers_balance_over_data_parallel_ranks():
    port = free_port_run(1)
    proc = _serve("--port", str(port), "--api-server-count", "2", "--data-parallel-size", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
        assert len(_children(proc.pid)) == 3          # still one engine process, holding both ranks
        # a pinned rank lands on that engine only
        with httpx.Client(timeout=60) as c:
            r = c.post(url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                       json={"model": MODEL, "prompt": [300] * 16, "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
        assert _per_engine(url, "vllm:generation_tokens_total") == {"0": 0.0, "1": 5.0}
        # concurrent requests from both API servers spread over both ranks (published counts + what each sent)
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda s: _seeded(httpx.Client(timeout=60), url, s), range(16)))
        assert all(o["usage"]["completion_tokens"] == 6 for o in outs)
        per = _per_engine(url, "vllm:generation_tokens_total")
        assert sum(per.values()) == 5 + 16 * 6 and min(per["0"], per["1"] - 5) >= 6
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
