"""Workload datasets for the load generator (spec §7.2).

* ``random_dataset`` -- the ``vllm bench serve --dataset-name random`` workload, in token ids only
  (no tokenizer here, so there is no decode/re-encode round trip: lengths are exact).
* ``trace_dataset`` -- a JSONL (optionally gzip) trace with per-request arrival offsets and exact
  input/output lengths, e.g. ``sharegpt-llama-3.1-8b-300-sps10.jsonl.gz``.
* ``sharegpt_dataset`` -- ShareGPT-format JSON conversations (text; counted with a tokenizer).
* ``prefix_repetition_dataset`` -- a few shared random prefixes, each followed by random suffixes
  (token ids, so prefix sharing is exact).
* ``custom_dataset`` -- a JSONL of ``{"prompt": ..., "output_tokens": ...}``.
* ``mooncake_dataset`` -- Mooncake's trace format (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``): each hash id one block of token ids, equal ids equal blocks, so shared prefixes are real.

Text datasets take any tokenizer with ``encode(text, add_special_tokens=True) -> list[int]``.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
from collections.abc import Iterator
from typing import IO, Any, Protocol

import numpy as np

__all__ = ["SampleRequest", "random_dataset", "trace_dataset", "sharegpt_dataset", "prefix_repetition_dataset",
           "custom_dataset", "mooncake_dataset", "MOONCAKE_BLOCK_SIZE", "oversample"]


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

_GZIP_MAGIC = b"\x1f\x8b"
# Synthetic ids avoid the lowest ids, where small vocabularies keep special tokens (bos/eos/unk).
_SYNTH_LOW_ID = 100


class SampleRequest:
    """One request of a workload: its prompt (ids and/or text), lengths and, for traces, its own arrival offset.

    ``prompt_token_ids``: exact ids when known (trace with input_tok_ids, random). ``token_array``: the same ids as an
    integer array when the dataset built them that way: the simulator hashes prompt blocks with numpy, and converting
    10,000 long Python lists would cost it more than the rest of a step. A sample made by ``from_array`` keeps only
    the array and makes the list the first time ``prompt_token_ids`` is read (``kernelsight simulate`` never does).
    """

    __slots__ = ("_ids", "_lazy_ids", "prompt_len", "expected_output_len", "arrival_offset_s", "prompt", "token_array",
                 "mm_sizes", "mm_items", "mm_urls", "mm_frames")

    def __init__(self, prompt_token_ids: list[int] | None, prompt_len: int, expected_output_len: int,
                 arrival_offset_s: float | None = None, prompt: str | None = None,
                 token_array: np.ndarray | None = None) -> None:
        self._ids = prompt_token_ids
        self._lazy_ids = False
        self.prompt_len = prompt_len
        self.expected_output_len = expected_output_len
        self.arrival_offset_s = arrival_offset_s    # trace datasets carry their own timing
        self.prompt = prompt                        # text, when the dataset has text
        self.token_array = token_array
        self.mm_sizes: list[tuple[int, int]] | None = None   # images (width, height) sent with the prompt (random-mm)
        self.mm_items: tuple = ()          # their MultimodalItems in the prompt, once expanded for the engine
        self.mm_urls: list[str] | None = None    # the images' URLs when they are files, not synthetic (custom-image)
        self.mm_frames: list[int] | None = None  # per mm_sizes entry its frames: 1 an image, > 1 a video (random-mm)

    @classmethod
    def from_array(cls, ids: np.ndarray, expected_output_len: int) -> SampleRequest:
        """A sample whose ids are ``ids``; ``prompt_token_ids`` is ``ids.tolist()``, made when first read."""
        s = cls(None, len(ids), expected_output_len, token_array=ids)
        s._lazy_ids = True
        return s

    @property
    def prompt_token_ids(self) -> list[int] | None:
        if self._lazy_ids:
            self._ids = self.token_array.tolist()
            self._lazy_ids = False
        return self._ids

    @prompt_token_ids.setter
    def prompt_token_ids(self, ids: list[int] | None) -> None:
        self._ids, self._lazy_ids = ids, False

    def _key(self) -> tuple:
        return (self.prompt_token_ids, self.prompt_len, self.expected_output_len, self.arrival_offset_s, self.prompt)

    def __eq__(self, other: object) -> bool:      # as the dataclass it was: every field but token_array
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]   # mutable, compared by value (as a dataclass with eq)

    def __repr__(self) -> str:
        return (f"SampleRequest(prompt_token_ids={self.prompt_token_ids!r}, prompt_len={self.prompt_len!r}, "
                f"expected_output_len={self.expected_output_len!r}, arrival_offset_s={self.arrival_offset_s!r}, "
                f"prompt={self.prompt!r})")


# --------------------------------------------------------------------------------------------
# random
# --------------------------------------------------------------------------------------------


def _len_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Integer range [floor(L(1-r)), ceil(L(1+r))] that vllm bench serve samples lengths from."""
    return math.floor(length * (1.0 - range_ratio)), math.ceil(length * (1.0 + range_ratio))


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Synthetic token-id prompts like ``vllm bench serve --dataset-name random``.

    ``input_len`` is the length of the per-request body; the prompt is ``prefix_len`` shared tokens
    followed by the body, so ``prompt_len = prefix_len + body_len`` (as in vLLM). Deterministic for a
    given ``seed`` (numpy ``default_rng``).
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if not (0.0 <= range_ratio < 1.0):
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")

    rng = np.random.default_rng(seed)
    # Same draw order as vLLM: shared prefix, then input lengths, output lengths, offsets.
    prefix = rng.integers(0, vocab_size, size=prefix_len)

    in_low, in_high = _len_bounds(input_len, range_ratio)
    out_low, out_high = _len_bounds(output_len, range_ratio)
    out_low = max(out_low, 1)  # a request must generate at least one token
    if prefix_len == 0:
        in_low = max(in_low, 1)  # an empty prompt is not a request
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, vocab_size, size=num_prompts)

    # Request i's body is consecutive ids from a per-request offset, (offsets[i] + i + j) % vocab_size for j <
    # input_lens[i] (cheap, and distinct bodies across requests), after the shared prefix: built for every request at
    # once in one flat array, each request's prompt a view of its own stretch.
    seg_lens = input_lens.astype(np.int64) + prefix_len
    ends = np.cumsum(seg_lens)
    total = int(ends[-1]) if num_prompts else 0
    seg_starts = ends - seg_lens
    # int32 when every running value below fits (always, but for absurd sizes): half the memory of a
    # 1,000,000-request fleet's prompts, and the same ids (the simulator hashes them as uint64 values)
    dtype = np.int32 if vocab_size + num_prompts + int(in_high) + prefix_len < 2**31 else np.int64
    # flat[seg_starts[i] + p] = base[i] + p (mod vocab_size) for p ≥ prefix_len, built in place as the running sum of
    # its steps (1 within a prompt, the jump to the next prompt's base at its start): one array of the total size
    base = offsets.astype(np.int64) + np.arange(num_prompts, dtype=np.int64) - prefix_len
    flat = np.ones(total, dtype=dtype)
    if num_prompts:
        flat[0] = base[0]
        flat[seg_starts[1:]] = base[1:] - base[:-1] - seg_lens[:-1] + 1
    np.cumsum(flat, out=flat)
    flat %= vocab_size
    if prefix_len:
        pos = np.arange(total, dtype=np.int64) - np.repeat(seg_starts, seg_lens)    # position within the prompt
        in_prefix = pos < prefix_len
        flat[in_prefix] = prefix.astype(dtype)[pos[in_prefix]]
    out_lens = output_lens.tolist()
    starts, stops = seg_starts.tolist(), ends.tolist()
    return [SampleRequest.from_array(flat[a:b], n) for a, b, n in zip(starts, stops, out_lens, strict=True)]


