"""Embedding vectors without a model: a text's vector is the sum of one fixed pseudo-random vector per token (drawn
from the token id, the server's ``--seed`` and the position in the vector, splitmix64), normalized. The same text
always gets the same vector, and texts that share tokens point the same way, so cosine scores (``/score``,
``/rerank``) rank overlapping texts first, as a bag-of-words model would."""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from kernelsight.server.model.output_tokens import _splitmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def embed(token_ids: Sequence[int], hidden_size: int, seed: int, normalize: bool = True) -> np.ndarray:
    """The float32 vector of ``hidden_size`` for a token sequence (unit length when ``normalize``)."""
    ids, counts = np.unique(np.asarray(token_ids, dtype=np.uint64), return_counts=True)
    cols = np.arange(hidden_size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = (ids[:, None] * _GOLDEN) ^ (cols[None, :] + np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(31))
        bits = _splitmix64(keys)
    # 53 random bits -> [-1, 1): uniform components (the sum of many is near-normal)
    comps = (bits >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0
    vec = (comps * counts[:, None]).sum(axis=0)
    if normalize:
        norm = float(np.linalg.norm(vec))
        if norm > 0:
            vec = vec / norm
    return vec.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else 0.0


def encode_vector(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    """``float``: a JSON list; ``base64``: the little-endian float32 bytes, as OpenAI's API sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def pack_bits(vec: np.ndarray, signed: bool) -> list[int]:
    """Cohere's binary types: one bit per component (1 for >= 0), 8 to a byte, most significant first; signed
    bytes are offset by 128."""
    if len(vec) % 8:
        raise ValueError(f"Embedding dimension must be a multiple of 8 for binary embedding types, but got {len(vec)}.")
    packed = np.packbits(vec >= 0).astype(np.int64)
    return (packed - 128 if signed else packed).tolist()
