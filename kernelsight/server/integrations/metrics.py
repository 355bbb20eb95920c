"""vLLM V1's Prometheus metrics (names, types, labels and buckets as vLLM 0.33), fed by the simulator.

Every value comes from simulated state and the virtual clock (seconds of simulated GPU time), not from
wall time: under ``--time-scale k`` the histograms still read like the simulated deployment's.
Each server has its own registry (so several replicas can live in one process); it also carries the
process/platform/GC collectors that vLLM's default registry exposes.

Two series are kernelsight's own (prefix ``kernelsight:``, same labels) and measure wall time instead: how late the
engine loop released each step's tokens, and how far its virtual clock trails wall time. They tell when the timings
above stopped being the simulated GPU's (a CPU-starved server releases tokens late).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: Release lateness: sub-ms jitter on a healthy server up to the minutes a starved one was seen to fall behind.
LATENESS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
                    120.0)
RELEASE_LATENESS = "kernelsight:release_lateness_seconds"
CLOCK_LAG = "kernelsight:virtual_clock_lag_seconds"
INJECTED_FAULTS = "kernelsight:injected_faults"
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
#: Deprecated names (vLLM 0.9.2–0.11; removed in 0.12) → the successor whose values they carry. vLLM 0.11 showed
#: them only with --show-hidden-metrics-for-version=0.10; production-stack's router and older dashboards read them.
HIDDEN_ALIASES = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}
#: The first release without those names: a --show-hidden-metrics-for-version before it brings them back.
HIDDEN_ALIASES_REMOVED_IN = (0, 12)
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"


def shows_hidden_aliases(version: str | None) -> bool:
    """Whether --show-hidden-metrics-for-version ``version`` (dotted numbers) asks for the deprecated names."""
    if version is None:
        return False
    return tuple(int(x) for x in version.split(".")[:2]) < HIDDEN_ALIASES_REMOVED_IN


class _AliasCollector:
    """Re-emits some families of the registry under old names at each scrape, so the values always equal the
    successors' (nothing is counted twice)."""

    def __init__(self, sources: dict[str, Any]) -> None:
        self._sources = sources       # old name -> the successor's metric object

    def describe(self) -> list:
        return []                     # names are not reserved in the registry: they are only ever aliases

    def collect(self):
        for old, metric in self._sources.items():
            for fam in metric.collect():
                out = Metric(old, fam.documentation + " (deprecated name)", fam.type, fam.unit)
                out.samples = [smp._replace(name=old + smp.name[len(fam.name):]) for smp in fam.samples]
                yield out


