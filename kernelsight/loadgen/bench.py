"""``kernelsight bench``: the load generator, measuring any OpenAI-compatible endpoint the way ``vllm bench
serve`` does (spec §7). Works against real vLLM and against ``kernelsight serve``.

The sending loop keeps to the arrival schedule (absolute deadlines, so lateness never accumulates); each
request runs in its own task behind an ``asyncio.Semaphore(max_concurrency)``; all requests share one aiohttp
session (``TCPConnector(limit=max_concurrency or 0)``). The client measures its own cost: how late each
request left vs its schedule, and the CPU time spent per received SSE message.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.loadgen.client import (
    ClientStats,
    RequestSpec,
    bench_session,
    chat_payload,
    completions_payload,
    send_streaming_request,
)
from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.progress import Progress

__all__ = ["BenchRun", "run_bench", "add_bench_parser", "cmd_bench", "parse_gauges", "SCRAPED_GAUGES",
           "LatenessSample", "parse_lateness", "lateness_summary", "histogram_quantile", "format_lateness"]

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
SCRAPED_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                  "vllm:kv_cache_usage_perc": "kv_cache_usage"}
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
# kernelsight serve's own series (absent from real vLLM: then no lateness is reported); wall seconds
RELEASE_LATENESS = "kernelsight:release_lateness_seconds"
CLOCK_LAG = "kernelsight:virtual_clock_lag_seconds"
_LE_RE = re.compile(r'le="([^"]+)"')


@dataclass(slots=True)
class BenchRun:
    records: list[RequestRecord]
    duration_s: float                       # in the server's (virtual) seconds when time_scale != 1
    send_lateness_s: np.ndarray             # wall seconds each request left after its scheduled time
    client: ClientStats
    scraped: dict[str, list[float]] | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0                      # this process's CPU time over the run (client + anything in-process)
    extra: dict[str, Any] = field(default_factory=dict)
    lateness: dict[str, Any] | None = None  # the server's release lateness over the run (``lateness_summary``)

    def client_summary(self) -> dict[str, Any]:
        late_ms = 1e3 * self.send_lateness_s if self.send_lateness_s.size else np.zeros(1)
        return {"send_lateness_ms": {"mean": float(late_ms.mean()), "p50": float(np.percentile(late_ms, 50)),
                                     "p99": float(np.percentile(late_ms, 99)), "max": float(late_ms.max())},
                "handle_us_per_sse_message": round(self.client.us_per_message, 2),
                # all CPU of this process per message: the client's full cost when the server runs elsewhere
                "process_cpu_us_per_sse_message": round(1e6 * self.cpu_s / max(self.client.num_messages, 1), 2),
                "sse_messages": self.client.num_messages, "wall_s": round(self.wall_s, 3),
                # sent again after meeting a pooled connection the server had closed idle (client.py's module doc)
                "resent_on_stale_connection": self.client.resent}


def parse_gauges(text: str) -> dict[str, float]:
    """Sum of each scraped gauge over its label sets (one engine or several) from Prometheus text."""
    out = {v: 0.0 for v in SCRAPED_GAUGES.values()}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _SAMPLE_RE.match(line)
        if m and m.group(1) in SCRAPED_GAUGES:
            try:
                out[SCRAPED_GAUGES[m.group(1)]] += float(m.group(3))
            except ValueError:
                pass
    return out


@dataclass(slots=True)
class LatenessSample:
    """kernelsight serve's release-lateness histogram (summed over engines) and clock lag (max over engines) in
    one /metrics scrape; wall seconds."""

    buckets: dict[float, float]             # upper bound (inf for +Inf) -> cumulative count
    count: float
    sum_s: float
    clock_lag_s: float = 0.0


def parse_lateness(text: str) -> LatenessSample | None:
    """The lateness series of a /metrics text; None when the server does not expose them (real vLLM)."""
    buckets: dict[float, float] = {}
    count = sum_s = lag = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith("kernelsight:"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        name = m.group(1)
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if name == RELEASE_LATENESS + "_bucket":
            le = _LE_RE.search(m.group(2) or "")
            if le:
                bound = float(le.group(1))          # "+Inf" parses as inf
                buckets[bound] = buckets.get(bound, 0.0) + value
                found = True
        elif name == RELEASE_LATENESS + "_count":
            count += value
        elif name == RELEASE_LATENESS + "_sum":
            sum_s += value
        elif name == CLOCK_LAG:
            lag = max(lag, value)
    return LatenessSample(dict(sorted(buckets.items())), count, sum_s, lag) if found else None


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank q·count (the first
    bucket starts at 0; a rank in +Inf gives the last finite bound); 0 for an empty histogram."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower, below = 0.0, 0.0
    for b in bounds:
        cum = buckets[b]
        if cum >= rank and cum > below:
            if math.isinf(b):
                return lower
            return lower + (b - lower) * (rank - below) / (cum - below)
        lower, below = (b if not math.isinf(b) else lower), cum
    return lower


def lateness_summary(before: LatenessSample | None, after: LatenessSample | None,
                     lag_max_s: float = 0.0) -> dict[str, Any] | None:
    """Release lateness over a run, from the histograms scraped before and after it (ms, wall time): number of
    step releases, mean (exact), p50/p99 (interpolated in the buckets), the upper bound of the highest occupied
    bucket (None: beyond the last finite one), and the largest virtual clock lag seen. None without the metrics."""
    if after is None:
        return None
    b0 = before.buckets if before is not None else {}
    delta = {b: c - b0.get(b, 0.0) for b, c in after.buckets.items()}
    n = after.count - (before.count if before is not None else 0.0)
    total_s = after.sum_s - (before.sum_s if before is not None else 0.0)
    top: float | None = 0.0
    below = 0.0
    for b in sorted(delta):
        if delta[b] > below:
            top = None if math.isinf(b) else b
        below = delta[b]
    lag = max(lag_max_s, after.clock_lag_s, before.clock_lag_s if before is not None else 0.0)
    return {"releases": int(round(n)), "mean_ms": 1e3 * total_s / n if n > 0 else 0.0,
            "p50_ms": 1e3 * histogram_quantile(0.5, delta), "p99_ms": 1e3 * histogram_quantile(0.99, delta),
            "max_ms_at_most": None if top is None else 1e3 * top, "virtual_clock_lag_ms_max": 1e3 * lag}


#: A p99 release lateness beyond this (ms) is flagged in the report line: the server's timings were not the GPU's.
LATENESS_FLAG_MS = 50.0


def format_lateness(s: dict[str, Any]) -> str:
    """The report line of a ``lateness_summary``."""
    top = "> 120 s" if s["max_ms_at_most"] is None else f"<= {s['max_ms_at_most']:g} ms"
    line = (f"Server release lateness (wall): p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, max {top}, mean "
            f"{s['mean_ms']:.2f} ms over {s['releases']} step releases; virtual clock lag max "
            f"{s['virtual_clock_lag_ms_max']:.2f} ms")
    if s["p99_ms"] > LATENESS_FLAG_MS:
        line += " -- token timings did not follow the simulated GPU (server CPU-starved?)"
    return line


async def _get_metrics(s: Any, base_url: str, headers: dict[str, str]) -> str | None:
    import aiohttp

    try:
        async with s.get(base_url + "/metrics", headers=headers) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def _scrape(base_url: str, interval_s: float, t0: float, time_scale: float, into: dict[str, list[float]],
                  headers: dict[str, str], lag_max_s: list[float] | None = None) -> None:
    """Sample /metrics every ``interval_s`` wall seconds on its own connection (not the benchmark's pool); the
    largest virtual clock lag seen goes to ``lag_max_s[0]``."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        nxt = time.perf_counter()
        while True:
            text = await _get_metrics(s, base_url, headers)
            if text is not None:
                t = (time.perf_counter() - t0) * time_scale
                into["time_s"].append(t)
                for k, v in parse_gauges(text).items():
                    into[k].append(v)
                if lag_max_s is not None:
                    lat = parse_lateness(text)
                    if lat is not None:
                        lag_max_s[0] = max(lag_max_s[0], lat.clock_lag_s)
            nxt += interval_s
            await asyncio.sleep(max(nxt - time.perf_counter(), 0.0))


async def _lateness_sample(base_url: str, headers: dict[str, str]) -> LatenessSample | None:
    """One scrape of the lateness series (before and after a run)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        text = await _get_metrics(s, base_url, headers)
    return parse_lateness(text) if text is not None else None


def _build_spec(i: int, s: SampleRequest, *, url: str, chat: bool, model: str, ignore_eos: bool,
                headers: dict[str, str], id_prefix: str, decode: Any, extra_body: dict | None,
                mm_seed: int = 0) -> RequestSpec:
    if chat:
        prompt = s.prompt if s.prompt is not None else decode(s.prompt_token_ids or [])
        payload = chat_payload(model, prompt, s.expected_output_len, ignore_eos, extra_body)
        if s.mm_sizes or s.mm_urls:     # random-mm, custom-image: the images after the text, as vllm bench
            from kernelsight.loadgen.mm_dataset import image_parts

            payload["messages"][0]["content"].extend(image_parts(s, mm_seed, i))
    else:
        # text datasets send their text (as vLLM does); token-id prompts go as ids: no decode/re-encode drift
        prompt_val: str | list[int] = s.prompt if s.prompt is not None else list(s.prompt_token_ids or [])
        payload = completions_payload(model, prompt_val, s.expected_output_len, ignore_eos, extra_body)
    return RequestSpec(url, payload, {**headers, "x-request-id": f"{id_prefix}{i}"}, s.prompt_len, chat)


async def run_bench(base_url: str, samples: Sequence[SampleRequest], arrivals_s: Sequence[float], *, model: str,
                    endpoint: str = "/v1/completions", max_concurrency: int | None = None, ignore_eos: bool = False,
                    time_scale: float = 1.0, decode: Any = None, count_tokens: Any = None,
                    headers: dict[str, str] | None = None, extra_body: dict | None = None,
                    scrape_interval_s: float | None = None, progress: bool = False,
                    request_id_prefix: str | None = None, mm_seed: int = 0) -> BenchRun:
    """Send ``samples`` at ``arrivals_s`` (the server's seconds; divided by ``time_scale`` for the wall
    schedule) and measure every response."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint}")
    chat = ENDPOINTS[endpoint] == "openai-chat"
    base_url = base_url.rstrip("/")
    hdrs = dict(headers or {})
    id_prefix = request_id_prefix if request_id_prefix is not None else f"bench-{uuid.uuid4().hex[:8]}-"
    # Payloads are built up front so the sending loop does nothing but wait and dispatch.
    specs = [_build_spec(i, s, url=base_url + endpoint, chat=chat, model=model, ignore_eos=ignore_eos,
                         headers=hdrs, id_prefix=id_prefix, decode=decode, extra_body=extra_body,
                         mm_seed=mm_seed)
             for i, s in enumerate(samples)]
    order = sorted(range(len(samples)), key=lambda i: arrivals_s[i])
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    stats = ClientStats()
    send_late = np.zeros(len(samples))
    records: list[RequestRecord | None] = [None] * len(samples)
    bar = Progress(len(samples), enabled=progress)
    scraped: dict[str, list[float]] | None = None
    lateness: dict[str, Any] | None = None
    lag_max_s = [0.0]
    # the server's release-lateness histogram before the run (its change over the run is what the run caused)
    late0 = await _lateness_sample(base_url, hdrs) if scrape_interval_s else None
    # Everything alive now (modules, datasets, payloads) is moved out of the cyclic collector's reach: a full
    # collection over a large heap stalls the event loop for tens of ms, which would read as latency.
    gc.collect()
    gc.freeze()
    try:
        async with bench_session(max_concurrency) as session:
            t0 = time.perf_counter()   # just before the first dispatch
            cpu0 = time.process_time()
            scraper = None
            if scrape_interval_s:
                scraped = {"time_s": [], **{v: [] for v in SCRAPED_GAUGES.values()}}
                scraper = asyncio.create_task(_scrape(base_url, scrape_interval_s, t0, time_scale, scraped, hdrs,
                                                      lag_max_s))

            async def one(i: int, due: float) -> None:
                t_task = time.perf_counter()
                if sem is not None:
                    await sem.acquire()
                t_go = time.perf_counter()
                send_late[i] = t_task - due   # the client's own delay: timer wake-up and task start after the schedule
                try:
                    rec = await send_streaming_request(session, specs[i], bench_start_s=t0, queue_s=t_go - t_task,
                                                       time_scale=time_scale, stats=stats, count_tokens=count_tokens)
                finally:
                    if sem is not None:
                        sem.release()
                records[i] = rec
                bar.update()

            tasks = []
            for i in order:
                due = t0 + arrivals_s[i] / time_scale
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, due)))
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            if scraper is not None:
                scraper.cancel()
                try:
                    await scraper
                except asyncio.CancelledError:
                    pass
                if late0 is not None:
                    lateness = lateness_summary(late0, await _lateness_sample(base_url, hdrs), lag_max_s[0])
    finally:
        gc.unfreeze()
    bar.close()
    return BenchRun([r for r in records if r is not None], wall * time_scale, send_late, stats, scraped, wall, cpu,
                    lateness=lateness)


