"""``--replicas N`` spread over worker processes, so that a fleet on one machine uses its cores.

Each replica is a whole server (front end and engine on one event loop: the stream fast path writes chunks from
the engine loop at the step deadline), so replicas split cleanly between processes: replica i keeps its port
(``--port + i``), its KV-event ports, its seed and its own ``/metrics`` whichever process runs it. The parent binds
every listener first, forks one worker per group of replicas (the workers inherit the bound sockets), then only
supervises: SIGTERM/SIGINT go on to the workers (each drains for ``--shutdown-timeout`` as one server does), and a
worker that dies stops the others and the parent exits with its code."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

#: how long the parent waits for stopped workers before killing them: the drain plus uvicorn's grace, plus slack
KILL_AFTER_S = 10.0


def usable_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, taskset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def replica_groups(replicas: int, processes: int | None) -> list[list[int]]:
    """Replica indices per worker process: ``processes`` (default: one per usable CPU, at most one per replica)
    contiguous groups as even as possible, the larger ones first."""
    n = min(replicas, processes if processes is not None else usable_cpus())
    n = max(1, n)
    base, extra = divmod(replicas, n)
    groups, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the supervisor dies (even by SIGKILL), so no orphan keeps a port."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _worker(run: Callable[..., int], args: tuple[Any, ...]) -> None:
    _die_with_parent()
    try:
        code = run(*args)
    except (ValueError, FileNotFoundError) as exc:   # found while building (a KV-event port in use, a tokenizer)
        print(f"kernelsight serve: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_replica_processes(run: Callable[..., int], group_args: Sequence[tuple[Any, ...]],
                          kill_after_s: float = KILL_AFTER_S) -> int:
    """Fork one worker per entry of ``group_args`` running ``run(*args)``; supervise until they end. Returns 0 when
    a signal stopped them all, else the first failed worker's exit code."""
    ctx = multiprocessing.get_context("fork")     # the workers inherit the bound sockets and the parsed flags
    procs = [ctx.Process(target=_worker, args=(run, args), name=f"kernelsight-replicas-{k}", daemon=False)
             for k, args in enumerate(group_args)]
    for p in procs:
        p.start()
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        alive = list(procs)
        while alive:
            done = wait([p.sentinel for p in alive])
            for p in [p for p in alive if p.sentinel in done]:
                p.join()
                alive.remove(p)
                if not stopping:
                    # a worker ended on its own (a startup error, a crash): the fleet is not what was asked for
                    code = p.exitcode if p.exitcode else 1
                    if code < 0:
                        code = 128 - code          # killed by a signal: the shell's convention
                    stop(signal.SIGTERM, None)
        return code
    finally:
        for p in procs:
            p.join(kill_after_s)
            if p.is_alive():
                p.kill()
                p.join()
        for sig, handler in old.items():
            signal.signal(sig, handler)
