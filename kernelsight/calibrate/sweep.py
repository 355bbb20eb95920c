"""``kernelsight calibrate sweep``: the one microbenchmark sweep a user runs on their own GPU.

A fixed, model-agnostic grid of GEMM, attention (prefill and decode) and all-reduce shapes, timed with
PyTorch and written in the measurement schema (``gemm.csv``, ``attn_prefill.csv``, ``attn_decode.csv``,
``comm.csv``), ready for ``kernelsight calibrate fit``. torch is imported lazily, only here: the core
never needs it. Attention uses vLLM's flash-attn when importable, else ``torch`` SDPA.

Budget: the full grid is ~1.6k GEMMs × 2 dtypes, ~300 attention shapes and 3 GPU counts × 21 message
sizes of all-reduce; each point is warmed up and timed over a few repetitions with CUDA events, which
is well under 15 minutes on an H100.
"""

from __future__ import annotations

import csv
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kernelsight.calibrate.measurements import SCHEMA

#: Largest KV / activation footprint a single point may allocate (keeps the sweep within 24 GB cards).
MAX_POINT_BYTES = 6 * 1024**3


class TorchUnavailableError(RuntimeError):
    """The sweep needs PyTorch (``pip install kernelsight[sweep]``)."""


@dataclass(frozen=True, slots=True)
class Grid:
    gemm: tuple[tuple[str, int, int, int], ...]
    attn_prefill: tuple[tuple[int, int, int, int, int, str, int], ...]
    attn_decode: tuple[tuple[int, int, int, int, int, str, int], ...]
    comm: tuple[tuple[str, str, str, int, int], ...]


def _fits(*elements_bytes: float) -> bool:
    return sum(elements_bytes) <= MAX_POINT_BYTES


def build_grid(
    quick: bool = False, gemm_dtypes: Sequence[str] = ("bf16", "fp8"), num_gpus: int = 1, max_gpus: int = 8
) -> Grid:
    """The fixed sweep grid (deterministic). ``quick`` = a tiny grid for smoke tests and CPU runs."""
    if quick:
        ms: Sequence[int] = (1, 16, 128)
        nks: Sequence[tuple[int, int]] = ((256, 256), (512, 1024))
        heads: Sequence[tuple[int, int, int]] = ((4, 2, 64),)
        batches: Sequence[int] = (1, 2)
        seqs: Sequence[int] = (16, 64)
        ctxs: Sequence[int] = (15, 63)
        msgs: Sequence[int] = (4096, 65536)
    else:
        ms = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384)
        dims = (512, 1024, 2048, 4096, 5120, 8192, 14336, 28672)
        nks = tuple(itertools.product(dims, dims))
        heads = (
            (8, 1, 128),
            (32, 8, 128),
            (64, 8, 128),
            (32, 32, 128),
            (16, 4, 64),
            (32, 8, 64),
            (16, 2, 256),
        )
        batches = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        seqs = (16, 64, 256, 1024, 2048, 4096, 8192)
        ctxs = (15, 127, 511, 2047, 8191, 32767)
        msgs = tuple(2**p for p in range(9, 30))
    gemm = tuple((dt, m, n, k) for dt in gemm_dtypes for (n, k) in nks for m in ms)
    prefill = tuple(
        (b, s, qh, kvh, hd, "bf16", 0)
        for (qh, kvh, hd) in heads
        for b in batches[:6]
        for s in seqs
        if b * s <= 65536 and _fits(2.0 * b * s * (qh + 2 * kvh) * hd * 2)
    )
    decode = tuple(
        (b, c, qh, kvh, hd, "bf16", 0)
        for (qh, kvh, hd) in heads
        for b in batches
        for c in ctxs
        if _fits(2.0 * b * (c + 1) * kvh * hd * 2)
    )
    gpus = [g for g in (2, 4, 8) if g <= max(num_gpus, 1) and g <= max_gpus]
    comm = tuple(("all_reduce", "nccl", "bf16", g, msg) for g in gpus for msg in msgs)
    return Grid(gemm, prefill, decode, comm)


def write_csv(
    path: str | Path, family: str, rows: Iterable[Sequence[object]], kernel: str | None = None
) -> Path:
    """Write rows of one family in the schema (+ ``kernel`` when given, + ``latency_us`` last)."""
    path = Path(path)
    cols = list(SCHEMA[family]) + (["kernel"] if kernel is not None else []) + ["latency_us"]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            *key, lat = r
            w.writerow(list(key) + ([kernel] if kernel is not None else []) + [f"{float(lat):.4f}"])
    return path


