"""Prefill/decode behind vllm-router (github.com/vllm-project/router, ``--vllm-pd-disaggregation``, its default
``--kv-connector nixl``): the router's exact request sequence, replayed over real HTTP against a prefill and a decode
kernelsight server.

What the router sends (src/routers/http/vllm_pd_router.rs, ``process_vllm_two_stage_request``; the request types in
src/protocols/spec.rs):

* It parses the client's body into its own request struct and re-serialises it, so the backends see the client's
  fields plus the struct's always-serialised defaults (``stream``, ``echo``, ``ignore_eos``, ``skip_special_tokens``,
  ``no_stop_trim``, ``return_hidden_states``, and for chat ``logprobs``, ``continue_final_message``,
  ``separate_reasoning``, ``stream_reasoning``, ``include_reasoning``). vLLM ignores the fields it does not know.
* Stage 1, to the prefill instance: ``max_tokens`` 1 (and ``max_completion_tokens`` 1 when the client set it),
  ``stream`` false, no ``stream_options``, ``kv_transfer_params`` ``{"do_remote_decode": true,
  "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
  "remote_port": null}``. Unlike vLLM's toy proxy it leaves ``min_tokens`` in place.
* Stage 2, to the decode instance: the client's request (as re-serialised) with the prefill answer's
  ``kv_transfer_params``; the decode answer is streamed back as it comes.
* Both stages carry the same headers: ``Content-Type: application/json``, ``Authorization: Bearer $OPENAI_API_KEY``
  (empty when unset) and ``X-Request-Id: ___prefill_addr_{P host:port}___decode_addr_{D host:port}_{uuid hex}``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator

import httpx
import pytest

NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
PLEN = 1000

# the router's serialisation defaults (spec.rs: #[serde(default)] / default_true fields without skip_serializing_if)
COMPLETION_DEFAULTS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                       "skip_special_tokens": True, "return_hidden_states": False}
CHAT_DEFAULTS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                 "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


def _hostport(url: str) -> str:
    return url.replace("http://", "").replace("https://", "")


def router_two_stage(client: httpx.Client, p_url: str, d_url: str, path: str, body: dict,
                     seen: list | None = None) -> Iterator[httpx.Response]:
    """vllm-router's two-stage dispatch, step for step: yields the decode response (open, streaming)."""
    defaults = CHAT_DEFAULTS if path.endswith("chat/completions") else COMPLETION_DEFAULTS
    request = {**defaults, **body}
    request_id = f"___prefill_addr_{_hostport(p_url)}___decode_addr_{_hostport(d_url)}_{uuid.uuid4().hex}"
    # with OPENAI_API_KEY unset the router sends "Bearer " (trailing space); a server receives it with the optional
    # whitespace stripped (RFC 9110 5.5), which is what is sent here (httpx refuses to send the trailing space)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer", "X-Request-Id": request_id}
    prefill = dict(request, max_tokens=1, stream=False)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                     "remote_port": None}
    r = client.post(p_url + path, content=json.dumps(prefill), headers=headers)
    assert r.status_code == 200, r.text          # the router turns anything else into a 500 for the client
    p_answer = r.json()
    decode = dict(request)
    if p_answer.get("kv_transfer_params") is not None:
        decode["kv_transfer_params"] = p_answer["kv_transfer_params"]
    if seen is not None:
        seen.extend([(prefill, p_answer), (decode, r.headers)])
    with client.stream("POST", d_url + path, content=json.dumps(decode), headers=headers) as d:
        yield d


@pytest.fixture(scope="module")
def pd():
    from kernelsight.server.runner import ServerThread

    common = ["--served-model-name", "m", "--max-model-len", "4096", "--time-scale", "50",
              "--enable-request-id-headers"]
    with ServerThread([*common, "--kv-transfer-config", NIXL]) as p, \
            ServerThread([*common, "--kv-transfer-config", NIXL, "--kv-transfer-link", "tcp"]) as d:
        yield p, d


def _engine(srv, fn):
    return srv.call(lambda: fn(srv.bridge.engine))


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    """Poll a state reached asynchronously (the decode side's HTTP notification) until it holds or time runs out."""
    import time
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 120000 + 1000 for i in range(PLEN)]


