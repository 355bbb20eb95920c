"""An embedding model's routes (registered instead of completions and chat under ``--runner pooling`` /
``--convert embed``, as vLLM 0.33 registers them by the model's tasks): /v1/embeddings, /v2/embed (Cohere's),
/pooling, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank.

Every input is one engine request that prefills its tokens and generates none worth the name: it is submitted
with one output token, so the answer comes when the simulated GPU finishes the prompt's prefill step (the step that
would compute the pooled hidden state), behind whatever else the engine is running. The vectors are
``server/model/embeddings.py``'s: seeded, of the model's hidden size, normalized."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.engine.admissions import admission_done
from kernelsight.server.engine.fastpath import RECV_KEY
from kernelsight.server.integrations.sleep_mode import SLEEPING_MESSAGE
from kernelsight.server.model.embeddings import cosine, embed, encode_vector, pack_bits
from kernelsight.server.model.prompts import completion_prompts, encode_prompt, normalize_messages, too_many_chars
from kernelsight.server.state import ServerState, server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import APIError, bad_request
from kernelsight.server.wire.jsonio import json_response
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.pooling import (
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kernelsight.server.wire.sse import await_or_disconnect

router = APIRouter()


def _rid(request: Request, prefix: str, body_id: str | None) -> str:
    return f"{prefix}-{request.headers.get('x-request-id') or body_id or uuid.uuid4().hex}"


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


async def _tokens(state: ServerState, texts: list[str], add_special: bool) -> list[list[int]]:
    out = []
    for t in texts:
        if len(t) > state.max_chars:
            raise too_many_chars(state, len(t))
        out.append(await encode_prompt(state.tok, t, add_special))
    return out


def _check_lengths(state: ServerState, prompts: list[list[int]], truncate: int | None) -> list[list[int]]:
    L = state.max_model_len
    if truncate is not None and truncate > L:
        raise bad_request(f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({L}). Please "
                          f"request a smaller truncation size.", "truncate_prompt_tokens")
    out = []
    for ids in prompts:
        if truncate is not None and truncate >= 0:
            ids = ids[-truncate:] if truncate else []
        if not ids:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "input")
        if len(ids) > L:
            raise bad_request(f"This model's maximum context length is {L} tokens. However, your prompt contains "
                              f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. "
                              f"Please reduce the length of the input prompt.", "input_tokens")
        out.append(ids)
    return out


async def prefill(state: ServerState, request: Request, prompts: list[list[int]], rid: str, priority: int) -> bool:
    """Run the prompts' prefills on the simulated engine; False if the client left (the requests are aborted)."""
    bridge = state.pick_bridge(request)
    if bridge.closing:
        raise APIError("The server is shutting down and cannot accept new requests.", "Service Unavailable", 503)
    if state.sleep.is_sleeping:
        raise APIError(SLEEPING_MESSAGE, "Service Unavailable", 503)
    L = state.max_model_len
    # a prompt of exactly max_model_len leaves no room for the one token the engine needs to run it: such a
    # prompt is priced one token shorter (the pooled prefill itself generates nothing)
    runs = [ids[: L - 1] if len(ids) >= L else ids for ids in prompts]
    state.check_admission(len(runs))
    sub = bridge.submit(runs, [1] * len(runs), 1, ignore_eos=True, priority=priority, label=rid,
                        arrival_wall_s=request.scope.get(RECV_KEY))
    admission_done(request.scope)
    if not await await_or_disconnect(request, sub, bridge):
        return False
    bridge.release(sub)
    return True


