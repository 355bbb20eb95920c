"""Which attention kernel the sweep times, and the calls it times it with (torch passed in, never imported here).

vLLM's FlashAttention (``vllm.vllm_flash_attn``) at the version vLLM serves with on the GPU (FA3 on Hopper, FA2 on
Ampere, Ada and sm_12x: :func:`vllm_fa_version`), else the ``flash_attn`` package, else ``torch`` SDPA with grouped
KV heads. vLLM's FlashAttention reads a paged KV cache, as vLLM serves (:func:`paged_block_table`): FA2 runs its
split-KV kernel on every paged call and another kernel on a contiguous cache it does not split, so a contiguous
sweep would time decode at large batches and every prefill with a kernel vLLM does not run. The ``flash_attn``
package is timed contiguous: its paged path wants blocks of a multiple of 256 tokens.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

import numpy as np

from kernelsight.calibrate.sweep_shapes import KV_BLOCK_SIZE
from kernelsight.calibrate.sweep_timing import call_error

#: Where vLLM keeps the function that picks the FlashAttention version it serves with (it moved between releases).
FA_VERSION_PICKERS: tuple[str, ...] = (
    "vllm.attention.utils.fa_utils", "vllm.v1.attention.backends.fa_utils", "vllm.vllm_flash_attn.fa_utils",
)


def vllm_fa_version(flash_module: object) -> int | None:
    """The FlashAttention version vLLM serves with on this GPU: its own picker's answer when importable, else the
    newest of 3 and 2 its FlashAttention build supports here; None when neither can tell. The build's entry point
    defaults to version 2, while vLLM runs version 3 on Hopper: a sweep calling it plainly would time FA2 there."""
    for path in FA_VERSION_PICKERS:
        try:
            version = importlib.import_module(path).get_flash_attn_version()
        except Exception:  # noqa: BLE001 — absent in this release, or it needs a vLLM config: try the next
            continue
        if version:
            return int(version)
    supported = getattr(flash_module, "is_fa_version_supported", None)
    for version in (3, 2):
        try:
            if supported is not None and supported(version):
                return version
        except Exception:  # noqa: BLE001 — a build that cannot answer: the next version, else none
            continue
    return None


def flash_attn_varlen() -> tuple[Callable[..., object], str] | None:
    """FlashAttention's variable-length entry point and the kernel name to record, when importable: vLLM's build
    called with the version vLLM serves with (recorded as e.g. ``vllm_flash_attn_fa3``, as in the shared tables),
    else the ``flash_attn`` package."""
    for module, name in (("vllm.vllm_flash_attn", "vllm_flash_attn"), ("flash_attn", "flash_attn")):
        try:
            mod = importlib.import_module(module)
            fn = mod.flash_attn_varlen_func
        except (ImportError, AttributeError):
            continue
        version = vllm_fa_version(mod) if module == "vllm.vllm_flash_attn" else None
        return (partial(fn, fa_version=version), f"{name}_fa{version}") if version else (fn, name)
    return None


def working_flash(torch, flash: tuple[Callable[..., object], str] | None, device: str,  # type: ignore[no-untyped-def]
                  say: Callable[[str], None]) -> tuple[Callable[..., object], str] | None:
    """``flash`` if one small call of it runs here, else None (attention is then timed with SDPA): an importable
    FlashAttention whose arguments or build do not match this GPU would otherwise fail every attention point."""
    if flash is None:
        return None
    if exc := call_error(torch, lambda: flash_fn(torch, flash[0], 2, 16, 16, 4, 2, 128, 0, device,
                                                  block_size=kv_block_size(flash))(), device):
        say(f"{flash[1]} is importable but a test call failed ({type(exc).__name__}: {exc}); "
            "attention is timed with torch SDPA instead")
        return None
    return flash


def paged_block_table(batch: int, kv_len: int, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Block table of ``batch`` sequences of ``kv_len`` tokens in a pool of exactly their blocks: row i lists the
    blocks of sequence i, the pool's blocks dealt in a shuffled order (a served cache's blocks are scattered once
    requests have come and gone; so are the shared tables')."""
    if batch < 1 or kv_len < 1 or block_size < 1:
        raise ValueError(f"a paged KV cache needs batch, kv_len and block_size >= 1, got {batch}, {kv_len}, "
                         f"{block_size}")
    per_seq = -(-kv_len // block_size)
    return rng.permutation(batch * per_seq).astype(np.int32).reshape(batch, per_seq)


def flash_fn(
    torch, flash: Callable[..., object], b: int, q_len: int, kv_len: int, qh: int, kvh: int, hd: int, window: int,
    device: str, kv_dtype: str = "bf16", block_size: int = 0,
) -> Callable[[], object]:  # type: ignore[no-untyped-def]
    """``b`` sequences of ``q_len`` new tokens attending ``kv_len`` tokens (the last ``q_len`` are the new ones).
    ``block_size`` > 0: the keys and values in a paged cache of blocks of that many tokens (``block_table`` and
    ``seqused_k``, as vLLM calls its FlashAttention; :func:`paged_block_table`), else contiguous (``cu_seqlens_k``).
    ``kv_dtype`` fp8: as vLLM runs an fp8 KV cache on FA3 — query, keys and values in e4m3 with per-sequence,
    per-KV-head descales, the output in bf16."""
    q = torch.randn(b * q_len, qh, hd, device=device, dtype=torch.bfloat16)
    cu_q = torch.arange(0, (b + 1) * q_len, q_len, device=device, dtype=torch.int32)
    # keyword arguments only: vLLM's fork and the flash_attn package order the positional ones differently
    kwargs = dict(q=q, cu_seqlens_q=cu_q, max_seqlen_q=q_len, max_seqlen_k=kv_len,
                  causal=True, window_size=(window - 1, 0) if window else (-1, -1))
    if block_size > 0:
        # one layout per shape: a repeated or resumed sweep times the same cache
        table = paged_block_table(b, kv_len, block_size, np.random.default_rng(b * 1_000_003 + kv_len))
        k = torch.randn(table.size, block_size, kvh, hd, device=device, dtype=torch.bfloat16)
        kwargs.update(block_table=torch.as_tensor(table, device=device),
                      seqused_k=torch.full((b,), kv_len, device=device, dtype=torch.int32))
    else:
        k = torch.randn(b * kv_len, kvh, hd, device=device, dtype=torch.bfloat16)
        kwargs.update(cu_seqlens_k=torch.arange(0, (b + 1) * kv_len, kv_len, device=device, dtype=torch.int32))
    v = torch.randn_like(k)
    kwargs.update(k=k, v=v)
    if kv_dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        one = torch.ones((b, kvh), device=device, dtype=torch.float32)
        kwargs.update(q=q.to(fp8), k=k.to(fp8), v=v.to(fp8), q_descale=one, k_descale=one, v_descale=one,
                      out=torch.empty(b * q_len, qh, hd, device=device, dtype=torch.bfloat16))
    elif kv_dtype != "bf16":
        raise ValueError(f"the sweep cannot time a {kv_dtype!r} KV cache")
    return lambda: flash(**kwargs)


def flash_runs_fp8_kv(torch, flash: tuple[Callable[..., object], str] | None, device: str,  # type: ignore[no-untyped-def]
                      say: Callable[[str], None]) -> bool:
    """Whether ``flash`` runs an fp8 KV cache here (FA3 on Hopper does; FA2 does not): one small call decides, so
    a build without it costs one line, not a family of failed points."""
    if flash is None or not flash[1].endswith("_fa3"):
        return False
    if exc := call_error(torch, lambda: flash_fn(torch, flash[0], 2, 16, 16, 4, 2, 128, 0, device, "fp8",
                                                  kv_block_size(flash))(), device):
        say(f"{flash[1]} did not run a test fp8 KV-cache call ({type(exc).__name__}: {exc}); attention is timed "
            "with a bf16 KV cache only")
        return False
    return True


def sdpa_fn(
    torch, b: int, q_len: int, kv_len: int, qh: int, kvh: int, hd: int, device: str, causal: bool
) -> Callable[[], object]:  # type: ignore[no-untyped-def]
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q = torch.randn(b, qh, q_len, hd, device=device, dtype=dt)
    k = torch.randn(b, kvh, kv_len, hd, device=device, dtype=dt)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:   # grouped KV heads read in place (torch ≥ 2.5); copying them inside the timed call would time the copy
        sdpa(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], enable_gqa=True)
        return lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        rep = qh // kvh
        kk, vv = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return lambda: sdpa(q, kk, vv, is_causal=causal)


