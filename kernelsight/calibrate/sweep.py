"""``kernelsight calibrate sweep``: the one microbenchmark sweep a user runs on their own GPU.

A fixed, model-agnostic set of GEMM, attention (prefill and decode) and collective shapes, timed with
PyTorch and written in the measurement schema (``gemm.csv``, ``attn_prefill.csv``, ``attn_decode.csv``,
``comm.csv``), ready for ``kernelsight calibrate fit``. torch is imported lazily, only here: the core
never needs it.

What runs: GEMMs through ``torch.nn.functional.linear`` (bf16) and ``torch._scaled_mm`` (per-tensor fp8, on
GPUs with fp8 tensor cores); attention through vLLM's FlashAttention (``vllm.vllm_flash_attn``, at the version
vLLM serves with on the GPU: FA3 on Hopper; else the ``flash_attn`` package) when importable — then also with
sliding windows — else ``torch`` SDPA with grouped KV heads; all-reduce, all-gather, reduce-scatter and
all-to-all through NCCL; where vLLM's FlashAttention runs an fp8 KV cache (FA3, Hopper), attention with one too.
The ``kernel`` column names what ran, so a fit keeps them apart. What the sweep cannot time (vLLM's block-scaled
fp8 GEMMs, an fp8 KV cache without FA3, vLLM's custom all-reduce) the fit takes from the cross-generation tier.

The shapes: a fixed-seed draw of points per family from a dense shape space, plus collectives over 2/4/8 GPUs
(:mod:`kernelsight.calibrate.sweep_shapes`). Each point is warmed up and timed over 10 back-to-back repetitions with
CUDA events, measured the way vLLM runs kernels in a forward pass:

* the GPU sleeps while Python queues the repetitions (:mod:`~kernelsight.calibrate.sweep_timing`), so it runs them
  without waiting on the interpreter, as vLLM's CUDA graphs do: a 3 µs GEMM is timed, not the time Python takes to
  issue a call;
* each GEMM repetition reads its own copy of the weight, the copies together ≥ 2× the L2 cache
  (:func:`weight_copies`): every layer of a forward pass reads its own weights from DRAM, and so do the shared
  tables' GEMMs (a 32 MB weight on the L40S, a third of its 96 MB L2, streams at 0.78 of DRAM bandwidth), while
  one weight called ten times would come from L2 (``calibrate fit`` would then price decode GEMMs with weights
  under the L2 size too fast). Activations stay one tensor: in a forward pass the previous kernel just wrote them.
  The copies of a weight total under 4× the L2 size (one weight of 2× L2 or more runs alone);
* attention reuses its tensors between repetitions, as the shared tables' attention does (their decode rows with
  a KV cache under the L2 size run faster than DRAM bandwidth allows), so a sweep's fit prices attention the way
  the bundled calibrations do; collectives sleep the same fixed time on every rank (:data:`COMM_HEAD_START_S`);
* vLLM's FlashAttention reads a paged KV cache, as vLLM serves (``--block-size`` tokens per block, 16 by default
  as in vLLM; the blocks in a shuffled order, as a cache's are once requests have come and gone; the attention
  kernels and their calls: :mod:`~kernelsight.calibrate.sweep_attention`). The shared tables time paged calls too
  (64-token blocks, shuffled).

Rows are written as they are timed, with a progress line every half minute; ``--resume`` continues a stopped sweep
(same GPU, software, draw and kernels), timing only the points its files lack.

``kernelsight calibrate sweep --estimate GPU`` predicts the GPU time with the
GPU's calibration (:func:`estimate_seconds`; ~3.5 minutes on an H100); ``benchmarks/sweep_grid.py`` measures what a
fit on these points achieves on the shared tables, and the time from their measured latencies.
"""

from __future__ import annotations

import csv
import importlib.metadata
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from kernelsight.calibrate.measurements import SCHEMA, SWEEP_INFO_FILE
from kernelsight.calibrate.sweep_attention import (
    attention_call,
    attention_kernel,
    flash_attn_varlen,
    flash_runs_fp8_kv,
    kv_block_size,
    working_flash,
)
from kernelsight.calibrate.sweep_shapes import (
    KV_BLOCK_SIZE,
    SWEEP_FAMILIES,
    SWEEP_SEED,
    SWEEP_WINDOWS,
    Grid,
    build_grid,
    formats_for,
    grid_columns,
)
from kernelsight.calibrate.sweep_timing import (
    CALLS_PER_POINT,
    COMM_HEAD_START_S,
    TIMED_CALLS,
    WARMUP_CALLS,
    call_error,
    head_start_cycles,
    import_torch,
    time_point,
    time_us,
)
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.hardware import HardwareSpec


