"""One ``Generate`` RPC from its checks to its last message (``GenerateCall``), over the HTTP server's engine
bridges: the same submission (prompt ids, output limit, seeded output keys, structured output drawn up front,
faults, admission limits, P/D roles), so the same request gets the same token times and ids over either front end.

What vLLM's servicer does and this follows: token-id or text input (a text prompt is tokenized with special
tokens, as vLLM's renderer does); the proto's unset fields take vLLM's defaults (temperature 1, top_p 1, n 1,
max_tokens up to the context); the engine's checks answer INVALID_ARGUMENT with vLLM's message. A stream sends one
``chunk`` per released step per choice (the step's new token ids) and, when a choice finishes, a ``complete``
carrying that last delta (gateways accumulate the chunks); a non-streaming call gets one ``complete`` per choice
with every token id. A request aborted (the Abort RPC, or the server shutting down) ends with
``finish_reason`` "abort"; a client that cancels frees the request's KV blocks at once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from kernelsight.server.engine.admissions import admission_done, admission_started
from kernelsight.server.engine.bridge import EngineBridge, Submission
from kernelsight.server.engine.generation import _SeqView, check_sampling, stop_list
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.integrations.faults import FAULT_HEADER, IN_ENGINE_FAULTS, request_fault_error
from kernelsight.server.integrations.kv_transfer import NO_TRANSFER, TransferRole, transfer_role
from kernelsight.server.integrations.sleep_mode import SLEEPING_MESSAGE
from kernelsight.server.model.logprobs import MAX_LOGPROBS, Entry
from kernelsight.server.model.output_tokens import exact_pieces
from kernelsight.server.model.prompts import encode_prompt, too_many_chars
from kernelsight.server.model.structured import constrained_text
from kernelsight.server.model.tool_calls import draw_seed
from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import APIError, bad_request
from kernelsight.server.wire.grpc.errors import RpcFailure
from kernelsight.server.wire.grpc.mm_inputs import mm_items_of
from kernelsight.server.wire.jsonio import dumps
from kernelsight.simcore.multimodal import check_mm_items

log = logging.getLogger("kernelsight.server")

SHUTTING_DOWN_MESSAGE = "The server is shutting down and cannot accept new requests."


@dataclass
class Inflight:
    """The Generate calls in flight by request id (the Abort RPC's lookup), and when the last one arrived."""

    calls: dict[str, list[tuple[EngineBridge, Submission]]] = field(default_factory=dict)
    last_receive_unix_s: float = 0.0

    def add(self, rid: str, bridge: EngineBridge, sub: Submission) -> None:
        self.calls.setdefault(rid, []).append((bridge, sub))

    def remove(self, rid: str, sub: Submission) -> None:
        subs = self.calls.get(rid)
        if subs is None:
            return
        subs[:] = [(b, s) for b, s in subs if s is not sub]
        if not subs:
            del self.calls[rid]

    def abort(self, rids: list[str]) -> int:
        """Abort the named requests in their engines (blocks freed); their streams end with "abort"."""
        n = 0
        for rid in rids:
            for bridge, sub in list(self.calls.get(rid, ())):
                bridge.abort(sub)
                sub.event.set()
                n += 1
        return n


@dataclass(frozen=True)
class Sampling:
    """A GenerateRequest's sampling parameters, vLLM's defaults in place of unset fields, checked."""

    max_tokens: int | None
    n: int
    temperature: float
    seed: int | None
    min_tokens: int
    ignore_eos: bool
    stops: list[str]
    stop_token_ids: frozenset[int]
    include_stop: bool
    logprobs: int | None
    prompt_logprobs: int | None
    structured: dict[str, Any] | None
    truncate_prompt_tokens: int | None


def sampling_of(p: pb.SamplingParams, stream: bool, vocab_size: int) -> Sampling:
    """The proto's parameters as vLLM's servicer reads them (``SamplingParams``), with vLLM's checks (APIError
    400 naming the parameter, the HTTP server's messages)."""
    temperature = p.temperature if p.HasField("temperature") else 1.0
    max_tokens = p.max_tokens if p.HasField("max_tokens") else None
    ns = SimpleNamespace(n=p.n if p.n > 0 else 1, temperature=temperature, top_p=p.top_p if p.top_p != 0.0 else 1.0,
                         top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
                         frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens, stream_options=None,
                         stream=stream, cache_salt=None)
    check_sampling(ns, max_tokens, "max_tokens")
    if p.repetition_penalty != 0.0 and p.repetition_penalty <= 0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {p.repetition_penalty}.",
                          "repetition_penalty")
    lp = p.logprobs if p.HasField("logprobs") else None
    plp = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    for k, what, param in ((lp, "sample", "logprobs"), (plp, "prompt", "prompt_logprobs")):
        if k is not None and k < -1:
            raise bad_request(f"{param} must be non-negative or -1, got {k}.", param)
        if k:
            num = vocab_size if k == -1 else k
            if num > MAX_LOGPROBS:
                raise bad_request(f"Requested {what} logprobs of {num}, which is greater than max allowed: "
                                  f"{MAX_LOGPROBS}", param)
    truncate = p.truncate_prompt_tokens if p.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate < -1:
        raise bad_request(f"truncate_prompt_tokens must be >= -1, got {truncate}.", "truncate_prompt_tokens")
    return Sampling(max_tokens=max_tokens, n=ns.n, temperature=temperature,
                    seed=p.seed if p.HasField("seed") else None, min_tokens=p.min_tokens, ignore_eos=p.ignore_eos,
                    stops=stop_list(list(p.stop)) if p.stop else [], stop_token_ids=frozenset(p.stop_token_ids),
                    include_stop=p.include_stop_str_in_output, logprobs=lp, prompt_logprobs=plp,
                    structured=_structured(p), truncate_prompt_tokens=truncate)