# -- command line ------------------------------------------------------------------------------------------
def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from kernelsight.loadgen.workload import add_report_args, add_workload_args

    p = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint and report like vllm bench serve",
        description="The bundled load generator: vllm bench serve's flags, datasets, arrival process and "
                    "measurement rules (TTFT on the first token-bearing chunk, ITL per chunk, TPOT excluding the "
                    "first token), against real vLLM or kernelsight serve. Needs aiohttp.")
    t = p.add_argument_group("target (as vllm bench serve)")
    t.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: "
                                                    "http://HOST:PORT)")
    t.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    t.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    t.add_argument("--endpoint", default="/v1/completions", choices=tuple(ENDPOINTS),
                   help="API route: completions (backend openai) or chat (openai-chat) (default: %(default)s)")
    t.add_argument("--backend", default=None, choices=("openai", "vllm", "openai-chat"),
                   help="request format; implied by --endpoint (default: openai for completions, openai-chat for "
                        "chat)")
    t.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    t.add_argument("--served-model-name", default=None, help="name sent in requests when it differs from --model")
    t.add_argument("--label", default=None, help="label stored in the result")
    t.add_argument("--header", nargs="*", default=None, metavar="K=V", help="extra HTTP headers")
    t.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    t.add_argument("--request-id-prefix", default=None, help="x-request-id prefix (default: bench-<random>-)")
    t.add_argument("--time-scale", type=float, default=1.0,
                   help="the kernelsight server's --time-scale: the send schedule runs that much faster and "
                        "every measured time is reported in the server's simulated seconds (default: 1)")
    add_workload_args(p)
    o = add_report_args(p, default_metrics="ttft,tpot,itl")
    o.add_argument("--scrape-metrics", nargs="?", type=float, const=0.5, default=None, metavar="SECONDS",
                   help="sample the server's /metrics gauges (running, waiting, KV usage) every SECONDS of wall "
                        "time (default when given: 0.5) into the result (and the --plot timeline); against "
                        "kernelsight serve also its release lateness over the run (server_lateness)")
    p.set_defaults(func=cmd_bench)
    return p


