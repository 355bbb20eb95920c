"""/v1/responses (OpenAI Responses API, as vLLM 0.33 serves it for a model without the Harmony format): the
request runs as a chat request on the same simulated engine, and its answer is converted to a response object, or
its stream to the Responses SSE events (``event: <type>`` / ``data: <json>``, numbered by ``sequence_number``).

Storage follows vLLM: only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` are responses kept (in memory, the newest
``STORE_LIMIT``), so that ``GET /v1/responses/{id}``, ``previous_response_id``, ``background`` and
``POST /v1/responses/{id}/cancel`` work; without it ``store`` is silently ignored and lookups answer 404."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.requests import Request as StarletteRequest

from kernelsight.server.engine.chat_relay import chat_chunks, chat_json, chat_request, chat_stream, passed_headers
from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import APIError, bad_request, sse_error_event, validation_error
from kernelsight.server.wire.jsonio import dumps, json_response
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.responses import (
    ResponsesRequest,
    chat_fields,
    output_as_messages,
    to_chat_messages,
)
from kernelsight.server.wire.sse import SSEResponse

router = APIRouter()

#: Stored responses kept (oldest dropped first), so a long soak with storage on does not grow without bound.
STORE_LIMIT = 10_000
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
STORE_UNSUPPORTED = ("`store=True` (default) is not supported. Please set `store=False` in Responses API or set "
                     "`VLLM_ENABLE_RESPONSES_API_STORE=1` in the env var when starting the vLLM server.")


class _Stored:
    __slots__ = ("body", "messages", "task", "events", "signal")

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.body = body
        self.messages = messages
        self.task: asyncio.Task | None = None
        self.events: list[str] | None = None        # a streamed background response's events, for replay
        self.signal = asyncio.Event()


def new_store() -> OrderedDict[str, _Stored] | None:
    """The app's response store, read from the environment when the app is built (as vLLM reads it at start)."""
    return OrderedDict() if os.environ.get(STORE_ENV, "").lower() in ("1", "true") else None


def _store(request: Request) -> OrderedDict[str, _Stored] | None:
    return getattr(request.app.state, "ks_responses", None)


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", "invalid_request_error", 404, "response_id")


def _hex() -> str:
    return uuid.uuid4().hex


def _usage(u: dict[str, Any] | None) -> dict[str, Any]:
    u = u or {}
    pt, ct = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": pt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": ct,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0}, "total_tokens": pt + ct}


