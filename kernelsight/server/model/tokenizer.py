"""The served model's tokenizer, found offline, plus the pool of tokens the mock generates from.

Resolution order (never touches the network):
1. ``--tokenizer`` (a local directory with tokenizer files, or an id in the local HF cache);
2. the tokenizer files beside the model's config.json (local directory / HF cache entry);
3. the tokenizer bundled for the model's family (Llama 3.x, Llama 4, Qwen3, Qwen2.5-VL, gpt-oss, Mistral/Mixtral
   v0.1): the publisher's own vocabulary file shipped in ``kernelsight/profiles/tokenizers/`` (source, licence and
   sha256 in its index.json), built into the model's HF tokenizer by ``bundled_tokenizer``;
4. otherwise a byte-level fallback (one token per UTF-8 byte), announced by a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("kernelsight.server")

# Our own minimal Llama-3 style template (used when the tokenizer brings none): header-delimited turns.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Generic fallback for tokenizers without a template (documented: vLLM would answer 400 instead).
GENERIC_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)

@dataclass(frozen=True)
class TokenizerSource:
    kind: str          # "hf" | "bundled" | "byte-fallback"
    where: str


class ServerTokenizer:
    """encode / decode / chat template over either a transformers tokenizer or the byte fallback."""

    def __init__(self, hf: Any | None, source: TokenizerSource, chat_template: str | None,
                 vocab_size: int, max_pool: int = 4096) -> None:
        self.hf = hf
        self.source = source
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self._pool_ids, self._pool_text = self._build_pool(max_pool)
        self._pool_id_list: list[int] = self._pool_ids.tolist()    # per-token lookups without numpy scalars

    # -- basic ops --------------------------------------------------------------------------------
    @property
    def is_fallback(self) -> bool:
        return self.hf is None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is None:
            return [b + 1 for b in text.encode("utf-8")]   # 0 is kept free as a "BOS"
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        if self.hf is None:
            return [self.decode([i]) for i in ids]
        return self.hf.convert_ids_to_tokens(list(ids))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        template = chat_template or self.chat_template or GENERIC_CHAT_TEMPLATE
        if self.hf is None:
            import jinja2
            env = jinja2.Environment(autoescape=False)
            return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    bos_token="", eos_token="", **(chat_template_kwargs or {}))
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, chat_template=template,
                                           **(chat_template_kwargs or {}))

    # -- generation pool ----------------------------------------------------------------------------
    def _build_pool(self, max_pool: int) -> tuple[np.ndarray, list[str]]:
        """Word tokens (" word") that decode alone to their text and re-tokenize to themselves when
        concatenated: so any output made of them round-trips to exactly its token count."""
        if self.hf is None:
            letters = "abcdefghijklmnopqrstuvwxyz"      # one byte = one token each
            return np.asarray([ord(c) + 1 for c in letters], dtype=np.int64), list(letters)
        vocab: dict[str, int] = self.hf.get_vocab()
        cand = sorted((i, t) for t, i in vocab.items() if re.fullmatch(r"[Ġ▁][a-z]{3,9}", t))
        ids, texts = [], []
        # SentencePiece (Mistral, Llama 2): the decoder drops a leading "▁" and the encoder prepends one, so a
        # word token stands for " word" inside a text but is probed without its space
        sp_style = False
        for i, _ in cand:
            text = probe = self.hf.decode([i])
            if not text.startswith(" "):
                sp_style, text = True, " " + text
            if not re.fullmatch(r" [a-z]{3,9}", text):
                continue
            if list(self.hf.encode(probe, add_special_tokens=False)) != [i]:
                continue
            ids.append(i)
            texts.append(text)
            if len(ids) >= max_pool:
                break
        if len(ids) < 16:
            raise ValueError(f"tokenizer {self.source.where}: found no plain word tokens to generate from")
        arr = np.asarray(ids, dtype=np.int64)
        # verify the concatenation property on a sample (guards against unusual pre-tokenizers)
        sample = arr[np.random.default_rng(0).integers(0, len(arr), 64)]
        text = "".join(texts[ids.index(int(t))] for t in sample)
        if len(self.hf.encode(text[1:] if sp_style else text, add_special_tokens=False)) != len(sample):
            log.warning("tokenizer %s: generated text may not re-tokenize to the same count", self.source.where)
        return arr, texts

    @property
    def pool_size(self) -> int:
        return len(self._pool_id_list)

    @property
    def pool_id_list(self) -> list[int]:
        """The pool's token ids as a Python list (index with ``k % pool_size``)."""
        return self._pool_id_list

    @property
    def pool_texts(self) -> list[str]:
        """The pool's token texts, parallel to ``pool_id_list``."""
        return self._pool_text

    def pool_token(self, k: int) -> tuple[int, str]:
        return self._pool_id_list[k], self._pool_text[k]

    def pool_ids(self, idx: np.ndarray) -> np.ndarray:
        return self._pool_ids[idx]

    def pool_text(self, k: int) -> str:
        return self._pool_text[k]


def _hf_tokenizer_from_dir(path: Path) -> Any | None:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json",
                                                 "tokenizer_config.json")):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _is_instruct(model: str) -> bool:
    return bool(re.search(r"instruct|chat|thinking", model, re.IGNORECASE))


def _local_dir(name: str) -> Path | None:
    from kernelsight import profiles

    p = Path(name).expanduser()
    if p.is_dir():
        return p
    cfg = profiles.model_config_path(name)
    if cfg is not None and cfg.parent.is_dir():
        return cfg.parent
    return None


@functools.cache
def load_tokenizer(model: str, tokenizer: str | None = None, vocab_size: int = 0) -> ServerTokenizer:
    """The tokenizer for ``model`` (or ``tokenizer``), offline; see the module doc for the order."""
    hf = None
    source = None
    for name in ([tokenizer] if tokenizer else []) + [model]:
        d = _local_dir(name)
        if d is None:
            continue
        try:
            hf = _hf_tokenizer_from_dir(d)
        except Exception as exc:  # noqa: BLE001 - a broken local dir must not stop the server
            log.warning("could not load the tokenizer in %s: %s", d, exc)
            hf = None
        if hf is not None:
            source = TokenizerSource("hf", str(d))
            break
    template = None
    if hf is None:
        from kernelsight.server.model import bundled_tokenizer

        name = tokenizer or model
        fam = bundled_tokenizer.family_for(name, vocab_size)
        if fam is None and tokenizer is not None and _local_dir(tokenizer) is None:
            raise ValueError(f"--tokenizer {tokenizer!r}: not a local directory, in the local HF cache, "
                             "nor a bundled tokenizer's model family")
        if fam is not None:
            hf = bundled_tokenizer.load_bundled(fam.name, _is_instruct(name))
            source = TokenizerSource("bundled", fam.where)
            template = fam.chat_template_for(name)
    if hf is not None:
        template = template or getattr(hf, "chat_template", None)
        if not template and "<|start_header_id|>" in hf.get_vocab():
            template = LLAMA3_CHAT_TEMPLATE      # a local Llama-3 base-model directory without a template
        return ServerTokenizer(hf, source, template, len(hf))
    log.warning("no tokenizer found for %s (install kernelsight[server] or pass --tokenizer DIR): "
                "using a byte-level fallback, 1 token per UTF-8 byte", tokenizer or model)
    return ServerTokenizer(None, TokenizerSource("byte-fallback", "bytes"), None, 257)
