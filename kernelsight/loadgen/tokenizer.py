"""The tokenizer the load generator counts and decodes prompts with (transformers stays optional).

Resolution (``resolve_tokenizer``), never touching the network except the benchmarked server itself:

1. ``--tokenizer`` / the model, through ``kernelsight.server.model.tokenizer`` when the server extra is installed
   (a local directory, the local HF cache, or the tokenizer bundled for the model's family);
2. the server's own ``POST /tokenize`` and ``/detokenize`` (vLLM and kernelsight both serve them);
3. a byte-level fallback (one token per UTF-8 byte), announced on stderr.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ClientTokenizer", "ByteTokenizer", "RemoteTokenizer", "LocalTokenizer", "EncoderTokenizer",
           "resolve_tokenizer"]

DEFAULT_VOCAB_SIZE = 32000


class ClientTokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 1..256); the last resort, and handy in tests."""

    name = "bytes"
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")


class LocalTokenizer:
    """Wraps kernelsight's server tokenizer (transformers or the Llama-3 package tokenizer)."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size = int(tok.vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, in one call (datasets tokenize thousands of prompts)."""
        return self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class EncoderTokenizer:
    """A bundled family's bare ``tokenizers.Tokenizer`` (``bundled_encoder``), for datasets that only count tokens:
    the ids ``LocalTokenizer`` gives, without importing transformers."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class RemoteTokenizer:
    """The benchmarked server's ``/tokenize`` and ``/detokenize`` (blocking; used while building datasets)."""

    def __init__(self, base_url: str, model: str, vocab_size: int, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.vocab_size = vocab_size
        self.name = f"{self.base_url}/tokenize"
        self._headers = {"Content-Type": "application/json", **(headers or {})}

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), headers=self._headers)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._post("/tokenize", {"model": self.model, "prompt": text,
                                        "add_special_tokens": add_special_tokens})["tokens"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"]

    def works(self) -> bool:
        try:
            return isinstance(self.encode("hello", False), list)
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False


def _profile_vocab_size(model: str) -> int | None:
    try:
        from kernelsight import profiles
        return int(profiles.load_model(model).vocab_size)
    except Exception:  # noqa: BLE001 - unknown model: no hint
        return None


def resolve_tokenizer(model: str, tokenizer: str | None = None, *, base_url: str | None = None,
                      model_root: str | None = None, headers: dict[str, str] | None = None,
                      encode_only: bool = False) -> ClientTokenizer:
    """The first tokenizer that works for ``model`` (see the module doc for the order).

    ``model_root`` is the ``root`` field of ``/v1/models`` (the real model path behind a served alias).
    ``encode_only`` (a dataset that only counts tokens, e.g. ShareGPT's): where the choice is a bundled family, its
    bare tokenizer (``EncoderTokenizer``: the same ids, no transformers import, ~1 s less) instead of the server's.
    """
    try:
        from kernelsight.server.model.tokenizer import bundled_encoder, load_tokenizer
    except ImportError:  # the server extra is not installed
        load_tokenizer = None  # type: ignore[assignment]
    if load_tokenizer is not None:
        for name in dict.fromkeys(n for n in (model, model_root) if n):
            vocab = _profile_vocab_size(name) or 0
            enc = bundled_encoder(name, tokenizer, vocab) if encode_only else None
            if enc is not None:
                return EncoderTokenizer(enc, f"bundled:{tokenizer or name}")
            tok = load_tokenizer(name, tokenizer, vocab)
            if not tok.is_fallback:
                return LocalTokenizer(tok, f"{tok.source.kind}:{tok.source.where}")
    elif tokenizer is not None:
        raise ValueError("--tokenizer needs transformers: pip install 'kernelsight[server]'")
    if base_url is not None:
        vocab = _profile_vocab_size(model_root or model) or _profile_vocab_size(model) or DEFAULT_VOCAB_SIZE
        remote = RemoteTokenizer(base_url, model, vocab, headers)
        if remote.works():
            return remote
    print(f"kernelsight: no tokenizer found for {model}: counting one token per UTF-8 byte", file=sys.stderr)
    return ByteTokenizer()