def _structured(p: pb.SamplingParams) -> dict[str, Any] | None:
    """The constraint oneof as vLLM's ``StructuredOutputsParams`` fields (what ``structured.constrained_text``
    reads)."""
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return {"json": p.json_schema}
    if kind == "choice":
        return {"choice": list(p.choice.choices)}
    return {kind: getattr(p, kind)}      # regex, grammar, structural_tag, json_object


def output_keys(seed: int | None, temperature: float, ids: list[int]) -> list[int] | None:
    """The seeded output draw, as the HTTP server keys it (``Generation._keys``): a seed or greedy sampling gives
    the same tokens for the same prompt, over either front end."""
    if seed is None and temperature != 0:
        return None
    h = hashlib.blake2b(dumps([seed, ids[-4096:], len(ids)]).encode(), digest_size=8).digest()
    return [int.from_bytes(h, "little") >> 1]


def kv_transfer_params_of(request: pb.GenerateRequest) -> dict[str, Any] | None:
    """The connector's params: ``kv_transfer_params_json`` (a JSON object), else the deprecated typed field."""
    if request.HasField("kv_transfer_params_json"):
        try:
            params = json.loads(request.kv_transfer_params_json)
        except json.JSONDecodeError as exc:
            raise bad_request(f"kv_transfer_params_json is not valid JSON: {exc}") from None
        if not isinstance(params, dict):
            raise bad_request("kv_transfer_params_json must be a JSON object")
        return params
    if request.HasField("kv_transfer_params") and request.kv_transfer_params.remote_host:
        t = request.kv_transfer_params
        return {"remote_host": t.remote_host, "remote_port": t.remote_port}
    return None


