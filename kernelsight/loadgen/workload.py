"""The workload and report layer shared by ``kernelsight bench`` (over HTTP) and ``kernelsight simulate``
(on the virtual clock): the same flags, datasets, arrival schedule, metrics and result JSON.

Flags are named as ``vllm bench serve`` names them (spec §7); each driver adds only what is its own
(``bench``: --base-url, --endpoint, ...; ``simulate``: the engine flags).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelsight.argtypes import non_negative_int, positive_int, range_ratio, rate
from kernelsight.loadgen.datasets import MOONCAKE_BLOCK_SIZE, SampleRequest

if TYPE_CHECKING:    # imported when --num-sessions asks for sessions
    from kernelsight.loadgen.sessions import SessionWorkload

__all__ = ["DATASETS", "Workload", "MetricOptions", "add_workload_args", "add_report_args", "build_workload",
           "metric_options", "result_header", "default_ignore_eos"]

DATASETS = ("random", "random-mm", "sharegpt", "prefix-repetition", "trace", "custom", "custom-image", "mooncake")
# vllm bench serve forces ignore_eos for random prompts; a trace's output lengths are exact by definition.
_IGNORE_EOS_BY_DEFAULT = ("random", "random-mm", "trace", "mooncake")
#: the datasets --num-sessions turns into multi-turn sessions
SESSION_DATASETS = ("random", "sharegpt")


def _dataset_name(text: str) -> str:
    name = text.replace("_", "-")  # vLLM spells it prefix_repetition
    if name not in DATASETS:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(DATASETS)})")
    return name


def _mm_limit(text: str) -> dict[str, int]:
    from kernelsight.loadgen.mm_dataset import parse_limit

    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mm_buckets(text: str) -> dict[tuple[int, int, int], float]:
    from kernelsight.loadgen.mm_dataset import parse_bucket_config

    try:
        return parse_bucket_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_workload_args(p: argparse.ArgumentParser, *, with_seed: bool = True, with_sessions: bool = True) -> None:
    """Dataset, arrival and length flags (``with_seed=False`` when the engine flags bring ``--seed``;
    ``with_sessions=False`` leaves out the multi-turn session flags)."""
    g = p.add_argument_group("workload (as vllm bench serve)")
    g.add_argument("--dataset-name", type=_dataset_name, default="random", metavar="{" + ",".join(DATASETS) + "}",
                   help="random token prompts, ShareGPT JSON, shared-prefix prompts, a JSONL(.gz) request trace, "
                        "a custom JSONL of prompts, or a Mooncake trace (default: random)")
    g.add_argument("--dataset-path", default=None,
                   help="sharegpt: the JSON file; custom: JSONL with prompt and optional output_tokens; "
                        "custom-image: JSONL with prompt and image_files (the first is sent); trace: one "
                        "JSON per line with arrival_time_ns, input_toks, output_toks and optional input_tok_ids "
                        "(gzip or plain); mooncake: one JSON per line with timestamp (ms), input_length, "
                        "output_length and hash_ids (Mooncake's trace format)")
    g.add_argument("--num-prompts", type=positive_int, default=1000,
                   help="requests to send (default: 1000; a trace sends at most its own length)")
    g.add_argument("--no-oversample", action="store_true",
                   help="do not repeat entries of a dataset smaller than --num-prompts")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or local HF-cache id for text datasets (default: the model's, else "
                        "the server's /tokenize)")
    g.add_argument("--random-input-len", "--input-len", type=positive_int, default=1024,
                   help="random dataset: prompt tokens (default: 1024)")
    g.add_argument("--random-output-len", "--output-len", type=positive_int, default=128,
                   help="random dataset: output tokens (default: 128)")
    g.add_argument("--random-range-ratio", type=range_ratio, default=0.0,
                   help="random dataset: lengths uniform in [L·(1−r), L·(1+r)] (default: 0)")
    g.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                   help="random dataset: tokens of one prefix shared by all prompts (default: 0)")
    g.add_argument("--random-mm-base-items-per-request", type=non_negative_int, default=1,
                   help="random-mm: images per request around which the count is drawn (default: 1)")
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request uniform in [floor(n·(1−r)), ceil(n·(1+r))], r in [0, 1] "
                        "(default: 0)")
    g.add_argument("--random-mm-limit-mm-per-prompt", type=_mm_limit, default=None, metavar="JSON",
                   help="random-mm: most items per modality in one request (default: '{\"image\": 255, "
                        "\"video\": 1}')")
    g.add_argument("--random-mm-bucket-config", type=_mm_buckets, default=None, metavar="DICT",
                   help="random-mm: {(height, width, frames): probability, ...} of image sizes (frames 1) "
                        "(default: '{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}')")
    g.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                   help="sharegpt: fixed output length (default: the reference completion's token count)")
    g.add_argument("--prefix-repetition-prefix-len", type=non_negative_int, default=256,
                   help="prefix-repetition: tokens of each shared prefix (default: 256)")
    g.add_argument("--prefix-repetition-suffix-len", type=non_negative_int, default=256,
                   help="prefix-repetition: tokens of each request's own suffix (default: 256)")
    g.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=10,
                   help="prefix-repetition: distinct prefixes (default: 10)")
    g.add_argument("--prefix-repetition-output-len", type=positive_int, default=128,
                   help="prefix-repetition: output tokens (default: 128)")
    g.add_argument("--mooncake-block-size", type=positive_int, default=MOONCAKE_BLOCK_SIZE,
                   help="mooncake: tokens per hash id; equal ids are equal blocks of token ids (default: "
                        "%(default)s, as Mooncake's traces)")
    g.add_argument("--custom-output-len", type=int, default=256,
                   help="custom: output tokens per request; -1 takes each line's output_tokens (default: 256)")
    g.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send prompts as they are instead of wrapping them in the model's chat template")
    g.add_argument("--request-rate", type=rate, default=None,
                   help="requests/s, Poisson with --burstiness 1 (default: inf = all at once; a trace keeps "
                        "its own timestamps unless this is given)")
    g.add_argument("--burstiness", type=rate, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier (default: 1)")
    g.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="at most this many requests in flight (closed loop with --request-rate inf)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the requested output lengths (default: on for random and trace, as "
                        "vllm bench serve forces for random prompts and a trace's lengths are exact; off for the "
                        "others; --no-ignore-eos lets the output-length model stop early)")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="seed for datasets and arrivals (default: 0)")
    if with_sessions:
        _add_session_args(p)


def _add_session_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group(
        "multi-turn sessions (genai-perf's session options)",
        "Each turn's prompt is the whole history (every earlier message and answer) plus the new message, sent when "
        "the previous answer has finished plus a think time. --dataset-name random: synthetic turns of "
        "--random-input-len new tokens and --random-output-len answer tokens; sharegpt: its real conversations. "
        "--request-rate and --burstiness then schedule session starts; --num-prompts is unused.")
    s.add_argument("--num-sessions", type=positive_int, default=None,
                   help="run this many multi-turn sessions instead of single requests (default: off)")
    s.add_argument("--session-concurrency", type=positive_int, default=None,
                   help="sessions open at once; a session keeps its place through its think times (default: all)")
    s.add_argument("--session-turns-mean", type=float, default=3.0,
                   help="random: mean turns per session, normal and rounded, at least 1 (default: 3)")
    s.add_argument("--session-turns-stddev", type=float, default=0.0,
                   help="random: standard deviation of the turns per session (default: 0)")
    s.add_argument("--session-turn-delay-mean", type=float, default=0.0, metavar="MS",
                   help="mean think time between an answer and the next turn, ms (default: 0)")
    s.add_argument("--session-turn-delay-stddev", type=float, default=0.0, metavar="MS",
                   help="standard deviation of the think time, ms (default: 0)")


def add_report_args(p: argparse.ArgumentParser, *, default_metrics: str) -> argparse._ArgumentGroup:
    """Metrics and output flags; returns the group so a driver can add its own outputs to it."""
    o = p.add_argument_group("metrics and output")
    o.add_argument("--percentile-metrics", default=default_metrics,
                   help="metrics to report percentiles for: ttft, tpot, itl, e2el, client_queue_time, "
                        "e2el_including_client_queue (default: %(default)s)")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    o.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    o.add_argument("--result-json", default=None, help="write the result (vllm bench serve keys) here")
    o.add_argument("--save-detailed", action="store_true",
                   help="include per-request lists (input/output lengths, ttfts, itls, texts, errors) in the result")
    o.add_argument("--plot", default=None, metavar="FILE.html",
                   help="write a self-contained HTML page with latency CDFs (and the engine/server timeline)")
    o.add_argument("--disable-tqdm", "--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is shown only when stderr is a terminal anyway)")
    return o


@dataclass(slots=True)
class MetricOptions:
    percentile_metrics: list[str]
    percentiles: list[float]
    goodput_slos_ms: dict[str, float] | None


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
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return out


def metric_options(ns: argparse.Namespace) -> MetricOptions:
    from kernelsight.loadgen.metrics import PERCENTILE_METRICS

    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in PERCENTILE_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; allowed: {', '.join(PERCENTILE_METRICS)}")
    percentiles = _parse_float_list(ns.metric_percentiles, "metric-percentiles")
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {ns.metric_percentiles}")
    return MetricOptions(metrics, percentiles, _parse_goodput(ns.goodput))


@dataclass(slots=True)
class Workload:
    """What to send and when: one sample per request and its send offset (seconds from the start)."""

    samples: list[SampleRequest]
    arrivals_s: list[float]
    ignore_eos: bool
    request_rate: float | str   # the configured rate, "inf", or "trace" (the trace's own timestamps)
    sessions: SessionWorkload | None = None     # --num-sessions: sessions instead of samples (samples then empty)

    @property
    def num_requests(self) -> int:
        return self.sessions.num_turns if self.sessions is not None else len(self.samples)


def default_ignore_eos(ns: argparse.Namespace) -> bool:
    return ns.dataset_name in _IGNORE_EOS_BY_DEFAULT if ns.ignore_eos is None else bool(ns.ignore_eos)


def _need_file(ns: argparse.Namespace) -> str:
    if not ns.dataset_path:
        raise ValueError(f"--dataset-name {ns.dataset_name} needs --dataset-path")
    if not Path(ns.dataset_path).is_file():
        raise ValueError(f"--dataset-path {ns.dataset_path}: no such file")
    return ns.dataset_path


def build_workload(ns: argparse.Namespace, vocab_size: int, get_tokenizer: Callable[[], Any], *,
                   max_context: int | None = None) -> Workload:
    """Samples and arrival offsets from the workload flags. ``get_tokenizer()`` is called only for the
    datasets that need one (sharegpt, custom, random-mm). ``max_context``: sessions end before their history reaches
    it."""
    from kernelsight.loadgen import datasets as ds
    from kernelsight.loadgen.arrivals import arrival_times_s

    name = ns.dataset_name
    do_oversample = not ns.no_oversample
    if getattr(ns, "num_sessions", None) is not None:
        return _session_workload(ns, vocab_size, get_tokenizer, max_context)
    if name == "mooncake":
        samples = ds.mooncake_dataset(_need_file(ns), ns.num_prompts, vocab_size=min(32000, max(vocab_size, 101)),
                                      seed=ns.seed, block_size=ns.mooncake_block_size)
    elif name == "trace":
        samples = ds.trace_dataset(_need_file(ns), ns.num_prompts, synth_vocab_size=min(32000, max(vocab_size, 101)))
    elif name == "sharegpt":
        samples = ds.sharegpt_dataset(_need_file(ns), ns.num_prompts, get_tokenizer(), ns.seed,
                                      output_len=ns.sharegpt_output_len, do_oversample=do_oversample)
    elif name == "custom":
        if ns.custom_output_len < 1 and ns.custom_output_len != -1:
            raise ValueError(f"--custom-output-len must be ≥ 1 or -1, got {ns.custom_output_len}")
        tok = get_tokenizer()
        template = None if ns.skip_chat_template else _chat_wrapper(tok)
        samples = ds.custom_dataset(_need_file(ns), ns.num_prompts, tok, ns.seed, output_len=ns.custom_output_len,
                                    do_oversample=do_oversample, chat_template=template)
    elif name == "random-mm":
        from kernelsight.loadgen.mm_dataset import random_mm_dataset

        samples = random_mm_dataset(ns, vocab_size, get_tokenizer())
    elif name == "custom-image":
        from kernelsight.loadgen.mm_dataset import custom_image_dataset

        if ns.custom_output_len < 1:
            raise ValueError(f"--dataset-name custom-image needs --custom-output-len >= 1, got {ns.custom_output_len}")
        samples = custom_image_dataset(_need_file(ns), ns.num_prompts, ns.custom_output_len, ns.seed,
                                       do_oversample=do_oversample)
    elif name == "prefix-repetition":
        samples = ds.prefix_repetition_dataset(
            ns.num_prompts, ns.prefix_repetition_prefix_len, ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes, ns.prefix_repetition_output_len, vocab_size, ns.seed)
    else:
        samples = ds.random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                    ns.random_range_ratio, vocab_size, ns.seed, ns.random_prefix_len)
    ignore_eos = default_ignore_eos(ns)
    if name in ("trace", "mooncake") and ns.request_rate is None:
        return Workload(samples, [s.arrival_offset_s or 0.0 for s in samples], ignore_eos, "trace")
    req_rate = ns.request_rate if ns.request_rate is not None else math.inf
    arrivals = arrival_times_s(len(samples), req_rate, ns.burstiness, ns.seed).tolist()
    return Workload(samples, arrivals, ignore_eos, "inf" if math.isinf(req_rate) else req_rate)


def _session_workload(ns: argparse.Namespace, vocab_size: int, get_tokenizer: Callable[[], Any],
                      max_context: int | None) -> Workload:
    from kernelsight.loadgen import sessions as ss
    from kernelsight.loadgen.arrivals import arrival_times_s

    if ns.dataset_name not in SESSION_DATASETS:
        raise ValueError(f"--num-sessions works with --dataset-name {' or '.join(SESSION_DATASETS)}, not "
                         f"{ns.dataset_name}")
    if ns.max_concurrency is not None:
        raise ValueError("--max-concurrency limits single requests: with --num-sessions use --session-concurrency")
    delay = {"delay_mean_ms": ns.session_turn_delay_mean, "delay_stddev_ms": ns.session_turn_delay_stddev}
    if ns.dataset_name == "sharegpt":
        sessions = ss.sharegpt_sessions(_need_file(ns), ns.num_sessions, get_tokenizer(), ns.seed,
                                        output_len=ns.sharegpt_output_len, max_context=max_context, **delay)
        options: dict[str, Any] = {}
    else:
        sessions = ss.synthetic_sessions(
            ns.num_sessions, turns_mean=ns.session_turns_mean, turns_stddev=ns.session_turns_stddev,
            input_len=ns.random_input_len, output_len=ns.random_output_len, range_ratio=ns.random_range_ratio,
            vocab_size=vocab_size, seed=ns.seed, prefix_len=ns.random_prefix_len, max_context=max_context, **delay)
        options = {"turns_mean": ns.session_turns_mean, "turns_stddev": ns.session_turns_stddev}
    options.update({"turn_delay_mean_ms": ns.session_turn_delay_mean,
                    "turn_delay_stddev_ms": ns.session_turn_delay_stddev})
    req_rate = ns.request_rate if ns.request_rate is not None else math.inf
    starts = arrival_times_s(len(sessions), req_rate, ns.burstiness, ns.seed).tolist()
    wl = ss.SessionWorkload(sessions, starts, ns.session_concurrency, ns.dataset_name.replace("random", "synthetic"),
                            options)
    return Workload([], [], default_ignore_eos(ns), "inf" if math.isinf(req_rate) else req_rate, wl)


def _chat_wrapper(tok: Any) -> Callable[[str], str] | None:
    """The model's chat template as ``prompt -> text`` (None when the tokenizer has none)."""
    inner = getattr(tok, "_tok", None)          # LocalTokenizer wraps kernelsight's ServerTokenizer
    if inner is None or getattr(inner, "hf", None) is None or not getattr(inner, "chat_template", None):
        return None
    return lambda prompt: inner.render_chat([{"role": "user", "content": prompt}])


def result_header(*, backend: str, endpoint_type: str, model_id: str, tokenizer_id: str, num_prompts: int,
                  request_rate: float | str, burstiness: float, max_concurrency: int | None,
                  label: str | None = None) -> dict[str, Any]:
    """The leading keys of the 0.33 result JSON (spec §7.5)."""
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": endpoint_type, "backend": backend,
            "label": label, "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
            "request_rate": request_rate, "burstiness": burstiness, "max_concurrency": max_concurrency}
