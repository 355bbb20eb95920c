"""Multi-turn sessions against a live server (``kernelsight bench --num-sessions``).

Each session is one task: it waits for its start, takes one of ``concurrency`` places (held through its think
times), and sends its turns one after the other, each once the previous answer has finished plus the think time
(divided by the server's ``--time-scale``, as the send schedule is). The history is what the server returned:

* chat (``/v1/chat/completions``): the message list, each earlier user message and the answer's text as an
  assistant message; the server renders it with its chat template.
* completions: token ids, the earlier prompt, the answer's ids (asked for with ``return_token_ids``; the answer's
  text encoded when the server does not return them) and the new user ids -- the prompts ``simulate`` builds.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelsight.loadgen.client import (
    ClientStats,
    RequestSpec,
    bench_session,
    chat_payload,
    completions_payload,
    send_streaming_request,
    user_message,
)
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.progress import Progress
from kernelsight.loadgen.sessions import SessionWorkload, Turn, next_prompt

__all__ = ["SessionBenchRun", "run_session_bench"]


@dataclass(slots=True)
class SessionBenchRun:
    records: list[RequestRecord]            # one per turn sent, in the order they finished
    duration_s: float                       # in the server's (virtual) seconds when time_scale != 1
    wall_s: float
    cpu_s: float
    client: ClientStats
    max_open_sessions: int


class _History:
    """One session's history as the next request carries it."""

    def __init__(self, chat: bool, first: Turn, decode: Callable[[Sequence[int]], str]) -> None:
        self.chat, self.decode = chat, decode
        self.messages: list[dict[str, Any]] = [user_message(self._text(first))] if chat else []
        self.ids = np.asarray(first.user_ids, dtype=np.int64)

    def _text(self, turn: Turn) -> str:
        return turn.user_text if turn.user_text is not None else self.decode(turn.user_ids.tolist())

    def prompt(self) -> list[dict[str, Any]] | list[int]:
        return list(self.messages) if self.chat else self.ids.tolist()

    def extend(self, rec: RequestRecord, nxt: Turn, encode: Callable[[str], list[int]]) -> None:
        if self.chat:
            self.messages += [{"role": "assistant", "content": rec.generated_text}, user_message(self._text(nxt))]
        else:
            answer = rec.output_token_ids if rec.output_token_ids is not None else encode(rec.generated_text)
            self.ids = next_prompt(self.ids, answer, nxt.user_ids)


async def run_session_bench(base_url: str, wl: SessionWorkload, *, model: str, chat: bool, endpoint: str,
                            ignore_eos: bool, decode: Callable[[Sequence[int]], str],
                            encode: Callable[[str], list[int]], time_scale: float = 1.0,
                            count_tokens: Callable[[str], int] | None = None, headers: dict[str, str] | None = None,
                            extra_body: dict | None = None, progress: bool = False,
                            request_id_prefix: str = "bench-") -> SessionBenchRun:
    """Run ``wl``'s sessions against ``base_url + endpoint`` and time every turn (see the module doc)."""
    url = base_url.rstrip("/") + endpoint
    hdrs = dict(headers or {})
    extra = dict(extra_body or {})
    if not chat:
        extra.setdefault("return_token_ids", True)
    sem = asyncio.Semaphore(wl.concurrency) if wl.concurrency else None
    stats = ClientStats()
    records: list[RequestRecord] = []
    bar = Progress(wl.num_turns, enabled=progress)
    open_now = [0, 0]            # sessions open now, most at once

    async def one_session(i: int, http: Any, t0: float) -> None:
        due = t0 + wl.starts_s[i] / time_scale
        if (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        t_wait = time.perf_counter()
        if sem is not None:
            await sem.acquire()
        queue_s = (time.perf_counter() - t_wait) * time_scale
        open_now[0] += 1
        open_now[1] = max(open_now[1], open_now[0])
        try:
            turns = wl.sessions[i].turns
            hist = _History(chat, turns[0], decode)
            for k, turn in enumerate(turns):
                if k and turn.delay_s > 0:
                    await asyncio.sleep(turn.delay_s / time_scale)
                payload = (chat_payload(model, hist.prompt(), turn.output_len, ignore_eos, extra) if chat else
                           completions_payload(model, hist.prompt(), turn.output_len, ignore_eos, extra))
                spec = RequestSpec(url, payload, {**hdrs, "x-request-id": f"{request_id_prefix}s{i}-t{k}"},
                                   len(hist.ids) if not chat else 0, chat)
                rec = await send_streaming_request(http, spec, bench_start_s=t0, queue_s=queue_s if k == 0 else 0.0,
                                                   time_scale=time_scale, stats=stats, count_tokens=count_tokens)
                rec.session, rec.turn = i, k
                records.append(rec)
                bar.update()
                if not rec.success:
                    break                   # a failed turn ends its session: there is no answer to build on
                if k + 1 < len(turns):
                    hist.extend(rec, turns[k + 1], encode)
        finally:
            open_now[0] -= 1
            if sem is not None:
                sem.release()

    gc.collect()
    gc.freeze()      # as run_bench: keep full collections over the datasets out of the measured latencies
    try:
        async with bench_session(wl.concurrency) as http:
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            await asyncio.gather(*(one_session(i, http, t0) for i in range(len(wl.sessions))))
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
    finally:
        gc.unfreeze()
    bar.close()
    return SessionBenchRun(records, wall * time_scale, wall, cpu, stats, open_now[1])
