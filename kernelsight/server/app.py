"""The FastAPI app: vLLM 0.33's OpenAI-compatible routes over simulated engines (wire format per the spec).

Assembly only: ``build_app`` creates the ``ServerState``, starts and stops the engine bridges with the app,
includes the routers of ``server.wire.routes`` and wraps the middleware stack (API-key auth, then the stream fast
path's raw-send capture outermost)."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel

from kernelsight.server.engine.fastpath import capture_raw_send
from kernelsight.server.model.tokenizer import ServerTokenizer
from kernelsight.server.options import ServerOptions
from kernelsight.server.state import ServerState
from kernelsight.server.wire.auth import add_api_key_auth
from kernelsight.server.wire.errors import APIError, api_error_handler
from kernelsight.server.wire.openapi_bodies import add_request_schemas
from kernelsight.server.wire.protocol.anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest
from kernelsight.server.wire.protocol.batch import BatchChatCompletionRequest
from kernelsight.server.wire.protocol.lora import LoadLoRARequest, UnloadLoRARequest
from kernelsight.server.wire.protocol.openai import ChatCompletionRequest, CompletionRequest
from kernelsight.server.wire.protocol.pooling import (
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kernelsight.server.wire.protocol.responses import ResponsesRequest
from kernelsight.server.wire.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from kernelsight.server.wire.routes import (
    admin,
    chat,
    chat_batch,
    completions,
    invocations,
    kv_cache,
    kv_transfer,
    lora,
    messages,
    models,
    pooling,
    responses,
    scale_out,
    sleep,
    system,
    tokenize,
)
from kernelsight.simcore.engine_config import EngineConfig


def build_app(config: EngineConfig, opts: ServerOptions, tok: ServerTokenizer, replica_index: int = 0,
              remote: Any = None) -> FastAPI:
    """One server (a replica): its own engines, metrics, LoRA list and KV-event publishers, serving vLLM's
    routes; or, with ``remote`` (``engine.remote.RemoteBridge``s, one per data-parallel rank), one API-server process
    of --api-server-count whose engines run in the engine process."""
    state = ServerState(config, opts, tok, replica_index, remote=remote)

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
    app.state.ks = state     # the handlers' state (server_state(request)); cli and runner read it too
    app.add_exception_handler(APIError, api_error_handler)
    app.state.ks_responses = responses.new_store()     # /v1/responses storage (VLLM_ENABLE_RESPONSES_API_STORE)

    # the order of inclusion is the route order, and the OpenAPI schema's
    _include(app, system.router)
    _include(app, models.router)
    _include(app, admin.router)
    _include(app, tokenize.router)
    _include(app, kv_cache.router)
    _include(app, kv_transfer.router)
    if kv_cache.dev_mode():
        _include(app, kv_cache.dev_router)
        _include(app, sleep.dev_router)
    if opts.enable_lora and opts.allow_runtime_lora_updating:
        _include(app, lora.router)
    if opts.pooling:       # an embedding model: vLLM registers the routes of its tasks, and no generation routes
        _include(app, pooling.router)
        bodies: list[type[BaseModel]] = [EmbeddingRequest, CohereEmbedRequest, PoolingRequest, ScoreRequest,
                                        RerankRequest]
    else:
        _include(app, completions.router)
        _include(app, chat.router)
        _include(app, chat_batch.router)
        _include(app, responses.router)
        _include(app, messages.router)
        bodies = [CompletionRequest, ChatCompletionRequest, BatchChatCompletionRequest, ResponsesRequest,
                  AnthropicMessagesRequest, AnthropicCountTokensRequest]
    _include(app, invocations.router)
    _include(app, scale_out.router)
    add_request_schemas(app, [*bodies, TokenizeRequest, DetokenizeRequest, LoadLoRARequest, UnloadLoRARequest])

    _hot_routes_first(app, ("/v1/chat/completions", "/v1/completions"))
    add_api_key_auth(app, opts)
    capture_raw_send(app)      # after auth: it wraps the whole stack, so it is the outermost layer
    return app


def _include(app: FastAPI, router: APIRouter) -> None:
    """The router's routes appended to the app's own route list, where ``@app.post`` used to put them.

    Not ``app.include_router``: FastAPI (0.165 here) keeps an included router as one lazily resolved node in
    ``app.routes``, which changes the route list and adds a walk through those nodes to every request (measured
    with trivial handlers on these paths: POST /v1/completions through the app in ~105 µs instead of ~76 µs).
    The route objects are the routers', shared by every app of the process: they hold no state of their own
    (handlers find theirs through ``request.app``), and the routers have no prefix, dependencies, tags or
    lifespan to carry over."""
    app.router.routes.extend(router.routes)


def _hot_routes_first(app: FastAPI, paths: tuple[str, ...]) -> None:
    """Match the generation routes first; ``/openapi.json`` keeps the declared order.

    Starlette tries every route's regex in list order until one matches: /v1/completions came 19th, ~25 µs of
    every request. Moving an exact path without parameters to the front cannot change which route a request
    matches (no other route's pattern matches that path)."""
    declared = list(app.router.routes)
    hot = [r for r in declared if getattr(r, "path", None) in paths]
    app.router.routes[:] = hot + [r for r in declared if all(r is not h for h in hot)]
    inner = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        served = list(app.router.routes)
        app.router.routes[:] = declared
        try:
            return inner()
        finally:
            app.router.routes[:] = served

    app.openapi = openapi  # type: ignore[method-assign]