def request_token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_model_len."""
    out, mantissa, exp = [], (1, 2, 5), 0
    while True:
        for m in mantissa:
            v = m * 10 ** exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


class ServerMetrics:
    """One registry; per-engine children labelled ``model_name`` and ``engine``."""

    def __init__(self, model_name: str, num_engines: int, max_model_len: int, cache_info: list[dict[str, Any]],
                 lora_enabled: bool = False, max_loras: int = 1, fault_types: tuple[str, ...] = (),
                 first_engine: int = 0, hidden_metrics_version: str | None = None) -> None:
        # first_engine: the label of the first engine (a process serving one rank with --data-parallel-rank)
        self.registry = reg = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        labels = ["model_name", "engine"]
        tok_buckets = request_token_buckets(max_model_len)

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def c(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=reg)

        def h(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        fam = {
            "running": g("vllm:num_requests_running", "Number of requests in model execution batches."),
            "waiting": g("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            "kv_usage": g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            "prefix_queries": c("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_hits": c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            "preemptions": c("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            "prompt_tokens": c("vllm:prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": c("vllm:generation_tokens", "Number of generation tokens processed."),
            "success": c("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)),
            "req_prompt_tokens": h("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok_buckets),
            "req_gen_tokens": h("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                tok_buckets),
            "iteration_tokens": h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKENS_BUCKETS),
            "max_gen_tokens": h("vllm:request_max_num_generation_tokens",
                                "Histogram of maximum number of requested generation tokens.", tok_buckets),
            "params_n": h("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
            "params_max_tokens": h("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   tok_buckets),
            "ttft": h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS),
            "itl": h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            "tpot": h("vllm:request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
            "e2e": h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS),
            "queue": h("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                       REQUEST_LATENCY_BUCKETS),
            "inference": h("vllm:request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
            "prefill": h("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                         REQUEST_LATENCY_BUCKETS),
            "decode": h("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                        REQUEST_LATENCY_BUCKETS),
            "req_preemptions": h("vllm:request_num_preemptions", "Number of preemptions per request.",
                                 PREEMPTION_BUCKETS),
            "kv_computed": h("vllm:request_prefill_kv_computed_tokens",
                             "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                             tok_buckets),
            "lateness": h(RELEASE_LATENESS,
                          "Wall seconds each engine step's tokens were released after the deadline the simulation "
                          "meant (wall0 + virtual end of the step / time scale); one observation per step. Large "
                          "values mean token timings no longer follow the simulated GPU (CPU starvation).",
                          LATENESS_BUCKETS),
            "clock_lag": g(CLOCK_LAG,
                           "Wall seconds by which the engine's virtual clock (the end of its latest computed step, "
                           "divided by the time scale) trails wall time at scrape time: max(0, (wall_now - wall0) - "
                           "virtual_now / time_scale). 0 when idle or when the step in flight is not yet due; a few "
                           "ms between steps; grows while the engine loop falls behind."),
        }
        cache_labels = sorted({k for info in cache_info for k in info}) + ["engine"]
        cache_gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", cache_labels,
                            registry=reg)
        self.engines: list[EngineMetrics] = []
        for i in range(num_engines):
            eng = str(first_engine + i)
            children = {}
            for key, metric in fam.items():
                if key == "success":
                    children[key] = {r: metric.labels(model_name, eng, r) for r in FINISHED_REASONS}
                else:
                    children[key] = metric.labels(model_name, eng)
            self.engines.append(EngineMetrics(children))
            info = cache_info[min(i, len(cache_info) - 1)]
            cache_gauge.labels(**{k: str(info.get(k, "")) for k in cache_labels if k != "engine"}, engine=eng).set(1)
        # admission limits (--max-num-queued-reqs / --max-num-queued-tokens) as vLLM 0.33 counts them: per model,
        # no engine label; and every fault kernelsight injected, by type (both pre-created at 0)
        self.admission_rejections = Counter("vllm:admission_rejections", "Requests rejected by admission control.",
                                            ["model_name", "reason"], registry=reg)
        for reason in ADMISSION_REASONS:
            self.admission_rejections.labels(model_name, reason)
        self.injected_faults = Counter(INJECTED_FAULTS, "Faults injected by kernelsight's fault injection "
                                       "(--fault-rate / X-Kernelsight-Fault / POST /kernelsight/faults), by type: "
                                       "per-request faults once per request, 'unready' once per failed /health or "
                                       "/ping, 'slow' once per request admitted while the replica is slow.",
                                       ["model_name", "type"], registry=reg)
        self._model_name = model_name
        for t in fault_types:
            self.injected_faults.labels(model_name, t)
        # sleep mode: one series per state and engine, 1 on the current one (awake until a /sleep)
        self.sleep_state = Gauge("vllm:engine_sleep_state",
                                 "Engine sleep state: 1 on the current state, 0 on the others.",
                                 labels + ["sleep_state"], registry=reg)
        self._engine_labels = [str(first_engine + i) for i in range(num_engines)]
        self.set_sleep_state("awake")
        if shows_hidden_aliases(hidden_metrics_version):
            by_name = {m._name: m for m in fam.values()}    # prometheus_client keeps a counter's name without _total
            reg.register(_AliasCollector({old: by_name[new] for old, new in HIDDEN_ALIASES.items()}))
        self.lora_gauge: Gauge | None = None
        self.max_loras = max_loras
        if lora_enabled:
            self.lora_gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
        self._lora_last: tuple[str, str] | None = None

    def bind_spec_decode(self, stats: list[Callable[[], Any]], num_spec_tokens: int) -> None:
        """vLLM's spec-decode counters (registered only with a speculative config, as vLLM does), read at scrape time
        from each engine's cumulative ``SpecDecodeStats`` (``stats[i]()``: engine i's)."""
        self.registry.register(_SpecDecodeCollector(self._model_name, self._engine_labels, stats, num_spec_tokens))

    def bind_offload(self, stats: list[Callable[[], Any]]) -> None:
        """KV offloading's counters (registered only with a CPU tier), read at scrape time from each engine's
        cumulative ``OffloadStats`` (``simcore/kv_offload.py``; ``stats[i]()``: engine i's)."""
        self.registry.register(_OffloadCollector(self._model_name, self._engine_labels, stats))

    def set_sleep_state(self, state: str) -> None:
        """Every engine's ``vllm:engine_sleep_state``: 1 on ``state`` (one of SLEEP_STATES), 0 on the others."""
        for eng in self._engine_labels:
            for st in SLEEP_STATES:
                self.sleep_state.labels(self._model_name, eng, st).set(1 if st == state else 0)

    def on_admission_rejected(self, reason: str) -> None:
        self.admission_rejections.labels(self._model_name, reason).inc()

    def on_fault(self, fault_type: str) -> None:
        self.injected_faults.labels(self._model_name, fault_type).inc()

    def faults_injected(self) -> dict[str, int]:
        """Injected faults so far, by type (``kernelsight:injected_faults_total``)."""
        out = {}
        for metric in self.injected_faults.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["type"]] = int(sample.value)
        return out

    def set_lora_state(self, waiting: list[str], running: list[str]) -> None:
        if self.lora_gauge is None:
            return
        key = (",".join(sorted(set(waiting))), ",".join(sorted(set(running))))
        # vLLM sets the series to the current Unix time on each stats update; one series per state
        self.lora_gauge.labels(str(self.max_loras), key[0], key[1]).set(time.time())
        self._lora_last = key

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCollector:
    """``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` (labels model_name, engine)
    and ``vllm:spec_decode_num_accepted_tokens_per_pos`` (plus ``position``, one series per draft position), as
    vLLM's SpecDecodingProm declares them (counters: exposed with the ``_total`` suffix)."""

    _FAMILIES = (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
                 ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
                 ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"))

    def __init__(self, model_name: str, engines: list[str], stats: list[Callable[[], Any]], k: int) -> None:
        self._model_name, self._engines, self._stats, self._k = model_name, engines, stats, k

    def describe(self) -> list:
        return []

    def collect(self):
        snaps = [get() for get in self._stats]
        for name, doc, attr in self._FAMILIES:
            fam = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            for eng, st in zip(self._engines, snaps, strict=True):
                fam.add_metric([self._model_name, eng], getattr(st, attr))
            yield fam
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                  labels=["model_name", "engine", "position"])
        for eng, st in zip(self._engines, snaps, strict=True):
            for pos in range(self._k):
                fam.add_metric([self._model_name, eng, str(pos)], st.num_accepted_tokens_per_pos[pos])
        yield fam


