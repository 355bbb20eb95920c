"""Synthetic but plausible logprobs, laid out as vLLM 0.33 puts them on the wire.

Per position the engine (vLLM V1) hands the serving layer a dict ``{token_id: Logprob(logprob, rank,
decoded_token)}`` that holds the sampled token **first**, then the top-k tokens in rank order (the sampled
token appears once when it is itself in the top-k). The OpenAI layers read that dict:

* completions: ``top_logprobs[i]`` is the whole dict keyed by decoded token (so k or k+1 entries, the
  sampled one first); ``token_logprobs[i]`` is the sampled token's logprob; ``text_offset`` advances by
  the length of each decoded token;
* chat: ``top_logprobs`` is the dict's first ``top_logprobs`` entries (the sampled token leads when it is
  not the most likely one, as in vLLM);
* ``prompt_logprobs``: the raw dicts, ``None`` for the first prompt token.

Values are deterministic per (sequence key, position): the key is the one the sequence's output tokens are
drawn from (fixed by ``seed`` / greedy decoding), so a seeded request repeats its logprobs exactly. The
sampled token's logprob lies in (-3, 0], the ranked probabilities are non-increasing and sum to at most 1,
and every alternative is a real vocabulary token from the generation pool. Logprobs are float32 values, as
the engine returns them. Nothing here runs unless a request asks for logprobs.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

from kernelsight.server.model.tokenizer import ServerTokenizer

MAX_LOGPROBS = 20               # vLLM's --max-logprobs default
_M64 = (1 << 64) - 1
_F32 = struct.Struct("<f")

# (token id, decoded token, logprob, rank): one entry of the engine's per-position dict
Entry = tuple[int, str, float, int]


def _mix(x: int) -> int:
    """splitmix64 finalizer on Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _f32(x: float) -> float:
    return _F32.unpack(_F32.pack(x))[0]


def prompt_key(ids: Sequence[int]) -> int:
    """Prompt logprobs depend on the prompt only (same model, same prompt → same numbers)."""
    h = hashlib.blake2b(repr((len(ids), list(ids[-4096:]))).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def token_label(tid: int, text: str, as_ids: bool) -> str:
    """How a token is written in logprobs: its decoded text, or ``"token_id:<id>"`` with
    ``return_tokens_as_token_ids`` (tokens that are not valid UTF-8 on their own stay identifiable)."""
    return f"token_id:{tid}" if as_ids else text


class LogprobSynth:
    def __init__(self, tok: ServerTokenizer) -> None:
        self.tok = tok
        self.pool = tok.pool_size

    def entries(self, key: int, pos: int, tid: int, text: str, k: int) -> list[Entry]:
        """The engine's dict for one position, in its order: the chosen token, then ranks 1..k without it."""
        h = _mix((key & _M64) ^ ((pos * 0xD1B54A32D192ED03) & _M64))

        def u(j: int) -> float:
            return _mix(h + j) / 18446744073709551616.0

        u0 = u(0)
        rank = 1 if u0 < 0.62 else 2 if u0 < 0.82 else 3 if u0 < 0.92 else 4 + int(u(1) * 6)
        m = max(k, rank)
        p = 0.3 + 0.69 * u(2)
        probs = [p]
        rest = 1.0 - p
        for j in range(1, m):
            p = min(p, rest * (0.2 + 0.45 * u(3 + j)))
            rest -= p
            probs.append(p)
        if probs[rank - 1] < 0.05:      # keep the chosen token's logprob above -3
            rank = 1
        lps = [_f32(math.log(q)) for q in probs]
        out: list[Entry] = [(tid, text, lps[rank - 1], rank)]
        if k:
            used = {tid}
            pool = self.pool
            for r in range(1, k + 1):
                if r == rank:
                    continue
                a = _mix(h ^ (0xA5A5A5A5 + r)) % pool
                for _ in range(pool):
                    alt, alt_text = self.tok.pool_token(a)
                    if alt not in used:
                        break
                    a = (a + 1) % pool
                used.add(alt)
                out.append((alt, alt_text, lps[r - 1], r))
        return out

    # -- wire layouts ----------------------------------------------------------------------------------
    @staticmethod
    def completion(steps: Sequence[tuple[int, str, list[Entry] | None]], offset0: int, k: int,
                   as_ids: bool = False) -> dict[str, Any]:
        """CompletionLogProbs for a run of tokens: (id, decoded token, engine dict or None) each; at most k+1
        entries per top_logprobs dict (the chosen token plus the top k). ``as_ids``: tokens are written
        ``"token_id:<id>"`` (``return_tokens_as_token_ids``), offsets advancing by that label's length as in vLLM."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top: list[dict[str, float] | None] = []
        last_len = 0
        for tid, text, ents in steps:
            label = token_label(tid, text, as_ids)
            tokens.append(label)
            if ents is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(ents[0][2])
                top.append({token_label(i, t, as_ids): lp for i, t, lp, _ in ents[:k + 1]})
            text_offset.append(offset0 if not text_offset else text_offset[-1] + last_len)
            last_len = len(label)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top}

    @staticmethod
    def chat(steps: Sequence[tuple[int, str, list[Entry]]], k: int, as_ids: bool = False) -> dict[str, Any]:
        """ChatCompletionLogProbs: {"content": [{token, logprob, bytes, top_logprobs}]} (``as_ids``: see
        :meth:`completion`; the bytes are then those of the label)."""
        content = []
        for tid, text, ents in steps:
            label = token_label(tid, text, as_ids)
            content.append({"token": label, "logprob": ents[0][2], "bytes": list(label.encode("utf-8", "replace")),
                            "top_logprobs": [{"token": (lab := token_label(i, t, as_ids)), "logprob": lp,
                                              "bytes": list(lab.encode("utf-8", "replace"))}
                                             for i, t, lp, _ in ents[:k]]})
        return {"content": content}

    def prompt(self, ids: Sequence[int], k: int) -> list[list[Entry] | None]:
        """Engine dicts for the prompt positions (None for the first token)."""
        key = prompt_key(ids)
        dec = self.tok.decode
        out: list[list[Entry] | None] = [None]
        for pos in range(1, len(ids)):
            t = ids[pos]
            out.append(self.entries(key, pos, t, dec([t], skip_special_tokens=False), k))
        return out

    @staticmethod
    def prompt_wire(plp: Sequence[list[Entry] | None]) -> list[dict[str, dict[str, Any]] | None]:
        """The raw prompt_logprobs field: [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]."""
        return [None if ents is None else
                {str(t): {"logprob": lp, "rank": r, "decoded_token": s} for t, s, lp, r in ents}
                for ents in plp]
