"""One streamed request over HTTP, timed by ``vllm bench serve``'s rules (spec §7.4).

The measurement itself (``StreamTimer``) is pure: it is fed ``(receive time, SSE message)`` pairs and knows
nothing about sockets, so every rule is unit-testable on recorded chunk sequences:

* TTFT: the first *token-bearing* message. Completions: any message with a non-empty ``choices`` list
  (its text may be empty). Chat: ``choices[0].delta`` has non-empty content / reasoning / tool_calls /
  function_call, or ``content == ""`` without a ``role`` -- so the opening role chunk is not TTFT.
* ITL: the gap between consecutive token-bearing messages (one sample per chunk, not per token).
* E2EL: the last token-bearing message minus the start; the usage chunk and ``[DONE]`` do not count.
* Output tokens: ``usage.completion_tokens`` (fallback: a tokenizer count of the text, else the number of
  token-bearing chunks); the prompt length becomes ``usage.prompt_tokens`` when the server reports it, and its
  prefix-cache hit ``usage.prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``).
* The answer's token ids, when the server streams them (``return_token_ids``): multi-turn sessions extend their
  history with them.
* An in-stream ``{"error": ...}`` event has neither ``choices`` nor ``usage``, so it is ignored.

One departure from ``vllm bench serve``, which shares its pool and its 60 s idle lifetime: a request that meets a
pooled connection the server has already closed is sent again (``MAX_RESENDS``). vLLM's API server closes a
connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s); a client whose event loop is starved of CPU across that
close has not yet read the FIN when it takes the connection from the pool, so the request goes out on a closed
socket, the server never reads it, and the client sees a disconnect before any byte of a response. That is the
one case re-sent (RFC 9112 §9.3.1: the request was never applied), counted in ``ClientStats.resent``; a disconnect
on a new connection, or after any byte came back, stays a failed request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelsight.loadgen.metrics import RequestRecord

__all__ = ["StreamTimer", "SSEBuffer", "RequestSpec", "ClientStats", "send_streaming_request", "bench_session",
           "completions_payload", "chat_payload", "user_message", "NO_TOKEN_ERROR", "MAX_RESENDS"]

NO_TOKEN_ERROR = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"
_CHAT_TOKEN_KEYS = ("content", "reasoning", "reasoning_content", "tool_calls", "function_call")


def _chat_token_bearing(choices: list) -> bool:
    delta = choices[0].get("delta") or {}
    for k in _CHAT_TOKEN_KEYS:
        if delta.get(k):
            return True
    return delta.get("content") == "" and not delta.get("role")


@dataclass(slots=True)
class StreamTimer:
    """Times one response from its messages. ``start_s`` is the perf_counter just before the POST."""

    chat: bool
    start_s: float
    prompt_len: int
    ttft_s: float = 0.0
    last_token_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    num_token_chunks: int = 0
    token_ids: list[int] | None = None

    def on_message(self, data: dict[str, Any], t_s: float) -> None:
        choices = data.get("choices")
        if choices:
            if self.chat:
                if not _chat_token_bearing(choices):
                    return  # the opening role chunk (or an empty keep-alive delta)
                self.text_parts.append((choices[0].get("delta") or {}).get("content") or "")
            else:
                self.text_parts.append(choices[0].get("text") or "")
            ids = choices[0].get("token_ids")
            if ids:
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)
            if self.num_token_chunks == 0:
                self.ttft_s = t_s - self.start_s
            else:
                self.itl_s.append(t_s - self.last_token_s)
            self.last_token_s = t_s
            self.num_token_chunks += 1
        elif usage := data.get("usage"):
            self.usage_completion_tokens = usage.get("completion_tokens")
            self.usage_prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.usage_cached_tokens = details["cached_tokens"]

    def record(self, *, queue_s: float, start_rel_s: float, error: str = "",
               count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
        """The request's RequestRecord (``start_rel_s``: start relative to the benchmark start)."""
        text = "".join(self.text_parts)
        ok = not error and self.num_token_chunks > 0
        if not ok:
            return RequestRecord(False, self.prompt_len, 0, 0.0, [], 0.0, start_rel_s, queue_s,
                                 error or NO_TOKEN_ERROR, text)
        out_len = self.usage_completion_tokens or 0
        if out_len <= 0:  # no usage chunk: count the text, as vLLM does (chunks when no tokenizer)
            out_len = count_tokens(text) if count_tokens is not None else self.num_token_chunks
        prompt_len = self.usage_prompt_tokens or self.prompt_len
        return RequestRecord(True, prompt_len, out_len, self.ttft_s, self.itl_s, self.last_token_s - self.start_s,
                             start_rel_s, queue_s, "", text, cached_tokens=self.usage_cached_tokens,
                             output_token_ids=self.token_ids)