# --------------------------------------------------------------------------------------------
# trace
# --------------------------------------------------------------------------------------------


def _open_text(path: str | os.PathLike) -> IO[str]:
    """Open plain or gzip text, deciding by the magic bytes rather than the file extension."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == _GZIP_MAGIC:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def jsonl_objects(path: str | os.PathLike, label: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file (gzip or plain); bad lines raise with
    ``label`` and the line number."""
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{label} line {lineno}: invalid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{label} line {lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _synth_ids(line_index: int, n_tokens: int, vocab_size: int) -> list[int]:
    """Deterministic pseudo-random ids for one trace line.

    Seeded by the line index, so two requests share no prefix (beyond chance on the first token),
    which keeps a prefix cache from finding sharing the trace does not have.
    """
    rng = np.random.default_rng([0x6B73, line_index])
    return rng.integers(_SYNTH_LOW_ID, vocab_size, size=n_tokens).tolist()


def _req_int(obj: dict, key: str, lineno: int, minimum: int) -> int:
    if key not in obj:
        raise ValueError(f"trace line {lineno}: missing required key {key!r}")
    val = obj[key]
    if isinstance(val, bool) or not isinstance(val, int | float) or val != int(val):
        raise ValueError(f"trace line {lineno}: {key!r} must be an integer, got {val!r}")
    val = int(val)
    if val < minimum:
        raise ValueError(f"trace line {lineno}: {key!r} must be >= {minimum}, got {val}")
    return val


def trace_dataset(
    path: str | os.PathLike,
    num_prompts: int | None = None,
    *,
    synth_vocab_size: int = 32000,
) -> list[SampleRequest]:
    """Read a JSONL trace (plain or gzip): one object per line with ``arrival_time_ns`` (offset from
    the start), ``input_toks``, ``output_toks`` (generated exactly) and optional ``input_tok_ids``.

    Requests are sorted by arrival (stable), and ``num_prompts`` keeps the first N of them. A trace is
    never oversampled: asking for more requests than it has returns all of them. When ids are absent
    they are synthesized (ids in ``[100, synth_vocab_size)``), distinct per request.
    """
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0 or None, got {num_prompts}")
    if synth_vocab_size <= _SYNTH_LOW_ID:
        raise ValueError(f"synth_vocab_size must be > {_SYNTH_LOW_ID}, got {synth_vocab_size}")

    rows: list[tuple[int, int, int, int, list[int] | None]] = []  # (arrival_ns, lineno, in, out, ids)
    for lineno, obj in jsonl_objects(path, "trace"):
        arrival_ns = _req_int(obj, "arrival_time_ns", lineno, 0)
        n_in = _req_int(obj, "input_toks", lineno, 1)
        n_out = _req_int(obj, "output_toks", lineno, 1)
        ids = obj.get("input_tok_ids")
        if ids is not None:
            if not isinstance(ids, list):
                raise ValueError(f"trace line {lineno}: 'input_tok_ids' must be a list")
            if len(ids) != n_in:
                raise ValueError(
                    f"trace line {lineno}: len(input_tok_ids)={len(ids)} != input_toks={n_in}"
                )
        rows.append((arrival_ns, lineno, n_in, n_out, ids))

    rows.sort(key=lambda r: (r[0], r[1]))  # by arrival; file order breaks ties
    if num_prompts is not None:
        rows = rows[:num_prompts]

    out: list[SampleRequest] = []
    for arrival_ns, lineno, n_in, n_out, ids in rows:
        if ids is None:
            ids = _synth_ids(lineno, n_in, synth_vocab_size)
        out.append(
            SampleRequest(
                prompt_token_ids=ids,
                prompt_len=n_in,
                expected_output_len=n_out,
                arrival_offset_s=arrival_ns / 1e9,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# oversampling, ShareGPT, prefix repetition, custom JSONL
# --------------------------------------------------------------------------------------------


def oversample(samples: list[SampleRequest], num_prompts: int, seed: int) -> list[SampleRequest]:
    """Repeat randomly drawn entries until there are ``num_prompts`` (vllm bench serve oversamples a
    dataset smaller than ``--num-prompts`` unless ``--no-oversample``)."""
    if len(samples) >= num_prompts or not samples:
        return samples
    rng = np.random.default_rng([seed, 0x05A])
    extra = rng.integers(0, len(samples), size=num_prompts - len(samples))
    return samples + [samples[int(i)] for i in extra]


def _encode_texts(tokenizer: _Encoder, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's ids: in one call when the tokenizer has ``encode_batch`` (the same ids as ``encode``), else one by
    one."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return batch(texts, add_special_tokens=add_special_tokens)
    if add_special_tokens:        # as the per-conversation loop called it: the tokenizer's own default
        return [tokenizer.encode(t) for t in texts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def sharegpt_dataset(path: str | os.PathLike, num_prompts: int, tokenizer: _Encoder, seed: int, *,
                     output_len: int | None = None, do_oversample: bool = True,
                     max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """ShareGPT JSON (a list of ``{"conversations": [{"value": prompt}, {"value": completion}, ...]}``),
    filtered by vllm bench serve's rules (spec §7.2): shuffled with the seed; the first two turns of each
    conversation are the prompt and the reference completion, whose token count is the output length
    unless ``output_len`` fixes it; pairs with a prompt < 4 tokens, an output < 4 (unless fixed), a prompt
    > 1024 or prompt + output > 2048 tokens are dropped."""
    with _open_text(path) as fh:
        data = json.load(fh)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and isinstance(d.get("conversations"), list) and len(d["conversations"]) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs)).tolist()
    out: list[SampleRequest] = []
    pos = 0
    while len(out) < num_prompts and pos < len(order):
        # The conversations are taken in the shuffled order, as one by one, but tokenized a chunk at a time (one
        # call into the tokenizer's batch encoder): a chunk as large as what is still missing at the pass rate so
        # far, so at most one chunk's tail is tokenized for nothing.
        need = num_prompts - len(out)
        size = need if not out else -(-need * pos // len(out))
        chunk = [convs[k] for k in order[pos:pos + max(size, 16)]]
        pos += len(chunk)
        prompts = [str(turns[0].get("value", "")) for turns in chunk]
        prompt_ids = _encode_texts(tokenizer, prompts, True)
        # a completion is counted only when its prompt could pass (a prompt too short or too long fails either way)
        fit = [i for i, ids in enumerate(prompt_ids) if 4 <= len(ids) <= max_prompt_len]
        n_outs: dict[int, int] = {}
        if output_len is None:
            completions = _encode_texts(tokenizer, [str(chunk[i][1].get("value", "")) for i in fit], False)
            n_outs = {i: len(ids) for i, ids in zip(fit, completions, strict=True)}
        for i in fit:
            ids = prompt_ids[i]
            n_out = output_len if output_len is not None else n_outs[i]
            if (output_len is None and n_out < 4) or len(ids) + n_out > max_total_len:
                continue
            out.append(SampleRequest(prompt_token_ids=ids, prompt_len=len(ids), expected_output_len=n_out,
                                     prompt=prompts[i]))
            if len(out) >= num_prompts:
                break
    if not out:
        raise ValueError(f"{path}: no conversation passed the ShareGPT length filters")
    return oversample(out, num_prompts, seed) if do_oversample else out


def prefix_repetition_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, vocab_size: int, seed: int) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, ``num_prompts // num_prefixes`` prompts each (prefix + a random
    suffix), shuffled, then oversampled up to ``num_prompts``. Token ids, so sharing is exact."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, num_prompts={num_prompts}], "
                         f"got {num_prefixes}")
    if prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix repetition needs prefix_len + suffix_len >= 1 and output_len >= 1")
    rng = np.random.default_rng(seed)
    low = min(_SYNTH_LOW_ID, vocab_size - 1)
    out: list[SampleRequest] = []
    for _ in range(num_prefixes):
        prefix = rng.integers(low, vocab_size, size=prefix_len).tolist()
        for _ in range(num_prompts // num_prefixes):
            ids = prefix + rng.integers(low, vocab_size, size=suffix_len).tolist()
            out.append(SampleRequest(prompt_token_ids=ids, prompt_len=len(ids), expected_output_len=output_len))
    perm = rng.permutation(len(out))
    return oversample([out[int(i)] for i in perm], num_prompts, seed)


def custom_dataset(path: str | os.PathLike, num_prompts: int, tokenizer: _Encoder, seed: int, *,
                   output_len: int = 256, do_oversample: bool = True,
                   chat_template: Any = None) -> list[SampleRequest]:
    """A JSONL of ``{"prompt": str, "output_tokens": int?}``. ``output_len`` -1 takes each line's
    ``output_tokens``; otherwise every request asks for ``output_len``. ``chat_template(prompt) -> str``
    wraps the prompt (vLLM applies the model's template unless ``--skip-chat-template``)."""
    out: list[SampleRequest] = []
    for lineno, obj in jsonl_objects(path, str(path)):
        if len(out) >= num_prompts:
            break
        if not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path} line {lineno}: expected an object with a string 'prompt'")
        if output_len == -1:
            n_out = _req_int(obj, "output_tokens", lineno, 1)
        else:
            n_out = output_len
        prompt = chat_template(obj["prompt"]) if chat_template is not None else obj["prompt"]
        ids = tokenizer.encode(prompt, add_special_tokens=chat_template is None)
        out.append(SampleRequest(prompt_token_ids=ids, prompt_len=len(ids), expected_output_len=n_out,
                                 prompt=prompt))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return oversample(out, num_prompts, seed) if do_oversample else out


# --------------------------------------------------------------------------------------------
# Mooncake traces
# --------------------------------------------------------------------------------------------

#: Tokens per hash id in Mooncake's published traces (kvcache-ai/Mooncake; aiperf's mooncake_trace loader uses it too).
MOONCAKE_BLOCK_SIZE = 512


class _HashBlocks:
    """The token ids of each hash id: ``block_size`` ids drawn from (seed, hash id) alone, so an id means the same
    block in every request, in ``simulate`` and ``bench`` alike; a request cut inside a block takes its head."""

    def __init__(self, block_size: int, vocab_size: int, seed: int) -> None:
        self.block_size, self.vocab_size, self.seed = block_size, vocab_size, seed
        self._cache: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        b = self._cache.get(hash_id)
        if b is None:
            rng = np.random.default_rng([0x4D43, self.seed & 0xFFFFFFFF, hash_id])
            b = self._cache[hash_id] = rng.integers(_SYNTH_LOW_ID, self.vocab_size, size=self.block_size)
        return b


def _hash_ids(obj: dict, lineno: int) -> list[int]:
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise ValueError(f"mooncake line {lineno}: 'hash_ids' must be a list of non-negative integers")
    return ids


def mooncake_dataset(path: str | os.PathLike, num_prompts: int | None = None, *, vocab_size: int = 32000,
                     seed: int = 0, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[SampleRequest]:
    """Read a Mooncake trace (JSONL, plain or gzip): per line ``timestamp`` (ms from the start; optional, 0),
    ``input_length``, ``output_length`` and ``hash_ids``.

    Each hash id is one ``block_size``-token block of ids in ``[100, vocab_size)``, the same for every request that
    names it; the prompt is its blocks in order, the last one cut so the prompt is exactly ``input_length`` tokens
    (it must end inside the last block, as aiperf requires). A line without hash ids gets ids of its own. Requests
    are sorted by timestamp (stable) and ``num_prompts`` keeps the first N; a trace is never oversampled.
    """
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0 or None, got {num_prompts}")
    if vocab_size <= _SYNTH_LOW_ID:
        raise ValueError(f"vocab_size must be > {_SYNTH_LOW_ID}, got {vocab_size}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    rows: list[tuple[float, int, int, int, list[int]]] = []   # (timestamp ms, lineno, in, out, hash ids)
    for lineno, obj in jsonl_objects(path, "mooncake"):
        ts = obj.get("timestamp", 0)
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
            raise ValueError(f"mooncake line {lineno}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
        n_in = _req_int(obj, "input_length", lineno, 1)
        n_out = _req_int(obj, "output_length", lineno, 1)
        ids = _hash_ids(obj, lineno)
        if ids and not (len(ids) - 1) * block_size < n_in <= len(ids) * block_size:
            raise ValueError(f"mooncake line {lineno}: input_length {n_in} must end in the last of its {len(ids)} "
                             f"hash blocks of {block_size} tokens ({(len(ids) - 1) * block_size + 1}.."
                             f"{len(ids) * block_size})")
        rows.append((float(ts), lineno, n_in, n_out, ids))
    rows.sort(key=lambda r: (r[0], r[1]))
    if num_prompts is not None:
        rows = rows[:num_prompts]
    blocks = _HashBlocks(block_size, vocab_size, seed)
    out: list[SampleRequest] = []
    for ts, lineno, n_in, n_out, ids in rows:
        if ids:
            prompt = np.concatenate([blocks.block(h) for h in ids])[:n_in]
        else:       # no blocks named: ids of its own (seeded by the line), shared with no other request
            prompt = np.random.default_rng([0x4D44, seed & 0xFFFFFFFF, lineno]).integers(
                _SYNTH_LOW_ID, vocab_size, size=n_in)
        s = SampleRequest.from_array(prompt, n_out)
        s.arrival_offset_s = ts / 1e3
        out.append(s)
    return out
