"""/tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.model.media import expand_chat_media, split_chat_media
from kernelsight.server.model.prompts import encode_prompt
from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.jsonio import json_response
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.tokenize import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    tok = state.tok
    req: TokenizeRequest = await parse_body(request, TokenizeRequest)
    state.check_model(req.model)
    if req.messages is not None:
        template = req.chat_template or state.opts.chat_template
        processor = state.request_mm_processor(getattr(req, "mm_processor_kwargs", None))
        media = split_chat_media(req.messages, processor, state.model_name, state.opts.media,
                                 template or tok.chat_template)
        try:
            text = tok.render_chat(media.messages, req.add_generation_prompt,
                                   req.continue_final_message, template, req.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's input (an empty list was a 500)
            # vLLM's tokenize handler answers its preprocessing errors as a 400 "{error} {cause}"
            raise bad_request(f"{exc} {exc.__cause__}") from None
        # no length limit on /tokenize (as in vLLM): a huge text is encoded off the loop, or every stream would stall
        ids = await encode_prompt(tok, text, bool(req.add_special_tokens))
        if media.urls:      # each image counts its expanded placeholder tokens, as the engine's prompt holds them
            ids = (await expand_chat_media(ids, media, processor, state.opts.media,
                                           lambda s: tok.encode(s, add_special_tokens=False)))[0]
    elif req.prompt is not None:
        ids = await encode_prompt(tok, req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
    else:
        raise bad_request("Either prompt or messages must be provided.")
    return json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                          "token_strs": tok.token_strs(ids) if req.return_token_strs else None})


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    tok = state.tok
    req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
    state.check_model(req.model)
    bad = [t for t in req.tokens if t < 0 or t >= tok.vocab_size]
    if bad:
        raise bad_request(f"Token id {bad[0]} is out of vocabulary", "tokens")
    return json_response({"prompt": tok.decode(req.tokens)})