# ------------------------------------------------------------------------------------------------------------
# timing with torch (lazy)
# ------------------------------------------------------------------------------------------------------------
def _torch():  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError as exc:
        raise TorchUnavailableError(
            "kernelsight calibrate sweep needs PyTorch: pip install 'kernelsight[sweep]'"
        ) from exc
    return torch


def time_us(fn: Callable[[], object], device: str, warmup: int = 3, reps: int = 10) -> float:
    """Median-free mean latency of ``fn`` in µs: CUDA events on GPUs, wall clock on CPU."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def _gemm_fn(torch, dtype: str, m: int, n: int, k: int, device: str) -> Callable[[], object] | None:  # type: ignore[no-untyped-def]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    if dtype == "bf16":
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        return lambda: torch.nn.functional.linear(x, w)
    if dtype == "fp8" and device.startswith("cuda") and hasattr(torch, "_scaled_mm"):
        w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)

        def run() -> object:  # per-tensor W8A8: quantize the activation, then the scaled GEMM
            x8 = x.to(torch.float8_e4m3fn)
            return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        return run
    return None


def _attn_fn(
    torch,
    b: int,
    q_len: int,
    kv_len: int,
    qh: int,
    kvh: int,
    hd: int,
    device: str,  # type: ignore[no-untyped-def]
    causal: bool,
) -> Callable[[], object]:
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q = torch.randn(b, qh, q_len, hd, device=device, dtype=dt)
    k = torch.randn(b, kvh, kv_len, hd, device=device, dtype=dt)
    v = torch.randn(b, kvh, kv_len, hd, device=device, dtype=dt)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rep = qh // kvh

    def run() -> object:
        kk, vv = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return sdpa(q, kk, vv, is_causal=causal)

    return run


def run_sweep(
    output: str | Path,
    device: str = "cuda",
    quick: bool = False,
    families: Sequence[str] = ("gemm", "attn_prefill", "attn_decode", "comm"),
) -> list[Path]:
    """Time the grid on ``device`` and write the schema files into ``output``; returns the files written."""
    torch = _torch()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count() if device.startswith("cuda") else 1
    grid = build_grid(quick=quick, num_gpus=n_gpus)
    reps = 3 if quick else 10
    written = []
    with torch.inference_mode():
        if "gemm" in families:
            rows = []
            for dt, m, n, k in grid.gemm:
                fn = _gemm_fn(torch, dt, m, n, k, device)
                if fn is not None:
                    rows.append((dt, m, n, k, time_us(fn, device, reps=reps)))
            written.append(write_csv(out / "gemm.csv", "gemm", rows, kernel="torch.nn.functional.linear"))
        if "attn_prefill" in families:
            rows = [
                (
                    b,
                    s,
                    qh,
                    kvh,
                    hd,
                    kvd,
                    w,
                    time_us(_attn_fn(torch, b, s, s, qh, kvh, hd, device, True), device, reps=reps),
                )
                for b, s, qh, kvh, hd, kvd, w in grid.attn_prefill
            ]
            written.append(write_csv(out / "attn_prefill.csv", "attn_prefill", rows, kernel="torch_sdpa"))
        if "attn_decode" in families:
            rows = [
                (
                    b,
                    c,
                    qh,
                    kvh,
                    hd,
                    kvd,
                    w,
                    time_us(_attn_fn(torch, b, 1, c + 1, qh, kvh, hd, device, False), device, reps=reps),
                )
                for b, c, qh, kvh, hd, kvd, w in grid.attn_decode
            ]
            written.append(write_csv(out / "attn_decode.csv", "attn_decode", rows, kernel="torch_sdpa"))
    if "comm" in families and grid.comm:
        written.append(_run_comm(out, grid, reps))
    return written


def _run_comm(out: Path, grid: Grid, reps: int) -> Path:
    """All-reduce over 2/4/8 local GPUs (one process per GPU, NCCL)."""
    torch = _torch()
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().list()
    for g in sorted({row[3] for row in grid.comm}):
        sizes = [row[4] for row in grid.comm if row[3] == g]
        mp.spawn(_comm_worker, args=(g, sizes, reps, results), nprocs=g, join=True)
    rows = [("all_reduce", "nccl", "bf16", g, msg, lat) for g, msg, lat in results]
    del torch
    return write_csv(out / "comm.csv", "comm", rows)


def _comm_worker(rank: int, world: int, sizes: list[int], reps: int, results: list) -> None:  # type: ignore[type-arg]
    import os

    torch = _torch()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for msg in sizes:
        x = torch.empty(msg // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
        lat = time_us(lambda x=x: dist.all_reduce(x), f"cuda:{rank}", reps=reps)
        if rank == 0:
            results.append((world, msg, lat))
    dist.destroy_process_group()
