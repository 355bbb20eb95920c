"""Multi-turn sessions: what each turn of a conversation adds, and how its prompt grows.

A session is a list of turns. Turn k's prompt is the whole history: turn k-1's prompt, turn k-1's answer, then turn
k's new user tokens; it is sent when turn k-1's answer has finished, plus a think time. ``kernelsight simulate``
(``session_fastforward.py``) appends the ids the simulated engine produced; ``kernelsight bench``
(``session_bench.py``) the answer the server returned. Both draw the sessions here, from the same flags and seed.

The flags are genai-perf's session options (``--num-sessions``, ``--session-concurrency``, ``--session-turns-mean``,
``--session-turns-stddev``, ``--session-turn-delay-mean``, ``--session-turn-delay-stddev``, delays in ms).

* ``synthetic_sessions`` -- random token ids: each turn ``--random-input-len`` new user tokens and
  ``--random-output-len`` answer tokens (± ``--random-range-ratio``), a ``--random-prefix-len`` system prompt shared
  by every session's first turn; turn counts and think times drawn from the session flags.
* ``sharegpt_sessions`` -- ShareGPT's real conversations: each human message and the gpt answer after it is a turn
  (the answer's token count its output length), think times from the session flags.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kernelsight.loadgen.datasets import _SYNTH_LOW_ID, _len_bounds, _open_text

__all__ = ["Turn", "Session", "SessionWorkload", "synthetic_sessions", "sharegpt_sessions", "answer_ids",
           "next_prompt", "synth_vocab"]


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def synth_vocab(vocab_size: int) -> int:
    """The id range synthetic session tokens are drawn below: the model's vocabulary, at most 32000 (as the trace
    dataset), so that ``bench`` (the tokenizer's size) and ``simulate`` (the model's) draw the same ids."""
    return max(min(32000, vocab_size), _SYNTH_LOW_ID + 1)


@dataclass(slots=True)
class Turn:
    """One turn: the user's new tokens (the first turn's with the tokenizer's special tokens), the answer's length
    and the think time before it is sent (after the previous answer; 0 for the first turn)."""

    user_ids: np.ndarray
    output_len: int
    delay_s: float = 0.0
    user_text: str | None = None        # the message as text, when the dataset has text


@dataclass(slots=True)
class Session:
    turns: list[Turn]


@dataclass(slots=True)
class SessionWorkload:
    """Sessions, each one's earliest start (seconds from the run's start) and how many may be open at once."""

    sessions: list[Session]
    starts_s: list[float]
    concurrency: int | None
    source: str                                         # "synthetic" or "sharegpt"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        counts = [len(s.turns) for s in self.sessions]
        return {"source": self.source, "num_sessions": len(self.sessions), "num_turns": self.num_turns,
                "turns_per_session_mean": float(np.mean(counts)) if counts else 0.0,
                "max_turns": max(counts, default=0), "session_concurrency": self.concurrency, **self.options}


def _turn_counts(rng: np.random.Generator, n: int, mean: float, stddev: float) -> np.ndarray:
    """genai-perf's turn counts: normal(mean, stddev) rounded, at least 1."""
    return np.maximum(1, np.rint(rng.normal(mean, stddev, size=n) if stddev > 0 else np.full(n, mean))).astype(int)


def _delays_s(rng: np.random.Generator, n: int, mean_ms: float, stddev_ms: float) -> np.ndarray:
    """Think times: normal(mean, stddev) ms, none below 0."""
    ms = rng.normal(mean_ms, stddev_ms, size=n) if stddev_ms > 0 else np.full(n, float(mean_ms))
    return np.maximum(ms, 0.0) / 1e3


def _fit_context(turns: list[Turn], max_context: int | None) -> list[Turn]:
    """The leading turns whose whole history (every user message and answer so far) stays below ``max_context``
    tokens; at least the first."""
    if max_context is None:
        return turns
    total = 0
    for k, t in enumerate(turns):
        total += len(t.user_ids) + t.output_len
        if total >= max_context and k > 0:
            return turns[:k]
    return turns


