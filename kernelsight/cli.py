"""``kernelsight`` command line: serve | simulate | profiles | calibrate | predict."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from kernelsight.simcore.engine_config import EngineArgs

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
DEFAULT_HARDWARE = "h100"


class OneLineParser(argparse.ArgumentParser):
    """Bad flags get one line on stderr (``kernelsight simulate: error: ...``), never a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# -- argument types (argparse turns their ValueError into a one-line error) ------------------------------
def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return v


def rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return v


def fraction(text: str) -> float:
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def range_ratio(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by ``serve`` and ``simulate``, named as ``vllm serve`` names them."""
    g = p.add_argument_group("engine (as vllm serve)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="bundled HF id (see `kernelsight profiles`), a local directory with config.json, or an "
                        "id in the local HF cache (default: %(default)s)")
    g.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help="GPU profile name or alias, or a hardware JSON file (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, help="TP degree (default: 1)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="max sequences per step (default: vLLM's for the GPU: 1024 on ≥70 GiB, else 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget per step (default: vLLM's for the GPU: 8192 on H100/H200, 2048 on "
                        "A100/L40S/..., 16384 on ≥160 GiB)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of device memory vLLM may use (default: 0.9)")
    g.add_argument("--block-size", type=int, choices=(1, 8, 16, 32, 64, 128), default=16,
                   help="KV-cache block size in tokens (default: 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked prefill (default: on)")
    g.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="weight quantization: fp8 = W8A8 (default: none, or what the model config says)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto",
                   help="KV-cache element type (default: auto = model dtype)")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "half"), default="auto",
                   help="activation/weight dtype (default: auto = the config's torch_dtype)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="waiting-queue order (default: fcfs)")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                   help="use this many KV blocks instead of sizing them from memory")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--max-cudagraph-capture-size", type=positive_int, default=None,
                   help="largest CUDA-graph batch size (default: min(2·max_num_seqs, 512))")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0,
                   help="cap on one request's prefill chunk per step (default: 0 = off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="prepare the next step while the GPU runs (default: on, as in vLLM 0.33; off "
                        "reproduces older releases)")
    g.add_argument("--calibration", default=None,
                   help="calibration JSON (default: the bundled table for the GPU)")
    g.add_argument("--seed", type=int, default=0, help="seed for everything random (default: 0)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, hardware=ns.hardware, tensor_parallel_size=ns.tensor_parallel_size,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
        block_size=ns.block_size, enable_prefix_caching=ns.enable_prefix_caching,
        enable_chunked_prefill=ns.enable_chunked_prefill, quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype, dtype=ns.dtype, seed=ns.seed, scheduling_policy=ns.scheduling_policy,
        num_gpu_blocks_override=ns.num_gpu_blocks_override, enforce_eager=ns.enforce_eager,
        max_cudagraph_capture_size=ns.max_cudagraph_capture_size,
        long_prefill_token_threshold=ns.long_prefill_token_threshold, async_scheduling=ns.async_scheduling,
        calibration=ns.calibration)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload flags named as ``vllm bench serve`` names them."""
    g = p.add_argument_group("workload (as vllm bench serve)")
    g.add_argument("--dataset-name", choices=("random", "trace"), default="random",
                   help="random token prompts, or a JSONL(.gz) request trace (default: random)")
    g.add_argument("--dataset-path", default=None,
                   help="trace file: one JSON per line with arrival_time_ns, input_toks, output_toks and "
                        "optional input_tok_ids (gzip or plain)")
    g.add_argument("--num-prompts", type=positive_int, default=1000,
                   help="requests to send (default: 1000; a trace sends at most its own length)")
    g.add_argument("--random-input-len", "--input-len", type=positive_int, default=1024,
                   help="random dataset: prompt tokens (default: 1024)")
    g.add_argument("--random-output-len", "--output-len", type=positive_int, default=128,
                   help="random dataset: output tokens (default: 128)")
    g.add_argument("--random-range-ratio", type=range_ratio, default=0.0,
                   help="random dataset: lengths uniform in [L·(1−r), L·(1+r)] (default: 0)")
    g.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                   help="random dataset: tokens of one prefix shared by all prompts (default: 0)")
    g.add_argument("--request-rate", type=rate, default=None,
                   help="requests/s, Poisson with --burstiness 1 (default: inf = all at once; a trace keeps "
                        "its own timestamps unless this is given)")
    g.add_argument("--burstiness", type=rate, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier (default: 1)")
    g.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="at most this many requests in flight (closed loop with --request-rate inf)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the requested output lengths (default: on, as vllm bench serve "
                        "forces for random prompts and the trace's lengths are exact; --no-ignore-eos lets "
                        "the output-length model stop early)")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles for (default: %(default)s)")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    g.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50")


