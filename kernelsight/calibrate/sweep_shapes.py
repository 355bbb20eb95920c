"""The shapes ``kernelsight calibrate sweep`` times: a model-agnostic shape space and its fixed-seed draw.

A fixed-seed draw of :data:`SWEEP_POINTS` points per family from a dense space of GEMM, prefill and decode attention
shapes (see :func:`build_grid`), plus 4 collectives × 3 GPU counts × 21 message sizes; on GPUs whose FlashAttention
has them, sliding windows and an fp8 KV cache on top. Which formats and attention variants a GPU gets is decided
from its spec here (:func:`formats_for`, :func:`runs_fa3`), so ``calibrate sweep --estimate`` and
``benchmarks/sweep_grid.py`` draw the same points as a sweep without torch. Timing them:
:mod:`kernelsight.calibrate.sweep`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kernelsight.calibrate.measurements import SCHEMA

T = TypeVar("T")

#: Largest KV / activation footprint a single point may allocate (keeps the sweep within 24 GB cards).
MAX_POINT_BYTES = 6 * 1024**3
#: Largest single GEMM / prefill point, in FLOPs (~0.4 s on an H100 in bf16: the slowest points stay short).
MAX_POINT_FLOPS = 2.0**48
#: Most prompt tokens in one prefill point (a long prompt or a batch of shorter ones).
MAX_PREFILL_TOKENS = 131072

# The model-agnostic shape space: per-GPU shapes (attention heads after tensor-parallel sharding), dense on
# every axis. m steps where a GEMM's tile count (and so its last wave) can step: every size to 16, then each
# multiple of 16 to 256 and of 256 to 4352, each with the size just past it; beyond, the large prefill chunks.
# n and k cover hidden, fused-QKV, MLP and vocabulary widths of current models split over 1-8 GPUs.
GEMM_M: tuple[int, ...] = tuple(sorted({
    *range(1, 17),
    *(m + d for m in range(16, 257, 16) for d in (0, 1)),
    *(m + d for m in range(512, 4353, 256) for d in (0, 1)),
    6144, 8192, 12288, 16384, 32768,
}))
GEMM_NK: tuple[int, ...] = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168,
                            8192, 10240, 12288, 14336, 16384, 28672, 65536)
ATTN_HEADS: tuple[tuple[int, int], ...] = tuple(
    (qh, kvh) for qh in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96)
    for kvh in (1, 2, 4, 8, 16, 32, 40, 48, 64) if qh % kvh == 0 and (kvh <= 8 or kvh == qh)
)
ATTN_HEAD_DIMS: tuple[int, ...] = (64, 128, 192, 256)
PREFILL_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_SEQS: tuple[int, ...] = (1, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
DECODE_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DECODE_CACHED: tuple[int, ...] = tuple(2**p - 1 for p in range(1, 18))   # 1 … 131071 cached tokens
#: Points timed per family (GEMM: per format), drawn without replacement from the space above by a fixed seed.
#: Why a draw from a dense space and not a coarse product grid: judged on the shared tables
#: (``benchmarks/sweep_grid.py``: the points' rows fitted, the other rows of the variants the sweep times judged),
#: the earlier grid (7-8 values per axis, ~2,000 GEMMs and ~500 attention shapes) gave GEMM / prefill / decode MAPE
#: of 13 / 22 / 19 % on the A100, 17 / 14 / 8.6 % on the H100 and 37 / 66 / 20 % on the L40S; this draw 4.4 / 2.5 /
#: 2.4, 3.8 / 3.6 / 2.2 and 6.4 / 4.0 / 4.5 %, about what as many random rows of the tables give. Twice the points
#: gain 0.3-1 point (H100 3.5 / 3.0 / 1.8 %, L40S 5.8 / 3.1 / 3.5 %) for twice the time: ``--points`` buys that
#: where the GPU time allows. Timing them takes about 3 minutes of GPU time on an H100, head starts included (2.8
#: from the shared H100 latencies, 3.6 predicted by ``calibrate sweep --estimate h100``; A100 / L40S 7.5 / 8.5
#: from their latencies), plus a few ms per point to allocate its tensors.
SWEEP_POINTS: dict[str, int] = {"gemm": 8000, "attn_prefill": 6000, "attn_decode": 6000}
SWEEP_SEED = 0
#: Tokens per block of the paged KV cache vLLM's FlashAttention is timed on by default: vLLM's own default on CUDA.
KV_BLOCK_SIZE = 16
#: The kernel families the sweep times (``--families`` picks among them).
SWEEP_FAMILIES: tuple[str, ...] = ("gemm", "attn_prefill", "attn_decode", "comm")
COMM_MESSAGE_BYTES: tuple[int, ...] = tuple(2**p for p in range(9, 30))
#: NCCL collectives timed (vLLM's custom all-reduce needs vLLM's own buffers: the fit takes it from the prior).
COMM_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: Sliding windows timed when FlashAttention is importable (0 = none): Mistral / Gemma / gpt-oss style widths.
#: Contexts shorter than the window are drawn too: a windowed model runs them all the time (Gemma's 4096 window
#: over short prompts), and the fit learns from such pairs whether the kernel then runs as if unwindowed. Without
#: them, a fit on the shared H100 table priced its window-128 decode rows with shorter contexts 11-17 % slow
#: (MAPE 19-24 %); with them, 1.6-2.1 %.
SWEEP_WINDOWS: tuple[int, ...] = (0, 128, 1024, 4096)
#: Windowed attention points, as a share of the family's budget, drawn on top of it: one draw over windows and
#: full attention together would leave full attention a quarter of the points; this way it gets the very points
#: a sweep without windows draws. On the shared tables (``benchmarks/sweep_grid.py``, flash sweep), prefill /
#: decode MAPE with a share of 1/3, 2/3 and 1: H100 4.6 / 2.7, 3.9 / 2.4 and 3.6 / 2.1 %; L40S 6.2 / 8.9, 4.8 / 7.5
#: and 4.4 / 6.2 % (A100, whose table has no windows: 2.5 / 2.3 % throughout). Windowed layers are common (Gemma 3,
#: gpt-oss, Mistral) and their points are no dearer than full attention's.
WINDOW_SHARE = 1.0
#: fp8 KV-cache attention points (full attention), as a share of the family's budget, drawn on top of the bf16
#: ones where vLLM's FlashAttention runs an fp8 KV cache (FA3: Hopper). Without them a fit prices
#: ``--kv-cache-dtype fp8`` from the cross-generation tier: on the shared H100 table's fp8 rows, prefill / decode
#: MAPE 28.9 / 20.7 % (``benchmarks/kernel_accuracy.py``); fitted with these points 11.3 / 6.6 %
#: (``benchmarks/sweep_grid.py``, flash sweep). A share of 1 gave 11.6 / 6.5 % for 1 more GPU minute.
FP8_KV_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Grid:
    """The sweep's points per family, each a row of the measurement schema's key columns (no latency)."""

    gemm: tuple[tuple[str, int, int, int], ...]
    attn_prefill: tuple[tuple[int, int, int, int, int, str, int], ...]
    attn_decode: tuple[tuple[int, int, int, int, int, str, int], ...]
    comm: tuple[tuple[str, str, str, int, int], ...]


def _fits(*elements_bytes: float) -> bool:
    return sum(elements_bytes) <= MAX_POINT_BYTES


def _draw(points: list[T], budget: int | None, rng: random.Random) -> tuple[T, ...]:
    """``budget`` points of ``points`` (all when it holds fewer), in the space's order."""
    if budget is None or len(points) <= budget:
        return tuple(points)
    keep = sorted(rng.sample(range(len(points)), budget))
    return tuple(points[i] for i in keep)


