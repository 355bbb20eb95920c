"""The search: static pruning, then deployments simulated cheapest first, in waves as wide as the workers.

Cost per hour grows with replicas, and latency at a fixed total load falls with them (each replica gets 1/R of
the arrivals: monotone in load). So, per engine choice, the replica counts form a line on which one failing point
decides every smaller count and one passing point every larger one; and once any deployment meets the SLO, every
costlier one is dominated (it cannot beat that goodput by more than the requests it already serves, at a higher
cost), and so is one of the same cost that can at best tie it (the passing point already serves every request
well, and sorts first by label, as the front and the choice break ties). Only the points left undecided are
simulated; the rest are counted, with the reason.

Each simulation is watched (plan/verdict.py): a run is cut short once the point provably fails and provably serves
fewer requests well than a point no costlier already does, so it can be neither chosen nor on the front. At the
end, a cut-short point that the bounds still leave a chance of being on the front (one read from the cache, cut
short against points this search does not hold) is simulated in full, so the
chosen deployment and the front are exactly those of the search with every run simulated to its end
(``early_stop=False``, ``--no-early-stop``); the probes never depend on a cut-short run's partial numbers, only on
its verdict, so both searches simulate the same points.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernelsight.plan.pareto import cheapest_meeting, pareto_front
from kernelsight.plan.point import PlanWorkload, PointTask, point_key
from kernelsight.plan.prices import PriceTable
from kernelsight.plan.prune import (
    REASON_DOMINATED,
    REASON_INVALID,
    REASON_MAX_GPUS,
    REASON_MONOTONE,
    REASON_NO_PRICE,
    REASON_ROOFLINE_LOAD,
    WorkloadShape,
    engine_args_for,
    min_replicas,
    pd_link,
    resolve_choice,
    roofline_bounds,
    slo_floor_violation,
)
from kernelsight.plan.runner import PointRunner
from kernelsight.plan.slo import Slo
from kernelsight.plan.space import Deployment, EngineChoice, SearchSpace, canonical_spec, pd_label
from kernelsight.plan.verdict import StopRule
from kernelsight.simcore.engine_config import EngineArgs

__all__ = ["PlanResult", "run_plan", "evaluate_point", "diagnose"]


@dataclass(slots=True)
class _Line:
    """One engine choice's deployments still in play: replica counts ``(r,)``, or P/D splits ``(x, y)`` when
    ``pd``. Both are ordered componentwise: a deployment that fails decides every one with no more of each kind of
    engine (fewer replicas, or fewer prefill and fewer decode engines, see each more load), one that passes every
    one with no fewer."""

    choice: EngineChoice
    args: EngineArgs
    usd_per_gpu_hour: float
    candidates: list[tuple[int, ...]]
    pd: bool = False
    failed: list[tuple[int, ...]] = field(default_factory=list)
    passed: list[tuple[int, ...]] = field(default_factory=list)
    simulated: set[tuple[int, ...]] = field(default_factory=set)
    speed: tuple = ()            # one engine's (token ceiling in req/s, KV blocks): see likelihood()

    def gpus(self, c: tuple[int, ...]) -> int:
        return self.choice.gpus_per_engine * sum(c)

    def deployment(self, c: tuple[int, ...]) -> Deployment:
        return Deployment(self.choice, 1, (c[0], c[1])) if self.pd else Deployment(self.choice, c[0])

    def decided(self, c: tuple[int, ...]) -> bool:
        return (any(all(a <= b for a, b in zip(c, f, strict=True)) for f in self.failed)
                or any(all(a >= b for a, b in zip(c, p, strict=True)) for p in self.passed))

    def undecided(self) -> list[tuple[int, ...]]:
        return [c for c in self.candidates if c not in self.simulated and not self.decided(c)]

    def usd_per_hour(self, c: tuple[int, ...]) -> float:
        return self.usd_per_gpu_hour * self.gpus(c)

    def likelihood(self, c: tuple[int, ...]) -> tuple:
        """Sort key among deployments of one cost, likelier to serve well first: the higher token ceiling (in
        12%-wide bands, the roofline's own precision), then fewer GPUs per engine (no all-reduce to pay), then more
        KV blocks. A good goodput known early lets the watch cut the level's failing points short."""
        rate, blocks = self.speed
        engines = c[1] if self.pd else c[0]
        band = round(8 * math.log2(max(rate * engines, 1e-12)))
        return (-band, self.choice.gpus_per_engine, -blocks * sum(c))

    def next_probe(self) -> tuple[int, ...] | None:
        u = self.undecided()
        if not u:
            return None
        if self.pd:           # cheapest undecided split first: a pass makes every costlier one dominated
            return u[0]
        if self.passed:       # a jump passed: bisect the gap below it
            return u[len(u) // 2]
        fail_max = max((f[0] for f in self.failed), default=0)
        if fail_max == 0:
            return u[0]
        # a failing count: try twice as many next (a pass is bisected back). Only the verdict steers the probes,
        # never a run's goodput, which a cut-short run knows only within bounds.
        return next((c for c in u if c[0] >= 2 * fail_max), u[-1])


@dataclass(slots=True)
class PlanResult:
    points: list[dict[str, Any]]                 # every simulated point at the requested rate, evaluated
    front: list[dict[str, Any]]
    chosen: dict[str, Any] | None
    curves: dict[str, list[dict[str, Any]]]      # deployment label → points at other rates, rate ascending
    pruned: Counter
    pruned_examples: dict[str, list[str]]
    space_size: int
    simulated: int
    cache_hits: int
    wall_s: float
    request_rate: float
    offered_tokens_per_s: float
    slo: Slo
    prices: PriceTable
    chosen_timeline: dict[str, list] = field(default_factory=dict)   # engine 0's, of the chosen deployment
    stopped_early: int = 0       # points whose run was cut short once they provably failed (and stayed so)
    rerun_in_full: int = 0       # cut-short points simulated again in full: the bounds left them a front chance

    def summary(self) -> dict[str, Any]:
        return {"space_points": self.space_size, "simulated": self.simulated, "cache_hits": self.cache_hits,
                "stopped_early": self.stopped_early, "rerun_in_full": self.rerun_in_full,
                "pruned": sum(self.pruned.values()), "pruned_by_reason": dict(self.pruned),
                "wall_s": round(self.wall_s, 2)}


def usd_per_mtok(num_gpus: int, usd_per_gpu_hour: float, tokens_per_s: float) -> float:
    """Cost per million tokens (the front's axis), computed one way everywhere it is compared."""
    gpu_hours_per_mtok = num_gpus / (tokens_per_s * 3600.0 / 1e6) if tokens_per_s > 0 else math.inf
    return gpu_hours_per_mtok * usd_per_gpu_hour


def evaluate_point(entry: dict[str, Any], slo: Slo, usd_per_gpu_hour: float,
                   offered_tokens_per_s: float) -> dict[str, Any]:
    """A cached result judged against ``slo``: pass/fail and why, goodput, cost."""
    if "cut_short" in entry:
        return _evaluate_cut_short(entry, slo, usd_per_gpu_hour, offered_tokens_per_s)
    m = entry["metrics"]
    pr = entry["per_request"]
    good = np.ones(len(pr["ttft_s"]), dtype=bool)
    for metric, limit_ms in slo.goodput_ms().items():
        good &= np.asarray(pr[f"{metric}_s"]) <= limit_ms / 1000.0
    duration = max(m["duration"], 1e-9)
    violations = slo.violations(_with_slo_stats(m, pr, slo))
    failed = m["failed"]
    meets = not violations and failed == 0
    a = entry["engine_args"]
    pd = entry.get("pd")
    per_engine = a["tensor_parallel_size"] * a.get("data_parallel_size", 1)
    num_gpus = per_engine * (pd[0] + pd[1] if pd else entry["replicas"])
    # the offered rate when the load is a rate; a closed loop (--max-concurrency) offers what it served
    tokens_per_s = offered_tokens_per_s if offered_tokens_per_s > 0 else m["total_token_throughput"]
    gpu_hours_per_mtok = num_gpus / (tokens_per_s * 3600.0 / 1e6) if tokens_per_s > 0 else math.inf
    out = {
        "label": entry["label"], "key": entry["key"], "replicas": entry["replicas"], "num_gpus": num_gpus,
        "hardware": entry["config"]["hardware"], "tensor_parallel_size": entry["config"]["tensor_parallel_size"],
        "quantization": entry["config"]["quantization"], "kv_cache_dtype": entry["config"]["kv_cache_dtype"],
        "max_num_seqs": entry["config"]["max_num_seqs"],
        "max_num_batched_tokens": entry["config"]["max_num_batched_tokens"],
        "data_parallel_size": a.get("data_parallel_size", 1),
        "enable_expert_parallel": bool(a.get("enable_expert_parallel", False)),
        "pd": pd_label((pd[0], pd[1])) if pd else "",
        "speculative_config": canonical_spec(a.get("speculative_config")) or "",
        "request_rate": entry["request_rate"], "meets_slo": meets, "violations": violations,
        # requests/s that meet the SLO out of the offered rate (a short run's drain tail would deflate vLLM's
        # good-requests-over-duration, kept as bench_goodput_rps)
        "goodput_rps": (int(good.sum()) / (good.size + m["failed"]) * entry["request_rate"]
                        if good.size and math.isfinite(entry["request_rate"]) else int(good.sum()) / duration),
        "bench_goodput_rps": int(good.sum()) / duration, "throughput_rps": m["request_throughput"],
        "usd_per_hour": usd_per_gpu_hour * num_gpus, "gpu_hours_per_mtok": gpu_hours_per_mtok,
        "usd_per_mtok": gpu_hours_per_mtok * usd_per_gpu_hour,
        **{k: round(m[k], 3) for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms",
                                       "p99_e2el_ms")},
        "failed_requests": failed, "queue": entry["queue"], "engine_args": entry["engine_args"],
        # requests within the goodput limits (exact: the lower and upper bound agree)
        "good_lo": int(good.sum()), "good_hi": int(good.sum()), "num_requests": int(good.size + failed),
        "cut_short_at_s": None,
    }
    out["why"] = "" if meets else diagnose(out)
    return out


def _evaluate_cut_short(entry: dict[str, Any], slo: Slo, usd_per_gpu_hour: float,
                        offered_tokens_per_s: float) -> dict[str, Any]:
    """A run the watch stopped: it fails (the statistics it provably breaks, with lower bounds on them); its
    latency statistics are lower bounds, its goodput the lower bound (``goodput_rps_max`` the upper)."""
    cs = entry["cut_short"]
    if cs["slo"] != slo.text():
        raise ValueError("a cut-short entry is judged only against the SLO it was cut short for")
    verdict, stop, n = cs["verdict"], cs["stop"], cs["num_requests"]
    a = entry["engine_args"]
    num_gpus = a["tensor_parallel_size"] * a.get("data_parallel_size", 1) * entry["replicas"]
    rate = entry["request_rate"]
    usd = usd_per_mtok(num_gpus, usd_per_gpu_hour, offered_tokens_per_s)
    violations = [{"slo": v["slo"], "value_ms": v["value_ms"], "limit_ms": v["limit_ms"]}
                  for v in verdict["violations"] if v["slo"] != "requests"]
    where = ", ".join(f"{v['slo']} ≥ {v['value_ms']:.0f} > {v['limit_ms']:g} ({v['over']} of {v['of']} requests "
                      f"already over)" if "over" in v else v["text"] for v in verdict["violations"])
    why = (f"{where}: decided at {verdict['at_s']:.1f} s simulated (engine {verdict['engine']}); run cut short at "
           f"{stop['at_s']:.1f} s, where at most {stop['good_hi']} of {n} requests could still meet the goodput "
           f"limits, below the {stop['hint_good']} a point no costlier leaves a front candidate")
    cfg = entry["config"]
    return {
        "label": entry["label"], "key": entry["point_key"], "replicas": entry["replicas"], "num_gpus": num_gpus,
        "hardware": cfg["hardware"], "tensor_parallel_size": cfg["tensor_parallel_size"],
        "quantization": cfg["quantization"], "kv_cache_dtype": cfg["kv_cache_dtype"],
        "max_num_seqs": cfg["max_num_seqs"], "max_num_batched_tokens": cfg["max_num_batched_tokens"],
        "data_parallel_size": a.get("data_parallel_size", 1),
        "enable_expert_parallel": bool(a.get("enable_expert_parallel", False)), "pd": "",
        "speculative_config": canonical_spec(a.get("speculative_config")) or "",
        "request_rate": rate, "meets_slo": False, "violations": violations,
        "goodput_rps": stop["good_lo"] / n * rate, "goodput_rps_max": stop["good_hi"] / n * rate,
        "bench_goodput_rps": None, "throughput_rps": None,
        "usd_per_hour": usd_per_gpu_hour * num_gpus,
        "gpu_hours_per_mtok": usd_per_mtok(num_gpus, 1.0, offered_tokens_per_s), "usd_per_mtok": usd,
        **stop["stats_lb"],
        "failed_requests": 0, "queue": {}, "engine_args": a,
        "good_lo": stop["good_lo"], "good_hi": stop["good_hi"], "num_requests": n,
        "cut_short_at_s": stop["at_s"], "why": why,
    }


def _with_slo_stats(m: dict[str, Any], pr: dict[str, list], slo: Slo) -> dict[str, Any]:
    """The statistics, plus any percentile the SLO names that the cached point does not hold (computed from the
    per-request numbers, as vllm bench serve computes them: TPOT over requests of more than one token)."""
    out = dict(m)
    for lim in slo.limits:
        if lim.result_key in out or lim.percentile is None or lim.metric == "itl":
            continue
        vals = np.asarray(pr[f"{lim.metric}_s"], dtype=float)
        if lim.metric == "tpot":
            vals = vals[vals > 0]
        out[lim.result_key] = float(np.percentile(vals if vals.size else np.zeros(1), lim.percentile)) * 1000.0
    return out


def diagnose(p: dict[str, Any]) -> str:
    """Which SLO fails and where the queue builds (engine 0's waiting queue, batch, KV cache)."""
    parts = [", ".join(f"{v['slo']} {v['value_ms']:.0f} > {v['limit_ms']:g}" for v in p["violations"])]
    if p["failed_requests"]:
        parts.append(f"{p['failed_requests']} requests did not finish")
    q = p["queue"]
    slow = {v["slo"].split("_")[0] for v in p["violations"]}
    if q.get("pd"):
        parts.append(_diagnose_pd(q, slow))
        return "; ".join(x for x in parts if x)
    if q["num_preemptions"] or q["peak_kv_usage"] >= 0.99:
        where = (f"KV cache full (peak {100 * q['peak_kv_usage']:.0f}%, {q['num_preemptions']} preemptions): "
                 "requests wait for blocks")
    elif q["peak_running"] >= q["max_num_seqs"]:
        where = f"batch full at max_num_seqs={q['max_num_seqs']}: requests wait for a slot"
    elif q["peak_waiting"] > 0:
        where = f"waiting queue peaks at {q['peak_waiting']} behind prefill chunks (token budget)"
    elif slow == {"ttft"}:
        where = (f"no waiting queue: prompts are prefilled in steps shared with a decode batch of up to "
                 f"{q['peak_running']}, and those steps are too slow")
    else:
        where = f"no waiting queue: the steps themselves are too slow at a batch of up to {q['peak_running']}"
    if q["waiting_at_last_arrival"] >= max(5, q["peak_waiting"] // 2) and q["peak_waiting"] > 0:
        where += f"; still {q['waiting_at_last_arrival']} waiting at the last arrival (arrivals outrun the engine)"
    parts.append(where)
    return "; ".join(x for x in parts if x)


def _diagnose_pd(q: dict[str, Any], slow: set[str]) -> str:
    """Where a P/D split's time went: each side's busiest instance (share of the run it was stepping), the KV pull
    and the wait for decode blocks. A P/D run keeps no per-step timeline, so these are the measured facts, not a
    verdict on which side to grow."""
    where = [f"prefill engines busy up to {100 * q['prefill_busy']:.0f}%, decode engines up to "
             f"{100 * q['decode_busy']:.0f}% of the run"]
    if "ttft" in slow or "e2el" in slow:
        where.append(f"KV in place {q['mean_kv_wait_ms']:.0f} ms after the prefill on average (pull "
                     f"{q['mean_pull_ms']:.1f} ms over {q['link']}, the rest waiting for decode blocks)")
    if slow & {"tpot", "itl", "e2el"}:
        kv = q["decode_peak_kv_usage"]
        where.append(f"decode KV peak {100 * kv:.0f}%, {q['num_preemptions']} preemptions")
    return "; ".join(where)


def run_plan(space: SearchSpace, base: EngineArgs, slo: Slo, workload: PlanWorkload, prices: PriceTable,
             runner: PointRunner, *, workers: int, curve_loads: tuple[float, ...] = (),
             curve_deployments: int = 6, early_stop: bool = True) -> PlanResult:
    t0 = time.perf_counter()
    shape = WorkloadShape.of([s.prompt_len for s in workload.samples],
                             [s.expected_output_len for s in workload.samples])
    rate = workload.request_rate
    digest = workload.digest()
    offered = (sum(s.prompt_len + s.expected_output_len for s in workload.samples) / len(workload.samples) * rate
               if math.isfinite(rate) and workload.samples else 0.0)
    # the watch needs an open loop at a known rate: cost is then the offered load's, not a run's throughput
    watch = early_stop and offered > 0 and workload.max_concurrency is None
    pruned: Counter = Counter()
    examples: dict[str, list[str]] = {}

    def prune(reason: str, label: str, n: int = 1) -> None:
        head = reason.split(":")[0]
        pruned[head] += n
        ex = examples.setdefault(head, [])
        if len(ex) < 5:
            ex.append(f"{label}: {reason}")

    moe = _is_moe(base.model)
    lines: list[_Line] = []
    for choice in space.engine_choices(moe):
        n_r = space.deployments_of(choice)
        price = prices.price(_canonical(choice.hardware))
        if price is None:
            prune(REASON_NO_PRICE, choice.label(), n_r)
            continue
        cfg, why = resolve_choice(choice, base, shape)
        if cfg is None:
            prune(why, choice.label(), n_r)
            continue
        choice = dataclasses.replace(choice, hardware=cfg.hardware.name)
        bounds = roofline_bounds(cfg, shape)
        why = slo_floor_violation(bounds, slo, shape)
        if why:
            prune(why, choice.label(), n_r)
            continue
        r_min = min_replicas(bounds, rate)
        args = engine_args_for(choice, base)
        kinds = [(False, [(r,) for r in space.replicas])]
        if choice.data_parallel_size == 1 and space.pd_max >= 2:
            try:
                pd_link(cfg.hardware, space.kv_link)
                kinds.append((True, space.pd_splits()))
            except ValueError as exc:      # e.g. --kv-transfer-link nvlink on a GPU without NVLink
                prune(f"{REASON_INVALID}: {exc}", f"P/D splits of {choice.label()}", len(space.pd_splits()))
        for is_pd, sizes in kinds:
            line = _Line(choice, args, price, [], is_pd,
                         speed=(bounds.max_rate_per_replica, cfg.memory.num_gpu_blocks))
            for c in sizes:
                dep = line.deployment(c)
                engines = c[1] if is_pd else c[0]       # the engines that make output tokens
                if dep.num_gpus > space.max_gpus:
                    prune(REASON_MAX_GPUS, dep.label())
                elif engines < r_min:
                    prune(f"{REASON_ROOFLINE_LOAD}: at most {bounds.max_rate_per_replica:.2f} req/s per "
                          f"{'decode engine' if is_pd else 'replica'}, {r_min} needed", dep.label())
                else:
                    line.candidates.append(c)
            if line.candidates:
                line.candidates.sort(key=lambda c, ln=line: (ln.gpus(c), c))
                lines.append(line)

    def cost(line: _Line, c: tuple[int, ...]) -> float:
        return usd_per_mtok(line.gpus(c), line.usd_per_gpu_hour, offered)

    def task(line: _Line, c: tuple[int, ...], at_rate: float, stop: StopRule | None = None) -> PointTask:
        dep = line.deployment(c)
        link = space.kv_link if dep.pd is not None else None
        return PointTask(line.args, dep.replicas, at_rate,
                         point_key(line.args, dep.replicas, at_rate, digest, dep.pd, link), dep.label(), dep.pd, link,
                         stop)

    evaluated: dict[str, dict[str, Any]] = {}
    timelines: dict[str, dict[str, list]] = {}
    owner: dict[str, tuple[_Line, tuple[int, ...]]] = {}
    best_usd_h = math.inf
    best: dict[str, Any] | None = None        # the passing point that sorts first (cost, goodput, label)

    def hint_good(c_usd: float, label: str) -> int:
        """Fewest requests a point of cost ``c_usd`` must be able to serve within the goodput limits to stay a
        front candidate: more than any no-costlier point certainly serves, or as many when that point sorts first
        on a tie (cheaper, or the same cost and an earlier label). -1: no such point yet."""
        return max((p["good_lo"] + (p["usd_per_mtok"] < c_usd or p["label"] < label)
                    for p in evaluated.values() if p["usd_per_mtok"] <= c_usd), default=-1)

    def tied_out(ln: _Line, c: tuple[int, ...]) -> bool:
        """Same cost as the best passing point, which serves every request well and sorts first by label: this
        one can at best tie it, and ties go by label (front and choice alike)."""
        return (best is not None and cost(ln, c) == best["usd_per_mtok"]
                and best["good_lo"] == best["num_requests"] and ln.deployment(c).label() > best["label"])

    runner.progress.set_total(sum(len(ln.candidates) for ln in lines))
    led: set[float] = set()       # cost levels whose first label has been probed
    while True:
        probes = []
        marked = False
        for ln in lines:
            c = ln.next_probe()
            if c is None:
                continue
            if ln.usd_per_hour(c) > best_usd_h or tied_out(ln, c):
                # everything costlier than a deployment that meets the SLO is decided; a cheaper one left
                # undecided (below a bisection's probe) gets its own probe in the next round
                for cc in ln.undecided():
                    if ln.usd_per_hour(cc) > best_usd_h or tied_out(ln, cc):
                        prune(REASON_DOMINATED, ln.deployment(cc).label())
                        ln.simulated.add(cc)
                        marked = True
                continue
            probes.append((ln.usd_per_hour(c), ln.likelihood(c), ln.choice.label(), ln.pd, c, ln))
        if not probes:
            if marked:
                continue
            break
        # each cost level leads with its first label (ties go by label: if it serves every request well, the
        # rest of the level is tied out at once), then the likelier-to-serve-well engines (a good goodput known
        # early lets the watch cut their failing peers short)
        dep_label = {id(x): x[5].deployment(x[4]).label() for x in probes}
        first_label: dict[float, str] = {}
        for x in probes:
            first_label[x[0]] = min(first_label.get(x[0], dep_label[id(x)]), dep_label[id(x)])
        probes.sort(key=lambda x: (x[0], x[0] in led or dep_label[id(x)] != first_label[x[0]], *x[1:5]))
        wave = probes[:max(1, workers)]
        led.update(x[0] for x in wave)
        tasks = {}
        for *_, c, ln in wave:
            ln.simulated.add(c)
            rule = None
            if watch and not ln.pd and ln.choice.data_parallel_size == 1:
                rule = StopRule(slo, hint_good(cost(ln, c), ln.deployment(c).label()))
            t = task(ln, c, rate, rule)
            tasks[t.key] = (ln, c, t)
        results = runner.run(t for _, _, t in tasks.values())
        for key, (ln, c, _) in tasks.items():
            p = evaluate_point(results[key], slo, ln.usd_per_gpu_hour, offered)
            evaluated[key] = p
            owner[key] = (ln, c)
            timelines[key] = results[key].get("timeline", {})
            if p["meets_slo"]:
                ln.passed.append(c)
                best_usd_h = min(best_usd_h, p["usd_per_hour"])
                if best is None or _order(p) < _order(best):
                    best = p
            else:
                ln.failed.append(c)
        left = sum(len(ln.undecided()) for ln in lines)
        runner.progress.set_total(runner.done + left)
    for ln in lines:       # decided by a neighbour (a failing smaller or passing larger deployment), not simulated
        for c in ln.candidates:
            if c not in ln.simulated:
                prune(REASON_MONOTONE, ln.deployment(c).label())

    # a cut-short point whose goodput bounds still allow it onto the front is simulated in full, cheapest first:
    # each exact goodput can rule out the next
    rerun = 0
    while True:
        maybe = sorted((p for p in evaluated.values() if p["cut_short_at_s"] is not None
                        and not _off_front(p, evaluated.values())), key=_order)
        if not maybe:
            break
        wave_pts = maybe[:max(1, workers)]
        runner.progress.set_total(runner.done + len(maybe))
        tasks = {p["key"]: (owner[p["key"]], task(*owner[p["key"]], rate)) for p in wave_pts}
        results = runner.run(t for _, t in tasks.values())
        for key, ((ln, _c), _t) in tasks.items():
            evaluated[key] = evaluate_point(results[key], slo, ln.usd_per_gpu_hour, offered)
            timelines[key] = results[key]["timeline"]
            rerun += 1

    points = sorted(evaluated.values(), key=lambda p: (p["usd_per_mtok"], -p["goodput_rps"], p["label"]))
    front = pareto_front(points)
    chosen = cheapest_meeting(points)
    assert not any(p["cut_short_at_s"] is not None for p in front), "a front point is exact"

    curves: dict[str, list[dict[str, Any]]] = {}
    if curve_loads and math.isfinite(rate):
        shown = _curve_deployments(front, chosen, curve_deployments)
        by_label = {ln.deployment(c).label(): (ln, c) for ln in lines for c in ln.candidates}
        ctasks = [(p["label"], task(*by_label[p["label"]], rate * m), by_label[p["label"]][0])
                  for p in shown for m in curve_loads if m != 1.0]
        runner.progress.set_total(runner.done + len(ctasks))
        results = runner.run(t for _, t, _ in ctasks)
        for p in shown:
            curves[p["label"]] = [p]
        for label, t, ln in ctasks:
            curves[label].append(evaluate_point(results[t.key], slo, ln.usd_per_gpu_hour, offered))
        for v in curves.values():
            v.sort(key=lambda p: p["request_rate"])
    stopped = sum(p["cut_short_at_s"] is not None for p in points)
    return PlanResult(points, front, chosen, curves, pruned, examples, space.size(moe), runner.simulated,
                      runner.cache.hits, time.perf_counter() - t0, rate, offered, slo, prices,
                      timelines[chosen["key"]] if chosen else {}, stopped, rerun)






def _order(p: dict[str, Any]) -> tuple:
    """The front's and the choice's order: cost, then goodput (higher first), then label."""
    return (p["usd_per_mtok"], -p["goodput_rps"], p["label"])


def _off_front(p: dict[str, Any], points: Any) -> bool:
    """Certainly not on the front: a point no costlier certainly serves more requests well than ``p`` can, or as
    many and sorts before it (cheaper, or an earlier label at the same cost). The front keeps a point only if its
    goodput beats every point before it in (cost, -goodput, label) order."""
    return any(q is not p and q["usd_per_mtok"] <= p["usd_per_mtok"]
               and (q["good_lo"] > p["good_hi"] or q["good_lo"] == p["good_hi"]
                    and (q["usd_per_mtok"] < p["usd_per_mtok"] or q["label"] < p["label"]))
               for q in points)


def _curve_deployments(front: list[dict[str, Any]], chosen: dict[str, Any] | None, n: int) -> list[dict[str, Any]]:
    """The chosen deployment and the front points nearest it in cost (n in all)."""
    pool = list(front)
    if chosen is not None and all(p["key"] != chosen["key"] for p in pool):
        pool.append(chosen)
    if chosen is None:
        return pool[-n:]
    pool.sort(key=lambda p: (abs(math.log(max(p["usd_per_mtok"], 1e-12) / max(chosen["usd_per_mtok"], 1e-12))),
                             p["label"]))
    return pool[:n]


def _is_moe(model: str) -> bool:
    from kernelsight import profiles

    return profiles.load_model(model).is_moe


def _canonical(name: str) -> str:
    from kernelsight import profiles

    try:
        return profiles.load_hardware(name).name
    except (ValueError, FileNotFoundError):
        return name