class _OffloadCollector:
    """vLLM's KV-offloading metrics (the OffloadingConnector's ``OffloadPromMetrics``, labels model_name, engine,
    transfer_type ``GPU_to_CPU`` / ``CPU_to_GPU``): ``vllm:kv_offload_total_bytes`` and ``vllm:kv_offload_total_time``
    (counters: bytes and seconds of simulated copies) and ``vllm:kv_offload_size`` (bytes per copy); and the
    connector's prefix-cache counters ``vllm:external_prefix_cache_queries`` / ``_hits`` (tokens looked up in the CPU
    tier past the GPU hit, and found there), as vLLM's scheduler records them."""

    def __init__(self, model_name: str, engines: list[str], stats: list[Callable[[], Any]]) -> None:
        self._model_name, self._engines, self._stats = model_name, engines, stats

    def describe(self) -> list:
        return []

    def collect(self):
        from kernelsight.simcore.kv_offload import CPU_TO_GPU, GPU_TO_CPU, TRANSFER_SIZE_BUCKETS

        snaps = [get() for get in self._stats]
        labels = ["model_name", "engine"]
        kinds = (GPU_TO_CPU, CPU_TO_GPU)
        fam = CounterMetricFamily("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                                  labels=[*labels, "transfer_type"])
        for eng, st in zip(self._engines, snaps, strict=True):
            for kind in kinds:
                fam.add_metric([self._model_name, eng, kind], st.bytes[kind])
        yield fam
        fam = CounterMetricFamily("vllm:kv_offload_total_time", "Total time measured by all KV offloading operations",
                                  labels=[*labels, "transfer_type"])
        for eng, st in zip(self._engines, snaps, strict=True):
            for kind in kinds:
                fam.add_metric([self._model_name, eng, kind], st.time_s[kind])
        yield fam
        hist = HistogramMetricFamily("vllm:kv_offload_size", "Histogram of KV offload transfer size, in bytes.",
                                     labels=[*labels, "transfer_type"])
        bounds = [*(floatToGoString(b) for b in TRANSFER_SIZE_BUCKETS), "+Inf"]    # le="1e+06" as a Histogram
        for eng, st in zip(self._engines, snaps, strict=True):
            for kind in kinds:
                cum, acc = [], 0
                for bound, n in zip(bounds, st.size_counts[kind], strict=True):
                    acc += n
                    cum.append((bound, acc))
                hist.add_metric([self._model_name, eng, kind], cum, st.bytes[kind])
        yield hist
        for name, doc, attr in (
                ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
                 "cache sharing, in terms of number of queried tokens.", "external_queries_tokens"),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
                 "sharing, in terms of number of cached tokens.", "external_hits_tokens")):
            fam = CounterMetricFamily(name, doc, labels=labels)
            for eng, st in zip(self._engines, snaps, strict=True):
                fam.add_metric([self._model_name, eng], getattr(st, attr))
            yield fam