def _headers(ns: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    key = os.environ.get("OPENAI_API_KEY")
    if key:  # 0.33 sends Authorization only when the variable is set
        out["Authorization"] = f"Bearer {key}"
    for item in ns.header or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"--header takes K=V, got {item!r}")
        out[k] = v
    return out


def _get_json(url: str, headers: dict[str, str]) -> Any:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None


def cmd_bench(ns: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ValueError("kernelsight bench needs aiohttp: pip install 'kernelsight[loadgen]'") from None
    if ns.plot:
        from kernelsight.loadgen.plot import require_plotly

        require_plotly()    # before the run, not after it
    from kernelsight.loadgen.metrics import assemble_result, compute_bench_metrics
    from kernelsight.loadgen.report import format_report
    from kernelsight.loadgen.session_metrics import format_workload_extra, workload_extra
    from kernelsight.loadgen.tokenizer import resolve_tokenizer
    from kernelsight.loadgen.workload import build_workload, metric_options, result_header

    if not ns.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {ns.time_scale}")
    if ns.backend == "openai-chat" and ns.endpoint == "/v1/completions":
        ns.endpoint = "/v1/chat/completions"
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    headers = _headers(ns)
    extra_body = json.loads(ns.extra_body) if ns.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    mopts = metric_options(ns)
    root = None
    model = ns.model
    sessions = getattr(ns, "num_sessions", None) is not None
    max_context = None
    if sessions and ns.scrape_metrics:
        raise ValueError("--scrape-metrics is not taken with --num-sessions")
    if model is None or ns.tokenizer is None or sessions:
        cards = _get_json(base_url + "/v1/models", headers).get("data") or []
        if model is None:
            if not cards:
                raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
            model = cards[0]["id"]
        card = next((c for c in cards if c.get("id") == model), {})
        root = card.get("root")
        if isinstance(card.get("max_model_len"), int):
            # sessions end before their history reaches the context; a chat template adds some tokens per message
            max_context = card["max_model_len"] * 7 // 8 if ns.endpoint == "/v1/chat/completions" else \
                card["max_model_len"]
    served = ns.served_model_name or model
    tok = resolve_tokenizer(model, ns.tokenizer, base_url=base_url, model_root=root, headers=headers)
    wl = build_workload(ns, tok.vocab_size, lambda: tok, max_context=max_context)
    backend = ENDPOINTS[ns.endpoint]
    if ns.dataset_name in ("random-mm", "custom-image") and backend != "openai-chat":
        raise ValueError("Multi-modal content (images) is only supported on the chat endpoint: pass "
                         "--endpoint /v1/chat/completions (or --backend openai-chat)")

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    what = (f"{len(wl.sessions.sessions)} sessions ({wl.num_requests} turns, session concurrency "
            f"{wl.sessions.concurrency})" if wl.sessions is not None else f"{len(wl.samples)} requests")
    print(f"kernelsight bench: {what} to {base_url}{ns.endpoint} (model {served}, tokenizer "
          f"{tok.name}), rate {wl.request_rate}, burstiness {ns.burstiness}, max concurrency {ns.max_concurrency}")
    max_open = None
    if wl.sessions is not None:
        from kernelsight.loadgen.session_bench import run_session_bench

        srun = asyncio.run(run_session_bench(
            base_url, wl.sessions, model=served, chat=backend == "openai-chat", endpoint=ns.endpoint,
            ignore_eos=wl.ignore_eos, decode=tok.decode, encode=lambda t: tok.encode(t, add_special_tokens=False),
            time_scale=ns.time_scale, count_tokens=count_tokens, headers=headers, extra_body=extra_body,
            progress=ns.progress, request_id_prefix=ns.request_id_prefix or f"bench-{uuid.uuid4().hex[:8]}-"))
        run = BenchRun(srun.records, srun.duration_s, np.zeros(0), srun.client, wall_s=srun.wall_s, cpu_s=srun.cpu_s)
        max_open = srun.max_open_sessions
    else:
        run = asyncio.run(run_bench(
            base_url, wl.samples, wl.arrivals_s, model=served, endpoint=ns.endpoint,
            max_concurrency=ns.max_concurrency, ignore_eos=wl.ignore_eos, time_scale=ns.time_scale, decode=tok.decode,
            count_tokens=count_tokens, headers=headers, extra_body=extra_body, scrape_interval_s=ns.scrape_metrics,
            progress=ns.progress, request_id_prefix=ns.request_id_prefix, mm_seed=ns.seed))
    stats = compute_bench_metrics(run.records, max(run.duration_s, 1e-9), percentile_metrics=mopts.percentile_metrics,
                                  percentiles=mopts.percentiles, goodput_slos_ms=mopts.goodput_slos_ms)
    header = result_header(backend=backend, endpoint_type=backend, model_id=model, tokenizer_id=ns.tokenizer or
                           tok.name, num_prompts=wl.num_requests, request_rate=wl.request_rate,
                           burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, label=ns.label)
    extra: dict[str, Any] = {"client": run.client_summary()}
    if ns.time_scale != 1.0:
        extra["time_scale"] = ns.time_scale
    if run.scraped is not None:
        extra["server_metrics"] = run.scraped
    if run.lateness is not None:
        extra["server_lateness"] = run.lateness
    extra.update(workload_extra(run.records, dataset_name=ns.dataset_name, sessions=wl.sessions,
                                max_open_sessions=max_open))
    result = assemble_result(header, stats, run.records, detailed=ns.save_detailed, extra=extra)
    print(format_report(result))
    if text := format_workload_extra(result):
        print(text)
    c = extra["client"]
    print(f"Client: send lateness mean {c['send_lateness_ms']['mean']:.2f} ms, p99 {c['send_lateness_ms']['p99']:.2f} "
          f"ms, max {c['send_lateness_ms']['max']:.2f} ms; {c['handle_us_per_sse_message']:.1f} µs per SSE message "
          f"({c['sse_messages']} messages)")
    if run.lateness is not None:
        print(format_lateness(run.lateness))
    errors = [r.error for r in run.records if not r.success]
    if errors:
        print(f"{len(errors)} request(s) failed, first error: {errors[0]}", file=sys.stderr)
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(result, indent=2))
        print(f"wrote {ns.result_json}")
    if ns.plot:
        from kernelsight.loadgen.plot import write_plot_html

        write_plot_html(ns.plot, f"kernelsight bench: {served}", run.records, summary=_plot_summary(result),
                        timeline=run.scraped, timeline_title="Server gauges (/metrics)")
        print(f"wrote {ns.plot}")
    return 0


def _plot_summary(result: dict) -> dict:
    keys = ("model_id", "num_prompts", "request_rate", "max_concurrency", "duration", "completed", "failed",
            "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms")
    return {k: result[k] for k in keys if k in result and not (isinstance(result[k], float)
                                                               and math.isnan(result[k]))}

