"""/v1/completions: the request checked and its prompts tokenized here, the rest is ``Generation``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.engine.generation import Generation, check_sampling, request_base, stop_list
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.model.prompts import completion_prompts
from kernelsight.server.model.structured import StructuredOutputError, constrained_text
from kernelsight.server.model.tool_calls import draw_seed
from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.openai import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    state = server_state(request)
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    await turn_gate().wait(first=True)     # routing and parsing took this turn: the rest takes the next
    lora = state.check_model(req.model)
    stops = stop_list(req.stop)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    echo_only = bool(req.echo) and max_tokens == 0
    check_sampling(req, None if echo_only else max_tokens, "max_tokens")
    if req.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    prompts = await completion_prompts(state, req.prompt, req.add_special_tokens)
    gen = Generation(state, request, req, "cmpl-" + request_base(request, req.request_id), lora, stops,
                     is_chat=False)
    text = None
    if req.response_format is not None or req.structured_outputs is not None:
        try:   # the draw's seed hashes the prompt (~40 µs for 256 ids): only for constrained requests
            text = constrained_text(req.response_format, req.structured_outputs, draw_seed(req, prompts[0][0]))
        except StructuredOutputError as exc:
            gen.engine_error = exc
    if text is not None:      # structured outputs: every prompt's choices emit the drawn JSON / choice
        gen.fixed_output = state.tok.encode(text, False)
    gen.lp_k = req.logprobs
    gen.plp_k = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if req.echo else None
    return await gen.run(prompts, max_tokens, echo_only=echo_only, field_name="max_tokens")