class GenerateCall:
    """One Generate RPC: ``run`` yields its GenerateResponse messages, or raises ``RpcFailure``."""

    def __init__(self, state: ServerState, inflight: Inflight, request: pb.GenerateRequest,
                 context: grpc.aio.ServicerContext, notify_address: tuple[str, int] | None = None) -> None:
        self.state = state
        self.inflight = inflight
        self.request = request
        self.context = context
        self.notify_address = notify_address
        self.rid = request.request_id or uuid.uuid4().hex
        self.kv_role: TransferRole = NO_TRANSFER
        self.fault: str | None = None
        self.fault_at = 1
        self._scope: dict[str, Any] = {}      # the admission token (``admissions``), as an HTTP request's scope

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        arrival_wall_s = time.perf_counter()       # the bridge stamps the arrival from this (the HTTP read clock)
        self.inflight.last_receive_unix_s = time.time()
        admission_started(self._scope)     # the engine loops wait for it before a step, as for an HTTP request
        try:
            await turn_gate().wait(first=True)
            sub, bridge, views, sp, ids = await self._admit(arrival_wall_s)
        finally:
            admission_done(self._scope)
        async for msg in self._serve(sub, bridge, views, sp, ids):
            yield msg

    # -- checks and submission ----------------------------------------------------------------
    def _mm_items(self, ids: list[int]) -> tuple:
        """The request's images/videos (``mm_inputs.mm_items_of``); none for a text request."""
        state, req = self.state, self.request
        if not (req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs")):
            return ()
        vision = state.config.model.vision
        if vision is None:
            raise bad_request(f"{state.config.model.architecture} is not a multimodal model: it takes no "
                              f"multimodal inputs (mm_inputs, media_refs)")
        if req.HasField("media_refs"):
            raise bad_request("media_refs are not served here: send the gateway's preprocessed mm_inputs")
        if req.WhichOneof("input") != "tokenized":
            raise bad_request("mm_inputs need tokenized input: the placeholders' offsets are in its token ids")
        if len(ids) != len(req.tokenized.input_ids):
            raise bad_request("truncate_prompt_tokens with mm_inputs: the placeholders' offsets would move")
        msgs = ([req.mm_inputs] if req.HasField("mm_inputs") else []) + list(req.extra_mm_inputs)
        try:
            items = mm_items_of(msgs, vision)
            check_mm_items(items, len(ids))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return items

    async def _prompt(self, sp: Sampling) -> list[int]:
        state, req = self.state, self.request
        kind = req.WhichOneof("input")
        if kind == "tokenized":
            ids = list(req.tokenized.input_ids)
            vocab = state.tok.vocab_size
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"Token id {bad} is out of vocabulary", "prompt")
        elif kind == "text":
            if len(req.text) > state.max_chars:
                raise too_many_chars(state, len(req.text))
            ids = await encode_prompt(state.tok, req.text, True)
        else:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        t = sp.truncate_prompt_tokens
        if t is not None and t != 0:
            L = state.max_model_len
            if t > L:
                raise bad_request(f"truncate_prompt_tokens value ({t}) is greater than max_model_len ({L}). Please "
                                  f"request a smaller truncation size.", "truncate_prompt_tokens")
            keep = L if t == -1 else t
            ids = ids[-keep:]
        if not ids:
            raise bad_request("The decoder prompt cannot be empty")
        return ids

    def _pick_bridge(self) -> EngineBridge:
        """vLLM's DP balancing (least 4·waiting + running), or the request's ``data_parallel_rank``."""
        bridges = self.state.bridges
        if self.request.HasField("data_parallel_rank"):
            r = self.request.data_parallel_rank
            if not 0 <= r < len(bridges):
                raise bad_request(f"data_parallel_rank {r} is out of range [0, {len(bridges)}).")
            return bridges[r]
        if len(bridges) == 1:
            return bridges[0]
        return min(bridges, key=lambda b: 4 * b.engine.num_waiting + b.engine.num_running)

    def _metadata(self, key: str) -> str | None:
        for k, v in self.context.invocation_metadata() or ():
            if k == key:
                return v if isinstance(v, str) else v.decode("latin-1")
        return None

    async def _admit(self, arrival_wall_s: float) -> tuple[Submission, EngineBridge, list[_SeqView], Sampling,
                                                           list[int]]:
        state, req = self.state, self.request
        sp = sampling_of(req.sampling_params, req.stream, state.tok.vocab_size)
        ids = await self._prompt(sp)
        mm = self._mm_items(ids)
        L = state.max_model_len
        if len(ids) >= L:
            raise bad_request(f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                              f"(at least 1) is longer than the maximum model length of {L}. Make sure that "
                              f"`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                              f"output tokens).")
        limit = L - len(ids) if sp.max_tokens is None else min(sp.max_tokens, L - len(ids))
        fixed: list[int] | None = None
        if sp.structured is not None:
            text = constrained_text(None, sp.structured, draw_seed(SimpleNamespace(seed=sp.seed), ids))
            if text is not None:
                fixed = state.tok.encode(text, False)
                limit = min(limit, len(fixed))
        kv_params = kv_transfer_params_of(req)
        bridge = self._pick_bridge()
        if bridge.closing:
            raise APIError(SHUTTING_DOWN_MESSAGE, "Service Unavailable", 503)
        if state.sleep.is_sleeping:
            raise APIError(SLEEPING_MESSAGE, "Service Unavailable", 503)
        fault = self._decide_fault()
        if fault is not None and fault not in IN_ENGINE_FAULTS:
            await self._fail_before_engine(fault)
        state.check_admission(sp.n)
        self.fault = fault
        self.fault_at = max(1, limit // 2)
        if bridge.kv_agent is not None:
            self.kv_role = transfer_role(kv_params, sp.n == 1)
        sub = bridge.submit([ids], [limit], sp.n, min_tokens=sp.min_tokens, mm_items=[mm] if mm else None,
                            ignore_eos=sp.ignore_eos or fixed is not None,
                            keys=output_keys(sp.seed, sp.temperature, ids),
                            echo_output=state.opts.output_mode == "echo", label=self.rid,
                            arrival_wall_s=arrival_wall_s, outputs=[fixed] if fixed is not None else None,
                            output_pieces=exact_pieces(state.tok, fixed) if fixed is not None else None,
                            hold_kv=self.kv_role.hold_kv, remote_prefill=self.kv_role.source is not None)
        if self.kv_role.source is not None:
            assert bridge.kv_agent is not None
            bridge.kv_agent.expect_pull(sub.seqs[0].seq_id, self.kv_role.source)
        self.inflight.add(self.rid, bridge, sub)
        views = [_SeqView(s, sp.stops, sp.include_stop) for s in sub.seqs]
        return sub, bridge, views, sp, ids

    def _decide_fault(self) -> str | None:
        """This request's injected fault: the ``x-kernelsight-fault`` metadata (the HTTP header's twin) or the
        seeded picker, counted as the HTTP server counts them."""
        try:
            return self.state.faults.decide_counted(self._metadata(FAULT_HEADER))
        except ValueError as exc:
            raise bad_request(f"X-Kernelsight-Fault: {exc}") from None

    async def _fail_before_engine(self, fault: str) -> None:
        if fault == "timeout":
            admission_done(self._scope)       # held outside the engine: the engine loops stop waiting for it
            # a hung replica never answers: held until the client gives up (cancelling this task), at most
            # timeout_s, then the stream ends as a dropped connection does for a gRPC client
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.Event().wait(), self.state.faults.config.timeout_s)
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "Connection dropped (injected timeout fault)")
        if fault == "invalid_api_key":
            raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "Unauthorized")
        state = self.state
        err = request_fault_error(fault, state.model_name, state.max_model_len, state.opts.served_model_names)
        assert err is not None, fault
        raise err

    # -- the answer ---------------------------------------------------------------------------
    async def _serve(self, sub: Submission, bridge: EngineBridge, views: list[_SeqView], sp: Sampling,
                     ids: list[int]) -> AsyncIterator[pb.GenerateResponse]:
        if (self.request.stream and len(views) == 1 and self.fault is None and not sp.stops
                and not sp.stop_token_ids and sp.logprobs is None and sp.prompt_logprobs is None):
            async for msg in self._serve_lean(sub, bridge, ids):
                yield msg
            return
        stream = self.request.stream
        first_sent: set[int] = set()
        held: list[pb.GenerateResponse] = []
        finished = False
        struck = False
        try:
            while True:
                await sub.event.wait()
                sub.event.clear()
                out: list[pb.GenerateResponse] = []
                for v in views:
                    before = v.consumed
                    if v.advance(bridge) is None:
                        continue
                    stop_token = self._stop_token(bridge, v, before, sp)
                    new_ids = v.ids[before:]
                    if stream:
                        first = v.seq.index not in first_sent
                        first_sent.add(v.seq.index)
                        out.append(pb.GenerateResponse(chunk=self._chunk(v, new_ids, before, ids, sp, first)))
                        if v.done:
                            out.append(pb.GenerateResponse(complete=self._complete(v, bridge, new_ids, before, ids,
                                                                                   sp, stop_token)))
                    elif v.done:
                        held.append(pb.GenerateResponse(complete=self._complete(v, bridge, v.ids, 0, ids, sp,
                                                                                stop_token)))
                for msg in out:
                    yield msg
                if self.fault is not None and not struck and (views[0].consumed >= self.fault_at
                                                              or all(v.done for v in views)):
                    struck = True
                    if self.fault == "stream-abort":       # the engine frees the blocks; the client sees a cut
                        bridge.abort(sub)
                        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "Connection dropped (injected stream-abort "
                                                                      "fault)")
                    await asyncio.sleep(self.state.faults.config.stall_s)     # stream-stall: nothing for stall_s
                if all(v.done for v in views):
                    for msg in sorted(held, key=lambda m: m.complete.index):     # non-streaming: all at the end
                        yield msg
                    break
            finished = True
        finally:
            self.inflight.remove(self.rid, sub)
            if finished:
                bridge.release(sub)
            else:
                bridge.abort(sub)       # the client went away (or the stream was cut): blocks freed now

    async def _serve_lean(self, sub: Submission, bridge: EngineBridge, ids: list[int]
                          ) -> AsyncIterator[pb.GenerateResponse]:
        """The common stream (one choice; no stop strings, stop ids, logprobs or fault): the released ids as they
        are, with no text kept (the general path decodes each token for stop strings). Same messages."""
        seq = sub.seqs[0]
        toks = seq.tokens
        n_prompt = len(ids)
        consumed = 0
        finished = False
        try:
            while True:
                await sub.event.wait()
                sub.event.clear()
                released, done = seq.released, seq.finished
                if released > consumed or done:
                    new_ids = toks[consumed:released]
                    consumed = released
                    r = seq.req
                    cached = max(r.num_cached_tokens, 0) if r is not None else 0
                    msg = pb.GenerateResponse()
                    chunk = msg.chunk
                    chunk.token_ids.extend(new_ids)
                    chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens = n_prompt, len(new_ids), cached
                    yield msg
                    if done:
                        end = pb.GenerateResponse()
                        c = end.complete
                        c.output_ids.extend(new_ids)
                        c.finish_reason = seq.finish_reason or "stop"
                        c.prompt_tokens, c.completion_tokens, c.cached_tokens = n_prompt, len(new_ids), cached
                        if self.kv_role.hold_kv and bridge.kv_agent is not None:
                            host, port = self.notify_address or ("127.0.0.1", 0)
                            params = bridge.kv_agent.response_params(seq.seq_id, host, port)
                            if params is not None:
                                c.kv_transfer_params_json = json.dumps(params, separators=(",", ":"))
                        yield end
                        break
            finished = True
        finally:
            self.inflight.remove(self.rid, sub)
            if finished:
                bridge.release(sub)
            else:
                bridge.abort(sub)

    def _stop_token(self, bridge: EngineBridge, v: _SeqView, before: int, sp: Sampling) -> int | None:
        """A generated id in ``stop_token_ids`` ends the choice after it (vLLM: stop_reason = the id)."""
        if not sp.stop_token_ids or v.stop_reason is not None:
            return None
        for j in range(before, v.consumed):
            t = v.ids[j]
            if t in sp.stop_token_ids:
                del v.ids[j + 1:]
                v.consumed = j + 1
                v.done, v.finish_reason = True, "stop"
                bridge.finish_early(v.seq, v.consumed)
                return t
        return None

    def _usage(self, v: _SeqView, ids: list[int]) -> tuple[int, int]:
        r = v.seq.req
        return len(ids), max(r.num_cached_tokens, 0) if r is not None else 0

    def _output_lp(self, v: _SeqView, start: int, count: int, sp: Sampling) -> pb.OutputLogProbs | None:
        k = sp.logprobs
        if k is None:
            return None
        top_k = min(self.state.tok.vocab_size if k == -1 else k, MAX_LOGPROBS)
        toks = v.seq.tokens
        ent = self.state.logprobs.entries
        out = pb.OutputLogProbs()
        for i in range(start, start + count):
            tid, text = toks.token(i)
            ents = ent(toks.key, i, tid, text, top_k)
            out.token_logprobs.append(ents[0][2])
            out.token_ids.append(tid)
            if top_k:
                out.top_logprobs.append(_top(ents[:top_k]))
        return out

    def _input_lp(self, ids: list[int], sp: Sampling) -> pb.InputLogProbs | None:
        k = sp.prompt_logprobs
        if k is None:
            return None
        top_k = min(self.state.tok.vocab_size if k == -1 else k, MAX_LOGPROBS)
        if not hasattr(self, "_plp"):
            self._plp = self.state.logprobs.prompt(ids, top_k)
        out = pb.InputLogProbs()
        for t, ents in zip(ids, self._plp, strict=True):
            item = pb.InputTokenLogProb()
            if ents is not None:
                item.value = ents[0][2]
            out.token_logprobs.append(item)
            out.token_ids.append(t)
            if top_k:
                out.top_logprobs.append(_top(ents[:top_k] if ents is not None else []))
        return out

    def _chunk(self, v: _SeqView, new_ids: list[int], before: int, ids: list[int], sp: Sampling,
               first: bool) -> pb.GenerateStreamChunk:
        prompt_tokens, cached = self._usage(v, ids)
        return pb.GenerateStreamChunk(token_ids=new_ids, prompt_tokens=prompt_tokens, completion_tokens=len(new_ids),
                                      cached_tokens=cached, index=v.seq.index,
                                      output_logprobs=self._output_lp(v, before, len(new_ids), sp),
                                      input_logprobs=self._input_lp(ids, sp) if first else None)

    def _complete(self, v: _SeqView, bridge: EngineBridge, out_ids: list[int], start: int, ids: list[int],
                  sp: Sampling, stop_token: int | None) -> pb.GenerateComplete:
        prompt_tokens, cached = self._usage(v, ids)
        msg = pb.GenerateComplete(output_ids=out_ids, finish_reason=v.finish_reason or "stop",
                                  prompt_tokens=prompt_tokens, completion_tokens=len(out_ids), cached_tokens=cached,
                                  index=v.seq.index, output_logprobs=self._output_lp(v, start, len(out_ids), sp),
                                  input_logprobs=self._input_lp(ids, sp))
        if stop_token is not None:
            msg.matched_token_id = stop_token
        elif v.stop_reason is not None:
            msg.matched_stop_str = v.stop_reason
        if self.kv_role.hold_kv and bridge.kv_agent is not None:
            host, port = self.notify_address or ("127.0.0.1", 0)
            params = bridge.kv_agent.response_params(v.seq.seq_id, host, port)
            if params is not None:
                msg.kv_transfer_params_json = json.dumps(params, separators=(",", ":"))
        return msg


def _top(ents: list[Entry]) -> pb.TopLogProbs:
    return pb.TopLogProbs(values=[e[2] for e in ents], token_ids=[e[0] for e in ents])
