"""/v1/messages and /v1/messages/count_tokens (the Anthropic Messages API as vLLM 0.33 serves it): the request
runs as a chat request on the same simulated engine, its answer converted to a message, its stream to Anthropic's
events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``)
with vLLM's JSON (unset fields left out). Handler errors use Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, with vLLM's status and error type; a body that fails
validation gets vLLM's usual 400, as its FastAPI handler answers it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.engine.chat_relay import chat_chunks, chat_json, chat_request, chat_stream, passed_headers
from kernelsight.server.model.media import expand_chat_media, split_chat_media
from kernelsight.server.model.prompts import encode_prompt
from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import APIError
from kernelsight.server.wire.jsonio import dumps, json_response
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.anthropic import (
    STOP_REASONS,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    chat_fields,
)
from kernelsight.server.wire.sse import SSEResponse

router = APIRouter()


def anthropic_error(err: APIError) -> Response:
    return json_response({"type": "error", "error": {"type": err.err_type, "message": err.message}}, err.status)


@router.post("/v1/messages", openapi_extra=request_body(AnthropicMessagesRequest))
async def create_messages(request: Request) -> Response:
    state = server_state(request)
    req: AnthropicMessagesRequest = await parse_body(request, AnthropicMessagesRequest)
    try:
        chat_req = chat_request(chat_fields(req))
        if req.stream:
            resp = await chat_stream(state, request, chat_req)
            if not isinstance(resp, SSEResponse):
                return resp
            return SSEResponse(_events(resp), passed_headers(resp))
        chat = await chat_json(state, request, chat_req)
    except APIError as exc:
        return anthropic_error(exc)
    if isinstance(chat, Response):
        return chat
    return json_response(_message(chat))


def _message(chat: dict[str, Any]) -> dict[str, Any]:
    """vLLM's conversion of a chat answer (dumped without None fields)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    out = {"id": chat["id"], "type": "message", "role": "assistant", "content": content, "model": chat["model"]}
    stop = STOP_REASONS.get(choice.get("finish_reason") or "")
    if stop is not None:
        out["stop_reason"] = stop
    usage = chat.get("usage") or {}
    out["usage"] = {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}
    return out


def _event(name: str, obj: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {dumps(obj)}\n\n"


async def _events(resp: SSEResponse) -> AsyncIterator[str]:
    """vLLM's message_stream_converter over our chat chunks."""
    first = True
    finish = None
    block_type: str | None = None
    block_index = 0          # the next block's index (the active block's while one is open)
    tool_ids: dict[int, str] = {}
    active_tool: str | None = None

    def stop_block() -> list[str]:
        nonlocal block_type, block_index, active_tool
        if block_type is None:
            return []
        out = [_event("content_block_stop", {"type": "content_block_stop", "index": block_index})]
        block_type, active_tool = None, None
        block_index += 1
        return out

    def start_block(block: dict[str, Any]) -> str:
        nonlocal block_type
        block_type = block["type"]
        return _event("content_block_start", {"type": "content_block_start", "content_block": block,
                                              "index": block_index})

    def delta(d: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "delta": d, "index": block_index})

    async for chunk in chat_chunks(resp):
        if chunk is None:
            yield _event("message_stop", {"type": "message_stop"})
            continue
        if "error" in chunk:
            err = chunk["error"]
            yield _event("error", {"type": "error", "error": {"type": "internal_error", "message": err["message"]}})
            continue
        usage = chunk.get("usage") or {}
        if first:
            first = False
            yield _event("message_start", {"type": "message_start", "message": {
                "id": chunk["id"], "content": [], "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
            continue
        choices = chunk.get("choices") or []
        if not choices:            # the usage chunk ends the message
            for e in stop_block():
                yield e
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": STOP_REASONS.get(finish or "stop")},
                                           "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                                                     "output_tokens": usage.get("completion_tokens", 0)}})
            continue
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            finish = choice["finish_reason"]
        d = choice.get("delta") or {}
        if d.get("content"):
            if block_type != "text":
                for e in stop_block():
                    yield e
                yield start_block({"type": "text", "text": ""})
            yield delta({"type": "text_delta", "text": d["content"]})
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id") is not None:
                tool_ids[tc["index"]] = tc["id"]
                if active_tool != tc["id"] and fn.get("name") is not None:
                    for e in stop_block():
                        yield e
                    yield start_block({"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": {}})
                    active_tool = tc["id"]
            elif tool_ids.get(tc["index"]) != active_tool:
                continue
            if fn.get("arguments"):
                yield delta({"type": "input_json_delta", "partial_json": fn["arguments"]})


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(AnthropicCountTokensRequest))
async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    req: AnthropicCountTokensRequest = await parse_body(request, AnthropicCountTokensRequest)
    try:
        chat_req = chat_request(chat_fields(req))
        state.check_model(chat_req.model)
        kwargs = chat_req.chat_template_kwargs
        if chat_req.tools and chat_req.tool_choice != "none":
            kwargs = {"tools": chat_req.tools, **(kwargs or {})}
        media = split_chat_media(chat_req.messages, state.mm_processor, state.model_name, state.opts.media,
                                 state.opts.chat_template or state.tok.chat_template)
        text = state.tok.render_chat(media.messages, True, False, state.opts.chat_template, kwargs)
    except APIError as exc:
        return anthropic_error(exc)
    except Exception as exc:  # noqa: BLE001 - a template error is the client's input
        return anthropic_error(APIError(f"Error applying the chat template: {exc}"))
    ids = await encode_prompt(state.tok, text, False)
    if media.urls:        # the images' tokens, as the prompt the engine gets holds them
        try:
            ids = (await expand_chat_media(ids, media, state.mm_processor, state.opts.media,
                                           lambda s: state.tok.encode(s, add_special_tokens=False)))[0]
        except APIError as exc:
            return anthropic_error(exc)
    n = len(ids)
    return json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})