class SSEBuffer:
    """Splits a byte stream into SSE ``data:`` payloads (messages end with a blank line)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\n\n" not in buf and b"\r\n\r\n" not in buf:
            self._buf = buf
            return []
        buf = buf.replace(b"\r\n", b"\n")
        *messages, self._buf = buf.split(b"\n\n")
        out = []
        for msg in messages:
            for line in msg.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        return out


@dataclass(slots=True)
class RequestSpec:
    """What to send: endpoint URL, JSON payload, headers; ``prompt_len`` as the dataset counted it."""

    url: str
    payload: dict[str, Any]
    headers: dict[str, str]
    prompt_len: int
    chat: bool


@dataclass(slots=True)
class ClientStats:
    """The client's own cost: CPU seconds spent handling received bytes, and how many messages; and how many
    requests were sent again after meeting a pooled connection the server had closed (see the module doc)."""

    handle_s: float = 0.0
    num_messages: int = 0
    resent: int = 0

    @property
    def us_per_message(self) -> float:
        return 1e6 * self.handle_s / self.num_messages if self.num_messages else 0.0


#: re-sends of one request on stale pooled connections. Each failed try discards its dead connection, and by the
#: second the event loop has read every FIN that arrived meanwhile, so one is all the race needs in practice
MAX_RESENDS = 3


class _Attempt:
    """``trace_request_ctx`` of one try: whether aiohttp handed it a pooled (reused) connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_connection_reuse(_session: Any, ctx: Any, _params: Any) -> None:
    attempt = getattr(ctx, "trace_request_ctx", None)
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def bench_session(max_concurrency: int | None = None, total_timeout_s: float = 6 * 3600) -> Any:
    """The benchmark's aiohttp session, as ``vllm bench serve`` builds it (one pool of ``max_concurrency``
    connections, idle ones kept 60 s, a 6 h total timeout), plus the trace that tells ``send_streaming_request``
    which tries went out on a reused connection."""
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_connection_reuse)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=total_timeout_s),
                                 trace_configs=[trace])


async def _post(session: Any, spec: RequestSpec, stats: ClientStats | None) -> Any:
    """POST ``spec`` and return the response once its headers are in; a try that died on a reused connection
    before any byte came back is sent again (see the module doc)."""
    import aiohttp

    for k in range(MAX_RESENDS + 1):
        attempt = _Attempt()
        try:
            return await session.post(spec.url, json=spec.payload, headers=spec.headers, trace_request_ctx=attempt)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # a new connection's failure (refused, reset) is the server's answer; so is the last try's
            if not attempt.reused or k == MAX_RESENDS:
                raise
        if stats is not None:
            stats.resent += 1
    raise AssertionError("unreachable")  # pragma: no cover


async def send_streaming_request(session: Any, spec: RequestSpec, *, bench_start_s: float, queue_s: float,
                                 time_scale: float = 1.0, stats: ClientStats | None = None,
                                 count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """POST one streaming request on ``session`` (an aiohttp ClientSession, best ``bench_session``'s) and time it.

    ``time_scale`` (the server's ``--time-scale``) converts the measured wall seconds into the server's
    virtual seconds, so a sped-up kernelsight server reports in simulated time.
    """
    import aiohttp

    perf = time.perf_counter
    st = perf()
    timer = StreamTimer(spec.chat, st, spec.prompt_len)
    error = ""
    try:
        async with await _post(session, spec, stats) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                error = f"HTTP {resp.status} {resp.reason}: {body}"
            else:
                sse = SSEBuffer()
                loads = json.loads
                async for chunk in resp.content.iter_any():
                    t = perf()  # one receive time for every message in this read: they arrived together
                    messages = sse.feed(chunk)
                    for data in messages:
                        if data == b"[DONE]":
                            continue
                        try:
                            msg = loads(data)
                        except ValueError:
                            continue
                        timer.on_message(msg, t)
                    if stats is not None:
                        stats.handle_s += perf() - t
                        stats.num_messages += len(messages)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    rec = timer.record(queue_s=queue_s, start_rel_s=st - bench_start_s, error=error, count_tokens=count_tokens)
    if time_scale != 1.0:
        _scale_record(rec, time_scale)
    return rec


def _scale_record(rec: RequestRecord, k: float) -> None:
    rec.ttft_s *= k
    rec.latency_s *= k
    rec.itl_s = [x * k for x in rec.itl_s]
    rec.start_s *= k
    rec.queue_s *= k


def completions_payload(model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool,
                        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body vllm bench serve (0.33) posts to /v1/completions."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": max_tokens,
                            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


def user_message(text: str) -> dict[str, Any]:
    """A user message as vllm bench serve writes it (one text part)."""
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def chat_payload(model: str, prompt: str | list[dict[str, Any]], max_tokens: int, ignore_eos: bool,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body vllm bench serve (0.33) posts to /v1/chat/completions; ``prompt`` is the user's text, or the whole
    message list (a multi-turn session's history)."""
    messages = [user_message(prompt)] if isinstance(prompt, str) else prompt
    body: dict[str, Any] = {"model": model, "messages": messages,
                            "max_completion_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body