def _share(budget: int | None, share: float) -> int | None:
    return None if budget is None else int(budget * share)


def gemm_space(dtype: str) -> list[tuple[str, int, int, int]]:
    return [
        (dtype, m, n, k) for n in GEMM_NK for k in GEMM_NK for m in GEMM_M
        if 2.0 * m * n * k <= MAX_POINT_FLOPS and _fits(2.0 * (m * k + n * k + m * n))
    ]


def prefill_space(windows: Sequence[int] = (0,), kv_dtype: str = "bf16"
                  ) -> list[tuple[int, int, int, int, int, str, int]]:
    return [
        (b, s, qh, kvh, hd, kv_dtype, w)
        for (qh, kvh) in ATTN_HEADS for hd in ATTN_HEAD_DIMS for b in PREFILL_BATCHES for s in PREFILL_SEQS
        for w in windows
        if b * s <= MAX_PREFILL_TOKENS and 2.0 * b * s * s * qh * hd <= MAX_POINT_FLOPS
        and _fits(2.0 * b * s * (2 * qh + 2 * kvh) * hd)
    ]


def decode_space(windows: Sequence[int] = (0,), kv_dtype: str = "bf16"
                 ) -> list[tuple[int, int, int, int, int, str, int]]:
    return [
        (b, c, qh, kvh, hd, kv_dtype, w)
        for (qh, kvh) in ATTN_HEADS for hd in ATTN_HEAD_DIMS for b in DECODE_BATCHES for c in DECODE_CACHED
        for w in windows
        if _fits(2.0 * b * (c + 1) * kvh * hd * 2)
    ]


