"""The token ids a simulated sequence emits: drawn lazily and deterministically from a per-request key (splitmix64
over the position), from the tokenizer's pool of printable tokens, so that a seeded request repeats its output and
generated blocks carry real ids for prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernelsight.server.model.tokenizer import ServerTokenizer

__all__ = ["OutputTokens", "exact_pieces"]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_MASK64 = 0xFFFFFFFFFFFFFFFF
#: Output-token slices up to this long are drawn in Python (cheaper than numpy's per-call overhead).
_SHORT_SLICE = 32


def _splitmix64_int(x: int) -> int:
    """``_splitmix64`` on one Python int: ~10x cheaper than a 1-element numpy call (one token per SSE chunk)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class OutputTokens(Sequence[int]):
    """The token ids a sequence will emit, generated lazily and deterministically from ``key``.

    Handed to the engine as ``output_token_ids`` so that blocks of generated text are prefix-cached with
    their real ids (a follow-up turn that quotes an answer hits the cache, as in vLLM).
    """

    def __init__(self, tok: ServerTokenizer, key: int, length: int, echo_prompt: Sequence[int] | None = None,
                 pieces: Sequence[str] | None = None):
        self._tok = tok
        self._pieces = pieces       # per token of a fixed output: its text as incremental detokenization gives it
        self._key = np.uint64(key & 0xFFFFFFFFFFFFFFFF)
        self._ikey = key & _MASK64
        self._len = length
        self._echo = [t for t in echo_prompt if t < tok.vocab_size] if echo_prompt else None
        self._pool_ids = tok.pool_id_list         # bound once: ``token`` runs once per streamed token
        self._pool_texts = tok.pool_texts

    def __len__(self) -> int:
        return self._len

    @property
    def key(self) -> int:
        """The draw key (fixed by seed / greedy decoding): logprobs are derived from it too."""
        return int(self._key)

    def _pool_idx(self, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return (_splitmix64(pos + self._key) % np.uint64(self._tok.pool_size)).astype(np.int64)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if self._echo:
                return [self._echo[j % len(self._echo)] for j in range(start, stop)]
            if stop - start <= _SHORT_SLICE:
                # the engine hashes each full generated block (16 tokens) as it completes: at 256 streams that is
                # 256 slices in one step, ~11 µs each in Python against ~21 µs through numpy
                ids, key = self._tok.pool_id_list, self._ikey
                n = len(ids)
                return [ids[_splitmix64_int((j + key) & _MASK64) % n] for j in range(start, stop)]
            return self._tok.pool_ids(self._pool_idx(start, stop)).tolist()
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        return self.token(i)[0]

    def token(self, i: int) -> tuple[int, str]:
        """(id, text) of the i-th generated token."""
        if self._echo:
            t = self._echo[i % len(self._echo)]
            if self._pieces is not None and i < len(self._pieces):
                return t, self._pieces[i]
            return t, self._tok.decode([t])
        # _splitmix64_int inlined (one call less per streamed token)
        z = (i + self._ikey + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        k = (z ^ (z >> 31)) % len(self._pool_ids)
        return self._pool_ids[k], self._pool_texts[k]


def exact_pieces(tok: ServerTokenizer, ids: Sequence[int]) -> list[str] | None:
    """Each token's text when tokens decoded one by one do not join into the text (a character split over tokens,
    such as an emoji in byte-level BPE): as vLLM's incremental detokenizer gives it, a token that ends mid-character
    gives nothing and the next one the whole character. None when one-by-one decoding is exact (the usual case).
    ASCII text is taken as exact without the check (one decode per token costs ~12 µs: a tenth of the server's
    CPU per streamed token), as fixed outputs always were: a byte-level token never splits an ASCII character."""
    full = tok.decode(ids)
    if full.isascii() or "".join(tok.decode([t]) for t in ids) == full:
        return None
    pieces: list[str] = []
    emitted = ""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        if text.endswith("\ufffd") and i + 1 < len(ids):
            pieces.append("")
            continue
        pieces.append(text[len(emitted):])
        emitted = text
    return pieces
