"""The content hash that keys an image in the encoder cache and the prefix cache.

vLLM's ``MultiModalHasher`` hashes the model id, the decoded item (a PIL image's mode and pixel bytes) and the
processor kwargs with blake3. We never decode pixels, so we hash the *encoded* bytes instead (sha256, with the model
and the processor kwargs that change the result): the same file sent twice gets the same key, as in vLLM; two
different encodings of the same pixels get two keys here where vLLM would find one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def mm_content_hash(model: str, modality: str, data: bytes, processor_kwargs: dict[str, Any] | None = None) -> str:
    """Hex sha256 of (model, modality, processor kwargs, item bytes)."""
    h = hashlib.sha256()
    h.update(model.encode())
    h.update(b"\0" + modality.encode() + b"\0")
    h.update(json.dumps(processor_kwargs or {}, sort_keys=True, default=str).encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


def synthetic_hash(model: str, modality: str, key: str) -> str:
    """A content hash for an item known only by a key (``simulate``'s images, which are never encoded): distinct
    keys give distinct hashes, the same key the same one."""
    return hashlib.sha256(f"{model}\0{modality}\0synthetic\0{key}".encode()).hexdigest()
