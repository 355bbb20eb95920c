"""/v1/messages (Anthropic Messages API as vLLM serves it), /v1/chat/completions/batch and /invocations, over real
HTTP (httpx: the Anthropic shapes as a client reads them)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("fastapi")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from kernelsight.server.runner import ServerThread  # noqa: E402

ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--time-scale", "20", "--served-model-name", "m",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOLS = [{"name": "get_weather", "description": "weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as client:
        yield client


def _events(c: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    out = []
    with c.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for event in r.read().decode().split("\n\n"):
            if event:
                head, data = event.split("\n")
                name = head.removeprefix("event: ")
                obj = json.loads(data.removeprefix("data: "))
                assert obj["type"] == name
                out.append((name, obj))
    return out


def test_message_and_its_chat_equivalent(c):
    m = c.post("/v1/messages", json={"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "terse"}],
                                     "messages": HI, "temperature": 0}).json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["stop_reason"] == "max_tokens"
    assert set(m) == {"id", "type", "role", "content", "model", "stop_reason", "usage"}    # None fields left out
    (block,) = m["content"]
    assert block["type"] == "text" and m["usage"]["output_tokens"] == 9
    chat = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 9, "temperature": 0, "messages": [
        {"role": "system", "content": "terse"}, *HI]}).json()
    assert block["text"] == chat["choices"][0]["message"]["content"]
    assert m["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    count = c.post("/v1/messages/count_tokens", json={"model": "m", "system": "terse", "messages": HI}).json()
    assert count == {"input_tokens": m["usage"]["input_tokens"],
                     "context_management": {"original_input_tokens": m["usage"]["input_tokens"]}}


def test_stream_event_sequence(c):
    ev = _events(c, {"model": "m", "max_tokens": 5, "messages": HI})
    names = [n for n, _ in ev]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * 5 + [
        "content_block_stop", "message_delta", "message_stop"]
    start = ev[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert ev[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    assert all(o["delta"]["type"] == "text_delta" and o["index"] == 0 for n, o in ev if n == "content_block_delta")
    assert ev[-2][1]["delta"] == {"stop_reason": "max_tokens"} and ev[-2][1]["usage"]["output_tokens"] == 5


def test_tool_use(c):
    m = c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "messages": HI, "tools": TOOLS}).json()
    assert m["stop_reason"] == "tool_use"
    (use,) = m["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather"
    jsonschema_rs.validate(TOOLS[0]["input_schema"], use["input"])
    ev = _events(c, {"model": "m", "max_tokens": 200, "messages": HI, "tools": TOOLS,
                     "tool_choice": {"type": "tool", "name": "get_weather"}})
    start = next(o for n, o in ev if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = "".join(o["delta"]["partial_json"] for n, o in ev if n == "content_block_delta")
    jsonschema_rs.validate(TOOLS[0]["input_schema"], json.loads(partial))
    # the result goes back as a tool_result block: the model answers in text
    turn = [*HI, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}]
    m2 = c.post("/v1/messages", json={"model": "m", "max_tokens": 6, "messages": turn, "tools": TOOLS}).json()
    assert m2["content"][0]["type"] == "text"


def test_errors(c):
    r = c.post("/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": HI})
    assert r.status_code == 404
    assert r.json() == {"type": "error", "error": {"type": "NotFoundError",
                                                   "message": "The model `nope` does not exist. Valid aliases: m."}}
    r = c.post("/v1/messages", json={"model": "m", "messages": HI})        # validation: vLLM's usual 400
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 0, "messages": HI})
    assert r.status_code == 400 and "max_tokens must be positive" in r.json()["error"]["message"]


def test_chat_batch(c, srv):
    convs = [HI, [{"role": "user", "content": "a much longer question about many things"}]]
    r = c.post("/v1/chat/completions/batch", json={"model": "m", "max_tokens": 4, "messages": convs}).json()
    assert r["object"] == "chat.completion" and [ch["index"] for ch in r["choices"]] == [0, 1]
    singles = [c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": m}).json()
               for m in convs]
    assert r["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert r["usage"]["completion_tokens"] == 8
    bad = c.post("/v1/chat/completions/batch", json={"model": "m", "n": 2, "messages": convs})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    eng = srv.bridge.engine
    assert srv.call(lambda: eng.has_unfinished()) is False


def test_invocations(c):
    assert c.post("/invocations", json={"model": "m", "messages": HI, "max_tokens": 2}).json()["object"] == \
        "chat.completion"
    assert c.post("/invocations", json={"model": "m", "prompt": "hi", "max_tokens": 2}).json()["object"] == \
        "text_completion"
    r = c.post("/invocations", json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']")
    # a generative model has no pooling routes: FastAPI's 404, as vLLM 0.33
    assert c.post("/v1/embeddings", json={"model": "m", "input": "x"}).json() == {"detail": "Not Found"}


def _idle(srv) -> bool:
    eng = srv.bridge.engine
    free, unfinished = srv.call(lambda: (eng.kv.num_free_blocks, eng.has_unfinished()))
    return not unfinished and free == srv.config.num_gpu_blocks - 1


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 1500, "messages": HI, "stream": True}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 1500, "input": "hi", "stream": True}),
])
def test_client_leaving_a_converted_stream_frees_its_blocks(srv, path, body):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c, c.stream("POST", path, json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("event: ") for line in got)
        assert not _idle(srv)           # still generating when the client goes
    # the abort reaches the engine through the closed converter: wait for it (bounded), then no block is held
    deadline = time.monotonic() + 20
    while not _idle(srv) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _idle(srv)
