"""One completion or chat request from validation to its last byte (``Generation``): limits, submission to an
engine bridge, the non-streaming body, and the SSE chunks, rendered by the same code for the handler's general
path and the bridge's stream fast path (``fastpath.FastStream``). Also the request checks the two generation
routes share (``stop_list``, ``check_sampling``, ``request_base``) and ``_SeqView`` (released tokens -> text
deltas, stop strings)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kernelsight.server.engine.admissions import admission_done
from kernelsight.server.engine.bridge import EngineBridge, Seq, Submission
from kernelsight.server.engine.fastpath import RAW_SEND_KEY, RECV_KEY, FastStream
from kernelsight.server.integrations.faults import (
    FAULT_HEADER,
    IN_ENGINE_FAULTS,
    UNAUTHORIZED_BODY,
    drop_connection,
    request_fault_error,
)
from kernelsight.server.integrations.kv_transfer import NO_TRANSFER, transfer_role
from kernelsight.server.integrations.sleep_mode import SLEEPING_MESSAGE
from kernelsight.server.model.logprobs import MAX_LOGPROBS
from kernelsight.server.model.output_tokens import exact_pieces
from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import APIError, bad_request, sse_error_event
from kernelsight.server.wire.jsonio import dumps, json_response
from kernelsight.server.wire.protocol.version import MAX_STOP_STRINGS
from kernelsight.server.wire.sse import SSEResponse, await_or_disconnect, watch_disconnect


def request_base(request: Request, body_id: str | None) -> str:
    """The request id after its prefix: X-Request-Id, else the body's request_id, else random."""
    hdr = request.headers.get("x-request-id")
    if hdr:
        return hdr
    if body_id:
        return body_id
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The ``stop`` field as a list, checked as vLLM checks it."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"The number of stop strings ({len(stops)}) exceeds the maximum of {MAX_STOP_STRINGS}.",
                          "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop cannot contain an empty string.", "stop")
    return stops


def check_sampling(req: Any, max_tokens: int | None, field_name: str) -> None:
    """vLLM's sampling-parameter checks (400 naming the parameter); ``field_name`` names ``max_tokens``."""
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.", "n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{field_name} must be at least 1, got {max_tokens}.", field_name)
    if req.temperature is not None and req.temperature < 0:
        raise bad_request(f"temperature must be non-negative, got {req.temperature}.", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}.", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {req.top_k}.", "top_k")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise bad_request(f"min_p must be in [0, 1], got {req.min_p}.", "min_p")
    if req.presence_penalty is not None and not -2 <= req.presence_penalty <= 2:
        raise bad_request(f"presence_penalty must be in [-2, 2], got {req.presence_penalty}.", "presence_penalty")
    if req.frequency_penalty is not None and not -2 <= req.frequency_penalty <= 2:
        raise bad_request(f"frequency_penalty must be in [-2, 2], got {req.frequency_penalty}.", "frequency_penalty")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.", "min_tokens")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.",
                          "min_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if req.cache_salt is not None and (len(req.cache_salt) > 128 or any(c in req.cache_salt for c in "@/\\\0")):
        raise bad_request("Parameter 'cache_salt' must be at most 128 characters and contain no '@', '/', '\\' "
                          "or NUL characters.", "cache_salt")


