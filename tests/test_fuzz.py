"""Property-based fuzzing of every route in the server's own OpenAPI schema (schemathesis on hypothesis): bodies
that fit the request models and bodies that do not, sent over HTTP to a live server. Every answer: no 5xx, every
4xx in vLLM's error shape with its status as ``code``, and the engine idle with no KV block leaked afterwards.
The default run draws a bounded number of cases per route; the ``slow`` one many more
(``benchmarks/reliability.py`` runs it at full size)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

import hypothesis  # noqa: E402
import requests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
# a short context and a fast clock: a fuzzed max_tokens or n costs at most 256 tokens per choice, quickly
ARGS = ["--max-model-len", "256", "--seed", "0", "--time-scale", "1000", "--num-gpu-blocks-override", "2000",
        "--served-model-name", MODEL]
# vLLM's 4xx answers: the nested error body (wire contract §3.4), except FastAPI's routing answers
ROUTING = {404: {"detail": "Not Found"}, 405: {"detail": "Method Not Allowed"}}


@pytest.fixture(scope="module")
def fuzz_srv():
    with ServerThread(ARGS) as s:
        yield s


#: The streams of named events (Responses API, Anthropic Messages) and the event that ends each.
NAMED_EVENT_STREAMS = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}


def check_response(status: int, body: bytes, content_type: str, path: str = "") -> str | None:
    """What is wrong with one answer (None: nothing). Shared reading of the wire contract's error rules."""
    if status >= 500:
        return f"{status} server error: {body[:300]!r}"
    if status < 400:
        if content_type.startswith("text/event-stream") and path in NAMED_EVENT_STREAMS:
            return _named_stream_problem(body.decode(), NAMED_EVENT_STREAMS[path])
        if content_type.startswith("text/event-stream"):
            text = body.decode()
            if not text.endswith("data: [DONE]\n\n"):
                return f"stream not ended by [DONE]: {text[-200:]!r}"
            for event in text.split("\n\n")[:-2]:
                if not event.startswith("data: "):
                    return f"not an SSE data event: {event[:200]!r}"
                obj = json.loads(event[len("data: "):])
                if "error" in obj and not _error_shape_ok(obj, None):
                    return f"in-stream error not in vLLM's shape: {obj}"
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return f"{status} body is not JSON: {body[:200]!r}"
    if status in ROUTING and obj == ROUTING[status]:
        return None
    if path.startswith("/v1/messages") and _anthropic_error_ok(obj):
        return None       # vLLM answers the Messages API's handler errors in Anthropic's shape
    if not _error_shape_ok(obj, status):
        return f"{status} body not in vLLM's error shape: {str(obj)[:300]}"
    return None


def _named_stream_problem(text: str, last: str) -> str | None:
    """``event: <type>`` / ``data: <json>`` events, each data's ``type`` its event's, ended by ``last``."""
    events = [e for e in text.split("\n\n") if e]
    for e in events:
        head, _, data = e.partition("\n")
        if not head.startswith("event: ") or not data.startswith("data: "):
            return f"not a named SSE event: {e[:200]!r}"
        if json.loads(data[len("data: "):]).get("type") != head[len("event: "):]:
            return f"event name and data type differ: {e[:200]!r}"
    if not events or not events[-1].startswith(f"event: {last}\n"):
        return f"stream not ended by {last}: {text[-200:]!r}"
    return None


def _anthropic_error_ok(obj: Any) -> bool:
    return (isinstance(obj, dict) and obj.get("type") == "error" and isinstance(obj.get("error"), dict)
            and isinstance(obj["error"].get("type"), str) and isinstance(obj["error"].get("message"), str))


def _error_shape_ok(obj: Any, status: int | None) -> bool:
    if not isinstance(obj, dict) or list(obj) != ["error"] or not isinstance(obj["error"], dict):
        return False
    e = obj["error"]
    return (list(e) == ["message", "type", "param", "code"] and isinstance(e["message"], str) and bool(e["message"])
            and isinstance(e["type"], str) and (e["param"] is None or isinstance(e["param"], str))
            and (status is None or e["code"] == status))


