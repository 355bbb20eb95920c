"""/v1/responses over real HTTP with the openai SDK (``client.responses``): answers, the SSE event sequence,
function calls, storage (vLLM's env switch), background and cancel, and the simulated timing it shares with chat."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from kernelsight.server.runner import ServerThread  # noqa: E402

ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--time-scale", "20", "--served-model-name", "m",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--record-timings"]
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def srv():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        with ServerThread(ARGS) as s:
            yield s


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)


def test_text_response_and_retrieve(client, srv):
    r = client.responses.create(model="m", input="Say hello", instructions="be brief", max_output_tokens=12,
                                extra_body={"seed": 1})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # the same tokens a chat request with the same prompt and seed gets: one engine, one output draw
    chat = client.chat.completions.create(model="m", max_tokens=12, seed=1, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hello"}])
    assert chat.choices[0].message.content == r.output_text
    assert chat.usage.prompt_tokens == r.usage.input_tokens
    # the engine timed it like any request: 12 token release times recorded under its id
    assert len(srv.bridge.timings[r.id]["token_times_s"]) == 12
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text


def test_stream_event_sequence(client):
    events = list(client.responses.create(model="m", input="Say hello", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:-4] == ["response.output_text.delta"] * (len(types) - 8)
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text == events[-4].text
    assert events[-1].response.usage.output_tokens == 6


def test_function_call_round_trip(client):
    r = client.responses.create(model="m", input="Weather in Oslo?", tools=TOOLS)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema_rs.validate(TOOLS[0]["parameters"], json.loads(call.arguments))
    r2 = client.responses.create(model="m", previous_response_id=r.id, tools=TOOLS, max_output_tokens=8,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output[0].type == "message" and r2.output_text
    assert r2.usage.input_tokens > r.usage.input_tokens       # the stored turn is part of the prompt
    events = list(client.responses.create(model="m", input="Weather in Oslo?", tools=TOOLS, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}
    r = client.responses.create(model="m", input="x", text={"format": {"type": "json_schema", "name": "t",
                                                                       "schema": schema}})
    jsonschema_rs.validate(schema, json.loads(r.output_text))
    assert r.status == "completed"


def test_background_and_cancel(client, srv):
    b = client.responses.create(model="m", input="long story", background=True, max_output_tokens=1500)
    assert b.status == "queued"
    c = client.responses.cancel(b.id)
    assert c.status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(client.responses.create(model="m", input="hi", max_output_tokens=2).id)
    eng = srv.bridge.engine
    assert srv.call(lambda: eng.has_unfinished()) is False      # the cancelled generation was aborted


def test_errors(client):
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_nope' not found."):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id="resp_gone")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="other", input="x")


def test_without_store_nothing_is_kept(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE")
    with ServerThread(ARGS) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3})
        assert r.status_code == 200
        got = c.get(f"/v1/responses/{r.json()['id']}")
        assert got.status_code == 404 and got.json()["error"]["param"] == "response_id"
        bg = c.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})
        assert bg.status_code == 400 and "VLLM_ENABLE_RESPONSES_API_STORE=1" in bg.json()["error"]["message"]


def _named_events(text: str) -> list[dict]:
    out = []
    for e in text.split("\n\n"):
        if e:
            head, data = e.split("\n")
            obj = json.loads(data.removeprefix("data: "))
            assert obj["type"] == head.removeprefix("event: ")
            out.append(obj)
    return out


def test_background_stream_replays_from_a_sequence_number(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 5, "background": True,
                                          "stream": True})
        events = _named_events(r.text)
        assert events[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        rid = events[0]["response"]["id"]
        again = _named_events(c.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 2}).text)
        assert again == events[3:]
        assert c.get(f"/v1/responses/{rid}").json()["status"] in ("completed", "incomplete")
        plain = c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}).json()
        bad = c.get(f"/v1/responses/{plain['id']}", params={"stream": "true"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == f"Unknown response_id: {plain['id']}"
