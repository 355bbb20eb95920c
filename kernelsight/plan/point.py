"""One point of the search: a deployment at one request rate, simulated by the fast-forward driver
(``loadgen.fastforward.run_replicas``, the path ``kernelsight simulate --replicas`` takes, or for a P/D split
``loadgen.pd_fastforward.run_pd``, the path of ``kernelsight simulate --pd``) and reduced to what the
planner keeps: the run's statistics, each request's TTFT/TPOT/E2EL (so goodput can be judged against any SLO
later, from the cache), where requests waited, and engine 0's timeline (a P/D run records none: its instances'
per-instance busy time, KV peaks and pull times stand in).

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
from kernelsight.loadgen.pd_fastforward import run_pd
from kernelsight.plan.prune import create_engine_config, pd_link
from kernelsight.plan.verdict import SloWatch, StopRule
from kernelsight.simcore.engine_config import EngineArgs

__all__ = ["PlanWorkload", "PointTask", "simulate_point", "point_key", "kernelsight_version", "STORED_PERCENTILES"]

#: Percentiles kept in a point's statistics. TTFT, TPOT and E2EL at any other percentile come from the per-request
#: numbers kept beside them; ITL only at these (its pooled samples are not kept).
STORED_PERCENTILES = (50, 75, 90, 95, 99, 99.5, 99.9)
#: Bumped when a cache entry's content changes shape, so entries of an older shape are not read.
ENTRY_SCHEMA = 3
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
            for it in s.mm_items:       # images: their placement, patches and content keys time the prefill
                h.update(repr((it.offset, it.num_tokens, it.encoder_seq_lens, it.grid_thw, it.mm_hash)).encode())
        return h.hexdigest()


@dataclass(frozen=True, slots=True)
class PointTask:
    args: EngineArgs
    replicas: int
    request_rate: float
    key: str
    label: str
    pd: tuple[int, int] | None = None      # (prefill, decode) engines of a P/D split (replicas is 1 then)
    kv_link: tuple[str | None, float | None, float | None] | None = None   # a split's link (None: the profile's)
    #: the verdict watch (plan/verdict.py): may cut the run short once the point provably fails and provably
    #: cannot be on the front. None: simulated to its end, unwatched (P/D, DP groups, closed loops, curves).
    stop: StopRule | None = None

    @property
    def stop_key(self) -> str | None:
        """Where a cut-short result of this task is cached: its facts hold for the SLO it was judged against."""
        if self.stop is None:
            return None
        return hashlib.sha256(f"{self.key}|{self.stop.key_part()}".encode()).hexdigest()[:32]


def kernelsight_version() -> str:
    try:
        return version("kernelsight")
    except PackageNotFoundError:
        return "unknown"


def point_key(args: EngineArgs, replicas: int, request_rate: float, workload_digest: str,
              pd: tuple[int, int] | None = None, link: tuple | None = None) -> str:
    """Hash of everything a point's result depends on: the full engine arguments (DP and EP among them; the
    calibration file's bytes when one is named), replicas or the P/D split, rate, the workload and the kernelsight
    version; a split's KV link when one is named. A point without a P/D split hashes as it did before P/D was
    searched (its cache entries stay valid)."""
    calib = ""
    if args.calibration:
        calib = hashlib.sha256(Path(args.calibration).read_bytes()).hexdigest()
    blob = json.dumps({"args": dataclasses.asdict(args), "calibration_sha256": calib, "replicas": replicas,
                       "request_rate": request_rate, "workload": workload_digest,
                       "kernelsight": kernelsight_version(), "entry_schema": ENTRY_SCHEMA,
                       **({"pd": list(pd)} if pd is not None else {}),
                       **({"kv_link": list(link)} if pd is not None and link is not None else {})},
                      sort_keys=True, default=str)
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
    watch = None
    if task.stop is not None and task.pd is None and workload.max_concurrency is None \
            and task.args.data_parallel_size == 1:
        watch = SloWatch(task.stop, arrivals, [s.expected_output_len for s in workload.samples], workload.ignore_eos)
    if task.pd is not None:
        res = run_pd(cfg, workload.samples, arrivals, *task.pd, link=pd_link(cfg.hardware, task.kv_link),
                     max_concurrency=workload.max_concurrency, ignore_eos=workload.ignore_eos)
    else:
        res = run_replicas(cfg, workload.samples, arrivals, task.replicas, max_concurrency=workload.max_concurrency,
                           ignore_eos=workload.ignore_eos, record_timeline=True, watch=watch)
    if res.stopped_at_s is not None:
        assert watch is not None and watch.stop is not None and watch.verdict is not None
        return _cut_short_entry(task, cfg, res, watch)
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
    # a DP group's timeline sums its ranks' running requests: its batch holds max_num_seqs per rank
    queue = (_pd_stats(res.pd, res.duration_s, res.num_preemptions) if res.pd is not None else
             _queue_stats(cols, last_arrival_s, cfg.scheduler.max_num_seqs * task.args.data_parallel_size,
                          res.num_preemptions))
    if timeline and len(timeline) > MAX_TIMELINE_ROWS:
        idx = np.linspace(0, len(timeline) - 1, MAX_TIMELINE_ROWS).round().astype(int)
        cols = {k: [v[i] for i in idx] for k, v in cols.items()}
    return {
        "key": task.key, "label": task.label, "replicas": task.replicas, "request_rate": task.request_rate,
        "pd": list(task.pd) if task.pd is not None else None,
        "engine_args": dataclasses.asdict(task.args), "config": cfg.summary(),
        "metrics": metrics,
        "per_request": {"ttft_s": ttft.round(6).tolist(), "tpot_s": tpot.round(7).tolist(),
                        "e2el_s": e2el.round(6).tolist()},
        "queue": queue, "timeline": cols,
        "sim": {"wall_s": round(res.wall_s, 3), "duration_s": round(res.duration_s, 4), "num_steps": res.num_steps,
                "num_preemptions": res.num_preemptions},
    }


def _cut_short_entry(task: PointTask, cfg: Any, res: Any, watch: SloWatch) -> dict[str, Any]:
    """A run the watch stopped: the verdict (fails, with the statistics it provably breaks and lower bounds on
    them), the goodput's bounds, where and when it stopped; no per-request numbers (they would be partial)."""
    assert watch.stop is not None and watch.verdict is not None
    return {
        "key": task.stop_key, "point_key": task.key, "label": task.label, "replicas": task.replicas,
        "request_rate": task.request_rate, "pd": None,
        "engine_args": dataclasses.asdict(task.args), "config": cfg.summary(),
        "cut_short": {"slo": task.stop.slo.text(), "num_requests": watch.n, "verdict": watch.verdict,
                      "stop": watch.stop},
        "sim": {"wall_s": round(res.wall_s, 3), "stopped_at_s": round(res.stopped_at_s, 4),
                "num_steps": res.num_steps, "num_preemptions": res.num_preemptions},
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


def _pd_stats(pd: dict[str, Any], duration_s: float, num_preemptions: int) -> dict[str, Any]:
    """Where a P/D split's requests waited: each side's busiest instance (share of the run it was stepping, peak
    KV use) and the decode side's mean KV pull and wait for its KV (the pull plus any wait for decode blocks)."""
    inst = pd["instances"]
    side = {r: [x for x in inst if x["instance"].startswith(r)] for r in ("P", "D")}
    dur = max(duration_s, 1e-9)
    dec = side["D"]
    pulls = sum(x["pulls"] for x in dec)
    return {"pd": True, "num_preemptions": num_preemptions,
            "prefill_busy": round(max(x["busy_s"] for x in side["P"]) / dur, 4),
            "decode_busy": round(max(x["busy_s"] for x in dec) / dur, 4),
            "prefill_peak_kv_usage": max(x["peak_kv_usage"] for x in side["P"]),
            "decode_peak_kv_usage": max(x["peak_kv_usage"] for x in dec),
            "mean_pull_ms": round(sum(x["mean_pull_ms"] * x["pulls"] for x in dec) / pulls, 3) if pulls else 0.0,
            "mean_kv_wait_ms": round(sum(x["mean_kv_wait_ms"] * x["pulls"] for x in dec) / pulls, 3) if pulls else 0.0,
            "link": pd["link"]["kind"]}