def build_grid(
    quick: bool = False, gemm_dtypes: Sequence[str] = ("bf16", "fp8"), num_gpus: int = 1, max_gpus: int = 8,
    points: Mapping[str, int | None] | None = None, seed: int = SWEEP_SEED, windows: Sequence[int] = (0,),
    fp8_kv: bool = False,
) -> Grid:
    """The sweep's points (deterministic for a seed). ``quick`` = a tiny grid for smoke tests and CPU runs;
    ``points`` overrides :data:`SWEEP_POINTS` per family (None = the whole space); ``windows``: sliding windows
    to time besides full attention (0), for backends that have them; ``fp8_kv``: fp8 KV-cache attention points
    too (:data:`FP8_KV_SHARE`), for backends that run one. The bf16 points are the same either way."""
    gpus = [g for g in (2, 4, 8) if g <= max(num_gpus, 1) and g <= max_gpus]
    if quick:
        gemm = tuple((dt, m, n, k) for dt in gemm_dtypes for (n, k) in ((256, 256), (512, 1024)) for m in (1, 16, 128))
        prefill = tuple((b, s, 4, 2, 64, "bf16", 0) for b in (1, 2) for s in (16, 64))
        decode = tuple((b, c, 4, 2, 64, "bf16", 0) for b in (1, 2) for c in (15, 63))
        comm = tuple(("all_reduce", "nccl", "bf16", g, msg) for g in gpus for msg in (4096, 65536))
        return Grid(gemm, prefill, decode, comm)
    budget = dict(SWEEP_POINTS, **(points or {}))
    rng = random.Random(seed)
    gemm = tuple(p for dt in gemm_dtypes for p in _draw(gemm_space(dt), budget["gemm"], rng))
    prefill = _draw(prefill_space(), budget["attn_prefill"], rng)
    decode = _draw(decode_space(), budget["attn_decode"], rng)
    slid = tuple(w for w in windows if w)
    if slid:   # windowed points on top: full attention stays as densely covered as without windows
        prefill += _draw(prefill_space(slid), _share(budget["attn_prefill"], WINDOW_SHARE), rng)
        decode += _draw(decode_space(slid), _share(budget["attn_decode"], WINDOW_SHARE), rng)
    if fp8_kv:   # drawn last: the bf16 and windowed points above do not move
        prefill += _draw(prefill_space(kv_dtype="fp8"), _share(budget["attn_prefill"], FP8_KV_SHARE), rng)
        decode += _draw(decode_space(kv_dtype="fp8"), _share(budget["attn_decode"], FP8_KV_SHARE), rng)
    comm = tuple((op, "nccl", "bf16", g, msg) for op in COMM_OPS for g in gpus for msg in COMM_MESSAGE_BYTES)
    return Grid(gemm, prefill, decode, comm)


def grid_columns(grid: Grid) -> dict[str, dict[str, np.ndarray]]:
    """The grid's points as schema columns per family (no ``latency_us``): what ``predict`` takes."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for fam, points in (("gemm", grid.gemm), ("attn_prefill", grid.attn_prefill),
                        ("attn_decode", grid.attn_decode), ("comm", grid.comm)):
        if not points:
            continue
        cols = list(zip(*points, strict=True))
        out[fam] = {c: np.asarray(v, dtype=str if isinstance(v[0], str) else float)
                    for c, v in zip(SCHEMA[fam], cols, strict=True)}
    return out


def formats_for(vendor: str, capability: tuple[int, ...]) -> tuple[str, ...]:
    """GEMM formats the sweep times on a GPU: bf16 everywhere, per-tensor fp8 on NVIDIA GPUs with fp8 tensor cores
    (sm_89+; ROCm's fp8 is e4m3fnuz, which ``torch.float8_e4m3fn`` is not)."""
    return ("bf16", "fp8") if vendor == "nvidia" and tuple(capability) >= (8, 9) else ("bf16",)


def runs_fa3(vendor: str, capability: tuple[int, ...]) -> bool:
    """Whether vLLM serves attention with FlashAttention 3 on this GPU (NVIDIA Hopper, sm_90), the version that
    takes an fp8 KV cache: what ``calibrate sweep --estimate --windows`` assumes without torch."""
    return vendor == "nvidia" and tuple(capability)[:1] == (9,)
