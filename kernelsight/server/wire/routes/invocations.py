"""/invocations (SageMaker): the body goes to the first of the model's request types it validates as, as vLLM
0.33 routes it (a generative model: chat, then completion; an embedding model: embedding, rerank, score, pooling);
none fits: 400 "Cannot find suitable handler for request. Expected one of: [...]"."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kernelsight.server.state import server_state
from kernelsight.server.wire.body import loads, parse_body
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.protocol.openai import ChatCompletionRequest, CompletionRequest
from kernelsight.server.wire.protocol.pooling import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from kernelsight.server.wire.routes import chat, completions, pooling

router = APIRouter()

Handler = Callable[[Request], Awaitable[Response]]


def _fits(model: type[BaseModel], obj: Any) -> bool:
    try:
        req = model.model_validate(obj)
    except ValidationError:
        return False
    if isinstance(req, ScoreRequest):
        return req.sides() is not None
    if isinstance(req, EmbeddingRequest) and not isinstance(req, PoolingRequest):
        return req.input is not None or req.messages is not None
    return True


def _candidates(pooling_model: bool) -> list[tuple[type[BaseModel], Handler]]:
    if pooling_model:
        return [(EmbeddingRequest, pooling.embeddings), (RerankRequest, pooling.rerank),
                (ScoreRequest, pooling.score), (PoolingRequest, pooling.pooling)]
    return [(ChatCompletionRequest, chat.chat), (CompletionRequest, completions.completions)]


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    state = server_state(request)
    try:
        obj = loads(await request.body())
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, list | str | int | float) or request.headers.get("content-type", "").split(";")[0] \
            .strip().lower() != "application/json":
        await parse_body(request, _AnyObject)     # a bad content type or bad JSON: the error every route gives
    candidates = _candidates(state.opts.pooling)
    for model, handler in candidates:
        if _fits(model, obj):
            return await handler(request)
    names = [m.__name__ for m, _ in candidates]
    raise bad_request(f"Cannot find suitable handler for request. Expected one of: {names}")


class _AnyObject(BaseModel):
    model_config = {"extra": "allow"}