# The request models accept anything of the right JSON type (as vLLM's do): drawn from them, nearly every body
# fails a semantic check (n < 1, top_p > 1, no prompt, ...) and never reaches the engine. Bounds a client meant
# to keep, laid over the schema, make "reaching" bodies that run generations, streams, logprobs and stops.
_SAMPLING = {
    "n": {"type": "integer", "minimum": 1, "maximum": 3},
    "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 48}, {"type": "null"}]},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 4},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 50},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3},
                       {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "maxItems": 3}]},
    "stream": {"type": "boolean"},
    "ignore_eos": {"type": "boolean"},
    "seed": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2**31}, {"type": "null"}]},
    "priority": {"type": "integer", "minimum": -5, "maximum": 5},
    "stream_options": {"type": "null"},
}
_MESSAGE = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": ["user", "assistant"]}, "content": {"type": "string", "maxLength": 200}}}
REACHING = {
    "CompletionRequest": {**_SAMPLING,
                          "prompt": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 200},
                                               {"type": "array", "minItems": 1, "maxItems": 64,
                                                "items": {"type": "integer", "minimum": 0, "maximum": 128_000}}]},
                          "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
                          "echo": {"type": "boolean"}},
    "ChatCompletionRequest": {**_SAMPLING,
                              "messages": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                                  "type": "object", "required": ["role", "content"], "additionalProperties": False,
                                  "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                                 "content": {"type": "string", "maxLength": 200}}}},
                              "max_completion_tokens": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 48},
                                                                  {"type": "null"}]},
                              "logprobs": {"type": "boolean"},
                              "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5}},
    "ResponsesRequest": {"input": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 200},
                                             {"type": "array", "minItems": 1, "maxItems": 3, "items": _MESSAGE}]},
                         "instructions": {"anyOf": [{"type": "string", "maxLength": 100}, {"type": "null"}]},
                         "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 48},
                         "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                         "stream": {"type": "boolean"}, "seed": _SAMPLING["seed"]},
    "AnthropicMessagesRequest": {"messages": {"type": "array", "minItems": 1, "maxItems": 3, "items": _MESSAGE},
                                 "max_tokens": {"type": "integer", "minimum": 1, "maximum": 48},
                                 "system": {"type": "string", "maxLength": 100},
                                 "stop_sequences": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "string", "minLength": 1, "maxLength": 3}},
                                 "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                                 "top_k": _SAMPLING["top_k"], "stream": {"type": "boolean"}},
}


def reaching(raw: dict[str, Any]) -> dict[str, Any]:
    """The server's schema with the body models narrowed to ``REACHING``'s fields (required, no others)."""
    out = json.loads(json.dumps(raw))
    for name, props in REACHING.items():
        model = out["components"]["schemas"][name]
        model["properties"] = {"model": {"const": MODEL}, **props}
        model["required"] = [k for k in ("prompt", "messages", "input") if k in props]
        if name == "AnthropicMessagesRequest":
            model["required"] += ["model", "max_tokens"]       # required by the Messages API itself
        model["additionalProperties"] = False
    return out


