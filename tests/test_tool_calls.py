"""Tool calls and structured outputs over real HTTP: the openai SDK parses them, the JSON validates against the
request's schema, vLLM's errors, and the timing follows the output's real token count."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from kernelsight.server.runner import ServerThread  # noqa: E402
from kernelsight.server.structured import instance_of  # noqa: E402

ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--time-scale", "20", "--served-model-name", "m"]
WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    with ServerThread([*ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as s:
        yield s


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)


def test_named_tool_call_parses_and_validates(client, srv):
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=7,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"           # vLLM: a named tool choice is guided JSON, not a parsed call
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    jsonschema_rs.validate(WEATHER, args)
    # the timing is the emitted text's: its token count is what the engine generated
    assert r.usage.completion_tokens == len(srv.state.tok.encode(call.function.arguments, False))


def test_auto_calls_a_tool_then_answers_its_result(client):
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=3)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (call,) = r.choices[0].message.tool_calls
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema_rs.validate(schema, json.loads(call.function.arguments))
    follow = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="m", messages=follow, tools=TOOLS, max_tokens=12)
    assert not r2.choices[0].message.tool_calls and r2.choices[0].message.content


def test_required_streams_arguments_in_vllm_deltas(client):
    stream = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                            stream=True, seed=5)
    first, args, finish = None, "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if first is None:
                    first = tc
                else:         # later deltas carry only the index and an arguments piece
                    assert tc.id is None and tc.function.name is None and tc.index == 0
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert first is not None and first.id and first.type == "function" and first.index == 0
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == first.function.name)
    jsonschema_rs.validate(schema, json.loads(args))
    assert finish == "tool_calls"


def test_json_schema_response_format_validates_and_repeats_with_seed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    texts = [client.chat.completions.create(model="m", messages=USER, response_format=fmt, seed=11,
                                            ).choices[0].message.content for _ in range(2)]
    jsonschema_rs.validate(WEATHER, json.loads(texts[0]))
    assert texts[0] == texts[1]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=USER, response_format=fmt, seed=11, stream=True) if c.choices)
    assert streamed == texts[0]
    obj = client.chat.completions.create(model="m", messages=USER, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def _successes(c: httpx.Client, reason: str) -> float:
    prefix = "vllm:request_success_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in c.get("/metrics").text.splitlines()
               if line.startswith(prefix) and f'finished_reason="{reason}"' in line)


def test_structured_outputs_and_truncation(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        before = _successes(c, "stop")
        r = c.post("/v1/completions", json={"model": "m", "prompt": "pick", "max_tokens": 50,
                                            "structured_outputs": {"choice": ["yes", "no", "maybe"]}}).json()
        assert r["choices"][0]["text"] in ("yes", "no", "maybe") and r["choices"][0]["finish_reason"] == "stop"
        assert _successes(c, "stop") == before + 1       # the engine finished it at its EOS, as /metrics counts
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 3,
                                                 "structured_outputs": {"json": WEATHER}}).json()
        # cut by max_tokens: vLLM returns the partial text with finish_reason "length"
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,message,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    ({"tools": []}, "`tools` must not be an empty array.", "tools"),
    ({"response_format": {"type": "json_schema"}}, "the 'json_schema' field must be provided", "response_format"),
    ({"structured_outputs": {"json": {}, "choice": ["a"]}}, "You can only use one kind of constraints", None),
])
def test_vllm_request_errors(srv, body, message, param):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param


def test_auto_needs_the_parser_flags():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        ServerThread([*ARGS, "--enable-auto-tool-choice"])          # refused at start, as vLLM
    with ServerThread(ARGS) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": TOOLS})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                "--tool-call-parser to be set")
        named = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": TOOLS,
                                                     "tool_choice": "required"})
        assert named.status_code == 200


@pytest.mark.parametrize("seed", range(12))
def test_instance_of_validates_against_varied_schemas(seed):
    schema = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0,
                                                                         "maximum": 1}}, "required": ["x"]}},
              "type": "object", "required": ["tags", "pt", "when", "n", "maybe", "mix"],
              "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2,
                                      "maxItems": 4, "uniqueItems": True},
                             "pt": {"$ref": "#/$defs/point"}, "when": {"type": "string", "format": "date-time"},
                             "n": {"type": "integer", "minimum": -3, "maximum": 9, "multipleOf": 3},
                             "maybe": {"type": ["string", "null"]},
                             "mix": {"anyOf": [{"type": "boolean"}, {"type": "integer"}]},
                             "all": {"allOf": [{"properties": {"a": {"const": 1}}, "required": ["a"]},
                                               {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}}}
    value = instance_of(schema, seed)
    jsonschema_rs.validate(schema, value)
    assert value == instance_of(schema, seed)
