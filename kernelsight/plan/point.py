"""One point of the search: a deployment at one request rate, simulated by the fast-forward driver
(``loadgen.fastforward.run_replicas``, the path ``kernelsight simulate --replicas`` takes) and reduced to what the
planner keeps: the run's statistics, each request's TTFT/TPOT/E2EL (so goodput can be judged against any SLO
later, from the cache), where requests waited, and engine 0's timeline.

Everything here is a pure function of its arguments, so it runs the same in a worker process or on a Ray node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import TIMELINE_COLUMNS, run_replicas
from kernelsight.loadgen.metrics import PERCENTILE_METRICS, compute_bench_metrics
from kernelsight.plan.prune import create_engine_config
from kernelsight.simcore.engine_config import EngineArgs

__all__ = ["PlanWorkload", "PointTask", "simulate_point", "point_key", "kernelsight_version", "STORED_PERCENTILES"]

#: Percentiles kept in a point's statistics. TTFT, TPOT and E2EL at any other percentile come from the per-request
#: numbers kept beside them; ITL only at these (its pooled samples are not kept).
STORED_PERCENTILES = (50, 75, 90, 95, 99, 99.5, 99.9)
#: Bumped when a cache entry's content changes shape, so entries of an older shape are not read.
ENTRY_SCHEMA = 2
#: Timeline rows kept per point (evenly thinned): enough for a plot, small enough for the cache.
MAX_TIMELINE_ROWS = 1500


@dataclass(slots=True)
class PlanWorkload:
    """The requests and their send offsets at the requested rate; other rates scale the offsets (the arrival
    process draws gaps as ``1/rate`` times a fixed-seed draw, so a scaled schedule is exactly the schedule of
    that rate)."""

    samples: list[SampleRequest]
    arrivals_s: list[float]
    request_rate: float               # the rate the offsets are drawn at (inf: all at once)
    ignore_eos: bool
    max_concurrency: int | None

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.request_rate, self.ignore_eos, self.max_concurrency]).encode())
        h.update(np.asarray(self.arrivals_s, dtype=np.float64).tobytes())
        for s in self.samples:
            ids = s.token_array if s.token_array is not None else s.prompt_token_ids
            h.update(np.asarray([s.prompt_len, s.expected_output_len], dtype=np.int64).tobytes())
            if ids is not None:
                h.update(np.asarray(ids, dtype=np.int64).tobytes())
        return h.hexdigest()


@dataclass(frozen=True, slots=True)
class PointTask:
    args: EngineArgs
    replicas: int
    request_rate: float
    key: str
    label: str


def kernelsight_version() -> str:
    try:
        return version("kernelsight")
    except PackageNotFoundError:
        return "unknown"


def point_key(args: EngineArgs, replicas: int, request_rate: float, workload_digest: str) -> str:
    """Hash of everything a point's result depends on: the full engine arguments (and the calibration file's bytes
    when one is named), replicas, rate, the workload and the kernelsight version."""
    calib = ""
    if args.calibration:
        calib = hashlib.sha256(Path(args.calibration).read_bytes()).hexdigest()
    blob = json.dumps({"args": dataclasses.asdict(args), "calibration_sha256": calib, "replicas": replicas,
                       "request_rate": request_rate, "workload": workload_digest,
                       "kernelsight": kernelsight_version(), "entry_schema": ENTRY_SCHEMA}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_CONFIGS: dict[str, Any] = {}


def _config(args: EngineArgs):
    """Resolved once per worker process (EngineArgs is mutable, so it is keyed by its JSON)."""
    k = json.dumps(dataclasses.asdict(args), sort_keys=True, default=str)
    if k not in _CONFIGS:
        _CONFIGS[k] = create_engine_config(args)
    return _CONFIGS[k]


def simulate_point(task: PointTask, workload: PlanWorkload) -> dict[str, Any]:
    """Simulate ``task`` and return its JSON-ready result (the cache entry)."""
    cfg = _config(task.args)
    scale = (workload.request_rate / task.request_rate
             if np.isfinite(task.request_rate) and np.isfinite(workload.request_rate) else 1.0)
    arrivals = [a * scale for a in workload.arrivals_s]
    res = run_replicas(cfg, workload.samples, arrivals, task.replicas, max_concurrency=workload.max_concurrency,
                       ignore_eos=workload.ignore_eos, record_timeline=True)
    metrics = compute_bench_metrics(res.records, max(res.duration_s, 1e-9), percentile_metrics=PERCENTILE_METRICS[:4],
                                    percentiles=STORED_PERCENTILES)
    ok = [r for r in res.records if r.success]
    ttft = np.array([r.ttft_s for r in ok])
    e2el = np.array([r.latency_s for r in ok])
    out_lens = np.array([r.output_len for r in ok])
    tpot = np.where(out_lens > 1, (e2el - ttft) / np.maximum(out_lens - 1, 1), 0.0) if ok else np.zeros(0)
    timeline = res.timeline or []
    cols = dict(zip(TIMELINE_COLUMNS, map(list, zip(*timeline, strict=True)), strict=True)) if timeline else {}
    engine0 = sorted(arrivals)[::task.replicas]          # run_replicas sends every R-th arrival to engine 0
    last_arrival_s = engine0[-1] if engine0 else 0.0
    queue = _queue_stats(cols, last_arrival_s, cfg.scheduler.max_num_seqs, res.num_preemptions)
    if timeline and len(timeline) > MAX_TIMELINE_ROWS:
        idx = np.linspace(0, len(timeline) - 1, MAX_TIMELINE_ROWS).round().astype(int)
        cols = {k: [v[i] for i in idx] for k, v in cols.items()}
    return {
        "key": task.key, "label": task.label, "replicas": task.replicas, "request_rate": task.request_rate,
        "engine_args": dataclasses.asdict(task.args), "config": cfg.summary(),
        "metrics": metrics,
        "per_request": {"ttft_s": ttft.round(6).tolist(), "tpot_s": tpot.round(7).tolist(),
                        "e2el_s": e2el.round(6).tolist()},
        "queue": queue, "timeline": cols,
        "sim": {"wall_s": round(res.wall_s, 3), "duration_s": round(res.duration_s, 4), "num_steps": res.num_steps,
                "num_preemptions": res.num_preemptions},
    }


def _queue_stats(cols: dict[str, list], last_arrival_s: float, max_num_seqs: int,
                 num_preemptions: int) -> dict[str, Any]:
    """Where requests waited on engine 0: the waiting queue's peak and its length when the last request arrived
    (a queue still long then was growing: arrivals outran the engine), the batch's peak against max_num_seqs, the
    KV cache's peak use and preemptions."""
    if not cols:
        return {"peak_waiting": 0, "waiting_at_last_arrival": 0, "peak_running": 0, "max_num_seqs": max_num_seqs,
                "peak_kv_usage": 0.0, "num_preemptions": num_preemptions}
    t = np.asarray(cols["time_s"])
    waiting = np.asarray(cols["waiting"])
    i_last = min(int(np.searchsorted(t, last_arrival_s)), len(t) - 1)
    return {"peak_waiting": int(waiting.max()), "waiting_at_last_arrival": int(waiting[i_last]),
            "peak_running": int(max(cols["running"])), "max_num_seqs": max_num_seqs,
            "peak_kv_usage": round(float(max(cols["kv_cache_usage"])), 4), "num_preemptions": num_preemptions}
