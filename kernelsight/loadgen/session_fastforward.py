"""Multi-turn sessions on the virtual clock (``kernelsight simulate --num-sessions``).

Sessions start in order of their start times, at most ``concurrency`` open at once (a session holds its place
through its think times). Each turn is handed to the engine with the ids it will emit (``sessions.answer_ids``), so
the blocks its answer fills are prefix-cached with those ids; when it finishes, the next turn's prompt is its prompt,
the ids it actually produced and the new user tokens, arriving at the finish plus the think time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import FastForwardResult, _Sender, _Tracker, run_fast_forward
from kernelsight.loadgen.sessions import SessionWorkload, answer_ids, next_prompt
from kernelsight.simcore.engine_config import EngineConfig

__all__ = ["run_sessions"]


class _SessionSender(_Sender):
    """``_Sender``'s interface over sessions: ``pending`` holds the sessions not yet started, ``send`` starts them
    while fewer than the limit are open, and a finished turn sends the session's next one."""

    def __init__(self, wl: SessionWorkload, engine: Any, ignore_eos: bool, seed: int, vocab_size: int) -> None:
        super().__init__([], [], None, engine.add_request, ignore_eos, None, engine.get_request)
        self.wl, self.seed, self.vocab_size = wl, seed, vocab_size
        self.pending = deque(sorted(range(len(wl.sessions)), key=lambda i: wl.starts_s[i]))
        self.limit = wl.concurrency if wl.concurrency is not None else len(wl.sessions) + 1
        self.open_sessions = 0
        self.max_open_sessions = 0
        self._answers: dict[str, list[int]] = {}         # request id -> the ids its turn emits

    def send(self, now_s: float) -> None:
        while self.pending and self.open_sessions < self.limit:
            i = self.pending.popleft()
            self.open_sessions += 1
            self.max_open_sessions = max(self.max_open_sessions, self.open_sessions)
            start_s = float(self.wl.starts_s[i])
            self._submit(i, 0, self.wl.sessions[i].turns[0].user_ids, max(start_s, now_s), start_s)

    def _submit(self, session: int, turn: int, prompt: np.ndarray, send_s: float, due_s: float) -> None:
        t = self.wl.sessions[session].turns[turn]
        rid = f"ff-s{session}-t{turn}"
        prompt = np.asarray(prompt, dtype=np.int64)
        # a list: the engine hashes generated blocks from Python ints, as the server's OutputTokens gives them
        answer = answer_ids(self.seed, session, turn, t.output_len, self.vocab_size).tolist()
        self._answers[rid] = answer
        tr = self.trackers[rid] = _Tracker(SampleRequest.from_array(prompt, t.output_len), send_s, due_s,
                                           index=len(self.trackers), session=session, turn=turn)
        self.add_request(rid, prompt, t.output_len, ignore_eos=self.ignore_eos, arrival_s=send_s,
                         output_token_ids=answer)
        tr.req = self.get_request(rid)
        self.in_flight += 1

    def on_finished(self, tr: _Tracker, ends: list[float] | None) -> None:
        assert ends is not None and tr.session is not None and tr.turn is not None
        answer = self._answers.pop(f"ff-s{tr.session}-t{tr.turn}")
        turns = self.wl.sessions[tr.session].turns
        done = tr.sample
        # the record needs only the lengths: a long run would otherwise keep every turn's whole history
        tr.sample = SampleRequest(None, done.prompt_len, done.expected_output_len)
        if tr.num_tokens == 0 or tr.turn + 1 >= len(turns):
            self.open_sessions -= 1          # its last turn (or a failed one) closes the session
            return
        last = tr.segments[-1]
        finish_s = ends[last[0] + last[1] - 1]
        nxt = turns[tr.turn + 1]
        prompt = next_prompt(done.token_array, answer[:tr.num_tokens], nxt.user_ids)
        send_s = finish_s + nxt.delay_s
        self._submit(tr.session, tr.turn + 1, prompt, send_s, send_s)


def run_sessions(config: EngineConfig, wl: SessionWorkload, *, ignore_eos: bool = True, seed: int = 0,
                 record_timeline: bool = False,
                 on_finished: Callable[[int], None] | None = None) -> tuple[FastForwardResult, int]:
    """Simulate the sessions of ``wl`` on one engine; the result's records are the turns in the order they were
    sent (each with its session, turn and prefix-cache hit). Also returns the most sessions that were open at once."""
    senders: list[_SessionSender] = []

    def make(engine: Any) -> _SessionSender:
        senders.append(_SessionSender(wl, engine, ignore_eos, seed, config.model.vocab_size))
        return senders[0]

    res = run_fast_forward(config, [], [], ignore_eos=ignore_eos, record_timeline=record_timeline,
                           on_finished=on_finished, make_sender=make)
    return res, senders[0].max_open_sessions
