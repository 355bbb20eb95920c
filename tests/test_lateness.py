"""Release lateness as a signal: the /metrics series, the rate-limited warning, and bench's summary of them.

Lateness is forced deterministically: by blocking the server's event loop from inside it (``ServerThread.call``)
until a known time past the deadline of the step in flight, or by calling the observe functions directly with
chosen values and a fake clock. No assertion bounds how fast anything runs.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kernelsight.loadgen.bench import (  # noqa: E402
    format_lateness,
    histogram_quantile,
    lateness_summary,
    parse_lateness,
)
from kernelsight.server.engine import lateness as lateness_mod  # noqa: E402
from kernelsight.server.engine.lateness import LatenessWatch, p99_nearest_rank  # noqa: E402
from kernelsight.server.integrations.metrics import LATENESS_BUCKETS  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402
from kernelsight.server.serve_args import serve_parser, server_options_from  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
ARGS = ["--max-model-len", "2048", "--num-gpu-blocks-override", "600", "--served-model-name", MODEL]
HIST = "kernelsight:release_lateness_seconds"
LAG = "kernelsight:virtual_clock_lag_seconds"
#: How long the server's loop is blocked past the deadline of the step in flight (wall seconds).
BLOCK_S = 0.4


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


def families(text: str) -> dict:
    """/metrics parsed by prometheus_client's own parser (which rejects an invalid exposition)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def hist_samples(fam, suffix: str) -> list:
    return [s for s in fam.samples if s.name == HIST + suffix]


async def test_metrics_names_types_labels_help_and_one_observation_per_step(srv):
    import httpx

    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
        for i in range(3):
            # the last one not streamed: its handler wakes only once its last step is fully booked
            body = {"model": MODEL, "prompt": list(range(100 + i, 400 + i)), "max_tokens": 12, "ignore_eos": True,
                    "stream": i != 2}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
        text = (await c.get("/metrics")).text
    # nothing runs once every request is done; read both on the server's loop anyway
    rendered, steps = srv.call(lambda: (srv.state.metrics.render().decode(), srv.bridge.num_steps))
    (count,) = hist_samples(families(rendered)[HIST], "_count")
    assert steps > 0 and count.value == steps
    fams = families(text)
    h, g = fams[HIST], fams[LAG]
    assert h.type == "histogram" and g.type == "gauge"
    assert "released after the deadline" in h.documentation and "one observation per step" in h.documentation
    assert "trails wall time" in g.documentation and "0 when idle" in g.documentation
    (count,) = hist_samples(h, "_count")
    assert count.labels == {"model_name": MODEL, "engine": "0"} and count.value == steps
    bounds = [float(s.labels["le"]) for s in hist_samples(h, "_bucket")]
    assert bounds == [*LATENESS_BUCKETS, math.inf]
    (lag,) = g.samples
    assert lag.labels == {"model_name": MODEL, "engine": "0"} and lag.value == 0.0     # idle
    # beside vLLM's series, same labels
    assert fams["vllm:num_requests_running"].samples[0].labels == {"model_name": MODEL, "engine": "0"}


def _block_past_deadline(bridge) -> tuple[bool, float]:
    """Runs on the server's loop, so the engine loop is suspended: busy until BLOCK_S past the deadline of the step
    in flight (or past the last released step's end, if the loop is between steps). Returns (a request was in
    flight, the virtual clock lag read at the end of the block)."""
    if not bridge.engine.has_unfinished():
        return False, 0.0
    until = bridge.wall_of(bridge.engine.now_s) + BLOCK_S
    while time.perf_counter() < until:
        pass
    return True, bridge.virtual_clock_lag_s()


