"""/v1/chat/completions: the messages checked, rendered with the chat template and tokenized here, the rest is
``Generation``'s."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.engine.generation import check_sampling, request_base, stop_list
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.model.media import expand_chat_media, split_chat_media
from kernelsight.server.model.prompts import encode_prompt, too_many_chars
from kernelsight.server.model.tool_calls import chat_generation, check_auto_tools
from kernelsight.server.state import ServerState, server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.openai import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat(request: Request) -> Response:
    state = server_state(request)
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    await turn_gate().wait(first=True)     # routing and parsing took this turn: the rest takes the next
    return await run_chat(state, request, req)


async def run_chat(state: ServerState, request: Request, req: ChatCompletionRequest, *, fast_ok: bool = True,
                   rid: str | None = None) -> Response:
    """A parsed chat request to its response (also the Responses, Messages and batch routes' engine: they
    convert to and from chat as vLLM's handlers do; ``fast_ok=False`` when they re-render the stream)."""
    lora = state.check_model(req.model)
    stops = stop_list(req.stop)
    if req.max_completion_tokens is not None:
        max_tokens, field_name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field_name = req.max_tokens, "max_tokens"
    check_sampling(req, max_tokens, field_name)
    check_auto_tools(state, req)
    if not req.messages:
        raise bad_request("messages must be a non-empty list.", "messages")
    template = req.chat_template or state.opts.chat_template
    processor = state.request_mm_processor(getattr(req, "mm_processor_kwargs", None))
    # images: counted and refused (text-only model, too many) before anything else; placeholders in the messages
    media = split_chat_media(req.messages, processor, state.model_name, state.opts.media,
                             template or state.tok.chat_template)
    messages = media.messages
    try:
        kwargs = req.chat_template_kwargs
        if req.tools and req.tool_choice != "none":      # the template sees the tools, as vLLM renders them
            kwargs = {"tools": req.tools, **(kwargs or {})}
        text = state.tok.render_chat(messages, req.add_generation_prompt, req.continue_final_message,
                                     template, kwargs)
    except Exception as exc:  # noqa: BLE001 - a template error is the client's input
        raise bad_request(f"Error applying the chat template: {exc}") from None
    if len(text) > state.max_chars:
        raise too_many_chars(state, len(text))
    ids = await encode_prompt(state.tok, text, req.add_special_tokens)
    mm_items = None
    if media.urls:        # fetched, sized and expanded: the prompt holds each image's tokens, as vLLM's
        ids, items = await expand_chat_media(ids, media, processor, state.opts.media,
                                             lambda s: state.tok.encode(s, add_special_tokens=False))
        mm_items = [items]
    gen = chat_generation(state, request, req, rid or "chatcmpl-" + request_base(request, req.request_id), lora,
                          stops, messages, ids)
    gen.fast_ok = fast_ok
    gen.mm_items = mm_items
    gen.echo_text = _chat_echo(messages) if req.echo else None
    gen.lp_k = (req.top_logprobs or 0) if req.logprobs else None
    gen.plp_k = req.prompt_logprobs
    return await gen.run([(ids, text)], max_tokens, echo_only=False, field_name=field_name)


def _chat_echo(messages: list[dict[str, Any]]) -> str | None:
    """What ``echo`` sends first: the last message's content if it is the assistant's (being continued)."""
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        return last.get("content") or ""
    return None