class EngineMetrics:
    """Hot-path helpers for one engine's labelled children."""

    __slots__ = ("m", "_last_queries", "_last_hits", "_last_preemptions", "on_release")

    def __init__(self, children: dict[str, Any]) -> None:
        self.m = children
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0
        # one step released this late (wall s): the histogram's observe itself, bound once (hot path)
        self.on_release: Callable[[float], None] = children["lateness"].observe

    def bind_clock_lag(self, lag_s: Callable[[], float]) -> None:
        """Compute ``kernelsight:virtual_clock_lag_seconds`` with ``lag_s()`` at each scrape (nothing per step)."""
        self.m["clock_lag"].set_function(lag_s)

    def on_step(self, running: int, waiting: int, kv_usage: float, scheduled_tokens: int, generated_tokens: int,
                prefix_queries: int, prefix_hits: int, preemptions: int) -> None:
        m = self.m
        m["running"].set(running)
        m["waiting"].set(waiting)
        m["kv_usage"].set(kv_usage)
        if scheduled_tokens:
            m["iteration_tokens"].observe(scheduled_tokens)
        if generated_tokens:
            m["generation_tokens"].inc(generated_tokens)
        if prefix_queries > self._last_queries:
            m["prefix_queries"].inc(prefix_queries - self._last_queries)
        if prefix_hits > self._last_hits:
            m["prefix_hits"].inc(prefix_hits - self._last_hits)
        if preemptions > self._last_preemptions:
            m["preemptions"].inc(preemptions - self._last_preemptions)
        self._last_queries, self._last_hits, self._last_preemptions = prefix_queries, prefix_hits, preemptions

    def set_gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        m = self.m
        m["running"].set(running)
        m["waiting"].set(waiting)
        m["kv_usage"].set(kv_usage)

    def on_first_token(self, ttft_s: float, prompt_len: int) -> None:
        self.m["ttft"].observe(ttft_s)
        self.m["prompt_tokens"].inc(prompt_len)

    def on_itl(self, itl_s: float) -> None:
        self.m["itl"].observe(itl_s)

    def on_itls(self, counts: dict[float, int]) -> None:
        """Observe each ITL ``count`` times: one bucket increment per distinct value (a decode step's sequences
        mostly share one), through prometheus_client's Histogram internals when they are as expected."""
        h = self.m["itl"]
        buckets, bounds = getattr(h, "_buckets", None), getattr(h, "_upper_bounds", None)
        total = getattr(h, "_sum", None)
        if not isinstance(buckets, list) or not isinstance(bounds, list) or len(buckets) != len(bounds) \
                or total is None or not bounds or bounds[-1] != float("inf"):
            for itl, n in counts.items():
                for _ in range(n):
                    h.observe(itl)
            return
        for itl, n in counts.items():
            total.inc(itl * n)
            buckets[bisect_left(bounds, itl)].inc(n)     # observe(): the first bucket with itl <= bound

    def on_new_request(self, n: int, max_tokens: int) -> None:
        self.m["params_n"].observe(n)
        self.m["params_max_tokens"].observe(max_tokens)
        self.m["max_gen_tokens"].observe(max_tokens)

    def on_finished(self, reason: str, *, arrival_s: float, scheduled_s: float | None, first_token_s: float | None,
                    finish_s: float, prompt_len: int, num_generated: int, num_cached: int,
                    num_preemptions: int) -> None:
        m = self.m
        m["success"][reason if reason in m["success"] else "stop"].inc()
        m["e2e"].observe(max(finish_s - arrival_s, 0.0))
        m["req_prompt_tokens"].observe(prompt_len)
        m["req_gen_tokens"].observe(num_generated)
        m["req_preemptions"].observe(num_preemptions)
        if scheduled_s is not None:
            m["queue"].observe(max(scheduled_s - arrival_s, 0.0))
            m["inference"].observe(max(finish_s - scheduled_s, 0.0))
            m["kv_computed"].observe(max(prompt_len - max(num_cached, 0), 0))
            if first_token_s is not None:
                m["prefill"].observe(max(first_token_s - scheduled_s, 0.0))
        if first_token_s is not None:
            decode = max(finish_s - first_token_s, 0.0)
            m["decode"].observe(decode)
            if num_generated > 1:
                m["tpot"].observe(decode / (num_generated - 1))