async def _inputs(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    if req.messages is not None:
        if req.input is not None:
            raise bad_request("Either `input` or `messages` must be provided, not both.", "messages")
        if not req.messages:
            raise bad_request("messages must be a non-empty list.", "messages")
        messages = normalize_messages(req.messages)
        try:
            text = state.tok.render_chat(messages, True, False, state.opts.chat_template)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's input
            raise bad_request(f"Error applying the chat template: {exc}") from None
        return [await encode_prompt(state.tok, text, False)]
    return [ids for ids, _ in await completion_prompts(state, req.input, req.add_special_tokens)]


async def _vectors(request: Request, req: EmbeddingRequest, prefix: str
                   ) -> tuple[ServerState, str, list[list[int]], list[np.ndarray]] | Response:
    state = server_state(request)
    lora = state.check_model(req.model)
    if req.dimensions is not None:
        raise bad_request(f'Model "{lora or state.model_name}" does not support matryoshka representation, changing '
                          f"output dimensions will lead to poor results.", "dimensions")
    if req.encoding_format not in ("float", "base64"):
        raise bad_request(f"Invalid encoding_format: {req.encoding_format!r} (float or base64).", "encoding_format")
    prompts = _check_lengths(state, await _inputs(state, req), req.truncate_prompt_tokens)
    rid = _rid(request, prefix, req.request_id)
    if not await prefill(state, request, prompts, rid, req.priority):
        return Response(status_code=499)
    hidden = state.config.model.hidden_size
    seed = state.config.args.seed
    normalize = req.normalize is not False
    return state, rid, prompts, [embed(ids, hidden, seed, normalize) for ids in prompts]


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
async def embeddings(request: Request) -> Response:
    req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
    got = await _vectors(request, req, "embd")
    if isinstance(got, Response):
        return got
    state, rid, prompts, vecs = got
    data = [{"index": i, "object": "embedding", "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vecs)]
    return json_response({"id": rid, "object": "list", "created": int(time.time()),
                          "model": req.model or state.model_name, "data": data,
                          "usage": _usage(sum(map(len, prompts)))})


@router.post("/pooling", openapi_extra=request_body(PoolingRequest))
async def pooling(request: Request) -> Response:
    req: PoolingRequest = await parse_body(request, PoolingRequest)
    got = await _vectors(request, req, "pool")
    if isinstance(got, Response):
        return got
    state, rid, prompts, vecs = got
    data = [{"index": i, "object": "pooling", "data": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vecs)]
    return json_response({"id": rid, "object": "list", "created": int(time.time()),
                          "model": req.model or state.model_name, "data": data,
                          "usage": _usage(sum(map(len, prompts)))})


async def _scores(request: Request, req: Any, first: list[str], second: list[str], prefix: str
                  ) -> tuple[ServerState, str, int, list[float]] | Response:
    """Cosine scores of an embedding model (vLLM's bi-encoder scoring): 1:N or N:N pairs."""
    state = server_state(request)
    state.check_model(req.model)
    if not first or not second:
        raise bad_request("At least one text element must be given on each side.", "documents")
    if len(first) != 1 and len(first) != len(second):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N", "documents")
    prompts = _check_lengths(state, await _tokens(state, first + second, req.add_special_tokens),
                             req.truncate_prompt_tokens)
    rid = _rid(request, prefix, req.request_id)
    if not await prefill(state, request, prompts, rid, req.priority):
        return Response(status_code=499)
    hidden, seed = state.config.model.hidden_size, state.config.args.seed
    vecs = [embed(ids, hidden, seed) for ids in prompts]
    q, d = vecs[: len(first)], vecs[len(first):]
    scores = [cosine(q[0] if len(q) == 1 else q[i], d[i]) for i in range(len(d))]
    return state, rid, sum(map(len, prompts)), scores


def _listed(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


async def score(request: Request) -> Response:
    req: ScoreRequest = await parse_body(request, ScoreRequest)
    sides = req.sides()
    if sides is None:
        raise bad_request("Score requests take `queries` with `documents` (or `items`), `data_1` with `data_2`, "
                          "or `text_1` with `text_2`.")
    got = await _scores(request, req, _listed(sides[0]), _listed(sides[1]), "score")
    if isinstance(got, Response):
        return got
    state, rid, n_tokens, scores = got
    return json_response({"id": rid, "object": "list", "created": int(time.time()),
                          "model": req.model or state.model_name,
                          "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                          "usage": _usage(n_tokens)})


async def rerank(request: Request) -> Response:
    req: RerankRequest = await parse_body(request, RerankRequest)
    docs = [d if isinstance(d, str) else str(d.get("text", "")) for d in req.documents]
    got = await _scores(request, req, [req.query], docs, "rerank")
    if isinstance(got, Response):
        return got
    state, rid, n_tokens, scores = got
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if req.top_n > 0:
        order = order[: req.top_n]
    results = [{"index": i, "document": {"text": docs[i], "multi_modal": None}, "relevance_score": scores[i]}
               for i in order]
    return json_response({"id": rid, "model": req.model or state.model_name,
                          "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results})


@router.post("/v2/embed", openapi_extra=request_body(CohereEmbedRequest))
async def cohere_embed(request: Request) -> Response:
    """Cohere's embed API (vLLM 0.33's /v2/embed): ``embeddings`` by requested type, ``meta.tokens``."""
    req: CohereEmbedRequest = await parse_body(request, CohereEmbedRequest)
    state = server_state(request)
    lora = state.check_model(req.model)
    if req.output_dimension is not None:
        raise bad_request(f'Model "{lora or state.model_name}" does not support matryoshka representation, changing '
                          f"output dimensions will lead to poor results.", "output_dimension")
    texts = req.all_texts()
    if not texts:
        raise bad_request("One of `texts` or `inputs` must be given.", "texts")
    L = state.max_model_len
    prompts = await _tokens(state, texts, True)
    if req.truncate != "NONE":      # Cohere's truncate: drop tokens from the end (END) or the start (START)
        prompts = [ids[:L] if req.truncate == "END" else ids[-L:] for ids in prompts]
    prompts = _check_lengths(state, prompts, None)
    rid = _rid(request, "embd", None)
    if not await prefill(state, request, prompts, rid, req.priority):
        return Response(status_code=499)
    hidden, seed = state.config.model.hidden_size, state.config.args.seed
    vecs = [embed(ids, hidden, seed) for ids in prompts]
    out: dict[str, Any] = {}
    for kind in req.embedding_types or ["float"]:
        if kind == "float":
            out[kind] = [v.tolist() for v in vecs]
        elif kind == "base64":
            out[kind] = [encode_vector(v, "base64") for v in vecs]
        else:
            out[kind] = [pack_bits(v, signed=kind == "binary") for v in vecs]
    return json_response({"id": rid, "embeddings": out, "texts": texts,
                          "meta": {"api_version": {"version": "2"},
                                   "tokens": {"input_tokens": sum(map(len, prompts))}}})


for _path in ("/score", "/v1/score"):
    router.add_api_route(_path, score, methods=["POST"], openapi_extra=request_body(ScoreRequest))
for _path in ("/rerank", "/v1/rerank", "/v2/rerank"):
    router.add_api_route(_path, rerank, methods=["POST"], openapi_extra=request_body(RerankRequest))
