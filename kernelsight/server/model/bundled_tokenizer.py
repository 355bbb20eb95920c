"""The tokenizers kernelsight ships: each publisher's own vocabulary file, turned into its model's HF tokenizer.

``kernelsight/profiles/tokenizers/index.json`` names, per model family, the bundled file (Meta's Llama 3 and
Llama 4 ``tokenizer.model``, Qwen's ``qwen.tiktoken``, OpenAI's ``o200k_base.tiktoken``, Mistral's SentencePiece
``tokenizer.model``), its source, licence and sha256, and the pieces of the Hugging Face tokenizer around the
vocabulary (pre-tokenizer regex, normalizer, special tokens, BOS rule). The files are stored unmodified
(xz-compressed) so their hash is the publisher's; the HF tokenizer is built from them here the way Hugging Face
built the models' tokenizer.json files (transformers' TikTokenConverter / LlamaConverter), which is why it
encodes exactly as those do.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import lzma
import os
import re
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "profiles" / "tokenizers"


@dataclass(frozen=True)
class BundledFamily:
    """One manifest entry (see index.json for the meaning of each field)."""

    name: str
    file: str
    format: str                       # "tiktoken" | "sentencepiece"
    sha256: str
    publisher: str
    source: str
    licence: str
    model_patterns: tuple[str, ...]
    vocab_sizes: tuple[int, ...]
    spec: dict[str, Any]

    def matches(self, model: str, vocab_size: int) -> bool:
        if vocab_size and vocab_size not in self.vocab_sizes:
            return False
        return any(re.search(p, model) for p in self.model_patterns)

    def chat_template_for(self, model: str) -> str | None:
        for rule in self.spec.get("chat_templates", []):
            if re.search(rule["models"], model):
                return (TOKENIZER_DIR / rule["file"]).read_text(encoding="utf-8")
        return None

    @property
    def where(self) -> str:
        return f"{self.publisher}: {self.source}; {self.licence}; sha256 {self.sha256[:16]}"


@functools.cache
def families() -> dict[str, BundledFamily]:
    data = json.loads((TOKENIZER_DIR / "index.json").read_text(encoding="utf-8"))
    return {name: BundledFamily(name=name, file=f["file"], format=f["format"], sha256=f["sha256"],
                                publisher=f["publisher"], source=f["source"], licence=f["licence"],
                                model_patterns=tuple(f["models"]), vocab_sizes=tuple(f["vocab_sizes"]), spec=f)
            for name, f in data["families"].items()}


def family_for(model: str, vocab_size: int = 0) -> BundledFamily | None:
    """The bundled family serving ``model`` (an HF id or a path naming it), if any."""
    for fam in families().values():
        if fam.matches(model, vocab_size):
            return fam
    return None


def read_verified(fam: BundledFamily) -> bytes:
    """The publisher's file, uncompressed; refuses a file whose hash is not the pinned one."""
    data = lzma.decompress((TOKENIZER_DIR / fam.file).read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != fam.sha256:
        raise ValueError(f"bundled tokenizer {fam.file}: sha256 {digest} is not the pinned {fam.sha256}")
    return data


# -- tiktoken rank files --------------------------------------------------------------------------------
def tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """tiktoken's format: one ``base64(token) rank`` per line."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (the alphabet of byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def _bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges as transformers' TikTokenConverter derives them: every split of a token into two
    tokens is a merge, ranked by the merged token's rank (then by the halves' ranks)."""
    table = _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                merges.append((rank, rl, rr, left, right))
    merges.sort(key=lambda m: m[:3])
    return vocab, [(text(m[3]), text(m[4])) for m in merges]


# -- SentencePiece model files --------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; length-delimited values as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"sentencepiece model: unsupported protobuf wire type {wire}")
        yield field, wire, value


def sentencepiece_pieces(data: bytes) -> list[tuple[str, float, int]]:
    """(piece, score, type) of a SentencePiece ModelProto, in id order (ModelProto field 1 = pieces)."""
    pieces = []
    for field, _, value in _fields(data):
        if field != 1:
            continue
        piece, score, kind = "", 0.0, 1
        for f, _, v in _fields(value):
            if f == 1:
                piece = v.decode("utf-8")
            elif f == 2:
                score = struct.unpack("<f", v)[0]
            elif f == 3:
                kind = v
        pieces.append((piece, score, kind))
    return pieces


def _bpe_from_pieces(pieces: list[tuple[str, float, int]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges as transformers' SentencePieceExtractor derives them for a BPE model: every split
    into two pieces is a merge, ranked by the merged piece's score (highest first), then the halves' ids."""
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    merges: list[tuple[float, int, int, str, str]] = []
    for i, (piece, score, _) in enumerate(pieces):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-score, i, vocab[left] * len(vocab) + vocab[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return vocab, [(m[3], m[4]) for m in merges]


# -- the HF tokenizer -------------------------------------------------------------------------------------
def _added_tokens(fam: BundledFamily) -> list[tuple[int, str, bool]]:
    spec = fam.spec
    out = [(int(i), t, True) for i, t in spec["special_tokens"].items()]
    out += [(int(i), t, False) for i, t in dict(spec.get("non_special_tokens") or {}).items()]
    res = spec.get("reserved_special_tokens") or []
    # one numbered range, or several (Llama 4 numbers each group of reserved tokens on its own)
    for rng in [res] if isinstance(res, dict) else res:
        skip = set(rng.get("skip_ids", []))
        out += [(i, rng["name"].format(rng["first_index"] + i - rng["first_id"]), True)
                for i in range(rng["first_id"], rng["last_id"] + 1) if i not in skip]
    return sorted(out)


def build_tokenizer(fam: BundledFamily) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the model's HF tokenizer.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    spec = fam.spec
    data = read_verified(fam)
    if fam.format == "tiktoken":
        vocab, merges = _bpe_from_ranks(tiktoken_ranks(data))
        tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=bool(spec["ignore_merges"])))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        if spec["normalizer"] == "NFC":
            tok.normalizer = normalizers.NFC()
        tail = processors.ByteLevel(trim_offsets=False)
    elif fam.format == "sentencepiece":
        vocab, merges = _bpe_from_pieces(sentencepiece_pieces(data))
        tok = Tokenizer(BPE(vocab, merges, unk_token=spec["unk_token"], fuse_unk=True, byte_fallback=True))
        # the legacy Llama/Mistral pipeline: "▁" for spaces and before the text, no pre-tokenizer
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
        tail = None
    else:
        raise ValueError(f"bundled tokenizer {fam.name}: unknown format {fam.format!r}")
    added = _added_tokens(fam)
    for tid, content, _ in added:
        if tid < len(vocab) and vocab.get(content) != tid:
            raise ValueError(f"bundled tokenizer {fam.name}: {content!r} is not id {tid} in the vocabulary")
    base = tok.get_vocab_size(with_added_tokens=False)
    expected = [i for i, _, _ in added if i >= base]
    if expected != list(range(base, base + len(expected))):
        raise ValueError(f"bundled tokenizer {fam.name}: added tokens do not follow the vocabulary contiguously")
    for _, content, special in added:      # in id order: new added tokens take the next free id
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    # re-check every id landed where the manifest says
    for tid, content, _ in added:
        if tok.token_to_id(content) != tid:
            raise ValueError(f"bundled tokenizer {fam.name}: {content!r} got id {tok.token_to_id(content)}, not {tid}")
    if spec["add_bos"]:
        bos = spec["bos_token"]
        template = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                 special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = template if tail is None else processors.Sequence([tail, template])
    elif tail is not None:
        tok.post_processor = tail
    return tok


# Bumped whenever build_tokenizer's output changes, so a stale cached build is never picked up.
BUILD_VERSION = 1


def cache_dir() -> Path:
    """Where built tokenizers are kept between runs: $KERNELSIGHT_CACHE_DIR, else the XDG cache."""
    root = os.environ.get("KERNELSIGHT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kernelsight")
    return Path(root) / "tokenizers"


def built_tokenizer_file(fam: BundledFamily) -> Path:
    """A tokenizer.json for the family: built once (seconds: ~10^5 merges derived in Python), then reused
    (loading a tokenizer.json is a fraction of that). The name carries the source hash and BUILD_VERSION."""
    name = f"{fam.name}-{fam.sha256[:16]}-v{BUILD_VERSION}.json"
    for d in (cache_dir(), Path(tempfile.gettempdir()) / f"kernelsight-{os.getuid()}" / "tokenizers"):
        path = d / name
        if path.is_file():
            return path
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{name}.{os.getpid()}.tmp"
            build_tokenizer(fam).save(str(tmp))
            os.replace(tmp, path)    # atomic: a concurrent reader sees the whole file or none
            return path
        except OSError:
            continue                 # unwritable cache: try the next place
    raise OSError(f"bundled tokenizer {fam.name}: no writable cache directory for its built tokenizer.json")


# One load at a time: transformers' lazy attribute import is not safe from two threads at once (two bench
# clients in one process hit it), and a family is built once rather than by every caller racing to it.
_LOAD_LOCK = threading.Lock()


def load_bundled(name: str, instruct: bool = False) -> Any:
    """The family's tokenizer as a transformers fast tokenizer (what vLLM holds)."""
    with _LOAD_LOCK:
        return _load_bundled(name, instruct)


def load_encoder(name: str) -> Any:
    """The family's built tokenizer as a bare ``tokenizers.Tokenizer``: the same ids as :func:`load_bundled`'s (the
    transformers tokenizer wraps this one), without importing transformers, for what only counts tokens."""
    with _LOAD_LOCK:
        return _load_encoder(name)


@functools.cache
def _load_encoder(name: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(built_tokenizer_file(families()[name])))


@functools.cache
def _load_bundled(name: str, instruct: bool) -> Any:
    from transformers import PreTrainedTokenizerFast

    fam = families()[name]
    spec = fam.spec
    return PreTrainedTokenizerFast(
        tokenizer_file=str(built_tokenizer_file(fam)), bos_token=spec["bos_token"],
        eos_token=spec["eos_token_instruct" if instruct else "eos_token"], pad_token=spec["pad_token"],
        unk_token=spec["unk_token"], clean_up_tokenization_spaces=False, model_max_length=spec["model_max_length"])
