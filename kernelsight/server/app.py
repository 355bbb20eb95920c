"""The FastAPI app: vLLM 0.33's OpenAI-compatible routes over simulated engines (wire format per the spec)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kernelsight.server.auth import add_api_key_auth
from kernelsight.server.body import parse_body
from kernelsight.server.errors import (
    APIError,
    api_error_handler,
    bad_request,
    not_found,
)
from kernelsight.server.fastpath import capture_raw_send
from kernelsight.server.generation import Generation, check_sampling, request_base, stop_list
from kernelsight.server.metrics import CONTENT_TYPE
from kernelsight.server.options import ServerOptions
from kernelsight.server.prompts import completion_prompts, encode_prompt, normalize_messages, too_many_chars
from kernelsight.server.protocol.lora import LoadLoRARequest, UnloadLoRARequest
from kernelsight.server.protocol.openai import ChatCompletionRequest, CompletionRequest
from kernelsight.server.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from kernelsight.server.protocol.version import VLLM_VERSION
from kernelsight.server.state import ServerState
from kernelsight.server.tokenizer import ServerTokenizer
from kernelsight.server.turns import turn_gate
from kernelsight.server.wire import json_response
from kernelsight.simcore.engine_config import EngineConfig

log = logging.getLogger("kernelsight.server")


# -- the app ------------------------------------------------------------------------------------------
def build_app(config: EngineConfig, opts: ServerOptions, tok: ServerTokenizer) -> FastAPI:
    state = ServerState(config, opts, tok)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for b in state.bridges:
            b.start()
        yield
        for b in state.bridges:
            await b.stop()

    kwargs: dict[str, Any] = {}
    if opts.disable_fastapi_docs:
        kwargs.update(openapi_url=None, docs_url=None, redoc_url=None)
    app = FastAPI(lifespan=lifespan, **kwargs)
    app.state.ks = state

    app.add_exception_handler(APIError, api_error_handler)

    # -- plain endpoints ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        ok = all(b.is_running for b in state.bridges)
        return Response(status_code=200 if ok else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": VLLM_VERSION})

    @app.get("/load")
    async def load() -> Response:
        return json_response({"server_load": 0})

    async def metrics_endpoint() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics/", metrics_endpoint, methods=["GET"], include_in_schema=False)

    @app.get("/v1/models")
    async def models() -> Response:
        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {"id": mid, "object": "model", "created": state.created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_len,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                    "created": state.created, "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None,
                                    "is_blocking": False}]}
        data = [card(n, opts.model_root, None, state.max_model_len) for n in opts.served_model_names]
        data += [card(n, p, state.model_name, None) for n, p in state.loras.items()]
        return json_response({"object": "list", "data": data})

    @app.get("/kernelsight/timings", include_in_schema=False)
    async def timings(reset_late: bool = False) -> Response:
        """Virtual arrival and token-release times (scaled to wall seconds), with --record-timings; ``wall0_s``
        maps them to time.perf_counter() (CLOCK_MONOTONIC: a client on the same host can compare directly).
        ``late_s_max``: the worst release lateness since the last ``?reset_late=true``."""
        ts = opts.time_scale
        out = {}
        for b in state.bridges:
            for sid, rec in b.timings.items():
                out[sid] = {"arrival_s": rec["arrival_s"] / ts, "token_times_s": [t / ts for t in rec["token_times_s"]],
                            "wall0_s": b._wall0}
        late_s_max = max(b.late_s_max for b in state.bridges)
        if reset_late:
            for b in state.bridges:
                b.late_s_max = 0.0
        return json_response({"time_scale": ts, "requests": out, "late_s_max": late_s_max,
                              "fast_writes": sum(b.fast_writes for b in state.bridges),
                              "fast_handbacks": sum(b.fast_handbacks for b in state.bridges)})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)
        state.check_model(req.model)
        if req.messages is not None:
            text = tok.render_chat(normalize_messages(req.messages), req.add_generation_prompt,
                                   req.continue_final_message, req.chat_template or opts.chat_template,
                                   req.chat_template_kwargs)
            ids = tok.encode(text, bool(req.add_special_tokens))
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        else:
            raise bad_request("Either prompt or messages must be provided.")
        return json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                              "token_strs": tok.token_strs(ids) if req.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        state.check_model(req.model)
        bad = [t for t in req.tokens if t < 0 or t >= tok.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary", "tokens")
        return json_response({"prompt": tok.decode(req.tokens)})

    if opts.enable_lora and opts.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora(request: Request) -> Response:
            req: LoadLoRARequest = await parse_body(request, LoadLoRARequest)
            if not req.lora_name or not req.lora_path:
                raise APIError("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
            if req.lora_name in opts.served_model_names:
                raise APIError(f"The lora adapter '{req.lora_name}' conflicts with a base model name.",
                               "InvalidUserInput", 400)
            if req.lora_name in state.loras and not req.load_inplace:
                raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded.", "InvalidUserInput",
                               400)
            state.loras[req.lora_name] = req.lora_path
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(request: Request) -> Response:
            req: UnloadLoRARequest = await parse_body(request, UnloadLoRARequest)
            if req.lora_name not in state.loras:
                raise not_found(f"The lora adapter '{req.lora_name}' cannot be found.")
            del state.loras[req.lora_name]
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # -- generation ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
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
        gen.lp_k = req.logprobs
        gen.plp_k = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if req.echo else None
        return await gen.run(prompts, max_tokens, echo_only=echo_only, field_name="max_tokens")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        await turn_gate().wait(first=True)     # routing and parsing took this turn: the rest takes the next
        lora = state.check_model(req.model)
        stops = stop_list(req.stop)
        if req.max_completion_tokens is not None:
            max_tokens, field_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field_name = req.max_tokens, "max_tokens"
        check_sampling(req, max_tokens, field_name)
        if not req.messages:
            raise bad_request("messages must be a non-empty list.", "messages")
        messages = normalize_messages(req.messages)
        try:
            text = tok.render_chat(messages, req.add_generation_prompt, req.continue_final_message,
                                   req.chat_template or opts.chat_template, req.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's input
            raise bad_request(f"Error applying the chat template: {exc}") from None
        if len(text) > state.max_chars:
            raise too_many_chars(state, len(text))
        ids = await encode_prompt(tok, text, req.add_special_tokens)
        gen = Generation(state, request, req, "chatcmpl-" + request_base(request, req.request_id), lora, stops,
                          is_chat=True)
        gen.echo_text = _chat_echo(messages) if req.echo else None
        gen.lp_k = (req.top_logprobs or 0) if req.logprobs else None
        gen.plp_k = req.prompt_logprobs
        return await gen.run([(ids, text)], max_tokens, echo_only=False, field_name=field_name)

    add_api_key_auth(app, opts)
    capture_raw_send(app)
    return app


def _chat_echo(messages: list[dict[str, Any]]) -> str | None:
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        return last.get("content") or ""
    return None
