"""vLLM's prefix-cache block hashes (``--prefix-caching-hash-algo``), for the hashes KV events carry.

As vllm/v1/core/kv_cache_utils.py and vllm/utils/hashing.py define them:

* ``hash_i = H((hash_{i-1}, tuple(block_tokens), extra_keys))``, with ``hash_{-1}`` = ``NONE_HASH``;
* ``NONE_HASH = H(os.environ["PYTHONHASHSEED"])`` when that variable is set, else 32 random bytes per process
  (so a router re-hashing token ids agrees with the server only under a shared PYTHONHASHSEED);
* ``H`` = sha256 of the pickle (protocol 5) | sha256 of canonical CBOR | xxh3-128 of the pickle | of the CBOR;
* on the wire a hash is its last 8 bytes as an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default
  1), or the raw bytes when that variable is 0.

cbor2 and xxhash are optional dependencies (``pip install 'kernelsight[kvhash]'``), as they are in vLLM.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

HashFn = Callable[[Any], bytes]


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor() -> Any:
    try:
        import cbor2
    except ImportError:
        raise ValueError("--prefix-caching-hash-algo sha256_cbor/xxhash_cbor needs cbor2: "
                         "pip install cbor2 (or 'kernelsight[kvhash]')") from None
    return cbor2


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:
        raise ValueError("--prefix-caching-hash-algo xxhash/xxhash_cbor needs xxhash: "
                         "pip install xxhash (or 'kernelsight[kvhash]')") from None
    return xxhash.xxh3_128_digest


def hash_function(name: str) -> HashFn:
    """vLLM's ``get_hash_fn_by_name``; a ValueError names the missing optional package."""
    if name == "sha256":
        return _sha256
    if name == "sha256_cbor":
        cbor2 = _cbor()
        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    if name == "xxhash":
        xxh = _xxh3_128()
        return lambda obj: xxh(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    if name == "xxhash_cbor":
        cbor2, xxh = _cbor(), _xxh3_128()
        return lambda obj: xxh(cbor2.dumps(obj, canonical=True))
    raise ValueError(f"Unsupported hash function: {name}")


def none_hash(fn: HashFn, seed: str | None = None) -> bytes:
    """The chain's seed (vLLM's ``init_none_hash``): from PYTHONHASHSEED (``seed`` overrides the environment)."""
    seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
    return os.urandom(32) if seed is None else fn(seed)


def hash_block_tokens(fn: HashFn, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    """One block's hash from its parent's (``NONE_HASH`` for the first block)."""
    return fn((parent, tuple(token_ids), extra_keys))


def external_hash(h: bytes, as_int: bool = True) -> int | bytes:
    """A hash as events carry it: the low 64 bits of the big-endian value, or the bytes."""
    return int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF if as_int else h


def ints_on_wire() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("0", "")


def vllm_extra_keys(sim_extra: tuple | None, block_index: int, mm_keys: tuple[str, ...] = ()) -> tuple | None:
    """vLLM's per-block extra keys (``generate_block_hash_extra_keys``), in its order: the content hashes of the
    multimodal items the block holds placeholders of, the LoRA name on every block, the cache salt on block 0 only
    (from the simulator's ``("lora", name, "cache_salt", salt)`` request extras; no prompt embeds)."""
    keys: list[Any] = list(mm_keys)
    if not sim_extra:
        return tuple(keys) or None
    d = dict(zip(sim_extra[::2], sim_extra[1::2], strict=False))
    if d.get("lora"):
        keys.append(d["lora"])
    if block_index == 0 and d.get("cache_salt"):
        keys.append(d["cache_salt"])
    return tuple(keys) or None


def lora_name_of(sim_extra: tuple | None) -> str | None:
    if not sim_extra:
        return None
    d = dict(zip(sim_extra[::2], sim_extra[1::2], strict=False))
    return d.get("lora") or None
