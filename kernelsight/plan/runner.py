"""Runs points: in worker processes on this machine (all cores by default) or on a Ray cluster, through the cache,
with a progress bar and an ETA.

Ray is imported only when ``--ray-address`` is given; the single-machine path needs nothing beyond the standard
library. The progress bar is ``loadgen/progress.py``'s (tqdm's, when tqdm is installed).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from kernelsight.loadgen.progress import Progress
from kernelsight.plan.cache import ResultCache
from kernelsight.plan.point import PlanWorkload, PointTask, simulate_point

__all__ = ["LocalExecutor", "RayExecutor", "PointRunner", "make_progress", "default_workers"]

_WORKLOAD: PlanWorkload | None = None


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:       # not Linux
        return os.cpu_count() or 1


def _init_worker(workload: PlanWorkload) -> None:
    global _WORKLOAD
    _WORKLOAD = workload


def _run_in_worker(task: PointTask) -> dict[str, Any]:
    assert _WORKLOAD is not None
    return simulate_point(task, _WORKLOAD)


class LocalExecutor:
    """Independent simulations in ``workers`` processes (the workload is sent to each once, at start); one worker
    runs them in this process."""

    def __init__(self, workload: PlanWorkload, workers: int) -> None:
        self.workload = workload
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def run(self, tasks: list[PointTask]) -> Iterator[tuple[PointTask, dict[str, Any]]]:
        if not tasks:
            return
        if self.workers == 1 or len(tasks) == 1 and self._pool is None:   # no pool started for one point
            for t in tasks:
                yield t, simulate_point(t, self.workload)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, initializer=_init_worker, initargs=(self.workload,))
        futures: dict[Future, PointTask] = {self._pool.submit(_run_in_worker, t): t for t in tasks}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                yield futures[f], f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


class RayExecutor:
    """The same simulations as Ray tasks on an existing cluster (``address``: ``auto``, ``ray://host:10001``, or
    ``local`` to start one here). The workload goes to the object store once; results come back to this process,
    which alone writes the cache, so the cluster needs no shared file system."""

    def __init__(self, workload: PlanWorkload, address: str, workers: int | None = None) -> None:
        from kernelsight.loadgen.ray_cluster import connect_ray

        self._ray = ray = connect_ray(address, workers or default_workers())
        self._wl = ray.put(workload)
        self._remote = ray.remote(num_cpus=1)(simulate_point)

    def cpus(self) -> int:
        """The cluster's CPUs: how many points can run at once."""
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def run(self, tasks: list[PointTask]) -> Iterator[tuple[PointTask, dict[str, Any]]]:
        refs = {self._remote.remote(t, self._wl): t for t in tasks}
        pending = list(refs)
        while pending:
            done, pending = self._ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs[ref], self._ray.get(ref)

    def close(self) -> None:
        pass


def make_progress(enabled: bool) -> Progress:
    """tqdm's bar (with an ETA whose total follows the pruning) when tqdm is installed and stderr is a terminal."""
    return Progress(1, "points simulated", enabled=enabled)


class PointRunner:
    """Runs tasks through the cache: cached keys come back at once, the rest from the executor (and are stored).

    A watched task (``PointTask.stop``) is answered by its full result when one is cached, else by a cut-short
    result for the same SLO; a run the watch cut short is stored under the task's ``stop_key``, a full one under
    its key. Results come back under the task's key either way."""

    def __init__(self, executor: LocalExecutor | RayExecutor, cache: ResultCache, progress: Progress) -> None:
        self.executor = executor
        self.cache = cache
        self.progress = progress
        self.simulated = 0
        self.cut_short = 0
        self.done = 0
        self.sim_wall_s = 0.0

    def run(self, tasks: Iterable[PointTask]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        todo = []
        for t in tasks:
            if t.key in out:
                continue
            hit = self.cache.get(t.key)
            if hit is None and t.stop_key is not None:
                hit = self.cache.get(t.stop_key)
            if hit is not None:
                out[t.key] = hit
                self.done += 1
                self.progress.update(1)
            else:
                todo.append(t)
        for t, res in self.executor.run(todo):
            self.cache.put(res["key"], res)
            out[t.key] = res
            self.simulated += 1
            self.cut_short += "cut_short" in res
            self.sim_wall_s += res["sim"]["wall_s"]
            self.done += 1
            self.progress.update(1)
        return out