def _envelope(rid: str, created: int, model: str, req: ResponsesRequest, output: list[dict[str, Any]],
              status: str, usage: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    if incomplete is not None and status == "completed":
        status = "incomplete"
    return {"id": rid, "created_at": created, "incomplete_details": incomplete, "instructions": req.instructions,
            "metadata": req.metadata, "model": model, "object": "response", "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature if req.temperature
            is not None else 1.0, "tool_choice": req.tool_choice, "tools": req.tools,
            "top_p": req.top_p if req.top_p is not None else 1.0, "background": req.background,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "previous_response_id": req.previous_response_id, "prompt": None, "reasoning": req.reasoning,
            "service_tier": req.service_tier, "status": status, "text": req.text or {"format": {"type": "text"}},
            "top_logprobs": req.top_logprobs, "truncation": req.truncation, "usage": usage, "user": req.user}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call: dict[str, Any], arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": arguments, "status": status}


def _output_of(chat: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    choice = chat["choices"][0]
    msg = choice["message"]
    out = []
    if msg.get("content"):
        out.append(_message_item(f"msg_{_hex()}", msg["content"]))
    for call in msg.get("tool_calls") or []:
        out.append(_call_item(f"fc_{_hex()}", call, call["function"]["arguments"]))
    return out, choice.get("finish_reason")


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state = server_state(request)
    req: ResponsesRequest = await parse_body(request, ResponsesRequest)
    store = _store(request)
    if req.background and (store is None or not req.store):
        raise APIError(STORE_UNSUPPORTED, "invalid_request_error", 400, "store")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id) if store is not None else None
        if prev is None:
            raise _not_found(req.previous_response_id)
        history = prev.messages + output_as_messages(prev.body["output"])
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + \
        to_chat_messages(req.input)
    rid = f"resp_{_hex()}"
    created = int(time.time())
    model = req.model or state.model_name
    fields = {**chat_fields(req), "messages": messages, "stream": bool(req.stream)}
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    chat_req = chat_request(fields)
    keep = store is not None and bool(req.store)
    if req.background and req.stream:
        return await _background_stream(state, request, req, chat_req, rid, created, model, messages, store)
    if req.background:
        return await _background(state, request, req, chat_req, rid, created, model, messages, store)
    if req.stream:
        resp = await chat_stream(state, request, chat_req, rid)
        if not isinstance(resp, SSEResponse):
            return resp
        events = _events(resp, req, rid, created, model, messages, store if keep else None)
        return SSEResponse(events, passed_headers(resp))
    chat = await chat_json(state, request, chat_req, rid)
    if isinstance(chat, Response):
        return chat
    output, finish = _output_of(chat)
    body = _envelope(rid, created, model, req, output, "completed", _usage(chat.get("usage")), finish)
    if keep:
        _put(store, rid, _Stored(body, messages))
    return json_response(body)


def _put(store: OrderedDict[str, _Stored], rid: str, item: _Stored) -> None:
    store[rid] = item
    while len(store) > STORE_LIMIT:
        store.popitem(last=False)


async def _never_disconnect() -> dict[str, Any]:
    await asyncio.Event().wait()      # a background response has no client connection to lose
    return {"type": "http.disconnect"}


async def _background(state: Any, request: Request, req: ResponsesRequest, chat_req: Any, rid: str, created: int,
                      model: str, messages: list[dict[str, Any]], store: OrderedDict[str, _Stored]) -> Response:
    """``background``: answer "queued" at once, generate on, and keep the result for ``GET``."""
    stored = _Stored(_envelope(rid, created, model, req, [], "queued", None), messages)
    _put(store, rid, stored)
    detached = StarletteRequest(dict(request.scope), _never_disconnect)

    async def run() -> None:
        stored.body["status"] = "in_progress"
        try:
            chat = await chat_json(state, detached, chat_req, rid)
        except APIError as exc:
            stored.body.update(status="failed", error={"code": str(exc.status), "message": exc.message})
            return
        if isinstance(chat, Response):
            stored.body["status"] = "failed"
            return
        output, finish = _output_of(chat)
        stored.body = _envelope(rid, created, model, req, output, "completed", _usage(chat.get("usage")), finish)

    stored.task = asyncio.create_task(run())
    return json_response(stored.body)


async def _background_stream(state: Any, request: Request, req: ResponsesRequest, chat_req: Any, rid: str,
                             created: int, model: str, messages: list[dict[str, Any]],
                             store: OrderedDict[str, _Stored]) -> Response:
    """``background`` with ``stream``: the events are generated on, kept, and streamed from the kept list (to this
    client, and to any ``GET ?stream=true&starting_after=N`` later)."""
    resp = await chat_stream(state, StarletteRequest(dict(request.scope), _never_disconnect), chat_req, rid)
    if not isinstance(resp, SSEResponse):
        return resp
    stored = _Stored(_envelope(rid, created, model, req, [], "queued", None), messages)
    stored.events = []
    _put(store, rid, stored)

    async def pump() -> None:
        stored.body["status"] = "in_progress"
        try:
            async for text in _events(resp, req, rid, created, model, messages, store):
                stored.events.append(text)
                stored.signal.set()
        finally:
            stored.signal.set()

    stored.task = asyncio.create_task(pump())
    return SSEResponse(_replay(stored, None), passed_headers(resp))


async def _replay(stored: _Stored, starting_after: int | None) -> AsyncIterator[str]:
    events = stored.events if stored.events is not None else []
    i = 0 if starting_after is None else starting_after + 1
    while True:
        while i < len(events):
            yield events[i]
            i += 1
        if stored.task is None or stored.task.done():
            return
        stored.signal.clear()
        if i == len(events):
            await stored.signal.wait()


def _query(request: Request) -> tuple[bool, int | None]:
    """``stream`` and ``starting_after`` read as FastAPI reads them, errors in vLLM's 400 validation shape (the
    app has no handler for FastAPI's own 422)."""
    q = request.query_params
    stream, after = q.get("stream"), q.get("starting_after")
    errs = []
    flag = False
    if stream is not None:
        low = stream.lower()
        if low in ("1", "true", "on", "yes", "t", "y"):
            flag = True
        elif low not in ("0", "false", "off", "no", "f", "n"):
            errs.append({"type": "bool_parsing", "loc": ("query", "stream"),
                         "msg": "Input should be a valid boolean, unable to interpret input", "input": stream})
    start = None
    if after is not None:
        try:
            start = int(after)
        except ValueError:
            errs.append({"type": "int_parsing", "loc": ("query", "starting_after"),
                         "msg": "Input should be a valid integer, unable to parse string as an integer",
                         "input": after})
    if errs:
        raise validation_error(errs)
    return flag, start


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    stream, starting_after = _query(request)
    store = _store(request)
    stored = store.get(response_id) if store is not None else None
    if stored is None:
        raise _not_found(response_id)
    if stream:
        if stored.events is None:
            raise bad_request(f"Unknown response_id: {response_id}", "response_id")
        return SSEResponse(_replay(stored, starting_after))
    return json_response(stored.body)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    store = _store(request)
    stored = store.get(response_id) if store is not None else None
    if stored is None:
        raise _not_found(response_id)
    if stored.body["status"] not in ("queued", "in_progress"):
        raise APIError("Cannot cancel a synchronous response.", "invalid_request_error", 400, "response_id")
    stored.body["status"] = "cancelled"
    if stored.task is not None:
        stored.task.cancel()          # aborts the engine request (its KV blocks are freed)
        try:
            await stored.task
        except asyncio.CancelledError:
            pass
        stored.body["status"] = "cancelled"
    return json_response(stored.body)


async def _events(resp: SSEResponse, req: ResponsesRequest, rid: str, created: int, model: str,
                  messages: list[dict[str, Any]], store: OrderedDict[str, _Stored] | None) -> AsyncIterator[str]:
    """The chat stream as the Responses events vLLM sends: created, in_progress, then per output item
    output_item.added (+ content_part.added), the deltas, their done events, and completed."""
    seq = 0

    def ev(obj: dict[str, Any]) -> str:
        nonlocal seq
        obj["sequence_number"] = seq
        seq += 1
        return f"event: {obj['type']}\ndata: {dumps(obj)}\n\n"

    head = _envelope(rid, created, model, req, [], "in_progress", None)
    yield ev({"type": "response.created", "response": head})
    yield ev({"type": "response.in_progress", "response": head})
    output: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None       # the message item being streamed: its index and text so far
    calls: dict[int, dict[str, Any]] = {}         # tool-call index -> its item being streamed
    finish = None
    usage = None
    async for chunk in chat_chunks(resp):
        if chunk is None:
            break
        if "error" in chunk:
            yield sse_error_event(APIError(chunk["error"]["message"], chunk["error"]["type"],
                                           chunk["error"]["code"]), compact=True)
            return
        if chunk.get("usage") and not chunk.get("choices"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if text_item is None:
                    text_item = {"index": len(output), "id": f"msg_{_hex()}", "text": ""}
                    output.append(text_item)
                    yield ev({"type": "response.output_item.added", "output_index": text_item["index"],
                              "item": _message_item(text_item["id"], "", "in_progress")})
                    yield ev({"type": "response.content_part.added", "output_index": text_item["index"],
                              "item_id": text_item["id"], "content_index": 0,
                              "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
                text_item["text"] += delta["content"]
                yield ev({"type": "response.output_text.delta", "output_index": text_item["index"],
                          "item_id": text_item["id"], "content_index": 0, "delta": delta["content"], "logprobs": []})
            for tc in delta.get("tool_calls") or []:
                call = calls.get(tc["index"])
                if call is None:
                    call = calls[tc["index"]] = {"index": len(output), "id": f"fc_{_hex()}", "call": tc,
                                                 "args": ""}
                    output.append(call)
                    yield ev({"type": "response.output_item.added", "output_index": call["index"],
                              "item": _call_item(call["id"], tc, "", "in_progress")})
                args = (tc.get("function") or {}).get("arguments") or ""
                if args:
                    call["args"] += args
                    yield ev({"type": "response.function_call_arguments.delta", "output_index": call["index"],
                              "item_id": call["id"], "delta": args})
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    items: list[dict[str, Any]] = []
    for o in output:
        if o is text_item:
            item = _message_item(o["id"], o["text"])
            yield ev({"type": "response.output_text.done", "output_index": o["index"], "item_id": o["id"],
                      "content_index": 0, "text": o["text"], "logprobs": []})
            yield ev({"type": "response.content_part.done", "output_index": o["index"], "item_id": o["id"],
                      "content_index": 0, "part": item["content"][0]})
        else:
            item = _call_item(o["id"], o["call"], o["args"])
            yield ev({"type": "response.function_call_arguments.done", "output_index": o["index"],
                      "item_id": o["id"], "name": item["name"], "arguments": o["args"]})
        items.append(item)
        yield ev({"type": "response.output_item.done", "output_index": o["index"], "item": item})
    body = _envelope(rid, created, model, req, items, "completed", _usage(usage), finish)
    if store is not None:
        kept = store.get(rid)
        if kept is not None:      # a background stream's entry: keep its events and task
            kept.body = body
        else:
            _put(store, rid, _Stored(body, messages))
    yield ev({"type": "response.completed", "response": body})