def write_csv(
    path: str | Path, family: str, rows: Iterable[Sequence[object]], kernel: str | Sequence[str] | None = None
) -> Path:
    """Write rows of one family in the schema (+ ``kernel`` when given: one name, or one per row; + ``latency_us``
    last)."""
    path = Path(path)
    cols = list(SCHEMA[family]) + (["kernel"] if kernel is not None else []) + ["latency_us"]
    names = itertools.repeat(kernel) if kernel is None or isinstance(kernel, str) else iter(kernel)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r, name in zip(rows, names, strict=False):   # names may repeat one kernel forever
            *key, lat = r
            w.writerow(list(key) + ([name] if name is not None else []) + [f"{float(lat):.4f}"])
    return path


#: CPU time to issue one timed call, assumed by :func:`estimate_seconds` for the head start (Python → ATen → launch).
ASSUMED_ISSUE_S = 20e-6


def estimate_seconds(grid: Grid, hw: HardwareSpec, calib: Calibration, calls_per_point: int | None = None,
                     head_start_s: float | None = None) -> dict[str, float]:
    """Predicted GPU seconds of timing the grid on ``hw``, per family, from a calibration of that GPU: how long a
    sweep will take before running it. Per point: its predicted latency × the calls it makes
    (:data:`CALLS_PER_POINT`) plus the head start slept before its timed calls (``head_start_s``, default: the
    sleep for :data:`ASSUMED_ISSUE_S` per call at the boost clock; collectives: :data:`COMM_HEAD_START_S`)."""
    from kernelsight.calibrate.evaluate import predict_comm_s
    from kernelsight.calibrate.rows import predict_rows_s

    calls = CALLS_PER_POINT if calls_per_point is None else calls_per_point
    if head_start_s is None:
        head_start_s = head_start_cycles(ASSUMED_ISSUE_S, TIMED_CALLS) / hw.boost_clock_hz
    out: dict[str, float] = {}
    for fam, cols in grid_columns(grid).items():
        t = predict_comm_s(cols, hw, calib) if fam == "comm" else predict_rows_s(fam, cols, hw, calib)
        out[fam] = float(np.nansum(t)) * calls + (COMM_HEAD_START_S if fam == "comm" else head_start_s) * len(t)
    return out


GEMM_KERNELS = {"bf16": "torch.nn.functional.linear", "fp8": "torch._scaled_mm"}


def gemm_formats(torch, device: str, say: Callable[[str], None] = lambda _line: None  # type: ignore[no-untyped-def]
                 ) -> tuple[str, ...]:
    """:func:`formats_for` this torch device (CPU: bf16 only), less fp8 when one small fp8 GEMM fails here (a torch
    build without this GPU's fp8 kernels would otherwise fail every fp8 point)."""
    if not device.startswith("cuda") or not hasattr(torch, "_scaled_mm"):
        return ("bf16",)
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    formats = formats_for(vendor, torch.cuda.get_device_capability(device))
    if "fp8" in formats and (exc := call_error(torch, lambda: _gemm_fn(torch, "fp8", 16, 16, 16, device)(), device)):
        say(f"a test fp8 GEMM failed ({type(exc).__name__}: {exc}); GEMMs are timed in bf16 only")
        formats = tuple(f for f in formats if f != "fp8")
    return formats


#: GEMM weight copies rotated over cover at least this many times the L2 size (:func:`weight_copies`).
COLD_L2_FACTOR = 2.0
GEMM_WEIGHT_BYTES = {"bf16": 2, "fp8": 1}


def weight_copies(weight_bytes: float, l2_bytes: int) -> int:
    """Copies of a GEMM weight to rotate over, used in the order they were made: between two reads of a byte the
    rotation reads all copies once, ≥ :data:`COLD_L2_FACTOR` × the L2 size, so every read comes from DRAM. A weight
    that large runs alone (a stream longer than the cache evicts itself); 1 without an L2 size."""
    if l2_bytes <= 0:
        return 1
    return max(1, math.ceil(COLD_L2_FACTOR * l2_bytes / max(weight_bytes, 1.0)))