def _parse_float_list(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated numbers, got {text!r}") from None


def _parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        out[key] = float(value)
    return out


# -- simulate ---------------------------------------------------------------------------------------
def build_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="fast-forward a workload through the simulator (no HTTP) and report like vllm bench serve",
        description="Run a workload through the simulated vLLM engine on a virtual clock and print the "
                    "metrics `vllm bench serve` would report against a real deployment.")
    add_workload_args(p)
    add_engine_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None, help="write the result (bench serve keys + config) here")
    o.add_argument("--timeline", default=None,
                   help="CSV per step: time, running, waiting, KV usage, scheduled tokens, step seconds")
    o.add_argument("--save-detailed", action="store_true", help="include per-request lists in --result-json")
    p.set_defaults(func=cmd_simulate)


def load_workload(ns: argparse.Namespace, vocab_size: int):
    from kernelsight.loadgen.arrivals import arrival_times_s
    from kernelsight.loadgen.datasets import random_dataset, trace_dataset

    if ns.dataset_name == "trace":
        if not ns.dataset_path:
            raise ValueError("--dataset-name trace needs --dataset-path")
        if not Path(ns.dataset_path).is_file():
            raise ValueError(f"--dataset-path {ns.dataset_path}: no such file")
        samples = trace_dataset(ns.dataset_path, ns.num_prompts)
        if ns.request_rate is None:
            return samples, [s.arrival_offset_s or 0.0 for s in samples]
    else:
        samples = random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                 ns.random_range_ratio, vocab_size, ns.seed, ns.random_prefix_len)
    req_rate = ns.request_rate if ns.request_rate is not None else math.inf
    return samples, arrival_times_s(len(samples), req_rate, ns.burstiness, ns.seed).tolist()


