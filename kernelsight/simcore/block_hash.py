"""Prefix-cache keys: chained hashes of a request's full KV blocks (equal hashes mean equal prefixes).

The hash function lives apart from the pool that stores by it, as vLLM keeps it apart (``kv_cache_utils``): the
pool only compares keys, and a router that re-hashes token ids needs the keys, not the pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

_MASK = (1 << 64) - 1


class BlockHasher:
    """Chained block hashes, computed for a whole prompt at once with numpy.

        content_i = Σ_k token_k · K_k        mod 2⁶⁴   (K: fixed random odd 64-bit key per in-block offset)
        hash_i    = hash_{i−1} + content_i · R_i  mod 2⁶⁴   (R: fixed random odd key per block position)

    hash_i therefore depends on every token of blocks 0..i and their order, like vLLM's
    ``H((parent, tokens, extra))``: two different prefixes collide only if a random linear form vanishes
    on their difference (probability ≈ 2⁻⁶⁰ per pair for token-id differences). A 1,000-token prompt costs a
    handful of numpy calls instead of 60 Python tuple hashes. Keys come from a fixed seed, so hashes are
    identical across runs.
    """

    def __init__(self, block_size: int) -> None:
        rng = np.random.default_rng(0x6B65726E656C)
        self.block_size = block_size
        self._k = rng.integers(1, 2**63, size=block_size, dtype=np.uint64) | np.uint64(1)
        self._k_list = [int(x) for x in self._k]
        self._r = np.zeros(0, dtype=np.uint64)
        self._r_list: list[int] = []
        self._ensure_positions(4096)

    def _ensure_positions(self, n: int) -> None:
        if n <= len(self._r):
            return
        size = max(n, 2 * len(self._r))
        # regenerate from the seed: the first values are the same for any size, so hashes stay stable
        self._r = np.random.default_rng(0x706F73).integers(1, 2**63, size=size, dtype=np.uint64) | np.uint64(1)
        self._r_list = [int(x) for x in self._r]

    def start(self, extra_keys: tuple | None) -> int:
        """Chain seed: 0 without extra keys; extra keys (LoRA, cache salt) start a separate chain."""
        if extra_keys is None:
            return 0
        data = repr(extra_keys).encode()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def chain_tokens(self, parent: int, first_block: int, tokens: np.ndarray,
                     extras: np.ndarray | None = None) -> list[int]:
        """Hashes of consecutive full blocks of ``tokens`` (uint64, length a multiple of block_size); ``extras``
        (uint64, one per block, 0 for none) are per-block extra keys (``extra_key``), e.g. the images a block
        holds placeholders of."""
        return self.chain_tokens_array(parent, first_block, tokens, extras).tolist()

    def chain_tokens_array(self, parent: int, first_block: int, tokens: np.ndarray,
                           extras: np.ndarray | None = None) -> np.ndarray:
        """:meth:`chain_tokens` as a uint64 array (the block pool stores them as one)."""
        nb = len(tokens) // self.block_size
        self._ensure_positions(first_block + nb)
        content = tokens.reshape(nb, self.block_size) @ self._k
        if extras is not None:
            content += extras
        content *= self._r[first_block:first_block + nb]
        h = content.cumsum()               # uint64 in, uint64 out (the method skips np.cumsum's dispatch)
        if parent:
            h += np.uint64(parent)
        return h

    def chain_one(self, parent: int, block_index: int, content: Sequence[Any], extra: int = 0) -> int:
        """Hash of one block from Python: known token ids hash exactly like ``chain_tokens``."""
        self._ensure_positions(block_index + 1)
        if all(type(t) is int for t in content):
            c = sum(t * k for t, k in zip(content, self._k_list, strict=True)) & _MASK
        else:                            # synthetic generated-token key: private to its request
            c = hash(content) & _MASK
        return (parent + ((c + extra) & _MASK) * self._r_list[block_index]) & _MASK

    @staticmethod
    def extra_key(keys: tuple) -> int:
        """A block's extra keys as the term its content hash adds (0 for none)."""
        if not keys:
            return 0
        return int.from_bytes(hashlib.blake2b(repr(keys).encode(), digest_size=8).digest(), "little")