def l2_cache_bytes(torch, device: str) -> int:  # type: ignore[no-untyped-def]
    """The GPU's L2 size from torch (0 on CPU or where torch does not report it)."""
    if not device.startswith("cuda"):
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def _gemm_fn(torch, dtype: str, m: int, n: int, k: int, device: str, l2_bytes: int = 0  # type: ignore[no-untyped-def]
             ) -> Callable[[], object]:
    """One GEMM call per call of the result, each on the next of :func:`weight_copies` weights (cold in L2)."""
    if dtype not in GEMM_WEIGHT_BYTES:
        raise ValueError(f"the sweep cannot time {dtype!r} GEMMs")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    copies = weight_copies(GEMM_WEIGHT_BYTES[dtype] * n * k, l2_bytes)
    turn = itertools.cycle(range(copies))
    if dtype == "bf16":
        w = torch.randn(copies, n, k, device=device, dtype=torch.bfloat16)   # one allocation for all copies
        return lambda: torch.nn.functional.linear(x, w[next(turn)])
    w8 = torch.randn(copies, n, k, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)   # no fp32 copy
    one = torch.ones((), device=device)

    def run() -> object:  # per-tensor W8A8: quantize the activation, then the scaled GEMM
        x8 = x.to(torch.float8_e4m3fn)
        return torch._scaled_mm(x8, w8[next(turn)].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return run


def _attention_rows(
    torch, points: Sequence[tuple[int, int, int, int, int, str, int]], decode: bool, device: str, reps: int,
    flash: tuple[Callable[..., object], str] | None, block_size: int = KV_BLOCK_SIZE,
) -> tuple[list[tuple[object, ...]], str]:  # type: ignore[no-untyped-def]
    """The timed points' rows (``latency_us`` last; points left out or failing are not there), and the kernel."""
    rows = []
    for point in points:
        make = attention_call(torch, point, decode, device, flash, block_size)
        lat = time_point(make, device, reps) if make is not None else None
        if lat is not None:
            rows.append((*point, lat))
    return rows, attention_kernel(flash)


#: Seconds between progress lines while a family is being timed.
PROGRESS_EVERY_S = 30.0


def _complete_rows(path: Path) -> list[list[str]]:
    """A CSV's header and the rows with as many cells (not one a stop cut off)."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    return rows[:1] + [r for r in rows[1:] if len(r) == len(rows[0])]


class _FamilyFile:
    """One family's CSV, a row appended (and flushed) as each point is timed: a sweep stopped part-way keeps what it
    measured, and ``resume`` skips the points already in the file."""

    def __init__(self, path: Path, family: str, resume: bool) -> None:
        self.path = path
        cols = [*SCHEMA[family], "kernel", "latency_us"]
        rows = _complete_rows(path) if resume and path.is_file() else [cols]
        if rows[0] != cols:
            raise ValueError(f"{path}: columns {rows[0]} are not this sweep's {cols}: cannot resume into it")
        self.kept = {tuple(r[: len(SCHEMA[family])]) for r in rows[1:]}
        self._fh = open(path, "w", newline="", encoding="utf-8")   # closed by close()
        self._w = csv.writer(self._fh)
        self._w.writerows(rows)
        self._fh.flush()

    def has(self, key: Sequence[object]) -> bool:
        return tuple(str(x) for x in key) in self.kept

    def add(self, key: Sequence[object], kernel: str, latency_us: float) -> None:
        self._w.writerow([*key, kernel, f"{float(latency_us):.4f}"])
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class _Progress:
    """A progress line every :data:`PROGRESS_EVERY_S` while a family is timed, and its summary at the end."""

    def __init__(self, say: Callable[[str], None], what: str, total: int, kept: int) -> None:
        self.say, self.what, self.total, self.kept = say, what, total, kept
        self.timed = self.seen = 0
        self.t0 = self.last = time.perf_counter()

    def tick(self, timed: bool) -> None:
        self.seen += 1
        self.timed += timed
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.say(f"{self.what}: {self.kept + self.seen} of {self.total} points, {now - self.t0:.0f} s")

    def done(self) -> None:
        seconds = time.perf_counter() - self.t0
        if not self.kept:
            self.say(_summary(self.what, self.timed, self.total, seconds))
            return
        self.say(f"{self.what}: {self.kept + self.timed} of {self.total} points ({self.kept} kept from the earlier "
                 f"run, {self.timed} timed now, {self.total - self.kept - self.timed} left out or failed) in "
                 f"{seconds:.0f} s")


def run_sweep(
    output: str | Path,
    device: str = "cuda",
    quick: bool = False,
    families: Sequence[str] = SWEEP_FAMILIES,
    progress: Callable[[str], None] | None = None,
    points: Mapping[str, int | None] | None = None,
    seed: int = SWEEP_SEED,
    resume: bool = False,
    block_size: int = KV_BLOCK_SIZE,
) -> list[Path]:
    """Time the grid on ``device`` and write the schema files into ``output``; returns the files written.
    ``progress`` receives a line per family (points timed, points that failed, seconds) and one every
    :data:`PROGRESS_EVERY_S` while a family runs. ``points`` and ``seed``: the draw (:func:`build_grid`).
    ``block_size``: tokens per KV-cache block of vLLM's FlashAttention calls (the block size one serves with).
    Rows are written as they are timed; ``resume`` keeps the rows already in ``output`` (of the same sweep: same
    GPU, draw and kernels, else ValueError) and times only the rest."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    torch = import_torch()
    say = progress or (lambda _line: None)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count() if device.startswith("cuda") else 1
    flash = working_flash(torch, flash_attn_varlen(), device, say) if device.startswith("cuda") else None
    grid = build_grid(quick=quick, gemm_dtypes=gemm_formats(torch, device, say), num_gpus=n_gpus, points=points,
                      seed=seed, windows=SWEEP_WINDOWS if flash is not None else (0,),
                      fp8_kv=not quick and flash_runs_fp8_kv(torch, flash, device, say))
    reps = 3 if quick else TIMED_CALLS
    info = sweep_info(torch, device, grid, families, reps, seed, attention_kernel(flash),
                      kv_block_size(flash, block_size))
    info_path = out / SWEEP_INFO_FILE
    if resume:
        _check_same_sweep(info_path, info)
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    written = [info_path]
    with torch.inference_mode():
        if "gemm" in families:
            l2_bytes = l2_cache_bytes(torch, device)
            written.append(_time_family(
                out, "gemm", grid.gemm, lambda p: partial(_gemm_fn, torch, *p, device, l2_bytes),
                lambda p: GEMM_KERNELS[p[0]], "gemm", device, reps, resume, say))
        for fam, shapes in (("attn_prefill", grid.attn_prefill), ("attn_decode", grid.attn_decode)):
            if fam in families:
                kernel = attention_kernel(flash)
                written.append(_time_family(
                    out, fam, shapes,
                    lambda p, decode=fam == "attn_decode": attention_call(torch, p, decode, device, flash,
                                                                           block_size),
                    lambda p, name=kernel: name, f"{fam} ({kernel})", device, reps, resume, say))
    if "comm" in families and grid.comm:
        comm_path = out / "comm.csv"
        kept = {tuple(r[: len(SCHEMA["comm"])]) for r in _complete_rows(comm_path)[1:]} \
            if resume and comm_path.is_file() else set()
        if kept >= {tuple(str(x) for x in p) for p in grid.comm}:
            say(f"comm (nccl): all {len(grid.comm)} points kept from the earlier run")
        else:   # the collectives run in one process per GPU: all of them again
            t0 = time.perf_counter()
            _run_comm(out, grid, reps)
            say(_summary("comm (nccl)", len(grid.comm), len(grid.comm), time.perf_counter() - t0))
        written.append(comm_path)
    return written


def _time_family(
    out: Path, family: str, points: Sequence[tuple], make: Callable[[tuple], Callable[[], Callable[[], object]] | None],
    kernel: Callable[[tuple], str], what: str, device: str, reps: int, resume: bool, say: Callable[[str], None],
) -> Path:
    """Time a family's points into ``out/<family>.csv`` (``make``: what builds a point's call, None to leave the
    point out; ``kernel``: the name its row records), skipping those kept from an earlier run when ``resume``."""
    f = _FamilyFile(out / f"{family}.csv", family, resume)
    todo = [p for p in points if not f.has(p)]
    bar = _Progress(say, what, len(points), len(points) - len(todo))
    for point in todo:
        call = make(point)
        lat = time_point(call, device, reps) if call is not None else None
        if lat is not None:
            f.add(point, kernel(point), lat)
        bar.tick(lat is not None)
    f.close()
    bar.done()
    return f.path


#: What must match for ``--resume`` to add to a directory: the same GPU, draw and kernels.
RESUME_KEYS = ("device_name", "seed", "points", "gemm_kernels", "attention", "kv_block_size", "timed_calls")
#: ... and the software, where the directory recorded it
RESUME_SOFTWARE_KEYS = ("torch", "cuda", "hip", "vllm", "nccl")


def _check_same_sweep(info_path: Path, info: Mapping[str, object]) -> None:
    if not info_path.is_file():
        return
    before = json.loads(info_path.read_text())
    differ = [k for k in RESUME_KEYS if before.get(k) != info.get(k)]
    # another kernel library times other kernels; a directory from before the software was recorded resumes
    differ += [k for k in RESUME_SOFTWARE_KEYS if k in before and before[k] != info.get(k)]
    if differ:
        was = ", ".join(f"{k} {before.get(k)!r}" for k in differ)
        now = ", ".join(repr(info.get(k)) for k in differ)
        raise ValueError(f"{info_path.parent} holds another sweep ({was}; this one: {now}): resume needs the same "
                         "GPU, software, draw and kernels — write to another directory, or leave out --resume to "
                         "start over")


def sweep_info(torch, device: str, grid: Grid, families: Sequence[str], reps: int, seed: int,  # type: ignore[no-untyped-def]
               attention: str, block_size: int = 0) -> dict[str, object]:
    """What :data:`~kernelsight.calibrate.measurements.SWEEP_INFO_FILE` records: the GPU (its CUDA device name is
    how ``calibrate fit`` finds its profile without ``--hardware``), the software, the draw and the timing method
    (``kv_block_size``: tokens per block of the paged KV cache attention read; 0: contiguous)."""
    info: dict[str, object] = {
        "tool": "kernelsight calibrate sweep", "device": device, "device_name": device,
        "torch": str(torch.__version__), "cuda": getattr(torch.version, "cuda", None),
        "hip": getattr(torch.version, "hip", None), "vllm": installed_version("vllm"), "seed": seed,
        "families": [f for f in families if f != "comm" or grid.comm],
        "points": {f: len(getattr(grid, f)) for f in ("gemm", "attn_prefill", "attn_decode", "comm")},
        "gemm_kernels": {dt: GEMM_KERNELS[dt] for dt in sorted({row[0] for row in grid.gemm})},
        "attention": attention, "kv_block_size": block_size, "warmup_calls": WARMUP_CALLS, "timed_calls": reps,
        "attention_kv_dtypes": sorted({row[5] for row in (*grid.attn_prefill, *grid.attn_decode)}),
    }
    if device.startswith("cuda"):
        info.update(gemm_weights=f"rotated over >= {COLD_L2_FACTOR:g}x L2 (read from DRAM)",
                    head_start="GPU sleep before the timed calls")
        props = torch.cuda.get_device_properties(device)
        info.update(nccl=nccl_version(torch), device_name=props.name,
                    compute_capability=f"{props.major}.{props.minor}",
                    num_sms=props.multi_processor_count, memory_bytes=props.total_memory,
                    l2_bytes=l2_cache_bytes(torch, device), num_gpus=torch.cuda.device_count())
    return info


def installed_version(distribution: str) -> str | None:
    """The installed version of a Python distribution (e.g. vLLM, whose kernels the sweep times), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_version(torch) -> str | None:  # type: ignore[no-untyped-def]
    """The NCCL torch was built with ("2.27.3"), or None (no NCCL: a CPU or ROCm build without it)."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:    # noqa: BLE001 — torch raises RuntimeError or AttributeError by build
        return None
    return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)


