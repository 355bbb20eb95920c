"""``kernelsight plan``: its flags and the command (attached by ``kernelsight/cli.py``)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path

from kernelsight.argtypes import fraction, json_object, positive_int
from kernelsight.simcore.expert_parallel import ALL2ALL_BACKENDS, DEFAULT_ALL2ALL_BACKEND

__all__ = ["add_plan_parser"]


def _csv_list(kind):
    def parse(text: str) -> tuple:
        out = []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            try:
                out.append(kind(item))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise argparse.ArgumentTypeError(f"bad item {item!r}: {exc}") from None
        if not out:
            raise argparse.ArgumentTypeError("empty list")
        return tuple(out)
    return parse


def _int_or_default(text: str) -> int | None:
    return None if text in ("default", "auto") else positive_int(text)


def _quant(text: str) -> str | None:
    if text in ("none", "bf16", "auto"):
        return None
    if text == "nvfp4":   # vLLM's name for ModelOpt NVFP4, which `simulate --quantization` takes
        return "modelopt_fp4"
    if text not in ("fp8", "modelopt_fp4", "mxfp4"):
        raise argparse.ArgumentTypeError("choose none, fp8, modelopt_fp4 (nvfp4) or mxfp4")
    return text


def _kv(text: str) -> str:
    if text not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise argparse.ArgumentTypeError("choose auto, fp8, fp8_e4m3 or fp8_e5m2")
    return text


def _non_negative_int(text: str) -> int:
    return 0 if text == "0" else positive_int(text)


def _on_off(text: str) -> bool:
    if text in ("on", "true", "1"):
        return True
    if text in ("off", "false", "0"):
        return False
    raise argparse.ArgumentTypeError("choose off or on")


def _spec_configs(text: str) -> tuple[str | None, ...]:
    """``none;{"method":"ngram","num_speculative_tokens":3}``: ';'-separated (JSON has commas), each ``none`` or a
    JSON object as ``simulate --speculative-config`` takes; kept as canonical JSON, duplicates once."""
    from kernelsight.plan.space import canonical_spec

    out: list[str | None] = []
    for item in (x.strip() for x in text.split(";") if x.strip()):
        if item.lower() == "none":
            value = None
        else:
            try:
                value = canonical_spec(json_object(item))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"bad item {item!r}: {exc}") from None
        if value not in out:
            out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(out)


def _replicas(text: str) -> tuple[int, ...]:
    """``1-8`` or ``1,2,4``."""
    if "-" in text and "," not in text:
        a, _, b = text.partition("-")
        lo, hi = positive_int(a), positive_int(b)
        if hi < lo:
            raise argparse.ArgumentTypeError(f"empty range {text}")
        return tuple(range(lo, hi + 1))
    return tuple(sorted(set(_csv_list(positive_int)(text))))


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from kernelsight.engine_args import DEFAULT_MODEL, add_kv_link_args, add_vllm_version_arg
    from kernelsight.loadgen.workload import add_workload_args
    from kernelsight.plan.space import DEFAULT_GPUS

    p = sub.add_parser(
        "plan", help="capacity planning: the cheapest deployment meeting an SLO at a load, and the cost/goodput front",
        description="Search GPUs, TP, DP/EP (MoE), replicas or P/D splits, batch limits and formats for the cheapest "
                    "deployment that meets a "
                    "latency SLO at the workload's request rate; every point is a `kernelsight simulate` run. "
                    "Prints the Pareto front of cost vs goodput and why each point fails; writes HTML/JSON/CSV.")
    add_workload_args(p, with_seed=False, with_sessions=False)
    g = p.add_argument_group("model, SLO and search space")
    g.add_argument("--model", default=DEFAULT_MODEL, help="bundled HF id or config directory (default: %(default)s)")
    g.add_argument("--slo", required=True,
                   help="limits on the run's statistics, e.g. ttft_p99_ms=1000,tpot_p99_ms=60 (metrics ttft, tpot, "
                        "itl, e2el; stats mean, median, pNN); goodput counts requests within the ttft/tpot/e2el "
                        "limits, as vllm bench serve --goodput")
    g.add_argument("--gpus", type=_csv_list(str), default=DEFAULT_GPUS,
                   help=f"GPU profiles to search (default: {','.join(DEFAULT_GPUS)})")
    g.add_argument("--tp", type=_csv_list(positive_int), default=(1, 2, 4, 8), help="TP sizes (default: 1,2,4,8)")
    g.add_argument("--replicas", type=_replicas, default=tuple(range(1, 9)),
                   help="replica (data-parallel) counts, 1-8 or 1,2,4 (default: 1-8); each replica gets every R-th "
                        "request (round robin)")
    g.add_argument("--dp", type=_csv_list(positive_int), default=(1, 2, 4, 8),
                   help="data-parallel sizes of a MoE model (--data-parallel-size; the ranks' MoE layers form one "
                        "group, experts split over DP×TP GPUs); a dense model's DP is its replicas (default: 1,2,4,8)")
    g.add_argument("--expert-parallel", type=_csv_list(_on_off), default=(False, True),
                   help="--enable-expert-parallel off/on for a MoE model over more than one GPU (DP > 1, or TP > 1 at "
                        "one DP rank: whole experts per GPU of the TP group) (default: off,on)")
    g.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=None,
                   help="vLLM's --all2all-backend for expert-parallel points (default: vLLM's)")
    g.add_argument("--pd-max", type=_non_negative_int, default=0, metavar="N",
                   help="also search prefill/decode splits XPyD with X + Y <= N engines (simulate --pd; KV pulled "
                        "over the GPU profile's default link); 0 = none (default: 0)")
    add_kv_link_args(g)
    g.add_argument("--max-gpus", type=positive_int, default=64, help="largest deployment in GPUs (default: 64)")
    g.add_argument("--max-num-seqs", type=_csv_list(_int_or_default), default=(None,),
                   help="values to try, 'default' = vLLM's for the GPU (default: default)")
    g.add_argument("--max-num-batched-tokens", type=_csv_list(_int_or_default), default=(None,),
                   help="values to try, 'default' = vLLM's for the GPU (default: default)")
    g.add_argument("--quantization", type=_csv_list(_quant), default=(None, "fp8"),
                   help="weight formats: none, fp8, modelopt_fp4 (NVFP4 W4A4 on Blackwell, Marlin W4A16 elsewhere), "
                        "mxfp4 (MoE experts) (default: none,fp8)")
    g.add_argument("--kv-cache-dtype", type=_csv_list(_kv), default=("auto",),
                   help="KV formats: auto, fp8 (default: auto)")
    g.add_argument("--speculative-config", type=_spec_configs, default=(None,), metavar="'none;JSON;...'",
                   help="speculative configs to try, ';'-separated: none or a JSON object as simulate's "
                        "--speculative-config, e.g. 'none;{\"method\":\"ngram\",\"num_speculative_tokens\":3}' "
                        "(default: none)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length every engine must hold (default: the model's)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of device memory vLLM may use (default: 0.9)")
    g.add_argument("--seed", type=int, default=0, help="seed for the workload and the engines (default: 0)")
    add_vllm_version_arg(g)
    g.add_argument("--prices", default=None,
                   help="JSON of GPU → USD per GPU-hour over the bundled example prices")
    r = p.add_argument_group("running")
    r.add_argument("--workers", type=positive_int, default=None,
                   help="points simulated at once (default: one per CPU of this machine, or of the Ray cluster)")
    r.add_argument("--ray-address", default=None,
                   help="run the points on a Ray cluster (auto, ray://HOST:10001, or local); needs `pip install ray`")
    r.add_argument("--cache-dir", default=None,
                   help="results by configuration hash (default: $XDG_CACHE_HOME/kernelsight/plan)")
    r.add_argument("--no-cache", action="store_true", help="keep no results between runs")
    r.add_argument("--curve-loads", type=_csv_list(float), default=(0.5, 0.75, 1.25, 1.5),
                   help="load multiples for the latency-vs-load curves of the front (default: 0.5,0.75,1.25,1.5; "
                        "'1' for none)")
    r.add_argument("--no-early-stop", dest="early_stop", action="store_false",
                   help="simulate every point to its end (by default a run is cut short once the point provably "
                        "fails and provably cannot be on the front; the answer is the same, see docs/planning.md)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    o = p.add_argument_group("output")
    o.add_argument("--report-html", default=None, metavar="FILE.html",
                   help="Pareto plot, latency-vs-load curves, the chosen deployment's timeline (needs plotly)")
    o.add_argument("--result-json", default=None, help="everything as JSON")
    o.add_argument("--csv", default=None, help="one row per simulated point")
    p.set_defaults(func=cmd_plan)


def cmd_plan(ns: argparse.Namespace) -> int:
    from kernelsight import profiles
    from kernelsight.loadgen.mm_dataset import prepare_for_engine
    from kernelsight.loadgen.tokenizer import resolve_tokenizer
    from kernelsight.loadgen.workload import build_workload
    from kernelsight.plan.cache import ResultCache, default_cache_dir
    from kernelsight.plan.point import PlanWorkload
    from kernelsight.plan.prices import load_prices
    from kernelsight.plan.report import format_plan, write_csv, write_html, write_json
    from kernelsight.plan.runner import LocalExecutor, PointRunner, RayExecutor, default_workers, make_progress
    from kernelsight.plan.search import run_plan
    from kernelsight.plan.slo import parse_slo
    from kernelsight.plan.space import SearchSpace
    from kernelsight.simcore.engine_config import EngineArgs
    from kernelsight.simcore.spec_decode import resolve_speculative_config

    slo = parse_slo(ns.slo)
    if ns.request_rate is None and ns.dataset_name != "trace" and ns.max_concurrency is None:
        raise ValueError("plan needs the load to plan for: --request-rate R (or --max-concurrency C)")
    model = profiles.load_model(ns.model)
    for spec in ns.speculative_config:      # a bad config stops the command with vLLM's message, as simulate's does
        if spec is not None:
            resolve_speculative_config(json.loads(spec), 1, model.num_mtp_layers)
    wl = build_workload(ns, model.vocab_size, lambda: resolve_tokenizer(ns.model, ns.tokenizer))
    prepare_for_engine(ns, wl.samples, model, lambda: resolve_tokenizer(ns.model, ns.tokenizer))
    rate = wl.request_rate
    if rate == "trace":
        last = max(wl.arrivals_s, default=0.0)
        rate = len(wl.arrivals_s) / last if last > 0 else math.inf
    workload = PlanWorkload(wl.samples, list(wl.arrivals_s), float(rate), wl.ignore_eos, ns.max_concurrency)
    for gpu in ns.gpus:
        profiles.load_hardware(gpu)        # an unknown name is an error here, not a silently pruned engine
    canonical = {a: profiles.load_hardware(h).name for h in profiles.list_hardware()
                 for a in (h, *profiles.load_hardware(h).aliases)}
    prices = load_prices(ns.prices, canonical)
    space = SearchSpace(gpus=tuple(ns.gpus), tensor_parallel_sizes=tuple(ns.tp), replicas=tuple(ns.replicas),
                        max_num_seqs=tuple(ns.max_num_seqs), max_num_batched_tokens=tuple(ns.max_num_batched_tokens),
                        quantizations=tuple(ns.quantization), kv_cache_dtypes=tuple(ns.kv_cache_dtype),
                        data_parallel_sizes=tuple(sorted(set(ns.dp))), expert_parallel=tuple(sorted(set(
                            ns.expert_parallel))), speculative_configs=ns.speculative_config, pd_max=ns.pd_max,
                        kv_link=_kv_link_spec(ns), max_gpus=ns.max_gpus)
    base = EngineArgs(model=ns.model, max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
                      seed=ns.seed, vllm_version=ns.vllm_version)
    if ns.all2all_backend is not None:
        base.all2all_backend = ns.all2all_backend
    if ns.ray_address:
        executor = RayExecutor(workload, ns.ray_address, ns.workers)
        workers = ns.workers or executor.cpus()
    else:
        workers = ns.workers or default_workers()
        executor = LocalExecutor(workload, workers)
    cache = ResultCache(None if ns.no_cache else (ns.cache_dir or default_cache_dir()))
    progress = make_progress(ns.progress)
    runner = PointRunner(executor, cache, progress)
    try:
        result = run_plan(space, base, slo, workload, prices, runner, workers=workers,
                          curve_loads=tuple(m for m in ns.curve_loads if m > 0), early_stop=ns.early_stop)
    finally:
        progress.close()
        executor.close()
    command = simulate_command(ns, result.chosen)
    print(format_plan(result, model=ns.model, simulate_command=command))
    if ns.result_json:
        write_json(ns.result_json, result, model=ns.model, simulate_command=command)
        print(f"wrote {ns.result_json}")
    if ns.csv:
        write_csv(ns.csv, result)
        print(f"wrote {ns.csv}")
    if ns.report_html:
        write_html(ns.report_html, result, model=ns.model, simulate_command=command)
        print(f"wrote {ns.report_html}")
    return 0


def _kv_link_spec(ns: argparse.Namespace) -> tuple | None:
    """``--kv-transfer-*`` as (kind, Gb/s, µs); None when none is given (the GPU profile's default link)."""
    spec = (ns.kv_transfer_link, ns.kv_transfer_bandwidth_gbps, ns.kv_transfer_latency_us)
    if spec == (None, None, None):
        return None
    if ns.pd_max < 2:
        raise ValueError("--kv-transfer-link/-bandwidth-gbps/-latency-us need --pd-max 2 or more")
    return spec


def simulate_command(ns: argparse.Namespace, chosen: dict | None) -> str:
    """The ``kernelsight simulate`` command line that re-runs the chosen deployment on the same workload."""
    if chosen is None:
        return ""
    a = chosen["engine_args"]
    argv = ["kernelsight", "simulate", "--model", a["model"], "--hardware", a["hardware"],
            "--tensor-parallel-size", str(a["tensor_parallel_size"])]
    if chosen.get("pd"):
        argv += ["--pd", chosen["pd"]]
        for flag, value in zip(("--kv-transfer-link", "--kv-transfer-bandwidth-gbps", "--kv-transfer-latency-us"),
                               _kv_link_spec(ns) or (), strict=False):
            if value is not None:
                argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    else:
        argv += ["--replicas", str(chosen["replicas"])]
    if a.get("data_parallel_size", 1) > 1:
        argv += ["--data-parallel-size", str(a["data_parallel_size"])]
    if a.get("enable_expert_parallel"):
        argv.append("--enable-expert-parallel")
        if a["all2all_backend"] != DEFAULT_ALL2ALL_BACKEND:
            argv += ["--all2all-backend", a["all2all_backend"]]
    for flag, key in (("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
                      ("--quantization", "quantization"), ("--max-model-len", "max_model_len")):
        if a[key] is not None:
            argv += [flag, str(a[key])]
    if a["kv_cache_dtype"] != "auto":
        argv += ["--kv-cache-dtype", a["kv_cache_dtype"]]
    if a["gpu_memory_utilization"] != 0.9:
        argv += ["--gpu-memory-utilization", str(a["gpu_memory_utilization"])]
    if a.get("speculative_config") is not None:
        argv += ["--speculative-config", json.dumps(a["speculative_config"], sort_keys=True, separators=(",", ":"))]
    if a.get("vllm_version"):
        argv += ["--vllm-version", a["vllm_version"]]
    argv += ["--seed", str(a["seed"]), "--dataset-name", ns.dataset_name, "--num-prompts", str(ns.num_prompts)]
    if ns.dataset_path:
        argv += ["--dataset-path", str(Path(ns.dataset_path))]
    if ns.request_rate is not None:
        argv += ["--request-rate", f"{ns.request_rate:g}"]
    if ns.burstiness != 1.0:
        argv += ["--burstiness", f"{ns.burstiness:g}"]
    if ns.max_concurrency is not None:
        argv += ["--max-concurrency", str(ns.max_concurrency)]
    if ns.dataset_name in ("random", "random-mm"):
        argv += ["--random-input-len", str(ns.random_input_len), "--random-output-len", str(ns.random_output_len),
                 "--random-range-ratio", f"{ns.random_range_ratio:g}"]
        if ns.random_prefix_len:
            argv += ["--random-prefix-len", str(ns.random_prefix_len)]
    if ns.dataset_name == "random-mm":
        argv += ["--random-mm-base-items-per-request", str(ns.random_mm_base_items_per_request),
                 "--random-mm-num-mm-items-range-ratio", f"{ns.random_mm_num_mm_items_range_ratio:g}"]
        if ns.random_mm_limit_mm_per_prompt is not None:
            argv += ["--random-mm-limit-mm-per-prompt", json.dumps(ns.random_mm_limit_mm_per_prompt)]
        if ns.random_mm_bucket_config is not None:
            argv += ["--random-mm-bucket-config", repr(ns.random_mm_bucket_config)]
    if ns.dataset_name in ("custom", "custom-image"):
        argv += ["--custom-output-len", str(ns.custom_output_len)]
    if ns.ignore_eos is not None:
        argv.append("--ignore-eos" if ns.ignore_eos else "--no-ignore-eos")
    if ns.dataset_name == "sharegpt" and ns.sharegpt_output_len:
        argv += ["--sharegpt-output-len", str(ns.sharegpt_output_len)]
    goodput = [f"{k}:{v:g}" for k, v in sorted(_slo_goodput(ns.slo).items())]
    if goodput:
        argv += ["--goodput", *goodput]
    pcts = sorted({lim.stat[1:] for lim in _slo(ns.slo).limits if lim.stat.startswith("p")} | {"50", "99"},
                  key=float)
    argv += ["--metric-percentiles", ",".join(pcts)]
    return shlex.join(argv)


def _slo(text: str):
    from kernelsight.plan.slo import parse_slo

    return parse_slo(text)


def _slo_goodput(text: str) -> dict[str, float]:
    return _slo(text).goodput_ms()