def operations(base_url: str, narrowed: bool = False) -> list[tuple[str, Any]]:
    raw = httpx.get(base_url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(reaching(raw) if narrowed else raw)
    ops = []
    for result in schema.get_all_operations():
        op = result.ok()
        ops.append((f"{op.method.upper()} {op.path}", op))
    return ops


def _served_model(case: Any) -> Any:
    """A valid body names the served model: a random name is always the same 404, and nothing would run."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def has_inputs(op: Any) -> bool:
    """Whether the route has an input that can be drawn invalid (a string path parameter, such as a response id,
    cannot: every string is one)."""
    return bool(len(op.body) or len(op.query) or len(op.headers))


def fuzz_operation(base_url: str, op: Any, mode: GenerationMode, max_examples: int, seed: int) -> dict[str, int]:
    """Send ``max_examples`` cases of ``op`` drawn in ``mode``; fail on the first bad answer. Returns counts."""
    counts = {"cases": 0, "2xx": 0, "4xx": 0, "5xx": 0}
    session = requests.Session()

    @hypothesis.seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode).map(_served_model if mode == GenerationMode.POSITIVE else
                                                        (lambda c: c)))
    def run(case):
        # sent by requests itself: schemathesis' own call stops reading an event stream after 20 events
        r = session.request(**case.as_transport_kwargs(base_url=base_url), timeout=60)
        counts["cases"] += 1
        key = f"{r.status_code // 100}xx"
        counts[key] = counts.get(key, 0) + 1
        problem = check_response(r.status_code, r.content, r.headers.get("content-type", ""), case.path)
        assert problem is None, f"{case.method} {case.path} body={str(case.body)[:300]}: {problem}"

    try:
        run()
    finally:
        session.close()
    return counts


def assert_engine_idle(s: ServerThread) -> None:
    eng = s.bridge.engine
    free, unfinished = s.call(lambda: (eng.kv.num_free_blocks, eng.has_unfinished()))
    assert not unfinished
    assert free == s.config.num_gpu_blocks - 1, "KV blocks leaked (free != total - the null block)"


def test_schema_documents_request_bodies(fuzz_srv):
    """Without request bodies in /openapi.json the fuzzer would only send empty posts: the body routes name
    their request model, as vLLM's schema does."""
    raw = httpx.get(fuzz_srv.base_url + "/openapi.json").json()
    bodies = {p: ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
              for p, ops in raw["paths"].items() if "post" in ops and "requestBody" in ops["post"]}
    assert bodies == {"/tokenize": "#/components/schemas/TokenizeRequest",
                      "/detokenize": "#/components/schemas/DetokenizeRequest",
                      "/v1/completions": "#/components/schemas/CompletionRequest",
                      "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
                      "/v1/chat/completions/batch": "#/components/schemas/BatchChatCompletionRequest",
                      "/v1/responses": "#/components/schemas/ResponsesRequest",
                      "/v1/messages": "#/components/schemas/AnthropicMessagesRequest",
                      "/v1/messages/count_tokens": "#/components/schemas/AnthropicCountTokensRequest"}
    assert "prompt" in raw["components"]["schemas"]["CompletionRequest"]["properties"]


def fuzz_all(base_url: str, examples: int) -> dict[str, int]:
    """Every route of the server's schema, valid and invalid bodies, then the body routes with reaching bodies."""
    total = {"cases": 0, "2xx": 0, "4xx": 0, "5xx": 0}
    runs = []
    for i, (_, op) in enumerate(operations(base_url)):
        # a route without a body or parameters has no invalid input to draw
        runs.append((op, GenerationMode.POSITIVE, i))
        if has_inputs(op):
            runs.append((op, GenerationMode.NEGATIVE, i))
    for i, (_, op) in enumerate(operations(base_url, narrowed=True)):
        if op.method.upper() == "POST" and op.path in ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                                                       "/v1/messages"):
            runs.append((op, GenerationMode.POSITIVE, 100 + i))
    for op, mode, seed in runs:
        for k, v in fuzz_operation(base_url, op, mode, examples, seed).items():
            total[k] = total.get(k, 0) + v
    return total


@pytest.mark.parametrize("examples", [pytest.param(8, id="quick"),
                                      pytest.param(120, id="full", marks=pytest.mark.slow)])
def test_fuzz_every_route(fuzz_srv, examples):
    names = {name for name, _ in operations(fuzz_srv.base_url)}
    assert names >= {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
                     "GET /v1/models", "GET /health"}
    total = fuzz_all(fuzz_srv.base_url, examples)
    # every body route drew `examples` cases per mode (a route without inputs has one case to draw)
    assert total["cases"] >= 8 * examples, total
    assert total["4xx"] >= examples, ("invalid bodies never drew an error", total)
    assert total["2xx"] >= examples, ("no fuzzed body reached the engine", total)
    assert total["5xx"] == 0
    assert_engine_idle(fuzz_srv)


@pytest.mark.slow
def test_fuzz_embedding_model_routes():
    """An embedding model's routes (--runner pooling) under the same rules: no 5xx, vLLM's error shapes, idle."""
    with ServerThread([*ARGS, "--runner", "pooling"]) as s:
        total = {"cases": 0, "4xx": 0, "5xx": 0}
        for i, (_, op) in enumerate(operations(s.base_url)):
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_inputs(op) else [])
            for mode in modes:
                for k, v in fuzz_operation(s.base_url, op, mode, 40, 200 + i).items():
                    total[k] = total.get(k, 0) + v
        assert total["5xx"] == 0 and total["4xx"] > 0, total
        assert_engine_idle(s)