def cmd_simulate(ns: argparse.Namespace) -> int:
    from kernelsight.loadgen.fastforward import run_fast_forward, write_timeline
    from kernelsight.loadgen.metrics import compute_bench_metrics, detailed_fields, per_request_fields
    from kernelsight.loadgen.report import format_report, format_table
    from kernelsight.runtime import create_engine_config

    config = create_engine_config(engine_args_from(ns))
    percentiles = _parse_float_list(ns.metric_percentiles, "metric-percentiles")
    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    goodput = _parse_goodput(ns.goodput)
    samples, arrivals = load_workload(ns, config.model.vocab_size)
    too_long = [s.prompt_len for s in samples if s.prompt_len >= config.scheduler.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) are longer than max_model_len={config.scheduler.max_model_len} "
                         f"(longest {max(too_long)} tokens)")
    ignore_eos = True if ns.ignore_eos is None else ns.ignore_eos
    res = run_fast_forward(config, samples, arrivals, max_concurrency=ns.max_concurrency, ignore_eos=ignore_eos,
                           record_timeline=ns.timeline is not None)
    stats = compute_bench_metrics(res.records, max(res.duration_s, 1e-9), percentile_metrics=metrics,
                                  percentiles=percentiles, goodput_slos_ms=goodput)
    req_rate = ns.request_rate if ns.request_rate is not None else (
        "trace" if ns.dataset_name == "trace" else "inf")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "kernelsight-simulate",
        "backend": "kernelsight", "label": None, "model_id": config.model.name, "tokenizer_id": config.model.name,
        "num_prompts": len(samples), "request_rate": req_rate if not isinstance(req_rate, float) else req_rate,
        "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
    }
    result.update(stats)
    result.update(per_request_fields(res.records))
    if ns.save_detailed:
        result.update(detailed_fields(res.records))
    busy = sum(res.breakdown_s.values()) or 1.0
    result["config"] = config.summary()
    result["kernel_time_breakdown"] = {
        f: {"seconds": round(s, 6), "fraction": round(s / busy, 5)} for f, s in res.breakdown_s.items()}
    result["simulator"] = res.simulator_stats()

    s = config.summary()
    print(f"kernelsight simulate: {s['model']} on {s['hardware']} (TP {s['tensor_parallel_size']}, "
          f"{s['dtype']}, kv {s['kv_cache_dtype']}, calibration: {s['calibration_tier']})")
    print(f"  KV cache: {s['num_gpu_blocks']} blocks × {s['block_size']} tokens = {s['kv_cache_tokens']} tokens; "
          f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}, "
          f"max_model_len {s['max_model_len']}")
    report = dict(result)
    report["request_rate"] = req_rate
    print(format_report(report, title=" Simulated Serving Benchmark Result "))
    rows = [{"family": f, "seconds": v["seconds"], "percent": 100 * v["fraction"]}
            for f, v in result["kernel_time_breakdown"].items() if v["seconds"] > 0]
    print("Step time by kernel family:")
    print(format_table(rows, ["family", "seconds", "percent"]))
    sim = result["simulator"]
    print(f"Simulated {res.duration_s:.1f} s in {sim['wall_s']:.2f} s of wall time ({sim['num_steps']} steps, "
          f"{sim['num_preemptions']} preemptions, prefix-cache hit rate {100 * sim['prefix_cache_hit_rate']:.1f}%)")
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(result, indent=2, default=_json_default))
        print(f"wrote {ns.result_json}")
    if ns.timeline:
        write_timeline(ns.timeline, res.timeline or [])
        print(f"wrote {ns.timeline}")
    return 0


def _json_default(o: Any) -> Any:
    try:
        return o.tolist()
    except AttributeError:
        return str(o)


# -- profiles ----------------------------------------------------------------------------------------
def cmd_profiles(ns: argparse.Namespace) -> int:
    from kernelsight import profiles

    print("hardware:")
    calibrated = set(profiles.list_calibrations())
    for name in profiles.list_hardware():
        hw = profiles.load_hardware(name)
        tier = profiles.load_calibration(name).tier if name in calibrated else "default"
        print(f"  {name:<14} {hw.display_name[:34]:<34} {hw.bf16_flops_per_s / 1e12:7.0f} TFLOP/s bf16  "
              f"{hw.mem_bytes_per_s / 1e12:5.2f} TB/s  {hw.mem_capacity_bytes / 2**30:6.1f} GiB  "
              f"aliases: {', '.join(hw.aliases)}  calibration: {tier}")
    print("models:")
    for mid in profiles.list_models():
        try:
            m = profiles.load_model(mid)
            kind = f"MoE {m.num_experts}x top-{m.experts_per_token}" if m.is_moe else "dense"
            print(f"  {mid:<40} {m.num_layers:3d} layers  hidden {m.hidden_size:5d}  {kind}")
        except ValueError as exc:
            print(f"  {mid:<40} not supported: {str(exc).splitlines()[0]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kernelsight", description="A vLLM-compatible mock backend driven by a "
                           "kernel-level GPU performance simulator.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    build_simulate_parser(sub)
    p = sub.add_parser("profiles", help="list bundled GPUs, models and calibrations")
    p.set_defaults(func=cmd_profiles)
    for attach in _optional_commands():
        attach(sub)
    return parser


def _optional_commands():
    """Subcommands living in other packages; each is attached if its module is present."""
    out = []
    try:
        from kernelsight.server.cli import add_serve_parser
        out.append(add_serve_parser)
    except ImportError:       # the server extra (fastapi, uvicorn, transformers) is not installed
        pass
    from kernelsight.calibrate.cli import add_calibrate_parser, add_predict_parser
    return out + [add_calibrate_parser, add_predict_parser]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kernelsight {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