def attention_kernel(flash: tuple[Callable[..., object], str] | None) -> str:
    """The ``kernel`` name attention rows are written with."""
    return flash[1] if flash is not None else "torch_sdpa"


def kv_block_size(flash: tuple[Callable[..., object], str] | None, block_size: int = KV_BLOCK_SIZE) -> int:
    """Tokens per KV-cache block the sweep pages attention by: ``block_size`` for vLLM's FlashAttention, 0
    (contiguous) for the ``flash_attn`` package (its paged path wants blocks of a multiple of 256 tokens) and
    SDPA."""
    return block_size if flash is not None and flash[1].startswith("vllm_flash_attn") else 0


def attention_call(
    torch, point: tuple[int, int, int, int, int, str, int], decode: bool, device: str,  # type: ignore[no-untyped-def]
    flash: tuple[Callable[..., object], str] | None, block_size: int = KV_BLOCK_SIZE,
) -> Callable[[], Callable[[], object]] | None:
    """What builds one attention point's call (prefill: ``seq_len`` new tokens, no prefix; decode: 1 new token after
    ``cached``), paged by :func:`kv_block_size`; None for a sliding window or an fp8 KV cache without
    FlashAttention (SDPA has no such kernels: a masked or upcast call would time a different path)."""
    b, s, qh, kvh, hd, kvd, w = point
    q_len, kv_len = (1, s + 1) if decode else (s, s)
    if flash is None:
        if w or kvd != "bf16":
            return None
        return partial(sdpa_fn, torch, b, q_len, kv_len, qh, kvh, hd, device, causal=not decode)
    return partial(flash_fn, torch, flash[0], b, q_len, kv_len, qh, kvh, hd, w, device, kvd,
                   kv_block_size(flash, block_size))
