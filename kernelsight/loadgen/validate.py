"""``kernelsight validate RUN_DIR``: replay a measured vLLM run through the simulator and compare, side by side.

A run is a directory in the shared e2e schema (``../shared/data/README.md``): ``meta.json`` (``engine_kwargs``,
optional ``resolved_config`` / ``kv_cache`` / ``hardware``, ``dataset_path``, ``tick_seconds``), ``requests.jsonl``
(one request per line: ``input_toks``, ``output_toks``, ``queued_ts``, ``first_token_ts``, ``last_token_ts``, in
seconds on one clock) and ``timeseries.csv`` (one row per tick: ``t`` and any of ``gen_throughput``, ``running``,
``waiting``, ``kv_cache_pct``).

The replay sends exactly the run's requests: the workload trace ``meta.json`` names when it lies beside the run
(its arrival times and real token ids, so prefix sharing is real), checked against ``requests.jsonl``; else the
requests themselves (arrivals from ``queued_ts``, distinct synthetic token ids: no prefix sharing). Outputs have
the measured lengths (``ignore_eos``). Everything below :func:`validate_run` is data in, tables out.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.datasets import SampleRequest, jsonl_objects, trace_dataset
from kernelsight.loadgen.fastforward import FastForwardResult, run_fast_forward
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.plot import cdf_xy, line_chart, page_html
from kernelsight.loadgen.report import RANK_COLUMNS, format_table, rank_rows
from kernelsight.loadgen.vllm_run import engine_args_from_run
from kernelsight.loadgen.work_pricing import price_run_work
from kernelsight.profiles import bundled_hardware_name
from kernelsight.profiles.accuracy import describe_expected_error, expected_error
from kernelsight.simcore.engine_config import EngineConfig, build_step_model

__all__ = [
    "MeasuredRequest", "Run", "read_meta", "read_requests", "read_timeseries", "read_run", "run_hardware",
    "run_workload_path", "replay_workload", "run_engine_config", "replay", "measured_latency_stats_ms",
    "simulated_latency_stats_ms", "latency_rows", "phase_rows", "tpot_spread_rows",
    "measured_tpot_s", "simulated_tpot_s", "timeseries_rows",
    "breakdown_rows", "pct_error", "validate_run",
    "LATENCY_METRICS", "STATS", "TIMESERIES_COLUMNS", "Validation", "token_times_s", "run_summary_rows",
    "header_line", "format_validation", "plot_html",
]

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATS: tuple[tuple[str, Callable[[np.ndarray], float]], ...] = (
    ("mean", lambda a: float(np.mean(a))), ("median", lambda a: float(np.median(a))),
    ("p90", lambda a: float(np.percentile(a, 90))), ("p99", lambda a: float(np.percentile(a, 99))))
#: timeseries.csv column → (name in the comparison, how a bin aggregates it). All are per-tick rates or gauges, so
#: a bin holds their time average; the simulated side is computed to the same meaning.
TIMESERIES_COLUMNS: dict[str, str] = {"gen_throughput": "output_tok_s", "running": "running",
                                      "waiting": "waiting", "kv_cache_pct": "kv_cache_pct"}
_REQUEST_FIELDS = ("input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts")


@dataclass(frozen=True, slots=True)
class MeasuredRequest:
    """One request of a measured run; times in seconds on the run's clock."""
    request_id: str
    input_toks: int
    output_toks: int
    queued_s: float
    first_token_s: float
    last_token_s: float
    scheduled_s: float | None = None    # first scheduled (``scheduled_ts``), when the run records it


@dataclass(slots=True)
class Run:
    """A measured run: its directory, ``meta.json``, requests and timeseries (column → values, ``t`` included)."""
    path: Path
    meta: dict[str, Any]
    requests: list[MeasuredRequest]
    timeseries: dict[str, np.ndarray]

    @property
    def tick_s(self) -> float:
        return float(self.meta.get("tick_seconds") or 1.0)


def pct_error(simulated: float, measured: float) -> float:
    """Signed % error of the simulated value against the measured one (nan when the measured one is 0)."""
    return 100.0 * (simulated - measured) / measured if measured else float("nan")