class _SeqView:
    """Turns a sequence's released tokens into text deltas (stop strings, stop-buffer hold-back)."""

    __slots__ = ("seq", "consumed", "text", "sent", "ids", "stop_reason", "finish_reason", "done", "stops",
                 "hold", "include_stop", "cut")

    def __init__(self, seq: Seq, stops: list[str], include_stop: bool) -> None:
        self.seq = seq
        self.consumed = 0
        self.text = ""
        self.sent = 0
        self.ids: list[int] = []
        self.stop_reason: str | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1   # vLLM withholds a possible stop prefix
        self.include_stop = include_stop
        self.cut: int | None = None

    def advance(self, bridge: EngineBridge, pending: tuple[int, bool, str | None] | None = None) -> str | None:
        """Consume newly released tokens; returns the new text delta (None: nothing new to send).

        ``pending`` = (released, finished, finish_reason) after a step whose deadline has not passed yet: the
        stream fast path renders a step's chunk ahead of time, while the sequence itself still shows the
        state before the step (it changes only at the deadline)."""
        seq = self.seq
        if self.done:
            return None
        if pending is None:
            released, finished, reason = seq.released, seq.finished, seq.finish_reason
        else:
            released, finished, reason = pending
        n_new = released - self.consumed
        if n_new <= 0 and not finished:
            return None
        start = len(self.text)
        for i in range(self.consumed, released):
            tid, piece = seq.tokens.token(i)
            self.ids.append(tid)
            self.text += piece
            self.consumed = i + 1
            if self.stops:
                lo = max(start - self.hold, 0)
                for s in self.stops:
                    j = self.text.find(s, lo)
                    if j >= 0:
                        self.cut = j + len(s) if self.include_stop else j
                        self.stop_reason = s
                        break
                if self.stop_reason is not None:
                    bridge.finish_early(seq, self.consumed)
                    break
                start = len(self.text)
        if self.stop_reason is not None:
            self.text = self.text[: self.cut]
            self.finish_reason = "stop"
            self.done = True
        elif finished:
            self.finish_reason = reason or "stop"
            self.done = True
        limit = len(self.text) if self.done or not self.stops else max(len(self.text) - self.hold, self.sent)
        delta = self.text[self.sent:limit]
        self.sent = limit
        if not delta and not self.done:
            return None
        return delta

    @property
    def num_tokens(self) -> int:
        return self.consumed