def test_streamed_completion_through_the_router_sequence_pulls_the_prefilled_kv(pd):
    p, d = pd
    p_free0, d_free0 = _engine(p, lambda e: e.kv.num_free_blocks), _engine(d, lambda e: e.kv.num_free_blocks)
    pulls0 = _engine(d, lambda e: e.num_pulls)
    body = {"model": "m", "prompt": _prompt(1), "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    seen: list = []
    with httpx.Client(timeout=30) as c:
        for resp in router_two_stage(c, p.base_url, d.base_url, "/v1/completions", body, seen):
            assert resp.status_code == 200
            assert resp.headers["x-request-id"].startswith("___prefill_addr_127.0.0.1:")
            events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    (prefill, p_answer), _ = seen
    # the prefill instance answered one token, non-streamed, and handed out NIXL's parameters for this engine
    assert (p_answer["usage"]["prompt_tokens"], p_answer["usage"]["completion_tokens"]) == (PLEN, 1)
    assert "stream_options" not in prefill and prefill["stream"] is False
    params = p_answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == p.port
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == math.ceil(PLEN / 16)
    # the decode instance pulled them instead of prefilling, streamed all six tokens and the usage chunk
    assert _engine(d, lambda e: e.num_pulls) == pulls0 + 1
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["usage"]["prompt_tokens"] == PLEN
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
    # the pull's notification freed the prefill side's blocks; the decode side freed its own at the finish
    assert _wait_for(lambda: _engine(p, lambda e: e.num_held) == 0)
    assert _wait_for(lambda: _engine(p, lambda e: e.kv.num_free_blocks) == p_free0)
    assert _wait_for(lambda: _engine(d, lambda e: e.kv.num_free_blocks) == d_free0)


def test_chat_with_max_completion_tokens_through_the_router_sequence(pd):
    p, d = pd
    pulls0 = _engine(d, lambda e: e.num_pulls)
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me a story " * 80}],
            "max_completion_tokens": 5, "ignore_eos": True}
    seen: list = []
    with httpx.Client(timeout=30) as c:
        for resp in router_two_stage(c, p.base_url, d.base_url, "/v1/chat/completions", body, seen):
            assert resp.status_code == 200
            answer = json.loads(resp.read())
    (prefill, p_answer), _ = seen
    assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1
    assert p_answer["usage"]["completion_tokens"] == 1
    assert p_answer["kv_transfer_params"]["remote_engine_id"] == p.call(lambda: p.bridge.kv_agent.engine_id)
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens"] == p_answer["usage"]["prompt_tokens"]
    assert answer["kv_transfer_params"] is None      # a decode-side finish hands nothing on
    assert _engine(d, lambda e: e.num_pulls) == pulls0 + 1
    assert _wait_for(lambda: _engine(p, lambda e: e.num_held) == 0)


def test_min_tokens_reaches_the_prefill_instance_and_is_refused_as_vllm_refuses_it(pd):
    """The router (unlike vLLM's toy proxy) keeps ``min_tokens`` in the max_tokens-1 prefill request: vLLM answers 400
    and nothing is held (the router then answers its client 500)."""
    p, _ = pd
    held0 = _engine(p, lambda e: e.num_held)
    body = {"model": "m", "prompt": _prompt(3), "max_tokens": 4, "min_tokens": 2}
    prefill = {**COMPLETION_DEFAULTS, **body, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    r = httpx.post(p.base_url + "/v1/completions", json=prefill, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens" and "min_tokens" in r.json()["error"]["message"]
    assert _engine(p, lambda e: e.num_held) == held0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_real_vllm_router_binary_drives_a_pull(pd, tmp_path):
    """The same through the router itself, when its binary is installed (``pip install vllm-router``; not a
    dependency of this project)."""
    import os
    import shutil
    import subprocess

    exe = os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router")
    if exe is None:
        pytest.skip("vllm-router is not installed")
    p, d = pd
    port = _free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen([exe, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.base_url,
                             "--decode", d.base_url, "--policy", "round_robin", "--intra-node-data-parallel-size",
                             "1", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                             str(_free_port())], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None          # stop waiting if it died
        assert _wait_for(ready, 60) and proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
        pulls0 = _engine(d, lambda e: e.num_pulls)
        body = {"model": "m", "prompt": _prompt(4), "max_tokens": 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[0]["id"].startswith("cmpl-___prefill_addr_127.0.0.1:")
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert _engine(d, lambda e: e.num_pulls) == pulls0 + 1
        assert _wait_for(lambda: _engine(p, lambda e: e.num_held) == 0)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