def _summary(what: str, timed: int, points: int, seconds: float) -> str:
    return f"{what}: {timed} of {points} points timed ({points - timed} left out or failed) in {seconds:.0f} s"


def collective_fn(torch, dist, op: str, message_bytes: int, world: int, device: str) -> Callable[[], object]:  # type: ignore[no-untyped-def]
    """One NCCL collective of ``message_bytes`` in bf16. The message is the whole buffer, as the schema and
    nccl-tests count it: all-gather's output, reduce-scatter's input, all-to-all's send buffer."""
    n = message_bytes // 2
    full = torch.empty(n, dtype=torch.bfloat16, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    part = torch.empty(n // world, dtype=torch.bfloat16, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    raise ValueError(f"the sweep cannot time collective {op!r}")


def _run_comm(out: Path, grid: Grid, reps: int) -> Path:
    """The grid's collectives over 2/4/8 local GPUs (one process per GPU, NCCL)."""
    torch = import_torch()
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().list()
    for g in sorted({row[3] for row in grid.comm}):
        points = [(row[0], row[4]) for row in grid.comm if row[3] == g]
        mp.spawn(_comm_worker, args=(g, points, reps, results), nprocs=g, join=True)
    rows = [(op, "nccl", "bf16", g, msg, lat) for op, g, msg, lat in results]
    del torch
    return write_csv(out / "comm.csv", "comm", rows)


def _comm_worker(rank: int, world: int, points: list[tuple[str, int]], reps: int, results: list) -> None:  # type: ignore[type-arg]
    import os

    torch = import_torch()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = f"cuda:{rank}"
    for op, msg in points:
        fn = collective_fn(torch, dist, op, msg, world, device)
        lat = time_us(fn, device, reps=reps, head_start_s=COMM_HEAD_START_S)
        if rank == 0:
            results.append((op, world, msg, lat))
    dist.destroy_process_group()
