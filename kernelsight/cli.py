"""``kernelsight`` command line: serve | bench | simulate | validate | plan | profiles | calibrate | predict."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kernelsight.argtypes import OneLineParser, positive_int
from kernelsight.engine_args import (
    add_engine_args,
    add_kv_link_args,
    add_vllm_version_arg,
    create_engine_config,
    engine_args_from,
    kv_link_from,
)
from kernelsight.profiles.accuracy import describe_expected_error, expected_error

__all__ = ["build_parser", "main"]


# -- simulate ---------------------------------------------------------------------------------------
def build_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from kernelsight.loadgen.workload import add_report_args, add_workload_args

    p = sub.add_parser(
        "simulate", help="fast-forward a workload through the simulator (no HTTP) and report like vllm bench serve",
        description="Run a workload through the simulated vLLM engine on a virtual clock and print the "
                    "metrics `vllm bench serve` would report against a real deployment (the same workload flags "
                    "and report as `kernelsight bench`).")
    add_workload_args(p, with_seed=False)      # --seed comes with the engine flags
    add_engine_args(p)
    o = add_report_args(p, default_metrics="ttft,tpot,itl,e2el")
    o.add_argument("--timeline", default=None,
                   help="CSV per step: time, running, waiting, KV usage, scheduled tokens, step seconds")
    p.add_argument("--replicas", type=positive_int, default=1,
                   help="independent engines behind a round-robin router (request i goes to engine i mod N); "
                        "the timeline is engine 0's (default: 1)")
    p.add_argument("--replica-processes", type=_processes, default=1, metavar="P|auto",
                   help="run the --replicas engines in P worker processes, so that a fleet uses several cores (the "
                        "result is the one process's, bit for bit); auto: one per usable CPU, at most one per replica "
                        "(default: 1, every engine in this process). With one replica and -dp N of a dense model in "
                        "an open loop (no --max-concurrency, --timeline, --plot, speculative decoding or KV "
                        "offloading), the group's ranks instead, each running alone from one 100 ms router refresh "
                        "to the next (same result); a MoE group's lockstep forbids it (every forward pass is a "
                        "group collective), so such a group runs in one process")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run the --replicas engines as Ray tasks instead, one CPU each (auto, ray://HOST:10001, or "
                        "local: a Ray instance on this machine with --replica-processes CPUs, every usable CPU when "
                        "that is 1 or auto); the result is the one process's, bit for bit. Needs `pip install "
                        "'kernelsight[cluster]'`. A -dp group runs whole inside its replica's task")
    pd = p.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--pd", default=None, metavar="XPyD",
                    help="X prefill and Y decode engines of this configuration behind vLLM's toy-proxy semantics "
                         "(e.g. 1P1D, 2P3D): prefill with max_tokens 1, KV pulled over --kv-transfer-link, decode")
    add_kv_link_args(pd)
    mm = p.add_argument_group("images and videos (random-mm, custom-image)")
    mm.add_argument("--mm-processor-kwargs", type=_mm_kwargs, default=None, metavar="JSON",
                    help="the image processor's overrides, as serve's (e.g. '{\"max_pixels\": 802816}')")
    mm.add_argument("--media-io-kwargs", type=_media_io_kwargs, default=None, metavar="JSON",
                    help="the video loader's settings, as serve's (e.g. '{\"video\": {\"num_frames\": 16}}')")
    p.set_defaults(func=cmd_simulate)


def _mm_kwargs(text: str) -> dict[str, Any]:
    from kernelsight.multimodal.options import parse_mm_processor_kwargs

    try:
        return parse_mm_processor_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _media_io_kwargs(text: str) -> dict[str, Any]:
    from kernelsight.multimodal.options import parse_media_io_kwargs

    try:
        return parse_media_io_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _processes(text: str) -> int | None:
    """--replica-processes: a positive count, or ``auto`` (None: one per usable CPU)."""
    return None if text == "auto" else positive_int(text)


def cmd_simulate(ns: argparse.Namespace) -> int:
    from kernelsight.loadgen.fastforward import TIMELINE_COLUMNS, run_replicas, write_timeline
    from kernelsight.loadgen.metrics import assemble_result, compute_bench_metrics
    from kernelsight.loadgen.mm_dataset import prepare_for_engine
    from kernelsight.loadgen.progress import Progress
    from kernelsight.loadgen.report import RANK_COLUMNS, format_report, format_table, rank_rows
    from kernelsight.loadgen.session_metrics import format_workload_extra, workload_extra
    from kernelsight.loadgen.workload import build_workload, metric_options, result_header

    if ns.plot:
        from kernelsight.loadgen.plot import require_plotly

        require_plotly()    # before the run, not after it
    config = create_engine_config(engine_args_from(ns))
    mopts = metric_options(ns)
    def tokenizer() -> Any:      # only the text datasets need one (its module imports urllib)
        from kernelsight.loadgen.tokenizer import resolve_tokenizer

        # ShareGPT only counts tokens: a bundled family's bare tokenizer does it without importing transformers
        return resolve_tokenizer(ns.model, ns.tokenizer, encode_only=ns.dataset_name == "sharegpt")

    wl = build_workload(ns, config.model.vocab_size, tokenizer, max_context=config.scheduler.max_model_len)
    samples = wl.samples
    prepare_for_engine(ns, samples, config.model, tokenizer)     # images: the prompts and items the server makes
    too_long = [s.prompt_len for s in samples if s.prompt_len >= config.scheduler.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) are longer than max_model_len={config.scheduler.max_model_len} "
                         f"(longest {max(too_long)} tokens)")
    pd = _pd_split(ns, config)
    if ns.ray_address is not None and (ns.replicas == 1 or pd is not None or wl.sessions is not None):
        raise ValueError("--ray-address spreads the engines of --replicas N (N > 1): leave it out with one replica, "
                         "--pd or --num-sessions")
    bar = Progress(wl.num_requests, "requests (simulated)", enabled=ns.progress)
    max_open = None
    if wl.sessions is not None:
        from kernelsight.loadgen.session_fastforward import run_sessions

        if pd is not None or ns.replicas > 1 or config.args.data_parallel_size > 1:
            raise ValueError("--num-sessions runs on one engine: leave out --pd, --replicas and --data-parallel-size")
        res, max_open = run_sessions(config, wl.sessions, ignore_eos=wl.ignore_eos, seed=ns.seed,
                                     record_timeline=ns.timeline is not None or ns.plot is not None,
                                     on_finished=bar.update if bar.enabled else None)
    elif pd is not None:
        from kernelsight.loadgen.pd_fastforward import run_pd

        res = run_pd(config, samples, wl.arrivals_s, *pd, link=kv_link_from(ns, config.hardware),
                     max_concurrency=ns.max_concurrency, ignore_eos=wl.ignore_eos,
                     on_finished=bar.update if bar.enabled else None)
    elif ns.replicas == 1 and ns.replica_processes != 1 and config.args.data_parallel_size > 1 and _dp_split(
            config, ns.max_concurrency, ns.timeline is not None or ns.plot is not None):
        from kernelsight.loadgen.dp_processes import run_group_in_processes
        from kernelsight.loadgen.fastforward import replica_workers

        res = run_group_in_processes(config, samples, wl.arrivals_s, wl.ignore_eos,
                                     replica_workers(ns.replica_processes),
                                     on_finished=bar.update if bar.enabled else None)
    else:
        res = run_replicas(config, samples, wl.arrivals_s, ns.replicas, max_concurrency=ns.max_concurrency,
                           ignore_eos=wl.ignore_eos, record_timeline=ns.timeline is not None or ns.plot is not None,
                           on_finished=bar.update if bar.enabled else None, processes=ns.replica_processes,
                           ray_address=ns.ray_address)
    bar.close()
    stats = compute_bench_metrics(res.records, max(res.duration_s, 1e-9), percentile_metrics=mopts.percentile_metrics,
                                  percentiles=mopts.percentiles, goodput_slos_ms=mopts.goodput_slos_ms)
    header = result_header(backend="kernelsight", endpoint_type="kernelsight-simulate", model_id=config.model.name,
                           tokenizer_id=ns.tokenizer or config.model.name, num_prompts=wl.num_requests,
                           request_rate=wl.request_rate, burstiness=ns.burstiness, max_concurrency=ns.max_concurrency)
    busy = sum(res.breakdown_s.values()) or 1.0
    extra: dict[str, Any] = {
        "config": {**config.summary(), "replicas": ns.replicas, **({"pd": ns.pd.upper()} if pd else {})},
        "kernel_time_breakdown": {f: {"seconds": round(s, 6), "fraction": round(s / busy, 5)}
                                  for f, s in res.breakdown_s.items()},
        "simulator": res.simulator_stats(),
        "expected_error_pct": expected_error(config.summary()["calibration_tier"]),
        **workload_extra(res.records, dataset_name=ns.dataset_name, sessions=wl.sessions,
                         max_open_sessions=max_open),
    }
    result = assemble_result(header, stats, res.records, detailed=ns.save_detailed, extra=extra)

    s = config.summary()
    dp = f"DP {s['data_parallel_size']}{'+EP' if config.expert_parallel else ''}, " if 'data_parallel_size' in s else ""
    replicas = f"{ns.replicas} replicas × " if ns.replicas > 1 else (f"{ns.pd.upper()} × " if pd else "")
    print(f"kernelsight simulate: {s['model']} on {replicas}{s['hardware']} ({dp}TP {s['tensor_parallel_size']}, "
          f"{s['dtype']}, kv {s['kv_cache_dtype']}, calibration: {config.calibration_label(s)})")
    print(f"  {describe_expected_error(s['calibration_tier'])}")
    if s.get("calibration_note"):
        print(f"  {s['calibration_note']}")
    groups = s["num_gpu_blocks"] * s["block_size"] // max(s["kv_cache_tokens"], 1)
    per_group = f" over {groups} KV-cache groups" if groups > 1 else ""
    print(f"  KV cache: {s['num_gpu_blocks']} blocks × {s['block_size']} tokens{per_group} = "
          f"{s['kv_cache_tokens']} tokens; "
          f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}, "
          f"max_model_len {s['max_model_len']}")
    if config.offload is not None:
        o = config.offload
        print(f"  KV offloading: {o.backend} ({o.connector}), {o.cpu_bytes / 2**30:g} GiB = {o.num_blocks} CPU blocks "
              f"× {o.block_size} tokens, copies over PCIe")
    print(format_report(result, title=" Simulated Serving Benchmark Result "))
    if text := format_workload_extra(result):
        print(text)
    rows = [{"family": f, "seconds": v["seconds"], "percent": 100 * v["fraction"]}
            for f, v in result["kernel_time_breakdown"].items() if v["seconds"] > 0]
    print("Step time by kernel family:")
    print(format_table(rows, ["family", "seconds", "percent"]))
    if res.ranks:
        print("Data-parallel ranks" + (" (expert-parallel lockstep):" if config.expert_parallel else ":"))
        print(format_table(rank_rows(res.ranks), list(RANK_COLUMNS)))
    if res.pd is not None:
        _print_pd(res.pd)
    sim = result["simulator"]
    if res.spec_decode is not None:
        sd = res.spec_decode
        rates = ", ".join(f"{r:.3f}" for r in sd["acceptance_rate_per_pos"])
        speedup = (f"estimated decode speedup {sd['estimated_decode_speedup']:.2f}x over {sd['decode_steps']} "
                   "decode-only steps (the same batches without drafts)" if sd["estimated_decode_speedup"]
                   else "no decode-only step to estimate a speedup on")
        print(f"Speculative decoding ({config.speculative.method}, k={config.speculative.num_speculative_tokens}): "
              f"mean acceptance length {sd['mean_acceptance_length']:.2f}, per-position acceptance rate {rates}; "
              f"{sd['num_drafts']} drafts; drafting {sd['draft_s']:.2f} s of {sd['verify_s'] + sd['draft_s']:.2f} s; "
              f"{speedup}")
    if res.kv_offload is not None:
        ko = res.kv_offload
        print(f"KV offloading: CPU hit rate {100 * ko['cpu_hit_rate']:.1f}% of the tokens looked up past the GPU hit "
              f"({ko['external_hit_tokens']} tokens); {ko['loads']} loads, {ko['loaded_bytes'] / 1e9:.2f} GB in "
              f"{ko['load_s']:.3f} s; {ko['stored_bytes'] / 1e9:.2f} GB stored; {ko['evicted_blocks']} blocks evicted")
    print(f"Simulated {res.duration_s:.1f} s in {sim['wall_s']:.2f} s of wall time ({sim['num_steps']} steps, "
          f"{sim['num_preemptions']} preemptions, prefix-cache hit rate {100 * sim['prefix_cache_hit_rate']:.1f}%)")
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(result, indent=2, default=_json_default))
        print(f"wrote {ns.result_json}")
    if ns.timeline:
        write_timeline(ns.timeline, res.timeline or [])
        print(f"wrote {ns.timeline}")
    if ns.plot:
        from kernelsight.loadgen.plot import write_plot_html

        cols = list(zip(*res.timeline, strict=True)) if res.timeline else [[] for _ in TIMELINE_COLUMNS]
        timeline = dict(zip(TIMELINE_COLUMNS, cols, strict=True))
        summary = {"model": s["model"], "hardware": s["hardware"], **{k: result[k] for k in (
            "num_prompts", "request_rate", "duration", "completed", "request_throughput", "output_throughput")},
            **{k: v for k, v in result.items() if k.startswith("mean_")}}
        write_plot_html(ns.plot, f"kernelsight simulate: {s['model']} on {s['hardware']}", res.records,
                        summary=summary, timeline=timeline)
        print(f"wrote {ns.plot}")
    return 0


def _dp_split(config: Any, max_concurrency: int | None, record_timeline: bool) -> bool:
    from kernelsight.loadgen.dp_processes import supports

    return supports(config, max_concurrency, record_timeline)


def _pd_split(ns: argparse.Namespace, config: Any) -> tuple[int, int] | None:
    """``--pd XPyD`` → (X, Y); None without it. P/D engines are single engines: no --replicas or DP with it."""
    if ns.pd is None:
        if ns.kv_transfer_link or ns.kv_transfer_bandwidth_gbps or ns.kv_transfer_latency_us is not None:
            raise ValueError("--kv-transfer-link/-bandwidth-gbps/-latency-us need --pd")
        return None
    if ns.replicas > 1 or config.args.data_parallel_size > 1:
        raise ValueError("--pd runs single engines per instance: leave out --replicas and --data-parallel-size")
    if ns.timeline:
        raise ValueError("--timeline is not recorded for --pd (the instances' steps interleave); leave it out")
    from kernelsight.loadgen.pd_fastforward import parse_pd

    return parse_pd(ns.pd)


def _print_pd(pd: dict[str, Any]) -> None:
    from kernelsight.loadgen.pd_fastforward import PD_COLUMNS
    from kernelsight.loadgen.report import format_table

    link = pd["link"]
    print(f"Prefill/decode instances ({pd['prefill']}P{pd['decode']}D; KV pulled over {link['kind']}: "
          f"{link['bytes_per_s'] * 8 / 1e9:.0f} Gb/s per GPU, {link['latency_s'] * 1e6:.0f} µs per pull):")
    rows = [{**r, "peak_kv_%": round(100 * r["peak_kv_usage"], 2)} for r in pd["instances"]]
    print(format_table(rows, list(PD_COLUMNS)))
    st = pd.get("ttft_stages")
    if st and st["requests"]:
        from kernelsight.loadgen.pd_stages import STAGE_COLUMNS

        print(f"TTFT by stage ({st['requests']} requests that pulled their KV; the stages add up to each TTFT):")
        print(format_table(st["stages"], list(STAGE_COLUMNS)))


def _json_default(o: Any) -> Any:
    try:
        return o.tolist()
    except AttributeError:
        return str(o)


# -- validate ---------------------------------------------------------------------------------------
def build_validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="replay a measured vLLM run (shared e2e schema) and compare measured with simulated",
        description="Replay a measured vLLM run directory (meta.json, requests.jsonl, timeseries.csv) with its "
                    "engine args and exact requests, and print measured vs simulated latencies (TTFT, TPOT, ITL, "
                    "E2EL), the timeseries on common bins and the simulated time by kernel family.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--hardware", default=None, help="GPU profile (default: the run's CUDA device name in meta.json)")
    p.add_argument("--calibration", default=None, help="calibration JSON (default: the GPU's bundled one)")
    p.add_argument("--workload", default=None,
                   help="the run's request trace (default: the file meta.json's dataset_path names, beside the run; "
                        "without one, the requests of requests.jsonl with no shared prefixes)")
    p.add_argument("--seed", type=int, default=None, help="engine seed (default: the run's)")
    add_vllm_version_arg(p, "the run's, meta.json's vllm_version")
    p.add_argument("--result-json", default=None, help="write every table as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.html",
                   help="measured vs simulated latency CDFs and timeseries on a self-contained page")
    p.set_defaults(func=cmd_validate)


def cmd_validate(ns: argparse.Namespace) -> int:
    from kernelsight.loadgen.validate import format_validation, plot_html, validate_run

    if ns.plot:
        from kernelsight.loadgen.plot import require_plotly

        require_plotly()

    v = validate_run(ns.run_dir, hardware=ns.hardware, calibration=ns.calibration, seed=ns.seed,
                     workload=ns.workload, vllm_version=ns.vllm_version)
    print(format_validation(v.result))
    print(f"simulated {v.sim.duration_s:.1f} s in {v.sim.wall_s:.2f} s of wall time")
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(v.result, indent=2, default=_json_default))
        print(f"wrote {ns.result_json}")
    if ns.plot:
        Path(ns.plot).write_text(plot_html(v), encoding="utf-8")
        print(f"wrote {ns.plot}")
    return 0


# -- profiles ----------------------------------------------------------------------------------------
def cmd_profiles(ns: argparse.Namespace) -> int:
    from kernelsight import profiles
    from kernelsight.calibrate.evaluate import CROSS_GENERATION_SOURCES
    from kernelsight.calibrate.fit.transfer import (
        FP4_TRANSFER_SOURCES,
        MLA_TRANSFER_SOURCES,
        borrowed_kernels,
        mla_source_names,
        moe_source_names,
    )
    from kernelsight.server.model.bundled_tokenizer import family_for
    from kernelsight.simcore.attention_dispatch import kernel_lineage
    from kernelsight.simcore.mla import mla_decode_backend
    from kernelsight.simcore.precision import resolve_precision

    print("hardware:")
    for name in profiles.list_hardware():
        hw = profiles.load_hardware(name)
        # one calibration per software stack its kernels were timed under (--vllm-version picks one; the default
        # first): a run on another stack may run other kernels
        stacks = profiles.bundled_calibration_summaries(name)
        tier = "; ".join(t + (f" (vLLM {sw['vllm']}{', default' if i == 0 and len(stacks) > 1 else ''})"
                              if sw.get("vllm") else "") for i, (t, sw) in enumerate(stacks)) or "default"
        print(f"  {name:<14} {hw.display_name[:34]:<34} {hw.bf16_flops_per_s / 1e12:7.0f} TFLOP/s bf16  "
              f"{hw.mem_bytes_per_s / 1e12:5.2f} TB/s  {hw.mem_capacity_bytes / 2**30:6.1f} GiB  "
              f"aliases: {', '.join(hw.aliases)}  calibration: {tier}")
        if any(t == "cross-generation" for t, _ in stacks):
            # what it borrows: no GPU of the same kernels measured, every source weighted by spec similarity
            source_hws = [profiles.load_hardware(g) for g in CROSS_GENERATION_SOURCES]
            borrowed = borrowed_kernels(hw, source_hws)
            fp4 = [g for g in FP4_TRANSFER_SOURCES if g != name] if hw.fp4_flops_per_s else []
            moe = moe_source_names(hw, source_hws)
            mla_hws = [profiles.load_hardware(g) for g in MLA_TRANSFER_SOURCES]
            mla = {f: ("from " + ", ".join(names) if (names := mla_source_names(hw, mla_hws, f))
                       else "composed (no measured GPU runs its kernel)") for f in ("mla_decode", "mla_prefill")}
            print(f"  {'':<14} runs {kernel_lineage(hw)}; borrows from "
                  + ", ".join(f"{g} {w:.2f} ({lineage})" for g, w, lineage in borrowed)
                  + "; MoE " + ", ".join(f"{fmt} ({kernel}) from {'+'.join(names)}"
                                         for fmt, (kernel, names) in moe.items())
                  + (f"; NVFP4 GEMMs from {', '.join(fp4)}" if fp4 else "")
                  + f"; MLA decode ({mla_decode_backend(hw.compute_capability, 'bf16')}) {mla['mla_decode']},"
                  f" prefill {mla['mla_prefill']}")
    print("models:")
    for mid in profiles.list_models():
        try:
            m = profiles.load_model(mid)
            resolve_precision(m.torch_dtype, m.quantization, "auto", fp8_scheme=m.fp8_scheme)  # a format we price?
            kind = f"MoE {m.num_experts}x top-{m.experts_per_token}" if m.is_moe else "dense"
            n_sw = m.num_window_layers
            n_ch = m.num_chunked_layers
            attn = ("MLA" if m.mla is not None
                    else f"sliding {m.sliding_window} x{n_sw} + full x{m.num_layers - n_sw}" if m.is_hybrid_attention
                    else f"chunked {m.attention_chunk_size} x{n_ch} + full x{m.num_layers - n_ch}" if n_ch
                    else "GQA" if m.num_kv_heads < m.num_attention_heads else "MHA")
            fmt = m.quantization or (f"{m.expert_quantization} experts" if m.expert_quantization else m.torch_dtype)
            extra = f"  MTP x{m.num_mtp_layers}" if m.num_mtp_layers else ""
            if m.vision is not None:    # takes images (Qwen-VL: and videos): its processor family and ViT size
                media = "images+video" if m.vision.kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") else "images"
                extra += f"  {media} ({m.vision.kind} ViT {m.vision.depth}x{m.vision.hidden_size})"
            fam = family_for(mid, m.vocab_size)
            tok = f"tokenizer: bundled {fam.name}" if fam else "tokenizer: none bundled (--tokenizer DIR / HF cache)"
            print(f"  {mid:<40} {m.num_layers:3d} layers  hidden {m.hidden_size:5d}  {kind}  {attn}  {fmt}{extra}"
                  f"  {tok}")
        except ValueError as exc:
            print(f"  {mid:<40} not supported: {str(exc).splitlines()[0]}")
    return 0


def _attach_profiles(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profiles", help="list bundled GPUs, models and calibrations")
    p.set_defaults(func=cmd_profiles)


def _attach_plan(sub: argparse._SubParsersAction) -> None:
    from kernelsight.plan.cli import add_plan_parser

    add_plan_parser(sub)


def _attach_serve(sub: argparse._SubParsersAction) -> None:
    """``serve`` lives in the server package; attached only when its extra (fastapi, uvicorn, transformers) is
    installed."""
    try:
        from kernelsight.server.cli import add_serve_parser
    except ImportError:
        return
    add_serve_parser(sub)


def _attach_bench(sub: argparse._SubParsersAction) -> None:
    from kernelsight.loadgen.bench import add_bench_parser  # aiohttp is imported only when bench runs

    add_bench_parser(sub)


def _attach_calibrate(sub: argparse._SubParsersAction) -> None:
    from kernelsight.calibrate.cli import add_calibrate_parser

    add_calibrate_parser(sub)


def _attach_predict(sub: argparse._SubParsersAction) -> None:
    from kernelsight.calibrate.cli import add_predict_parser

    add_predict_parser(sub)


#: every subcommand in --help's order, and what attaches it: each imports its own modules only when attached, so a
#: run of one subcommand imports what that one uses (``simulate`` never imports the web stack)
SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "simulate": build_simulate_parser, "validate": build_validate_parser, "plan": _attach_plan,
    "profiles": _attach_profiles, "serve": _attach_serve, "bench": _attach_bench, "calibrate": _attach_calibrate,
    "predict": _attach_predict,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``kernelsight`` parser with every subcommand, or with subcommand ``only`` alone (``main`` builds just the
    one its command line names)."""
    parser = OneLineParser(prog="kernelsight", description="A vLLM-compatible mock backend driven by a "
                           "kernel-level GPU performance simulator.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, attach in SUBCOMMANDS.items():
        if only is None or name == only:
            attach(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # the subcommand is the first word (the top-level parser has no options but --help): build only its parser
    parser = build_parser(args[0] if args and args[0] in SUBCOMMANDS else None)
    ns = parser.parse_args(args)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kernelsight {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
