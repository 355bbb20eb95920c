"""/v1/chat/completions/batch (vLLM 0.33): N conversations in one request, each run as its own chat request on the
engine at once, answered as one chat completion whose choice i is conversation i. As in vLLM: no streaming (the
answer is whole), no tools (``tool_choice`` is "none"), no beam search, ``n`` must be 1."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.engine.chat_relay import chat_json, chat_request
from kernelsight.server.engine.generation import request_base
from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.jsonio import json_response
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.batch import BatchChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions/batch", openapi_extra=request_body(BatchChatCompletionRequest))
async def chat_batch(request: Request) -> Response:
    state = server_state(request)
    req: BatchChatCompletionRequest = await parse_body(request, BatchChatCompletionRequest)
    if getattr(req, "use_beam_search", False):
        raise bad_request("Batch chat completions do not support beam search. Please set `use_beam_search` to "
                          "False.", "use_beam_search")
    if req.n != 1:
        raise bad_request("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    if any(len(conv) == 0 for conv in req.messages):
        raise bad_request("Each conversation must hold at least one message.", "messages")
    rid = "chatcmpl-" + request_base(request, req.request_id)
    base = req.model_dump(exclude={"messages", "tools", "stream", "stream_options"}, exclude_none=True)
    base["tool_choice"] = "none"
    singles = [chat_request({**base, "messages": conv}) for conv in req.messages]
    answers = await asyncio.gather(*(chat_json(state, request, r, f"{rid}_{i}") for i, r in enumerate(singles)))
    for a in answers:
        if isinstance(a, Response):
            return a
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, a in enumerate(answers):
        assert isinstance(a, dict)
        choices.append({**a["choices"][0], "index": i})
        prompt_tokens += a["usage"]["prompt_tokens"]
        completion_tokens += a["usage"]["completion_tokens"]
    first = answers[0]
    assert isinstance(first, dict)
    return json_response({**first, "id": rid, "created": int(time.time()), "choices": choices,
                          "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                                    "completion_tokens": completion_tokens, "prompt_tokens_details": None},
                          "prompt_logprobs": None, "prompt_token_ids": None})