def synthetic_sessions(num_sessions: int, *, turns_mean: float, turns_stddev: float, delay_mean_ms: float,
                       delay_stddev_ms: float, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                       seed: int, prefix_len: int = 0, max_context: int | None = None) -> list[Session]:
    """``num_sessions`` sessions of random token ids (see the module doc), deterministic for ``seed``."""
    if num_sessions < 1:
        raise ValueError(f"--num-sessions must be >= 1, got {num_sessions}")
    if turns_mean < 1 or turns_stddev < 0:
        raise ValueError(f"--session-turns-mean must be >= 1 and --session-turns-stddev >= 0, got {turns_mean}, "
                         f"{turns_stddev}")
    if delay_mean_ms < 0 or delay_stddev_ms < 0:
        raise ValueError("--session-turn-delay-mean and --session-turn-delay-stddev must be >= 0")
    if input_len < 1 or output_len < 1:
        raise ValueError("sessions need --random-input-len and --random-output-len >= 1")
    vocab = synth_vocab(vocab_size)
    rng = np.random.default_rng([0x5E55, seed & 0xFFFFFFFF])
    system = rng.integers(_SYNTH_LOW_ID, vocab, size=prefix_len)
    counts = _turn_counts(rng, num_sessions, turns_mean, turns_stddev)
    in_lo, in_hi = _len_bounds(input_len, range_ratio)
    out_lo, out_hi = _len_bounds(output_len, range_ratio)
    in_lo, out_lo = max(in_lo, 1), max(out_lo, 1)
    out: list[Session] = []
    for n in counts.tolist():
        ins = rng.integers(in_lo, in_hi + 1, size=n)
        outs = rng.integers(out_lo, out_hi + 1, size=n)
        delays = _delays_s(rng, n, delay_mean_ms, delay_stddev_ms)
        turns = []
        for k in range(n):
            ids = rng.integers(_SYNTH_LOW_ID, vocab, size=int(ins[k]))
            if k == 0 and prefix_len:
                ids = np.concatenate([system, ids])
            turns.append(Turn(ids, int(outs[k]), float(delays[k]) if k else 0.0))
        out.append(Session(_fit_context(turns, max_context)))
    return out


def sharegpt_sessions(path: str | os.PathLike, num_sessions: int, tokenizer: _Encoder, seed: int, *,
                      delay_mean_ms: float = 0.0, delay_stddev_ms: float = 0.0, output_len: int | None = None,
                      max_context: int | None = None) -> list[Session]:
    """ShareGPT conversations as sessions: shuffled with ``seed``, each conversation's human messages and the gpt
    answer after each (in order, from the first human message; a message without an answer ends it) are its turns.
    A turn's output length is its answer's token count (``output_len`` fixes it). Conversations with no complete
    turn are skipped; never oversampled (a repeated conversation would share a whole history)."""
    if num_sessions < 1:
        raise ValueError(f"--num-sessions must be >= 1, got {num_sessions}")
    with _open_text(path) as fh:
        data = json.load(fh)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and isinstance(d.get("conversations"), list)]
    rng = np.random.default_rng([0x5E56, seed & 0xFFFFFFFF])
    order = rng.permutation(len(convs))
    out: list[Session] = []
    for c in order.tolist():
        if len(out) >= num_sessions:
            break
        turns = _conversation_turns(convs[c], tokenizer, output_len)
        if not turns:
            continue
        delays = _delays_s(rng, len(turns), delay_mean_ms, delay_stddev_ms)
        for k, t in enumerate(turns):
            t.delay_s = float(delays[k]) if k else 0.0
        out.append(Session(_fit_context(turns, max_context)))
    if not out:
        raise ValueError(f"{path}: no conversation has a human message answered by gpt")
    return out


def _conversation_turns(messages: list, tokenizer: _Encoder, output_len: int | None) -> list[Turn]:
    msgs = [(str(m.get("from", "")), str(m.get("value", ""))) for m in messages if isinstance(m, dict)]
    start = next((i for i, (who, _) in enumerate(msgs) if who == "human"), len(msgs))
    turns: list[Turn] = []
    i = start
    while i + 1 < len(msgs) and msgs[i][0] == "human" and msgs[i + 1][0] == "gpt":
        user, answer = msgs[i][1], msgs[i + 1][1]
        ids = tokenizer.encode(user, add_special_tokens=not turns)
        n_out = output_len if output_len is not None else len(tokenizer.encode(answer, add_special_tokens=False))
        if not ids or n_out < 1:
            break
        turns.append(Turn(np.asarray(ids, dtype=np.int64), n_out, 0.0, user))
        i += 2
    return turns


def answer_ids(seed: int, session: int, turn: int, length: int, vocab_size: int) -> np.ndarray:
    """The ids the simulated engine emits for a turn (fast-forward): drawn from (seed, session, turn), shared with
    no other turn, so only the session's own next turn can hit the blocks they fill."""
    rng = np.random.default_rng([0x5E57, seed & 0xFFFFFFFF, session, turn])
    return rng.integers(_SYNTH_LOW_ID, synth_vocab(vocab_size), size=length)


def next_prompt(prompt: np.ndarray, answer: np.ndarray | list[int], user_ids: np.ndarray) -> np.ndarray:
    """The next turn's prompt: the whole history so far, then the new user tokens."""
    return np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(answer, dtype=np.int64),
                           np.asarray(user_ids, dtype=np.int64)])
