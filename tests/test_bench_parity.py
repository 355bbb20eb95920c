"""``kernelsight bench`` against ``kernelsight serve`` (in-process) vs ``kernelsight simulate``: same workload and
seed, same numbers; plus the bench command's result JSON, chat endpoint, /metrics scraping and plot."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from kernelsight.cli import main  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

# A100 with 2k-token prompts at 8 req/s (busy: TTFT ≈ 0.7 s, TPOT ≈ 58 ms) of simulated time, so the few ms
# the HTTP round trip really costs (×time scale) stay well inside the tolerance while the run takes ~6 s.
ENGINE = ["--hardware", "a100", "--max-model-len", "4096"]
WORKLOAD = ["--num-prompts", "60", "--request-rate", "8", "--random-input-len", "2048", "--random-output-len", "64",
            "--random-range-ratio", "0.5", "--seed", "11", "--percentile-metrics", "ttft,tpot,itl,e2el"]
TIME_SCALE = 2.0


def test_bench_vs_simulate_parity(tmp_path, capsys):
    sim_json, bench_json = tmp_path / "sim.json", tmp_path / "bench.json"
    assert main(["simulate", *ENGINE, *WORKLOAD, "--result-json", str(sim_json)]) == 0
    with ServerThread([*ENGINE, "--time-scale", str(TIME_SCALE)]) as srv:
        assert main(["bench", "--base-url", srv.base_url, "--time-scale", str(TIME_SCALE), *WORKLOAD,
                     "--result-json", str(bench_json)]) == 0
    sim, bench = json.loads(sim_json.read_text()), json.loads(bench_json.read_text())
    out = capsys.readouterr().out
    assert bench["completed"] == sim["completed"] == 60 and bench["failed"] == 0
    assert bench["total_input_tokens"] == sim["total_input_tokens"]
    assert bench["total_output_tokens"] == sim["total_output_tokens"]
    report = {k: (sim[k], bench[k]) for k in ("mean_ttft_ms", "mean_tpot_ms", "request_throughput")}
    print(report)
    assert bench["mean_ttft_ms"] == pytest.approx(sim["mean_ttft_ms"], rel=0.03), (report, out)
    assert bench["mean_tpot_ms"] == pytest.approx(sim["mean_tpot_ms"], rel=0.03), (report, out)
    assert bench["request_throughput"] == pytest.approx(sim["request_throughput"], rel=0.01), (report, out)


def test_bench_chat_scrape_plot_and_result_keys(tmp_path, capsys):
    res, plot = tmp_path / "r.json", tmp_path / "p.html"
    with ServerThread(["--max-model-len", "2048", "--time-scale", "4"]) as srv:
        rc = main(["bench", "--base-url", srv.base_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "12",
                   "--random-input-len", "64", "--random-output-len", "12", "--request-rate", "20", "--max-concurrency",
                   "4", "--time-scale", "4", "--goodput", "ttft:1000", "--scrape-metrics", "0.05", "--save-detailed",
                   "--metric-percentiles", "50,99.9", "--result-json", str(res), "--plot", str(plot)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms)" in text and "µs per SSE message" in text
    r = json.loads(res.read_text())
    keys = list(r)
    # spec §7.5 order: header, totals, per-request arrays, peaks, (our extras), statistics
    expected = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
                "latencies", "start_times", "queue_times", "generated_texts", "errors", "max_output_tokens_per_s",
                "max_concurrent_requests", "rtfx"]
    assert keys[:len(expected)] == expected
    assert r["backend"] == "openai-chat" and r["completed"] == 12 and r["max_concurrency"] == 4
    assert r["output_lens"] == [12] * 12 and all(len(x) == 11 for x in r["itls"])
    assert r["request_goodput"] is not None
    assert "p99.9_ttft_ms" in r and "p50_itl_ms" in r and "mean_e2el_ms" not in r   # vLLM's default metrics
    assert keys.index("rtfx") < keys.index("client") < keys.index("mean_ttft_ms")
    sm = r["server_metrics"]
    assert len(sm["time_s"]) >= 3 and max(sm["running"]) >= 1 and max(sm["running"]) <= 4
    assert max(sm["kv_cache_usage"]) > 0
    # kernelsight serve's release lateness over the run (wall ms; its values depend on the machine's load)
    lat = r["server_lateness"]
    assert lat["releases"] > 0 and 0 <= lat["p50_ms"] <= lat["p99_ms"] and lat["virtual_clock_lag_ms_max"] >= 0
    assert "Server release lateness (wall): p50" in text
    page = plot.read_text()
    assert page.count('class="plotly-graph-div"') >= 6 and "TTFT CDF" in page and "KV-cache usage" in page
    assert not re.search(r"<script[^>]*\bsrc=", page) and "<link" not in page    # self-contained: nothing fetched


def test_bench_unreachable_server_one_line_error(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach" in err[0]


# Multi-turn sessions: 8 sessions of 3 turns (1024 new tokens, 32 answer tokens each), 4 open at once, a 200 ms think
# time, on the busy A100 above: the completions path builds the very prompts simulate builds (token ids, the answer's
# ids from return_token_ids), so the hits are equal turn by turn and the TTFTs within the HTTP round trip.
SESSIONS = ["--num-sessions", "8", "--session-concurrency", "4", "--session-turns-mean", "3",
            "--session-turn-delay-mean", "200", "--random-input-len", "1024", "--random-output-len", "32",
            "--seed", "5"]


@pytest.mark.slow      # ~7 s: three runs of 24 turns
def test_multi_turn_bench_vs_simulate_parity(tmp_path, capsys):
    sim_json, bench_json, chat_json = tmp_path / "sim.json", tmp_path / "bench.json", tmp_path / "chat.json"
    assert main(["simulate", *ENGINE, *SESSIONS, "--result-json", str(sim_json)]) == 0
    with ServerThread([*ENGINE, "--time-scale", str(TIME_SCALE), "--enable-prompt-tokens-details"]) as srv:
        assert main(["bench", "--base-url", srv.base_url, "--time-scale", str(TIME_SCALE), *SESSIONS,
                     "--result-json", str(bench_json)]) == 0
        assert main(["bench", "--base-url", srv.base_url, "--time-scale", str(TIME_SCALE), *SESSIONS,
                     "--endpoint", "/v1/chat/completions", "--save-detailed", "--result-json", str(chat_json)]) == 0
    out = capsys.readouterr().out
    sim, bench, chat = (json.loads(p.read_text()) for p in (sim_json, bench_json, chat_json))
    # the same report, keys and structure
    for key in ("prefix_cache", "sessions", "turns"):
        assert key in sim and key in bench and key in chat
    assert [list(t) for t in sim["turns"]] == [list(t) for t in bench["turns"]]
    assert bench["completed"] == sim["completed"] == 24 and bench["failed"] == 0
    assert bench["total_input_tokens"] == sim["total_input_tokens"]
    assert bench["total_output_tokens"] == sim["total_output_tokens"]
    assert bench["sessions"]["max_open_sessions"] == sim["sessions"]["max_open_sessions"] == 4
    for s, b in zip(sim["turns"], bench["turns"], strict=True):
        assert (b["cached_tokens"], b["mean_prompt_tokens"]) == (s["cached_tokens"], s["mean_prompt_tokens"]), out
        # each request's HTTP and JSON (×2 at this time scale; up to ~15 ms of wall on a loaded 2-core box) against
        # TTFTs of 150-250 ms; and the 4 sessions that start together reach the server a few ms apart, so the first
        # may start a step alone (simulate batches all 4). Without the cache hits turn 3 takes 2.6x as long
        assert b["mean_ttft_ms"] == pytest.approx(s["mean_ttft_ms"], rel=0.1, abs=40), (sim["turns"], bench["turns"])
    hits = [t["hit_rate"] for t in sim["turns"]]
    assert hits[0] == 0 and hits[1] < hits[2]
    # chat: the history goes back as messages (the answers as the server wrote them); the template re-renders them,
    # so the hits still grow with the turn
    chat_hits = [t["hit_rate"] for t in chat["turns"]]
    assert chat_hits[1] > 0.4 and chat_hits[2] > chat_hits[1]
    assert chat["input_lens"] and chat["turns"][2]["mean_prompt_tokens"] > chat["turns"][1]["mean_prompt_tokens"] \
        + 1024 + 32