class Generation:
    """One completion / chat request from validation to the last byte."""

    def __init__(self, state: ServerState, request: Request, req: Any, rid: str, lora: str | None,
                 stops: list[str], is_chat: bool) -> None:
        self.state = state
        self.request = request
        self.req = req
        self.rid = rid
        self.lora = lora
        self.stops = stops
        self.is_chat = is_chat
        self.model = lora or state.model_name
        self.created = int(time.time())
        self.echo_text: str | None = None
        self.kv_role = NO_TRANSFER            # P/D disaggregation: what kv_transfer_params asked of this instance
        self.tail_done = False                 # streaming: the usage chunk and [DONE] are rendered
        self._role_sent = False
        self._echoed: set[int] = set()
        self._text_lens: list[int] = []
        self.lp_k: int | None = None      # logprobs per generated token (completions logprobs / chat top_logprobs)
        self.plp_k: int | None = None     # prompt logprobs
        self.fixed_output: list[int] | None = None   # the token ids every choice emits (structured outputs, tools)
        self.engine_error: APIError | None = None     # refused by the engine's parameter checks (structured outputs)
        self.fast_ok = True               # False: a caller re-renders the chunks (no stream fast path)
        # tokens in logprobs as "token_id:<id>": the request's field, else the server flag
        as_ids = getattr(req, "return_tokens_as_token_ids", None)
        self.lp_as_ids: bool = state.opts.return_tokens_as_token_ids if as_ids is None else bool(as_ids)
        so = req.stream_options
        self.include_usage = bool(state.opts.enable_force_include_usage or (so is not None and so.include_usage))
        self.continuous = bool(self.include_usage and so is not None and so.continuous_usage_stats)
        self.headers = {"X-Request-Id": request.headers.get("x-request-id") or rid.split("-", 1)[1]} \
            if state.opts.enable_request_id_headers else None

    # -- validation + submission --------------------------------------------------------------
    def _limits(self, prompts: list[tuple[list[int], str | None]], max_tokens: int | None,
                field_name: str) -> list[int]:
        L = self.state.max_model_len
        out = []
        for ids, _ in prompts:
            n = len(ids)
            if n > L:
                raise bad_request(f"This model's maximum context length is {L} tokens. However, your prompt "
                                  f"contains {n} input tokens, which exceeds this limit even without any output "
                                  f"tokens. Please reduce the length of the input prompt.", "input_tokens")
            if max_tokens is not None and max_tokens > L:
                raise bad_request(f"{field_name}={max_tokens} cannot be greater than max_model_len={L}. "
                                  f"Please request fewer output tokens.", field_name)
            out.append(max(min(L - n, max_tokens if max_tokens is not None else L - n), 0))
        return out

    def _decoder_prompt_error(self, n: int) -> APIError:
        L = self.state.max_model_len
        return bad_request(f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                           f"is longer than the maximum model length of {L}. Make sure that `max_model_len` is no "
                           f"smaller than the number of text tokens (prompt + requested output tokens).")

    def _logprobs_error(self) -> APIError | None:
        """The engine's max_logprobs check (input processor: sample logprobs first, then prompt logprobs)."""
        vocab = self.state.tok.vocab_size
        for k, what, param in ((self.lp_k, "sample", "logprobs"), (self.plp_k, "prompt", "prompt_logprobs")):
            if k:
                num = vocab if k == -1 else k
                if num > MAX_LOGPROBS:
                    return bad_request(f"Requested {what} logprobs of {num}, which is greater than max allowed: "
                                       f"{MAX_LOGPROBS}", param)
        return None

    # -- logprobs (only built when requested) -------------------------------------------------
    def _token_steps(self, v: _SeqView, start: int, stop: int, k: int) -> list:
        toks = v.seq.tokens
        key = toks.key
        ent = self.state.logprobs.entries
        out = []
        for i in range(start, stop):
            tid, text = toks.token(i)
            out.append((tid, text, ent(key, i, tid, text, k)))
        return out

    def _prompt_lp(self, p: int) -> list:
        """Engine prompt-logprob dicts of prompt p (computed once, shared by its n choices)."""
        cache = self.__dict__.setdefault("_plp", {})
        if p not in cache:
            cache[p] = self.state.logprobs.prompt(self.prompts[p][0], self.plp_k or 0)
        return cache[p]

    def _prompt_steps(self, p: int) -> list:
        """Echoed prompt tokens as completion logprob steps (the first one has no logprob)."""
        ids = self.prompts[p][0]
        plp = self._prompt_lp(p)
        dec = self.state.tok.decode
        return [(t, dec([t], skip_special_tokens=False) if e is None else e[0][1], e)
                for t, e in zip(ids, plp, strict=True)]

    def _choice_prompt_lp(self, p: int) -> list | None:
        return self.state.logprobs.prompt_wire(self._prompt_lp(p)) if self.plp_k is not None else None

    def _keys(self, prompts: list[tuple[list[int], str | None]]) -> list[int] | None:
        """Deterministic outputs (like greedy or seeded sampling) for identical prompts; else random."""
        req = self.req
        if req.seed is None and req.temperature != 0:
            return None
        out = []
        for ids, _ in prompts:
            h = hashlib.blake2b(dumps([req.seed, ids[-4096:], len(ids)]).encode(), digest_size=8).digest()
            out.append(int.from_bytes(h, "little") >> 1)
        return out

    async def run(self, prompts: list[tuple[list[int], str | None]], max_tokens: int | None, *, echo_only: bool,
                  field_name: str) -> Response:
        req = self.req
        limits = self._limits(prompts, max_tokens, field_name)
        lp_err = self._logprobs_error()
        if lp_err is not None:
            if not req.stream:
                raise lp_err
            self.prompts = prompts
            return SSEResponse(self._error_stream(lp_err), self.headers)
        if self.engine_error is not None:      # vLLM validates structured outputs after logprobs, in generate()
            if not req.stream:
                raise self.engine_error
            self.prompts = prompts
            return SSEResponse(self._error_stream(self.engine_error), self.headers)
        if self.plp_k is not None:      # requested only: long prompts off the event loop (~0.1 ms per token)
            self.prompts = prompts
            cache = self.__dict__.setdefault("_plp", {})
            for p, (ids, _) in enumerate(prompts):
                if len(ids) > 256:
                    cache[p] = await asyncio.to_thread(self.state.logprobs.prompt, ids, self.plp_k)
        if echo_only:
            return self._echo_only(prompts)
        bad_len = next((len(ids) for ids, _ in prompts if len(ids) >= self.state.max_model_len), None)
        if bad_len is not None and not req.stream:
            raise self._decoder_prompt_error(bad_len)
        bridge = self.state.pick_bridge(self.request)
        if bridge.closing:       # shutting down (a request admitted after SIGTERM's abort): vLLM rejects with 503
            raise APIError("The server is shutting down and cannot accept new requests.", "Service Unavailable", 503)
        if self.state.sleep.is_sleeping:      # sleep mode: weights/KV cache are off the (simulated) GPU
            raise APIError(SLEEPING_MESSAGE, "Service Unavailable", 503)
        self.prompts = prompts
        if bad_len is not None:   # streaming: the engine-side check surfaces as an in-stream error
            return SSEResponse(self._error_stream(self._decoder_prompt_error(bad_len)), self.headers)
        fault = self._decide_fault()
        if fault is not None and fault not in IN_ENGINE_FAULTS:
            return await self._fail_before_engine(fault)
        self.state.check_admission(len(prompts) * req.n)
        self.fault = fault
        self._fault_at = max(1, limits[0] // 2)       # stream-abort / stream-stall strike half-way
        self._raw_send = self.request.scope.get(RAW_SEND_KEY)
        if bridge.kv_agent is not None:
            self.kv_role = transfer_role(req.kv_transfer_params, len(prompts) * req.n == 1)
            self.kv_bridge = bridge
        extra = ("lora", self.lora) if self.lora else None
        if req.cache_salt:
            extra = (*(extra or ()), "cache_salt", req.cache_salt)
        fixed = self.fixed_output
        if fixed is not None:        # drawn up front: it ends where it ends (EOS, see bridge.submit), or at max_tokens
            limits = [min(lim, len(fixed)) for lim in limits]
        sub = bridge.submit([ids for ids, _ in prompts], limits, req.n, min_tokens=req.min_tokens,
                            ignore_eos=req.ignore_eos or fixed is not None, priority=self._priority(),
                            extra_keys=extra, keys=self._keys(prompts),
                            echo_output=self.state.opts.output_mode == "echo", label=self.rid,
                            arrival_wall_s=self.request.scope.get(RECV_KEY),
                            outputs=[fixed] * len(prompts) if fixed is not None else None,
                            output_pieces=exact_pieces(self.state.tok, fixed) if fixed is not None else None,
                            hold_kv=self.kv_role.hold_kv, remote_prefill=self.kv_role.source is not None)
        if self.kv_role.source is not None:
            bridge.kv_agent.expect_pull(sub.seqs[0].seq_id, self.kv_role.source)
        admission_done(self.request.scope)
        self.views = [_SeqView(s, self.stops, req.include_stop_str_in_output) for s in sub.seqs]
        if req.stream:
            self._text_lens = [0] * len(self.views)      # vLLM's previous_text_lens: generated text only
            if fault is not None:        # the general path, where the stream can be cut or paused between chunks
                return SSEResponse(self._faulted_stream(bridge, sub), self.headers)
            fast = FastStream(self, bridge, sub) if self._fast_eligible() else None
            return SSEResponse(self._stream(bridge, sub), self.headers, fast)
        if fault == "stream-abort":
            v0 = self.views[0]
            if await await_or_disconnect(self.request, sub, bridge, until=lambda: v0.seq.released >= self._fault_at):
                bridge.abort(sub)            # the engine frees the request's blocks; the client gets no answer
                drop_connection(self._raw_send)
            return Response(status_code=499)
        try:
            ok = await await_or_disconnect(self.request, sub, bridge)
        except asyncio.CancelledError:
            raise
        if not ok:
            return Response(status_code=499)
        if fault == "stream-stall":
            await asyncio.sleep(self.state.faults.config.stall_s)     # the answer is late by the stall
        for v in self.views:
            v.advance(bridge)
        bridge.release(sub)
        return json_response(self._full_response(), headers=self.headers)

    # -- fault injection (server/integrations/faults.py) ---------------------------------------------------------------
    def _decide_fault(self) -> str | None:
        """This request's injected fault (counted), from its X-Kernelsight-Fault header or the seeded picker."""
        try:
            return self.state.faults.decide_counted(self.request.headers.get(FAULT_HEADER))
        except ValueError as exc:
            raise bad_request(f"X-Kernelsight-Fault: {exc}") from None

    async def _fail_before_engine(self, fault: str) -> Response:
        """The faults that never reach the engine: an error answer, or (timeout) no answer at all."""
        if fault == "timeout":
            # vLLM has no request timeout: a hung replica simply never answers, and the client's (or the router's)
            # own timeout decides. Held until the client leaves, at most timeout_s; then the connection is closed
            # with nothing sent, as when an idle-timeout middlebox or a dying replica cuts it.
            admission_done(self.request.scope)
            raw_send = self.request.scope.get(RAW_SEND_KEY)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(watch_disconnect(self.request.receive), self.state.faults.config.timeout_s)
            drop_connection(raw_send)
            return Response(status_code=499)        # unsent: the connection is gone
        if fault == "invalid_api_key":
            return json_response(UNAUTHORIZED_BODY, 401)
        err = request_fault_error(fault, self.model, self.state.max_model_len, self.state.opts.served_model_names)
        assert err is not None, fault
        raise err

    async def _faulted_stream(self, bridge: EngineBridge, sub: Submission) -> AsyncIterator[str]:
        """The general stream path with a stream-abort (the connection closes half-way, no [DONE]: the request is
        aborted in the engine) or a stream-stall (nothing is sent for stall_s half-way; the engine keeps
        generating, and what it made meanwhile goes out at once after the pause)."""
        inner = self._stream(bridge, sub)
        v0 = self.views[0]
        struck = False
        try:
            async for text in inner:
                if not struck and (v0.consumed >= self._fault_at or self.tail_done):
                    struck = True
                    if self.fault == "stream-abort":
                        break            # this chunk is never sent
                    yield text
                    await asyncio.sleep(self.state.faults.config.stall_s)
                    continue
                yield text
        finally:
            await inner.aclose()         # not run to its end: aborts the request in the engine (frees its blocks)
        if struck and self.fault == "stream-abort":
            drop_connection(self._raw_send)

    def _priority(self) -> int:
        hdr = self.request.headers.get("x-vllm-priority")
        if hdr is not None:
            with contextlib.suppress(ValueError):
                return int(hdr)
        return self.req.priority

    # -- usage --------------------------------------------------------------------------------
    def _num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.prompts)

    def _cached_tokens(self) -> int:
        # per prompt: the prefix hit of its first sequence (siblings share the prompt)
        n = self.req.n
        total = 0
        for p in range(len(self.prompts)):
            r = self.views[p * n].seq.req
            total += max(r.num_cached_tokens, 0) if r is not None else 0
        return total

    def _usage(self, completion_tokens: int, *, details_null: bool, completion_details: bool = False) -> dict:
        pt = self._num_prompt_tokens()
        u: dict[str, Any] = {"prompt_tokens": pt, "total_tokens": pt + completion_tokens,
                             "completion_tokens": completion_tokens}
        if self.state.opts.enable_prompt_tokens_details:
            u["prompt_tokens_details"] = {"cached_tokens": self._cached_tokens()}
        elif details_null:
            u["prompt_tokens_details"] = None
        if details_null or completion_details:
            u["completion_tokens_details"] = None
        return u

    # -- non-streaming ------------------------------------------------------------------------
    def _full_response(self) -> dict[str, Any]:
        total = sum(v.num_tokens for v in self.views)
        if self.is_chat:
            choices = []
            for v in self.views:
                content = (self.echo_text or "") + v.text if self.echo_text is not None else v.text
                choices.append({"index": v.seq.index,
                                "message": {"role": "assistant", "content": content, "refusal": None,
                                            "annotations": None, "audio": None, "function_call": None,
                                            "reasoning": None},
                                "logprobs": None if self.lp_k is None else self.state.logprobs.chat(
                                    self._token_steps(v, 0, v.consumed, self.lp_k), self.lp_k, self.lp_as_ids),
                                "finish_reason": v.finish_reason, "stop_reason": v.stop_reason,
                                "token_ids": v.ids if self.req.return_token_ids else None,
                                "routed_experts": None, "weight_versions": None})
            return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": choices, "service_tier": None, "system_fingerprint": self.state.fingerprint,
                    "usage": self._usage(total, details_null=True),
                    "prompt_logprobs": self._choice_prompt_lp(0),
                    "prompt_token_ids": self.prompts[0][0] if self.req.return_token_ids else None,
                    "prompt_text": None, "kv_transfer_params": self._kv_transfer_params(), "ec_transfer_params": None,
                    "metrics": None}
        n = self.req.n
        choices = []
        for v in self.views:
            p = v.seq.index // n
            ids, text = self.prompts[p]
            prefix = (text if text is not None else self.state.tok.decode(ids)) if self.req.echo else ""
            logprobs = None
            if self.lp_k is not None:
                steps = self._token_steps(v, 0, v.consumed, self.lp_k)
                if self.req.echo:
                    steps = self._prompt_steps(p) + steps
                logprobs = self.state.logprobs.completion(steps, 0, self.lp_k, self.lp_as_ids)
            choices.append({"index": v.seq.index, "text": prefix + v.text, "logprobs": logprobs,
                            "finish_reason": v.finish_reason, "stop_reason": v.stop_reason,
                            "token_ids": v.ids if self.req.return_token_ids else None,
                            "prompt_logprobs": self._choice_prompt_lp(p),
                            "prompt_token_ids": ids if self.req.return_token_ids else None,
                            "routed_experts": None, "weight_versions": None})
        return self._completion_envelope(choices, total)

    def _completion_envelope(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "service_tier": None, "system_fingerprint": self.state.fingerprint,
                "usage": self._usage(completion_tokens, details_null=True),
                "kv_transfer_params": self._kv_transfer_params() if self.views else None,
                "ec_transfer_params": None, "metrics": None}

    def _kv_transfer_params(self) -> dict[str, Any] | None:
        """A prefill instance's answer to do_remote_decode: where the decode side pulls the KV from."""
        if not self.kv_role.hold_kv:
            return None
        url = self.request.url
        return self.kv_bridge.kv_agent.response_params(self.views[0].seq.seq_id, url.hostname or "localhost",
                                                       url.port or 80)

    def _echo_only(self, prompts: list[tuple[list[int], str | None]]) -> Response:
        """echo with max_tokens=0: the prompt back, no generation."""
        self.prompts = prompts
        self.views = []
        n = self.req.n
        choices = []
        for p, (ids, text) in enumerate(prompts):
            logprobs = None
            if self.lp_k is not None:
                logprobs = self.state.logprobs.completion(self._prompt_steps(p), 0, self.lp_k, self.lp_as_ids)
            for i in range(n):
                choices.append({"index": p * n + i, "text": text if text is not None else self.state.tok.decode(ids),
                                "logprobs": logprobs, "finish_reason": "length", "stop_reason": None,
                                "token_ids": None, "prompt_logprobs": self._choice_prompt_lp(p),
                                "prompt_token_ids": None, "routed_experts": None, "weight_versions": None})
        body = self._completion_envelope(choices, 0)
        body["usage"]["prompt_tokens_details"] = None if not self.state.opts.enable_prompt_tokens_details else \
            {"cached_tokens": 0}
        if self.req.stream:
            return SSEResponse(self._echo_stream(choices), self.headers)
        return json_response(body, headers=self.headers)

    async def _echo_stream(self, choices: list[dict[str, Any]]) -> AsyncIterator[str]:
        for c in choices:
            lp = dumps(c["logprobs"]) if c["logprobs"] is not None else "null"
            yield self._cmpl_chunk(c["index"], c["text"], "length", None, final=True, logprobs=lp)
        if self.include_usage:
            yield self._usage_chunk(0)
        yield "data: [DONE]\n\n"

    # -- streaming ----------------------------------------------------------------------------
    async def _error_stream(self, err: APIError) -> AsyncIterator[str]:
        yield sse_error_event(err, compact=self.is_chat)
        yield "data: [DONE]\n\n"

    def _head(self, obj: str) -> str:
        heads = self.__dict__.setdefault("_heads", {})
        h = heads.get(obj)
        if h is None:
            h = heads[obj] = (f'{{"id":{dumps(self.rid)},"object":"{obj}","created":{self.created},'
                              f'"model":{dumps(self.model)},')
        return h

    def _cmpl_chunk(self, index: int, text: str, finish: str | None, stop_reason: str | None, final: bool,
                    token_ids: list[int] | None = None, usage: dict | None = None, logprobs: str = "null") -> str:
        ids = dumps(token_ids) if token_ids is not None else "null"
        choice = (f'{{"index":{index},"text":{dumps(text)},"logprobs":{logprobs},"finish_reason":{dumps(finish)},'
                  f'"stop_reason":{dumps(stop_reason)},"prompt_token_ids":null,"token_ids":{ids},'
                  f'"weight_versions":null}}')
        tail = f',"usage":{dumps(usage)}' if usage is not None else ""
        if final and not self.include_usage:
            tail += f',"system_fingerprint":{dumps(self.state.fingerprint)}'
        return f'data: {self._head("text_completion")}"choices":[{choice}]{tail},"kv_transfer_params":null}}\n\n'

    def _chat_role_chunk(self, index: int, usage: dict | None) -> str:
        tail = f',"usage":{dumps(usage)}' if usage is not None else ""
        return (f'data: {self._head("chat.completion.chunk")}"choices":[{{"index":{index},"delta":{{"role":"assistant",'
                f'"content":""}},"logprobs":null,"finish_reason":null}}]{tail},"prompt_token_ids":null,'
                f'"prompt_text":null}}\n\n')

    def _chat_chunk(self, index: int, text: str | None, finish: str | None, stop_reason: str | None,
                    token_ids: list[int] | None = None, usage: dict | None = None, logprobs: str = "null") -> str:
        delta = f'{{"content":{dumps(text)}}}' if text is not None else "{}"
        ids = dumps(token_ids) if token_ids is not None else "null"
        if finish is None:
            choice = (f'{{"index":{index},"delta":{delta},"logprobs":{logprobs},"finish_reason":null,'
                      f'"token_ids":{ids}}}')
        else:
            choice = (f'{{"index":{index},"delta":{delta},"logprobs":{logprobs},"finish_reason":{dumps(finish)},'
                      f'"stop_reason":{dumps(stop_reason)},"token_ids":{ids},"weight_versions":null}}')
        tail = f',"usage":{dumps(usage)}' if usage is not None else ""
        if finish is not None and not self.include_usage:
            tail += f',"system_fingerprint":{dumps(self.state.fingerprint)}'
        return f'data: {self._head("chat.completion.chunk")}"choices":[{choice}]{tail},"kv_transfer_params":null}}\n\n'

    def _usage_chunk(self, completion_tokens: int) -> str:
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        usage = self._usage(completion_tokens, details_null=False)
        return (f'data: {self._head(obj)}"choices":[],"usage":{dumps(usage)},'
                f'"system_fingerprint":{dumps(self.state.fingerprint)}}}\n\n')

    def _render(self, bridge: EngineBridge, pending: tuple[int, bool, str | None] | None = None,
                force_tail: bool = False) -> str:
        """The SSE text for every choice's newly released tokens, plus the tail (usage chunk, [DONE]) once all
        choices are done. Shared by the handler's slow path and the bridge's fast path (``pending``: the one
        choice's state after a step not yet released, see ``_SeqView.advance``), so both send the same bytes."""
        if self.tail_done:
            return ""
        req = self.req
        want_ids = bool(req.return_token_ids)
        lp_k = self.lp_k
        lps = self.state.logprobs
        parts: list[str] = []
        for v in self.views:
            before = v.consumed
            delta = v.advance(bridge, pending)
            if delta is None:
                continue
            new_ids = v.ids[before:] if want_ids else None
            lp = "null"
            lp_new = False      # new tokens carry logprobs: their chunk is never skipped
            if lp_k is not None:
                steps = self._token_steps(v, before, v.consumed, lp_k)
                lp_new = bool(steps)
                if self.is_chat:
                    lp = dumps(lps.chat(steps, lp_k, self.lp_as_ids))
                else:
                    if req.echo and v.seq.index not in self._echoed:
                        steps = self._prompt_steps(v.seq.index // req.n) + steps
                    lp = dumps(lps.completion(steps, self._text_lens[v.seq.index], lp_k, self.lp_as_ids))
                    self._text_lens[v.seq.index] += len(delta)
            usage = None
            if self.continuous:
                usage = self._usage(v.num_tokens, details_null=False, completion_details=True)
            fin = v.finish_reason if v.done else None
            if self.is_chat:
                if not self._role_sent:
                    self._role_sent = True
                    for rv in self.views:
                        ru = self._usage(0, details_null=False, completion_details=True) if self.continuous else None
                        parts.append(self._chat_role_chunk(rv.seq.index, ru))
                        if self.echo_text:
                            parts.append(self._chat_chunk(rv.seq.index, self.echo_text, None, None))
                if fin is None and delta == "" and not new_ids and not lp_new:
                    continue
                text = delta if (delta or fin is None or v.num_tokens) else None
                parts.append(self._chat_chunk(v.seq.index, text, fin, v.stop_reason, new_ids, usage, lp))
            else:
                if req.echo and v.seq.index not in self._echoed:
                    self._echoed.add(v.seq.index)
                    ids, text = self.prompts[v.seq.index // req.n]
                    delta = (text if text is not None else self.state.tok.decode(ids)) + delta
                if fin is None and delta == "" and not new_ids and not lp_new:
                    continue
                parts.append(self._cmpl_chunk(v.seq.index, delta, fin, v.stop_reason, fin is not None,
                                              new_ids, usage, lp))
        if force_tail or all(v.done for v in self.views):
            self.tail_done = True
            if self.include_usage:
                parts.append(self._usage_chunk(sum(v.num_tokens for v in self.views)))
            parts.append("data: [DONE]\n\n")
        return "".join(parts)

    async def _stream(self, bridge: EngineBridge, sub: Submission) -> AsyncIterator[str]:
        """The slow path: wake on every release of this request's tokens and render them here."""
        finished = False
        try:
            while not self.tail_done:
                await sub.event.wait()
                sub.event.clear()
                text = self._render(bridge, force_tail=sub.closed)   # closed under us: server shutting down
                if text:
                    yield text
            finished = True
            bridge.release(sub)
        finally:
            if not finished:
                bridge.abort(sub)

    def _fast_eligible(self) -> bool:
        """The stream fast path covers the common case: one choice, no stop strings, logprobs, echo or
        per-chunk usage (those keep the general path)."""
        req = self.req
        return (self.state.opts.stream_fast_path and self.fast_ok and len(self.views) == 1 and not self.stops
                and self.lp_k is None and not self.continuous and not getattr(req, "echo", False)
                and not self.echo_text)