async def test_blocked_loop_shows_up_as_lateness_and_clock_lag(srv):
    import httpx

    def over(text: str, bound: float) -> float:
        """Releases later than ``bound`` seconds."""
        h = families(text)[HIST]
        (count,) = hist_samples(h, "_count")
        below = next(s.value for s in hist_samples(h, "_bucket") if float(s.labels["le"]) == bound)
        return count.value - below

    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
        before = over((await c.get("/metrics")).text, 0.2)
        body = {"model": MODEL, "prompt": list(range(500, 600)), "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()

            async def next_chunk() -> None:
                while not (await anext(lines)).startswith("data: {"):
                    pass

            await next_chunk()                 # a step has released tokens: the request is in flight
            in_flight, lag_s = srv.call(_block_past_deadline, srv.bridge)
            await next_chunk()                 # a step released after the block
        # leaving the stream disconnects: the request is aborted
        after = over((await c.get("/metrics")).text, 0.2)
    assert in_flight
    # the step in flight (or the next one, at most one short decode step later) was released ≥ BLOCK_S late
    assert after - before >= 1
    assert lag_s >= BLOCK_S
    assert srv.call(lambda: srv.bridge.late_s_max) > 0.2


# -- the warning ---------------------------------------------------------------------------------------------
def feed(watch: LatenessWatch, late_s: float, n: int, t0: float, dt: float = 0.01) -> float:
    for i in range(n):
        watch.observe(late_s, t0 + i * dt)
    return t0 + n * dt


def test_warning_fires_once_per_interval_when_p99_passes(caplog):
    caplog.set_level(logging.WARNING, logger="kernelsight.server")
    w = LatenessWatch(0.05, engine="1")
    t = feed(w, 0.2, 200, 100.0)               # every release 200 ms late, over 2 s
    assert w.warnings == 1
    (rec,) = [r for r in caplog.records if r.name == "kernelsight.server"]
    msg = rec.getMessage()
    assert rec.levelno == logging.WARNING
    assert "engine 1" in msg and "p99 200.0 ms" in msg and "no longer follow the simulated GPU" in msg
    assert "CPU starvation" in msg and "threshold 50 ms" in msg
    t = feed(w, 0.2, 100, t, dt=0.2)           # 20 s more of it: still inside the 30 s interval
    assert w.warnings == 1
    feed(w, 0.2, 20, t + lateness_mod.WARN_INTERVAL_S, dt=0.1)
    assert w.warnings == 2


def test_no_warning_below_threshold_or_rare_or_disabled(caplog):
    caplog.set_level(logging.WARNING, logger="kernelsight.server")
    below = LatenessWatch(0.05)
    feed(below, 0.04, 500, 0.0)
    rare = LatenessWatch(0.05)                 # 1 release in 200 late: the p99 stays on time
    for i in range(2000):
        rare.observe(0.5 if i % 200 == 0 else 0.001, i * 0.004)
    few = LatenessWatch(0.05)                  # too few releases in the window to call it a trend
    feed(few, 1.0, lateness_mod.MIN_RELEASES - 1, 0.0)
    off = LatenessWatch(0.0)
    feed(off, 10.0, 500, 0.0)
    assert below.warnings == rare.warnings == few.warnings == off.warnings == 0
    assert not [r for r in caplog.records if r.name == "kernelsight.server"]


def test_window_forgets_old_releases():
    w = LatenessWatch(0.05)
    feed(w, 1.0, 50, 0.0)                      # late (warned), long ago
    assert w.recent_p99_s(1000.0) == (0.0, 0, 0.0)
    feed(w, 0.001, 50, 1000.0)
    p99, n, worst = w.recent_p99_s(1000.5)
    assert (p99, n, worst) == (0.001, 50, 0.001)


def test_p99_nearest_rank():
    assert p99_nearest_rank([]) == 0.0
    assert p99_nearest_rank([3.0]) == 3.0
    assert p99_nearest_rank(list(range(1, 101))) == 99
    assert p99_nearest_rank(list(range(1, 201))) == 198


def test_observe_release_feeds_histogram_max_and_watch(caplog):
    """The bridge's one call per release: histogram, worst lateness, warning window (no server loop needed)."""
    from kernelsight.engine_args import create_engine_config
    from kernelsight.server.engine.bridge import EngineBridge
    from kernelsight.server.integrations.metrics import ServerMetrics
    from kernelsight.server.model.tokenizer import load_tokenizer
    from kernelsight.simcore.engine_config import EngineArgs

    caplog.set_level(logging.WARNING, logger="kernelsight.server")
    cfg = create_engine_config(EngineArgs(model=MODEL, hardware="h100", max_model_len=2048))
    metrics = ServerMetrics("m", 1, 2048, [{}])
    bridge = EngineBridge(cfg, load_tokenizer(MODEL, None, cfg.model.vocab_size), metrics.engines[0],
                          lateness_warn_s=0.1)
    for i in range(20):
        bridge.observe_release(0.3 if i >= 10 else 0.0001, 50.0 + i * 0.01)
    h = families(metrics.render().decode())[HIST]
    (count,) = hist_samples(h, "_count")
    (total,) = hist_samples(h, "_sum")
    assert count.value == 20 and total.value == pytest.approx(10 * 0.3 + 10 * 0.0001)
    buckets = {float(s.labels["le"]): s.value for s in hist_samples(h, "_bucket")}
    assert buckets[0.0005] == 10 and buckets[0.2] == 10 and buckets[0.5] == 20
    assert bridge.late_s_max == 0.3
    assert bridge.lateness.warnings == 1
    # the engine is idle and everything released: no clock lag
    assert bridge.virtual_clock_lag_s() == 0.0


def test_flag_reaches_the_bridge():
    ns = serve_parser().parse_args(["--lateness-warn-ms", "120"])
    assert server_options_from(ns).lateness_warn_ms == 120.0
    assert server_options_from(serve_parser().parse_args([])).lateness_warn_ms == 50.0
    srv = ServerThread([*ARGS, "--lateness-warn-ms", "0", "--data-parallel-size", "2"])   # built, not started
    assert [b.lateness.warn_s for b in srv.state.bridges] == [0.0, 0.0]
    assert [b.lateness.engine for b in srv.state.bridges] == ["0", "1"]


# -- bench's summary -----------------------------------------------------------------------------------------
def _exposition(per_engine: list[tuple[dict[str, float], float, float, float]]) -> str:
    """A /metrics text with the lateness series of several engines: (cumulative buckets, count, sum, lag)."""
    lines = ["# HELP vllm:num_requests_running x", 'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
             f"# TYPE {HIST} histogram"]
    for e, (buckets, count, total, lag) in enumerate(per_engine):
        for le, c in buckets.items():
            lines.append(f'{HIST}_bucket{{engine="{e}",le="{le}",model_name="m"}} {c}')
        lines.append(f'{HIST}_count{{engine="{e}",model_name="m"}} {count}')
        lines.append(f'{HIST}_sum{{engine="{e}",model_name="m"}} {total}')
        lines.append(f'{HIST}_created{{engine="{e}",model_name="m"}} 1.7e9')
        lines.append(f'{LAG}{{engine="{e}",model_name="m"}} {lag}')
    return "\n".join(lines) + "\n"


def test_bench_lateness_summary_from_two_scrapes():
    before = parse_lateness(_exposition([({"0.001": 2, "0.01": 3, "0.1": 3, "+Inf": 3}, 3, 0.006, 0.0)]))
    # after the run, two engines (summed): the run added 10 / 50 / 40 / 0 releases to the four buckets
    after = parse_lateness(_exposition([({"0.001": 7, "0.01": 33, "0.1": 53, "+Inf": 53}, 53, 1.0, 0.0),
                                        ({"0.001": 5, "0.01": 30, "0.1": 50, "+Inf": 50}, 50, 1.206, 0.25)]))
    assert before is not None and after is not None
    assert after.buckets == {0.001: 12, 0.01: 63, 0.1: 103, math.inf: 103} and after.clock_lag_s == 0.25
    s = lateness_summary(before, after, lag_max_s=0.1)
    # by hand: delta cumulative = {1 ms: 10, 10 ms: 60, 100 ms: 100, +Inf: 100}, 100 releases, 2.2 s in all
    # p50: rank 50 in (1, 10] ms holding 50: 1 + 9 · (50 − 10) / 50 = 8.2 ms
    # p99: rank 99 in (10, 100] ms holding 40: 10 + 90 · (99 − 60) / 40 = 97.75 ms
    assert s == {"releases": 100, "mean_ms": pytest.approx(22.0), "p50_ms": pytest.approx(8.2),
                 "p99_ms": pytest.approx(97.75), "max_ms_at_most": 100.0, "virtual_clock_lag_ms_max": 250.0}
    line = format_lateness(s)
    assert "p50 8.20 ms, p99 97.75 ms, max <= 100 ms" in line and "100 step releases" in line
    assert "did not follow the simulated GPU" in line            # p99 beyond 50 ms is flagged


def test_bench_lateness_beyond_last_bucket_and_quiet_run():
    b0 = {"0.5": 0, "120.0": 0, "+Inf": 0}
    before = parse_lateness(_exposition([(b0, 0, 0.0, 0.0)]))
    after = parse_lateness(_exposition([({"0.5": 98, "120.0": 98, "+Inf": 100}, 100, 400.0, 90.0)]))
    s = lateness_summary(before, after)
    assert s["max_ms_at_most"] is None and s["p99_ms"] == 120_000.0 and s["virtual_clock_lag_ms_max"] == 90_000.0
    assert "max > 120 s" in format_lateness(s)
    quiet = lateness_summary(before, before)
    assert quiet == {"releases": 0, "mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms_at_most": 0.0,
                     "virtual_clock_lag_ms_max": 0.0}
    assert "did not follow" not in format_lateness(quiet)


def test_bench_lateness_absent_against_vllm():
    vllm_text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
                 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0\n')
    assert parse_lateness(vllm_text) is None
    assert lateness_summary(None, None) is None
    assert histogram_quantile(0.5, {}) == 0.0
