"""The chat engine behind the Responses, Messages and batch routes: vLLM's handlers for those APIs build a chat
request, run it through the chat handler and convert what comes back; so do these (``chat_request``,
``chat_json`` for a whole answer, ``chat_chunks`` for the stream's chunks as objects)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import validation_error
from kernelsight.server.wire.protocol.openai import ChatCompletionRequest
from kernelsight.server.wire.routes.chat import run_chat
from kernelsight.server.wire.sse import SSEResponse


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request, checked by the chat request model (its errors in vLLM's validation shape)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def chat_json(state: ServerState, request: Request, req: ChatCompletionRequest,
                    rid: str | None = None) -> dict[str, Any] | Response:
    """A non-streaming chat answer as an object, or the response itself when it is not one (an injected fault's,
    a client that left)."""
    resp = await run_chat(state, request, req, fast_ok=False, rid=rid)
    if resp.status_code != 200 or isinstance(resp, SSEResponse):
        return resp
    return orjson.loads(resp.body)


async def chat_stream(state: ServerState, request: Request, req: ChatCompletionRequest,
                      rid: str | None = None) -> SSEResponse | Response:
    """A streaming chat answer (its chunks are read with ``chat_chunks``)."""
    return await run_chat(state, request, req, fast_ok=False, rid=rid)


async def chat_chunks(resp: SSEResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The chat stream's chunks as objects; None for ``[DONE]``. Closing this closes the chat stream (the
    request is aborted in the engine if it has not finished)."""
    inner = resp.gen
    try:
        async for text in inner:
            for event in text.split("\n\n"):
                if not event.startswith("data: "):
                    continue
                data = event[6:]
                yield None if data == "[DONE]" else orjson.loads(data)
    finally:
        await inner.aclose()


def passed_headers(resp: SSEResponse) -> dict[str, str] | None:
    """The chat stream's own headers (X-Request-Id with --enable-request-id-headers) for the converted stream."""
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in resp.raw_headers if k != b"content-type"}
    return out or None