# -- reading a run -------------------------------------------------------------------------------------
def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` as a dict; a one-line ValueError naming the file when it is missing or not a JSON object."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found (a run directory holds meta.json, requests.jsonl, timeseries.csv)") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if not isinstance(meta.get("engine_kwargs", {}), dict):
        raise ValueError(f"{path}: 'engine_kwargs' must be an object")
    return meta


def read_requests(path: str | Path) -> list[MeasuredRequest]:
    """``requests.jsonl``: one request per line, in file order; a one-line ValueError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: not found")
    out = []
    for lineno, obj in jsonl_objects(path, str(path)):
        vals = []
        for key in _REQUEST_FIELDS:
            v = obj.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{path} line {lineno}: {key!r} must be a number, got {v!r}")
            vals.append(v)
        n_in, n_out, queued, first, last = vals
        if n_in < 1 or n_out < 1 or int(n_in) != n_in or int(n_out) != n_out:
            raise ValueError(f"{path} line {lineno}: input_toks and output_toks must be positive integers")
        if not queued <= first <= last:
            raise ValueError(f"{path} line {lineno}: timestamps out of order (queued ≤ first token ≤ last token)")
        sched = obj.get("scheduled_ts")
        if sched is not None and (isinstance(sched, bool) or not isinstance(sched, int | float)
                                  or not math.isfinite(sched) or not queued <= sched <= first):
            raise ValueError(f"{path} line {lineno}: 'scheduled_ts' must be a number between queued_ts and "
                             f"first_token_ts, got {sched!r}")
        out.append(MeasuredRequest(str(obj.get("request_id", lineno)), int(n_in), int(n_out), float(queued),
                                   float(first), float(last), None if sched is None else float(sched)))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def read_timeseries(path: str | Path) -> dict[str, np.ndarray]:
    """``timeseries.csv``: column → float array; ``t`` (end of each tick, seconds from the run start) is required."""
    path = Path(path)
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    if "t" not in rows[0]:
        raise ValueError(f"{path}: no 't' column (columns: {', '.join(rows[0])})")
    out: dict[str, np.ndarray] = {}
    for col in rows[0]:
        try:
            out[col] = np.array([float(r[col]) for r in rows])
        except (TypeError, ValueError):
            bad = next(i for i, r in enumerate(rows, 2) if not _is_float(r[col]))
            raise ValueError(f"{path} line {bad}: column {col!r} is not a number ({rows[bad - 2][col]!r})") from None
    return out


def _is_float(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def read_run(run_dir: str | Path) -> Run:
    """The three files of a run directory (errors name the file at fault)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    return Run(run_dir, read_meta(run_dir / "meta.json"), read_requests(run_dir / "requests.jsonl"),
               read_timeseries(run_dir / "timeseries.csv"))


# -- what to replay, on what -----------------------------------------------------------------------------
def run_hardware(meta: Mapping[str, Any]) -> str:
    """The bundled profile of the run's GPU: its CUDA device name (``hardware.device_name``) is a profile alias."""
    device = (meta.get("hardware") or {}).get("device_name", "")
    if not device:
        raise ValueError("records no GPU (hardware.device_name): pass --hardware")
    name = bundled_hardware_name(device)
    if name is None:
        raise ValueError(f"no bundled profile for the run's device {device!r}: pass --hardware")
    return name


def run_workload_path(run_dir: Path, meta: Mapping[str, Any]) -> Path | None:
    """The trace ``meta.json``'s ``dataset_path`` names, beside the run or in it (plain or gzip); None if absent."""
    name = Path(str(meta.get("dataset_path") or "")).name
    if not name:
        return None
    for cand in (run_dir.parent / name, run_dir.parent / f"{name}.gz", run_dir / name, run_dir / f"{name}.gz"):
        if cand.is_file():
            return cand
    return None


def replay_workload(run: Run, workload: str | Path | None = None) -> tuple[list[SampleRequest], list[float], str]:
    """(samples, arrival seconds, where they came from) replaying exactly the run's requests.

    The trace (``workload``, else the one ``meta.json`` names) must hold the same requests as ``requests.jsonl``
    (count, and input/output tokens in arrival order): a different trace would be another experiment. Its requests
    arrive when the run's engine queued them (``queued_ts``; the first at the trace's own first offset), not at the
    trace's times: a client's sends drift from its schedule (±40 ms on the shared runs, requests due 50 ms apart
    queued together), and the measured TTFT runs from the queue time."""
    path = Path(workload) if workload is not None else run_workload_path(run.path, run.meta)
    if path is not None:
        samples = trace_dataset(path)
        measured = sorted(run.requests, key=lambda r: r.queued_s)
        if len(samples) != len(measured):
            raise ValueError(f"{path}: {len(samples)} requests, but the run's requests.jsonl has {len(measured)}")
        for i, (s, r) in enumerate(zip(samples, measured, strict=True)):
            if (s.prompt_len, s.expected_output_len) != (r.input_toks, r.output_toks):
                raise ValueError(f"{path}: request {i} (by arrival) has {s.prompt_len}/{s.expected_output_len} "
                                 f"input/output tokens, the run's {r.request_id} {r.input_toks}/{r.output_toks}")
        start = (samples[0].arrival_offset_s or 0.0) if samples else 0.0
        arrivals = [start + r.queued_s - measured[0].queued_s for r in measured]
        return samples, arrivals, f"trace {path.name} at the run's queue times"
    # No trace: the requests themselves, sent when vLLM queued them. Ids are distinct per request (no shared
    # prefixes), and the run's own token ids are unknown, so a prefix-cache effect cannot be replayed.
    t0 = min(r.queued_s for r in run.requests)
    samples, arrivals = [], []
    for i, r in enumerate(sorted(run.requests, key=lambda r: r.queued_s)):
        ids = (np.arange(r.input_toks, dtype=np.int64) * 7919 + i * 104729) % 30000 + 100
        samples.append(SampleRequest(None, r.input_toks, r.output_toks, r.queued_s - t0, token_array=ids))
        arrivals.append(r.queued_s - t0)
    return samples, arrivals, "requests.jsonl (no token ids: prefix sharing not replayed)"


def run_engine_config(run: Run, *, hardware: str | None = None, calibration: str | None = None,
                      seed: int | None = None, vllm_version: str | None = None) -> EngineConfig:
    """The engine the run was served with (:func:`engine_args_from_run`), on its GPU unless ``hardware`` is given,
    priced with the GPU's calibration of the run's vLLM release (meta.json's ``vllm_version``) unless
    ``vllm_version`` is given."""
    try:
        overrides: dict[str, Any] = {"hardware": hardware or run_hardware(run.meta), "calibration": calibration,
                                     "vllm_version": vllm_version or run.meta.get("vllm_version") or None}
        if seed is not None:
            overrides["seed"] = seed
        return create_engine_config(engine_args_from_run(run.meta, **overrides))
    except ValueError as exc:   # a model or engine setting the simulator does not have
        raise ValueError(f"{run.path / 'meta.json'}: {exc}") from None


def replay(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float]) -> FastForwardResult:
    """Fast-forward the replay: exact output lengths, the engine timeline recorded."""
    return run_fast_forward(config, samples, arrivals_s, ignore_eos=True, record_timeline=True)


# -- latencies ----------------------------------------------------------------------------------------------
def _stats_ms(values_s: np.ndarray) -> dict[str, float | None]:
    if values_s.size == 0:
        return {stat: None for stat, _ in STATS}
    return {stat: fn(values_s) * 1e3 for stat, fn in STATS}


def measured_tpot_s(r: MeasuredRequest) -> float:
    """A measured request's TPOT (2+ output tokens): (last − first token) / (output − 1)."""
    return (r.last_token_s - r.first_token_s) / (r.output_toks - 1)


def simulated_tpot_s(r: RequestRecord) -> float:
    """A simulated request's TPOT (2+ output tokens), as :func:`measured_tpot_s`."""
    return (r.latency_s - r.ttft_s) / (r.output_len - 1)


def measured_latency_stats_ms(requests: Sequence[MeasuredRequest]) -> dict[str, dict[str, float | None]]:
    """metric → stat → ms, as ``vllm bench serve`` defines them: TTFT = first token − queued, TPOT = (last − first)
    / (output − 1) over requests of 2+ tokens, E2EL = last − queued. A run records only first and last token times,
    so of ITL (every gap between tokens) only the mean is known: Σ(last − first) / Σ(output − 1)."""
    ttft = np.array([r.first_token_s - r.queued_s for r in requests])
    e2el = np.array([r.last_token_s - r.queued_s for r in requests])
    multi = [r for r in requests if r.output_toks > 1]
    tpot = np.array([measured_tpot_s(r) for r in multi])
    gaps = sum(r.output_toks - 1 for r in multi)
    itl: dict[str, float | None] = {stat: None for stat, _ in STATS}
    if gaps:
        itl["mean"] = 1e3 * sum(r.last_token_s - r.first_token_s for r in multi) / gaps
    return {"ttft": _stats_ms(ttft), "tpot": _stats_ms(tpot), "itl": itl, "e2el": _stats_ms(e2el)}


def simulated_latency_stats_ms(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """metric → stat → ms of the simulated requests (successful ones), same definitions; ITL from every gap."""
    ok = [r for r in records if r.success]
    itl = np.concatenate([np.asarray(r.itl_s, dtype=float) for r in ok]) if ok else np.zeros(0)
    return {"ttft": _stats_ms(np.array([r.ttft_s for r in ok])),
            "tpot": _stats_ms(np.array([simulated_tpot_s(r) for r in ok if r.output_len > 1])),
            "itl": _stats_ms(itl), "e2el": _stats_ms(np.array([r.latency_s for r in ok]))}


def latency_rows(measured: Mapping[str, Mapping[str, float | None]],
                 simulated: Mapping[str, Mapping[str, float | None]],
                 metrics: Sequence[str] = LATENCY_METRICS) -> list[dict[str, Any]]:
    """One row per metric × stat: measured_ms, simulated_ms, error_pct (None where either side is unknown)."""
    rows = []
    for metric in metrics:
        for stat, _ in STATS:
            m, s = measured[metric][stat], simulated[metric][stat]
            rows.append({"metric": metric, "stat": stat, "measured_ms": m, "simulated_ms": s,
                         "error_pct": pct_error(s, m) if m is not None and s is not None else None})
    return rows


# -- timeseries -------------------------------------------------------------------------------------------
def token_times_s(records: Sequence[RequestRecord]) -> np.ndarray:
    """Every simulated output token's time (seconds from the start): send + TTFT, then the ITLs."""
    parts = [r.start_s + r.ttft_s + np.concatenate(([0.0], np.cumsum(np.asarray(r.itl_s, dtype=float))))
             for r in records if r.success]
    return np.concatenate(parts) if parts else np.zeros(0)


def timeseries_rows(measured: Mapping[str, np.ndarray], tick_s: float, token_times: np.ndarray,
                    timeline: Sequence[tuple], *, num_bins: int = 15, bin_s: float | None = None
                    ) -> tuple[float, list[dict[str, Any]]]:
    """(bin seconds, rows): the measured timeseries and the simulated run on common time bins from 0.

    A bin holds time averages: tokens per second, and the gauges (running, waiting, KV-cache %) weighted by the
    time they held; time outside the run counts as idle (0) on both sides. Measured rows cover the tick ending at
    ``t``; simulated gauges are the engine's after each step (``timeline``: fast-forward's TIMELINE_COLUMNS).
    Only the columns the measured timeseries has are compared; a KV-cache column that is 0 throughout was not
    recorded (a run that generated tokens held KV blocks) and is left out."""
    cols = {src: name for src, name in TIMESERIES_COLUMNS.items() if src in measured}
    kv = measured.get("kv_cache_pct")
    if kv is not None and not np.any(kv):
        cols.pop("kv_cache_pct")
    t = np.asarray(measured["t"], dtype=float)
    tl = np.asarray(timeline, dtype=float).reshape(-1, 6)
    end_s = max(float(t.max()) if t.size else 0.0, float(token_times.max()) if token_times.size else 0.0,
                float(tl[:, 0].max()) if tl.size else 0.0)
    if bin_s is None:   # whole ticks, so each measured row falls in one bin
        bin_s = tick_s * max(1, math.ceil(end_s / (num_bins * tick_s)))
    n = max(1, math.ceil(end_s / bin_s - 1e-9))

    def measured_avg(values: np.ndarray) -> np.ndarray:
        b = np.clip(((t - tick_s / 2) // bin_s).astype(np.int64), 0, n - 1)   # a row at t = 0 goes to bin 0
        return np.bincount(b, weights=values * tick_s, minlength=n)[:n] / bin_s

    # A step's gauges hold over the step, [end − step_s, end]; its time is split between the bins it spans (a 2,048
    # token prefill step straddling a 1 s tick boundary would otherwise put a fifth of a second in the wrong one).
    edges = np.arange(n + 1) * bin_s
    if tl.size:
        # the timeline's rounding (µs ends, 0.1 µs durations) may start a step a hair before the last one ended
        xs = np.maximum.accumulate(np.column_stack((tl[:, 0] - tl[:, 5], tl[:, 0])).ravel())

    def simulated_avg(col: int, scale: float = 1.0) -> np.ndarray:
        if not tl.size:
            return np.zeros(n)
        cum = np.cumsum(tl[:, col] * tl[:, 5] * scale)
        ys = np.column_stack((cum - tl[:, col] * tl[:, 5] * scale, cum)).ravel()   # the integral, piecewise linear
        return np.diff(np.interp(edges, xs, ys)) / bin_s

    series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for src, name in cols.items():
        m = measured_avg(np.asarray(measured[src], dtype=float))
        if src == "gen_throughput":
            tb = np.minimum((token_times // bin_s).astype(np.int64), n - 1)
            s = np.bincount(tb, minlength=n)[:n] / bin_s
        else:
            s = simulated_avg({"running": 1, "waiting": 2, "kv_cache_pct": 3}[src],
                              100.0 if src == "kv_cache_pct" else 1.0)
        series[name] = (m, s)
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"t_start_s": round(i * bin_s, 6), "t_end_s": round((i + 1) * bin_s, 6)}
        for name, (m, s) in series.items():
            row[f"measured_{name}"] = float(m[i])
            row[f"simulated_{name}"] = float(s[i])
        rows.append(row)
    return float(bin_s), rows


def breakdown_rows(breakdown_s: Mapping[str, float]) -> list[dict[str, Any]]:
    """Simulated busy time by kernel family: seconds and percent of the total (families with time only)."""
    busy = sum(breakdown_s.values()) or 1.0
    return [{"family": f, "seconds": round(s, 6), "percent": round(100.0 * s / busy, 3)}
            for f, s in breakdown_s.items() if s > 0]


def phase_rows(requests: Sequence[MeasuredRequest], records: Sequence[RequestRecord],
               num_groups: int = 4) -> list[dict[str, Any]]:
    """Each request against its own replay, in ``num_groups`` groups of equal count by when its first token came
    (measured, seconds from the first arrival): mean TTFT and TPOT of each side and their error.

    A step priced uniformly too fast or too slow shows the same TPOT error in every group; a regime the simulator
    gets wrong (a queue that builds, preemption, the drain at the end) shows in its own group. ``records`` are in the
    replay's order, which is the requests' arrival (queue) order."""
    measured = sorted(requests, key=lambda r: r.queued_s)
    if len(measured) != len(records) or not measured:
        return []
    t0 = measured[0].queued_s
    pairs = [(m, r) for m, r in zip(measured, records, strict=True)
             if r.success and m.output_toks >= 2 and r.output_len >= 2]
    pairs.sort(key=lambda p: p[0].first_token_s)
    rows = []
    for chunk in np.array_split(np.arange(len(pairs)), min(num_groups, len(pairs))):
        grp = [pairs[i] for i in chunk]
        ttft_m = float(np.mean([m.first_token_s - m.queued_s for m, _ in grp]))
        ttft_s = float(np.mean([r.ttft_s for _, r in grp]))
        tpot_m = float(np.mean([measured_tpot_s(m) for m, _ in grp]))
        tpot_s = float(np.mean([simulated_tpot_s(r) for _, r in grp]))
        rows.append({"first_token_s": f"{grp[0][0].first_token_s - t0:.1f}-{grp[-1][0].first_token_s - t0:.1f}",
                     "requests": len(grp),
                     "ttft_measured_ms": 1e3 * ttft_m, "ttft_simulated_ms": 1e3 * ttft_s,
                     "ttft_error_pct": pct_error(ttft_s, ttft_m),
                     "tpot_measured_ms": 1e3 * tpot_m, "tpot_simulated_ms": 1e3 * tpot_s,
                     "tpot_error_pct": pct_error(tpot_s, tpot_m)})
    return rows


SPREAD_QUANTILES = (10, 90, 99)


def tpot_spread_rows(requests: Sequence[MeasuredRequest], records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """The shape of the per-request TPOT distribution on each side, each TPOT divided by its side's median: p10, p90,
    p99 and the most, and how many requests run 1.5x their side's median or slower (a preemption's recompute and
    requeue, or prefills interleaved into its decode). Scale-free, so a step priced too fast or too slow leaves it
    alone: where the shapes agree the simulator reproduces the stalls, and the TPOT error is the step's price."""
    def ratios(tpots: list[float]) -> np.ndarray:
        a = np.asarray(tpots, dtype=float)
        return a / np.median(a) if a.size else a
    meas = ratios([measured_tpot_s(r) for r in requests if r.output_toks >= 2])
    sim = ratios([simulated_tpot_s(r) for r in records if r.success and r.output_len >= 2])
    if not meas.size or not sim.size:
        return []
    rows = [{"what": f"p{q} / median", "measured": float(np.percentile(meas, q)),
             "simulated": float(np.percentile(sim, q))} for q in SPREAD_QUANTILES]
    rows.append({"what": "max / median", "measured": float(meas.max()), "simulated": float(sim.max())})
    rows.append({"what": "requests >= 1.5x median", "measured": int((meas >= 1.5).sum()),
                 "simulated": int((sim >= 1.5).sum())})
    return rows


def overtaken_count(arrivals_s: Sequence[float], first_tokens_s: Sequence[float]) -> int:
    """Requests whose first token came before that of a request that arrived strictly earlier: 0 when prompts are
    served first-come first-served (vLLM's default), more under a priority policy or a scheduler that reorders."""
    order = sorted(range(len(arrivals_s)), key=lambda i: arrivals_s[i])
    count, latest_before, group_latest, group_arrival = 0, -math.inf, -math.inf, None
    for i in order:
        if arrivals_s[i] != group_arrival:      # requests that arrived together do not overtake each other
            latest_before = max(latest_before, group_latest)
            group_arrival, group_latest = arrivals_s[i], -math.inf
        count += first_tokens_s[i] < latest_before
        group_latest = max(group_latest, first_tokens_s[i])
    return count


def run_summary_rows(requests: Sequence[MeasuredRequest], records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Whole-run duration (first arrival to last token), output token throughput and requests served out of arrival
    order, measured vs simulated (``records`` in the replay's order, the requests' arrival order)."""
    m_dur = max(r.last_token_s for r in requests) - min(r.queued_s for r in requests)
    ok = [r for r in records if r.success]
    s_dur = (max(r.start_s + r.latency_s for r in ok) - min(r.start_s for r in ok)) if ok else 0.0
    m_tok = sum(r.output_toks for r in requests)
    s_tok = sum(r.output_len for r in ok)
    m_rate = m_tok / m_dur if m_dur > 0 else 0.0
    s_rate = s_tok / s_dur if s_dur > 0 else 0.0
    return [{"what": "duration_s", "measured": m_dur, "simulated": s_dur, "error_pct": pct_error(s_dur, m_dur)},
            {"what": "output_tok_s", "measured": m_rate, "simulated": s_rate, "error_pct": pct_error(s_rate, m_rate)},
            {"what": "completed", "measured": len(requests), "simulated": len(ok),
             "error_pct": pct_error(len(ok), len(requests))},
            {"what": "first_token_before_earlier_arrival", "measured": overtaken_count(
                [r.queued_s for r in requests], [r.first_token_s for r in requests]),
             "simulated": overtaken_count([r.start_s for r in ok], [r.start_s + r.ttft_s for r in ok]),
             "error_pct": None}]


# -- the whole comparison ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Validation:
    """A run's comparison: ``result`` (JSON-ready, deterministic for a seed) and what the plot needs."""
    result: dict[str, Any]
    run: Run
    sim: FastForwardResult


#: How the report names each software component of ``Calibration.software`` and of a run's meta.json.
_SOFTWARE_NAMES = {"vllm": "vLLM", "torch": "torch", "cuda": "CUDA", "hip": "HIP", "nccl": "NCCL"}


def run_software(meta: Mapping[str, Any]) -> dict[str, str]:
    """The software a run was served under, as far as its meta.json records it (``vllm_version``; ``hardware``'s
    ``torch_version`` and ``cuda_version``)."""
    hw = meta.get("hardware") if isinstance(meta.get("hardware"), Mapping) else {}
    found = {"vllm": meta.get("vllm_version"), "torch": hw.get("torch_version"), "cuda": hw.get("cuda_version"),
             "hip": hw.get("hip_version"), "nccl": hw.get("nccl_version")}
    return {k: str(v) for k, v in found.items() if v not in (None, "")}


def software_comparison(calibration: Mapping[str, str], run: Mapping[str, str]) -> dict[str, Any]:
    """The calibration's kernel software against the run's: ``differs`` lists the components both record whose run
    version is none of the calibration's (a kernel library picks its kernels per release, so the run may not have
    run the kernels the calibration prices)."""
    differs = [k for k in _SOFTWARE_NAMES if k in calibration and k in run
               and run[k] not in calibration[k].split(" / ")]
    return {"calibration": dict(calibration), "run": dict(run), "differs": differs}


def describe_software(cmp: Mapping[str, Any]) -> str | None:
    """One report line on the software the calibration was timed under and the run served with; None when neither
    side records any."""
    def versions(record: Mapping[str, str]) -> str:
        return ", ".join(f"{_SOFTWARE_NAMES.get(k, k)} {v}" for k, v in record.items())

    cal, run, differs = cmp["calibration"], cmp["run"], cmp["differs"]
    if not cal and not run:
        return None
    line = (f"kernel software: the calibration's kernels timed under {versions(cal) or 'unrecorded software'}; "
            f"the run served under {versions(run) or 'unrecorded software'}")
    if differs:
        names = ", ".join(_SOFTWARE_NAMES.get(k, k) for k in differs)
        return (line + f" — {names} {'differs' if len(differs) == 1 else 'differ'}: kernel libraries choose "
                "their kernels per release, so the run may not have run the kernels this calibration prices "
                "(a `kernelsight calibrate sweep` under the run's software measures those)")
    return line


def validate_run(run_dir: str | Path, *, hardware: str | None = None, calibration: str | None = None,
                 seed: int | None = None, workload: str | Path | None = None, num_bins: int = 15,
                 vllm_version: str | None = None) -> Validation:
    """Read the run, replay it, and compare latencies, timeseries and (simulated) time by kernel family."""
    run = read_run(run_dir)
    config = run_engine_config(run, hardware=hardware, calibration=calibration, seed=seed, vllm_version=vllm_version)
    samples, arrivals, source = replay_workload(run, workload)
    too_long = [s.prompt_len for s in samples if s.prompt_len >= config.scheduler.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) are longer than max_model_len={config.scheduler.max_model_len}")
    res = replay(config, samples, arrivals)
    bin_s, ts_rows = timeseries_rows(run.timeseries, run.tick_s, token_times_s(res.records), res.timeline or [],
                                     num_bins=num_bins)
    stats = res.simulator_stats()
    result = {
        "run": run.path.name,
        "vllm_version": run.meta.get("vllm_version"),
        "workload": source,
        "num_requests": len(run.requests),
        "config": config.summary(),
        "measured_num_gpu_blocks": (run.meta.get("kv_cache") or {}).get("num_gpu_blocks"),
        "latency": latency_rows(measured_latency_stats_ms(run.requests), simulated_latency_stats_ms(res.records)),
        "run_summary": run_summary_rows(run.requests, res.records),
        "by_phase": phase_rows(run.requests, res.records),
        "tpot_spread": tpot_spread_rows(run.requests, res.records),
        "timeseries": {"bin_s": bin_s, "rows": ts_rows},
        "breakdown": breakdown_rows(res.breakdown_s),
        "expected_error_pct": expected_error(config.summary()["calibration_tier"]),
        "software": software_comparison(config.calibration.software, run_software(run.meta)),
        # the tick-by-tick pricing assumes one engine did a tick's work: not a data-parallel run's
        "work_pricing": None if config.args.data_parallel_size > 1 else price_run_work(
            run.requests, run.timeseries, run.tick_s, build_step_model(config), config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens),
        # wall-clock figures stay out: the result is identical for a seed
        "simulator": {k: v for k, v in stats.items() if k in ("num_steps", "num_preemptions", "prefix_cache_hit_rate",
                                                              "finish_reasons", "data_parallel_ranks")},
    }
    return Validation(result, run, res)


# -- rendering ----------------------------------------------------------------------------------------------
_TS_LABELS = {"output_tok_s": "tok/s", "running": "running", "waiting": "waiting", "kv_cache_pct": "kv%"}


def header_line(result: Mapping[str, Any]) -> str:
    """Model, GPU, engine settings and calibration tier of a validation result."""
    c = result["config"]
    measured_blocks = result.get("measured_num_gpu_blocks")
    blocks = f"{c['num_gpu_blocks']} KV blocks" + (f" (measured {measured_blocks})" if measured_blocks else "")
    dp = c.get("data_parallel_size", 1)
    parallel = f"TP {c['tensor_parallel_size']}" + (f", DP {dp}" if dp > 1 else "") + (
        ", EP" if c.get("enable_expert_parallel") else "")
    return (f"kernelsight validate {result['run']}: {c['model']} on {c['hardware']} ({parallel}, "
            f"{c['dtype']}, kv {c['kv_cache_dtype']}, max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens "
            f"{c['max_num_batched_tokens']}, prefix caching {'on' if c['enable_prefix_caching'] else 'off'}, "
            f"async scheduling {'on' if c['async_scheduling'] else 'off'}, {blocks}, seed {c['seed']}), "
            f"calibration: {EngineConfig.calibration_label(c)}; {result['num_requests']} requests from "
            f"{result['workload']}")


_PHASE_COLUMNS = ["first_token_s", "requests", "ttft_measured_ms", "ttft_simulated_ms", "ttft_error_pct",
                  "tpot_measured_ms", "tpot_simulated_ms", "tpot_error_pct"]


def _phase_part(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["each request against its replay, grouped by when its first token came (measured, s from the first "
            "arrival; means, ms): the same TPOT error in every group is the step's price, one group's own is its "
            "regime's", format_table(rows, _PHASE_COLUMNS, float_fmt=".1f"), ""]


def _spread_part(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["per-request TPOT over its side's median (the stalls — preemption, prefills between decodes — without the "
            "step's price):", format_table(rows, ["what", "measured", "simulated"], float_fmt=".2f"), ""]


def format_validation(result: Mapping[str, Any]) -> str:
    """The printed report: header, latency table, run summary, the phase groups and the TPOT spread, binned
    timeseries, kernel-family breakdown, work pricing."""
    ts = result["timeseries"]
    names = [k.removeprefix("measured_") for k in (ts["rows"][0] if ts["rows"] else {}) if k.startswith("measured_")]
    ts_cols = ["t_s"] + [f"{_TS_LABELS.get(n, n)} {side}" for n in names for side in ("meas", "sim")]
    ts_rows = [{"t_s": f"{r['t_start_s']:g}-{r['t_end_s']:g}",
                **{f"{_TS_LABELS.get(n, n)} {side}": r[f"{pre}_{n}"] for n in names
                   for side, pre in (("meas", "measured"), ("sim", "simulated"))}} for r in ts["rows"]]
    software = describe_software(result["software"]) if result.get("software") else None
    parts = [header_line(result), describe_expected_error(result["config"]["calibration_tier"]),
             *([software] if software else []), "",
             "latency (ms; error = simulated vs measured, %; the run records first and last token times only, so "
             "of ITL only the mean is measured):",
             format_table(result["latency"], ["metric", "stat", "measured_ms", "simulated_ms", "error_pct"]), "",
             format_table(result["run_summary"], ["what", "measured", "simulated", "error_pct"]), "",
             *_phase_part(result.get("by_phase") or []),
             *_spread_part(result.get("tpot_spread") or []),
             f"timeseries ({ts['bin_s']:g} s bins from the start; time averages):",
             format_table(ts_rows, ts_cols, float_fmt=".1f"), "",
             "simulated step time by kernel family:",
             format_table(result["breakdown"], ["family", "seconds", "percent"])]
    sim = result["simulator"]
    parts.append(f"{sim['num_steps']} steps, {sim['num_preemptions']} preemptions, prefix-cache hit rate "
                 f"{100 * sim['prefix_cache_hit_rate']:.1f}%")
    if sim.get("data_parallel_ranks"):
        parts += ["", "simulated data-parallel ranks (own step time, MoE all-to-all, waiting for the slowest rank):",
                  format_table(rank_rows(sim["data_parallel_ranks"]), list(RANK_COLUMNS))]
    wp = result.get("work_pricing")
    if wp and wp["groups"][0]["count"]:
        parts += ["", "the measured work priced by the step model (simulated GPU seconds per measured second, on "
                      "ticks the GPU was busy throughout; < 1: the step is priced too fast for that work; ticks "
                      f"placed {wp.get('clock_offset_s', 0.0):+.2f} s from their labels, where the running and "
                      "waiting counts match the requests'):",
                  format_table(wp["groups"], ["ticks", "count", "mean", "median", "std"], float_fmt=".3f")]
        if wp["split"]:
            sp = wp["split"]
            parts.append(f"least-squares split over {sp['ticks']} ticks: tick time = {sp['decode_scale']:.3f} x priced "
                         f"decode + {sp['prefill_scale']:.3f} x priced prefill (rms residual "
                         f"{sp['rms_residual_s']:.3f} s)")
        if wp.get("decode_steps"):
            parts += ["", "decode-only busy ticks as one step each, by batch (measured = tick / steps it ran):",
                      format_table(wp["decode_steps"], ["t_end_s", "batch", "graph_batch", "mean_context",
                                                        "measured_step_ms", "priced_step_ms", "priced_over_measured"],
                                   float_fmt=".3f")]
    return "\n".join(parts)


def plot_html(v: Validation) -> str:
    """``--plot``: measured vs simulated latency CDFs and per-tick timeseries on one self-contained page."""
    reqs = v.run.requests
    measured_s = {"TTFT": [r.first_token_s - r.queued_s for r in reqs],
                  "TPOT": [measured_tpot_s(r) for r in reqs if r.output_toks > 1],
                  "E2EL": [r.last_token_s - r.queued_s for r in reqs]}
    ok = [r for r in v.sim.records if r.success]
    simulated_s = {"TTFT": [r.ttft_s for r in ok],
                   "TPOT": [simulated_tpot_s(r) for r in ok if r.output_len > 1],
                   "E2EL": [r.latency_s for r in ok]}
    cdfs = []   # no ITL CDF: a run records first and last token times, not each gap
    for name in measured_s:
        series = [(label, *cdf_xy(1e3 * np.asarray(vals, dtype=float)))
                  for label, vals in (("measured", measured_s[name]), ("simulated", simulated_s[name]))]
        cdfs.append(line_chart(f"{name} CDF", series, xlabel=f"{name} (ms)", ylabel="fraction", y_max=1.0))
    _, rows = timeseries_rows(v.run.timeseries, v.run.tick_s, token_times_s(v.sim.records), v.sim.timeline or [],
                              bin_s=v.run.tick_s)
    t = [r["t_end_s"] for r in rows]
    names = [k.removeprefix("measured_") for k in (rows[0] if rows else {}) if k.startswith("measured_")]
    charts = [line_chart(n, [(side, t, [r[f"{side}_{n}"] for r in rows]) for side in ("measured", "simulated")],
                         xlabel="time (s)", ylabel=n, step=True) for n in names]
    r = v.result
    summary = {"run": r["run"], "model": r["config"]["model"], "hardware": r["config"]["hardware"],
               "calibration": r["config"]["calibration_tier"], "workload": r["workload"],
               **{f"{row['metric']} {row['stat']} error %": row["error_pct"] for row in r["latency"]
                  if row["stat"] == "mean" and row["error_pct"] is not None}}
    return page_html(f"kernelsight validate: {r['run']}", summary,
                     [("Latency CDFs, measured vs simulated", cdfs),
                      (f"Timeseries ({v.run.tick_s:g} s ticks)", charts)])
