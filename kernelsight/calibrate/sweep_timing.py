"""How the sweep times one call on the GPU, and whether a kernel runs here at all (torch imported lazily).

Each point is warmed up, then timed over back-to-back repetitions with CUDA events, the way vLLM runs kernels in a
forward pass: the GPU sleeps while Python queues the repetitions (:func:`time_us`), so it runs them without waiting
on the interpreter, as vLLM's CUDA graphs do. A point that fails (out of memory, a shape the backend rejects) is left
out, not fatal (:func:`time_point`); a kernel the build or the GPU cannot run is found by one small call before the
sweep (:func:`call_error`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TorchUnavailableError(RuntimeError):
    """The sweep needs PyTorch (``pip install kernelsight[sweep]``)."""


def import_torch():  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError as exc:
        raise TorchUnavailableError(
            "kernelsight calibrate sweep needs PyTorch: pip install 'kernelsight[sweep]'"
        ) from exc
    return torch


WARMUP_CALLS = 3
TIMED_CALLS = 10
#: GPU calls a point makes: the warm-up, the call whose CPU time sets the head start, the timed ones.
CALLS_PER_POINT = WARMUP_CALLS + 1 + TIMED_CALLS
#: ``torch.cuda._sleep`` counts SM clock cycles; no GPU clocks faster than this, so a sleep lasts at least as asked.
SLEEP_CYCLES_PER_S = 3.0e9
#: The GPU's head start: this many times the CPU time to issue the timed calls (one call's issue time, measured on
#: the last warm-up call, × the calls), at least :data:`MIN_HEAD_START_S`.
HEAD_START_MARGIN = 2.0
MIN_HEAD_START_S = 50e-6
#: ... and at most this: a call that waits for the GPU (its CPU time then holds GPU time) gains nothing from a
#: longer sleep, and ten such calls of a long kernel would otherwise sleep seconds per point.
MAX_HEAD_START_S = 20e-3
#: A collective's head start, the same on every rank: the first collective waits for the last rank to reach it, so
#: sleeps of different lengths (each rank's own issue time) would be timed. Issuing a collective from Python takes
#: tens of µs, ten of them well under this.
COMM_HEAD_START_S = 1e-3


def head_start_cycles(issue_s: float, reps: int) -> int:
    """Cycles of GPU sleep queued ahead of ``reps`` timed calls that each take ``issue_s`` of CPU time to issue."""
    seconds = min(max(HEAD_START_MARGIN * reps * issue_s, MIN_HEAD_START_S), MAX_HEAD_START_S)
    return int(seconds * SLEEP_CYCLES_PER_S)


def time_us(fn: Callable[[], object], device: str, warmup: int = WARMUP_CALLS, reps: int = TIMED_CALLS,
            head_start_s: float | None = None) -> float:
    """Mean latency of ``fn`` in µs over ``reps`` calls after ``warmup``: CUDA events on GPUs, wall clock on CPU.

    On a GPU the timed calls are queued behind a sleep kernel: the GPU then runs them back to back instead of
    idling while Python issues the next one, which would time the interpreter for kernels shorter than a call's
    issue time. The sleep lasts ``head_start_s`` (0: none), by default :func:`head_start_cycles` of this call's
    issue time."""
    torch = import_torch()
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        t0 = time.perf_counter()
        fn()   # one more warm-up call, whose CPU time is what issuing one call costs
        issue_s = time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        cycles = head_start_cycles(issue_s, reps) if head_start_s is None else int(head_start_s * SLEEP_CYCLES_PER_S)
        sleep = getattr(torch.cuda, "_sleep", None)
        if cycles > 0 and sleep is not None:
            sleep(cycles)
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


def time_point(make: Callable[[], Callable[[], object]], device: str, reps: int) -> float | None:
    """``time_us`` of the call ``make`` builds, or None when building or running it fails (out of memory, a shape
    the backend rejects): one point must not end a sweep of thousands."""
    torch = import_torch()
    try:
        return time_us(make(), device, reps=reps)
    except (RuntimeError, ValueError):   # torch.OutOfMemoryError is a RuntimeError
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return None


def call_error(torch, call: Callable[[], object], device: str) -> Exception | None:  # type: ignore[no-untyped-def]
    """What one small call of a kernel raises here (None: it ran), synchronized on a GPU so that an error of the
    kernel itself shows: a kernel the build or the GPU cannot run is left out before the sweep, not point by point."""
    try:
        call()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 — whatever a build raises, the sweep goes on without that kernel
        return exc
    return None
