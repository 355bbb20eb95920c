"""``kernelsight validate RUN_DIR``: a run in the shared e2e schema is read, replayed and compared.

Synthetic runs check the reading and the measured statistics against values worked out by hand; the shared RTX 4090
run checks the whole command end to end (loosely: accuracy is the benchmarks' business, not a test's)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight.cli import main
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.validate import (
    MeasuredRequest,
    describe_software,
    latency_rows,
    measured_latency_stats_ms,
    overtaken_count,
    phase_rows,
    read_run,
    replay_workload,
    run_software,
    run_summary_rows,
    software_comparison,
    timeseries_rows,
    tpot_spread_rows,
    validate_run,
)
from kernelsight.profiles import load_calibration

# (input, output, queued, first token, last token): TTFT 200/300/100 ms, TPOT 50/50/- ms, E2EL 700/500/100 ms
REQUESTS = [(100, 11, 10.0, 10.2, 10.7), (50, 5, 10.5, 10.8, 11.0), (20, 1, 11.0, 11.1, 11.1)]
META = {"model": "meta-llama/Llama-3.1-8B", "vllm_version": "0.19.0", "tick_seconds": 1.0,
        "engine_kwargs": {"model": "meta-llama/Llama-3.1-8B", "max_num_seqs": 8, "max_num_batched_tokens": 512,
                          "max_model_len": 2048, "seed": 1},
        "hardware": {"device_name": "NVIDIA H100 80GB HBM3"}}
TIMESERIES = "t,prompt_throughput,gen_throughput,running,waiting,kv_cache_pct\n1.0,170,14,2,0,1.5\n2.0,0,3,0,0,0.0\n"


def write_run(root: Path, requests=REQUESTS, meta=META, timeseries=TIMESERIES) -> Path:
    run = root / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "meta.json").write_text(json.dumps(meta))
    (run / "requests.jsonl").write_text("".join(
        json.dumps({"request_id": f"r{i}", "input_toks": a, "output_toks": b, "queued_ts": q, "first_token_ts": f,
                    "last_token_ts": e}) + "\n" for i, (a, b, q, f, e) in enumerate(requests)))
    (run / "timeseries.csv").write_text(timeseries)
    return run


def test_a_run_is_read_and_its_measured_statistics_are_those_worked_out_by_hand(tmp_path):
    run = read_run(write_run(tmp_path))
    assert [(r.request_id, r.input_toks, r.output_toks) for r in run.requests] == \
        [("r0", 100, 11), ("r1", 50, 5), ("r2", 20, 1)]
    assert run.tick_s == 1.0 and list(run.timeseries["gen_throughput"]) == [14.0, 3.0]
    m = measured_latency_stats_ms(run.requests)
    assert m["ttft"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert m["tpot"] == pytest.approx({"mean": 50, "median": 50, "p90": 50, "p99": 50})   # r2 has one token
    assert m["e2el"] == pytest.approx({"mean": 1300 / 3, "median": 500, "p90": 660, "p99": 696})
    # only first and last token times are recorded: of ITL, the mean over every gap, (0.5 + 0.2) s / (10 + 4)
    assert m["itl"]["mean"] == pytest.approx(50) and m["itl"]["p90"] is None
    sim = {k: {s: (None if v is None else 1.1 * v) for s, v in d.items()} for k, d in m.items()}
    rows = latency_rows(m, sim)
    assert len(rows) == 16 and rows[0] == {"metric": "ttft", "stat": "mean", "measured_ms": pytest.approx(200),
                                           "simulated_ms": pytest.approx(220), "error_pct": pytest.approx(10)}
    assert next(r for r in rows if (r["metric"], r["stat"]) == ("itl", "p99"))["error_pct"] is None


def test_without_a_trace_the_requests_themselves_are_replayed_at_their_queue_times(tmp_path):
    samples, arrivals, source = replay_workload(read_run(write_run(tmp_path)))
    assert arrivals == pytest.approx([0.0, 0.5, 1.0]) and "requests.jsonl" in source
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == [(100, 11), (50, 5), (20, 1)]
    assert samples[0].token_array[:16].tolist() != samples[1].token_array[:16].tolist()   # no shared prefix


def test_the_trace_meta_names_is_replayed_and_must_hold_the_same_requests(tmp_path):
    run_dir = write_run(tmp_path, meta={**META, "dataset_path": "workloads/trace.jsonl"})
    # the client meant to send at 0.04 / 0.30 / 1.20 s; the engine queued the requests 0.5 and 1.0 s after the first
    sends_s = (0.04, 0.3, 1.2)
    rows = [{"arrival_time_ns": int(1e9 * t), "input_toks": a, "output_toks": b,
             "input_tok_ids": list(range(1, a + 1))} for (a, b, _, _, _), t in zip(REQUESTS, sends_s, strict=True)]
    with gzip.open(tmp_path / "trace.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    samples, arrivals, source = replay_workload(read_run(run_dir))
    assert source == "trace trace.jsonl.gz at the run's queue times"
    assert arrivals == pytest.approx([0.04, 0.54, 1.04])     # the trace's start, then the run's own queue times
    assert samples[1].prompt_token_ids[:3] == [1, 2, 3]     # the trace's ids: prefixes are shared as measured
    with gzip.open(tmp_path / "trace.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:2])
    with pytest.raises(ValueError, match=r"trace.jsonl.gz: 2 requests, but the run's requests.jsonl has 3"):
        replay_workload(read_run(run_dir))


def test_timeseries_bins_hold_time_averages_of_both_sides():
    measured = {"t": np.array([1.0, 2.0, 3.0, 4.0]), "gen_throughput": np.array([10.0, 20.0, 30.0, 40.0]),
                "running": np.array([1.0, 2.0, 3.0, 4.0]), "kv_cache_pct": np.zeros(4)}
    # (time_s, running, waiting, kv_cache_usage, scheduled_tokens, step_s): 2 running for 1 s, then 4 for 0.5 s
    timeline = [(1.0, 2, 0, 0.5, 10, 1.0), (3.0, 4, 1, 0.25, 10, 0.5)]
    bin_s, rows = timeseries_rows(measured, 1.0, np.array([0.5, 1.5, 2.5, 2.6]), timeline, bin_s=2.0)
    assert bin_s == 2.0 and len(rows) == 2
    assert rows[0] == {"t_start_s": 0.0, "t_end_s": 2.0, "measured_output_tok_s": 15.0,
                       "simulated_output_tok_s": 1.0, "measured_running": 1.5, "simulated_running": 1.0}
    assert rows[1]["measured_output_tok_s"] == 35.0 and rows[1]["simulated_running"] == 1.0
    # a step across a bin boundary counts in each bin for the time it spent there
    _, rows = timeseries_rows(measured, 1.0, np.zeros(0), [(2.5, 2, 0, 0.5, 10, 1.0)], bin_s=2.0)
    assert [r["simulated_running"] for r in rows] == [0.5, 0.5]
    # a KV-cache column at 0 throughout was not recorded: left out rather than compared
    assert not any("kv" in k for k in rows[0])
    _, rows = timeseries_rows(measured, 1.0, np.zeros(0), [], num_bins=3)
    assert [r["t_start_s"] for r in rows] == [0.0, 2.0]       # whole ticks per bin, about num_bins bins
    _, rows = timeseries_rows({"t": np.array([0.0, 1.0]), "running": np.array([2.0, 4.0])}, 1.0, np.zeros(0), [],
                              bin_s=1.0)
    assert len(rows) == 1 and rows[0]["measured_running"] > 0     # a row stamped t = 0 lands in the first bin


@pytest.mark.parametrize(("file", "content", "message"), [
    ("meta.json", None, r"meta.json: not found"),
    ("meta.json", "{not json", r"meta.json: not valid JSON"),
    ("meta.json", "[1, 2]", r"meta.json: expected a JSON object"),
    ("requests.jsonl", "", r"requests.jsonl: no requests"),
    ("requests.jsonl", '{"input_toks": 5}\n', r"requests.jsonl line 1: 'output_toks' must be a number"),
    ("requests.jsonl", '{"input_toks": 5, "output_toks": 2, "queued_ts": 2, "first_token_ts": 1, '
                       '"last_token_ts": 3}\n', r"requests.jsonl line 1: timestamps out of order"),
    ("requests.jsonl", '{"input_toks": 5, "output_toks": 2, "queued_ts": 1, "scheduled_ts": 2.5, '
                       '"first_token_ts": 2, "last_token_ts": 3}\n',
     r"requests.jsonl line 1: 'scheduled_ts' must be a number between queued_ts and first_token_ts, got 2.5"),
    ("requests.jsonl", "{}\n[\n", r"requests.jsonl line 1: 'input_toks' must be a number"),
    ("timeseries.csv", None, r"timeseries.csv: not found"),
    ("timeseries.csv", "x,running\n1,2\n", r"timeseries.csv: no 't' column"),
    ("timeseries.csv", "t,running\n1,2\n2,many\n", r"timeseries.csv line 3: column 'running' is not a number"),
])
def test_a_missing_or_malformed_file_is_a_one_line_error_naming_it(tmp_path, file, content, message):
    run = write_run(tmp_path)
    if content is None:
        (run / file).unlink()
    else:
        (run / file).write_text(content)
    with pytest.raises(ValueError, match=message) as exc:
        read_run(run)
    assert "\n" not in str(exc.value)


def test_the_cli_replays_a_small_run_and_reports_errors_in_one_line(tmp_path, capsys):
    run = write_run(tmp_path)
    out_json = tmp_path / "v.json"
    assert main(["validate", str(run), "--result-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "meta-llama/Llama-3.1-8B on h100" in out and "calibration: target-measured" in out
    result = json.loads(out_json.read_text())
    assert result["simulator"]["finish_reasons"] == {"length": 3}     # outputs have the measured lengths
    assert [r["what"] for r in result["run_summary"]] == ["duration_s", "output_tok_s", "completed",
                                                          "first_token_before_earlier_arrival"]
    assert main(["validate", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().endswith("nope: not a directory")
    meta = {k: v for k, v in META.items() if k != "hardware"}
    (run / "meta.json").write_text(json.dumps(meta))
    assert main(["validate", str(run)]) == 2
    assert "meta.json: records no GPU (hardware.device_name): pass --hardware" in capsys.readouterr().err


def test_the_shared_rtx4090_run_replays_end_to_end_and_deterministically(shared_data, tmp_path, capsys):
    run = shared_data / "e2e" / "llmservingsim_rtx4090_llama31_8b"
    a, b, page = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "v.html"
    assert main(["validate", str(run), "--seed", "7", "--result-json", str(a), "--plot", str(page)]) == 0
    out = capsys.readouterr().out
    for heading in ("latency (ms", "timeseries (", "simulated step time by kernel family", "rtx-4090",
                    "the measured work priced by the step model", "least-squares split"):
        assert heading in out
    result = json.loads(a.read_text())
    assert result["num_requests"] == 300 and result["config"]["seed"] == 7
    means = {r["metric"]: r for r in result["latency"] if r["stat"] == "mean"}
    for metric in ("ttft", "tpot", "itl", "e2el"):     # physically sensible, not an accuracy claim
        assert abs(means[metric]["error_pct"]) < 50, means[metric]
    assert 5 <= len(result["timeseries"]["rows"]) <= 20
    assert {"measured_kv_cache_pct", "simulated_running"} <= set(result["timeseries"]["rows"][0])
    assert {r["family"] for r in result["breakdown"]} >= {"gemm", "attn_decode"}
    # vLLM served the prompts first come, first served, and so does the replay, preemptions and all
    order = next(r for r in result["run_summary"] if r["what"] == "first_token_before_earlier_arrival")
    assert (order["measured"], order["simulated"]) == (0, 0) and result["simulator"]["num_preemptions"] > 0
    busy = result["work_pricing"]["groups"][0]
    assert busy["ticks"] == "busy, all" and busy["count"] >= 100 and 0.5 < busy["median"] < 2
    html = page.read_text()
    assert html.count('class="plotly-graph-div"') == 7               # 3 CDFs + 4 timeseries
    assert html.count("window.PlotlyConfig") == 1 and "<link" not in html   # plotly.js inlined once
    assert main(["validate", str(run), "--seed", "7", "--result-json", str(b)]) == 0
    assert a.read_text() == b.read_text()


def test_validate_run_takes_the_gpu_from_the_flag_when_meta_has_none(shared_data):
    run = shared_data / "e2e" / "llmservingsim_rtxpro6000_llama31_8b"
    with pytest.raises(ValueError, match="meta.json: records no GPU"):
        validate_run(run)


def test_requests_are_compared_with_their_own_replays_grouped_by_when_their_first_token_came():
    # queued in index order; request 1 waits long, so its first token comes after requests 2 and 3's
    first = [0.1, 3.0, 1.0, 2.0]
    measured = [MeasuredRequest(f"r{i}", 100, 11, queued_s=0.01 * i, first_token_s=f, last_token_s=f + 0.5)
                for i, f in enumerate(first)]
    # the replay, in queue order: TTFT 20 ms longer each, TPOT 10% longer for requests 1 and 3 (the late pair)
    scale = [1.0, 1.1, 1.0, 1.1]
    records = [RequestRecord(True, 100, 11, ttft_s=m.first_token_s - m.queued_s + 0.02, itl_s=[],
                             latency_s=m.first_token_s - m.queued_s + 0.02 + 0.5 * k)
               for m, k in zip(measured, scale, strict=True)]
    rows = phase_rows(list(reversed(measured)), records, num_groups=2)     # the file order does not matter
    assert [r["requests"] for r in rows] == [2, 2] and [r["first_token_s"] for r in rows] == ["0.1-1.0", "2.0-3.0"]
    assert [r["tpot_measured_ms"] for r in rows] == pytest.approx([50, 50])
    assert [r["tpot_error_pct"] for r in rows] == pytest.approx([0, 10])
    early_ttft_ms = np.mean([100, 1000 - 20])
    assert rows[0]["ttft_measured_ms"] == pytest.approx(early_ttft_ms)
    assert rows[0]["ttft_simulated_ms"] == pytest.approx(early_ttft_ms + 20)
    # a request the replay did not finish, or of one token, is left out; a replay of other requests gives nothing
    records[0] = RequestRecord(False, 100, 0, 0.0, [], 0.0, error="request did not finish")
    assert sum(r["requests"] for r in phase_rows(measured, records, num_groups=2)) == 3
    assert phase_rows(measured, records[:3]) == []


def test_the_tpot_spread_is_each_sides_own_shape_whatever_the_step_costs():
    # measured TPOTs 10 / 20 (x8) / 40 ms; the replay's are the same shape 10% slower: the spread agrees
    tpots = [0.01] + [0.02] * 8 + [0.04]
    measured = [MeasuredRequest(f"r{i}", 10, 11, 0.0, 1.0, 1.0 + 10 * t) for i, t in enumerate(tpots)]
    records = [RequestRecord(True, 10, 11, ttft_s=1.0, itl_s=[], latency_s=1.0 + 11 * t) for t in tpots]
    rows = {r["what"]: (r["measured"], r["simulated"]) for r in tpot_spread_rows(measured, records)}
    assert rows["max / median"] == pytest.approx((2.0, 2.0))
    assert rows["p10 / median"] == pytest.approx((0.95, 0.95))      # between 0.5 and 1.0, as numpy interpolates
    assert rows["requests >= 1.5x median"] == (1, 1)
    # a replay whose one slow request stalled less shows it, whatever its median
    records[-1] = RequestRecord(True, 10, 11, ttft_s=1.0, itl_s=[], latency_s=1.0 + 11 * 0.025)
    rows = {r["what"]: (r["measured"], r["simulated"]) for r in tpot_spread_rows(measured, records)}
    assert rows["max / median"] == pytest.approx((2.0, 1.25)) and rows["requests >= 1.5x median"] == (1, 0)
    assert tpot_spread_rows(measured, []) == []


def test_the_report_says_when_the_run_served_other_software_than_the_calibration_was_timed_under(tmp_path, capsys):
    """The run's vLLM (and torch, CUDA where meta.json records them) against the calibration's record: a kernel
    library picks its kernels per release, so the report says which components differ."""
    cal = {"vllm": "0.14.0 / 0.24.0", "nccl": "2.27.3"}
    assert run_software({**META, "hardware": {"torch_version": "2.10.0+cu128", "cuda_version": "12.8"}}) == {
        "vllm": "0.19.0", "torch": "2.10.0+cu128", "cuda": "12.8"}
    assert run_software({"vllm_version": None, "hardware": "not a mapping"}) == {}
    assert software_comparison(cal, {"vllm": "0.19.0", "torch": "2.10.0"})["differs"] == ["vllm"]
    assert software_comparison(cal, {"vllm": "0.24.0"})["differs"] == []        # one of the sources' versions
    assert software_comparison({"vllm": "0.24.0", "torch": "2.9.0"},
                               {"vllm": "0.19.0", "torch": "2.10.0"})["differs"] == ["vllm", "torch"]
    assert describe_software(software_comparison({}, {})) is None
    same = describe_software(software_comparison({"vllm": "0.24.0"}, {"vllm": "0.24.0"}))
    assert same == ("kernel software: the calibration's kernels timed under vLLM 0.24.0; the run served under "
                    "vLLM 0.24.0")
    # end to end: the bundled H100 calibration's record against the run's meta.json
    run = write_run(tmp_path)
    out_json = tmp_path / "v.json"
    assert main(["validate", str(run), "--result-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    bundled = load_calibration("h100-sxm").software
    assert result["software"] == {"calibration": bundled, "run": {"vllm": "0.19.0"},
                                  "differs": [] if "0.19.0" in bundled["vllm"].split(" / ") else ["vllm"]}
    assert out.splitlines()[2].startswith("kernel software: the calibration's kernels timed under vLLM "
                                          f"{bundled['vllm']}")
    assert ("vLLM differs: kernel libraries choose their kernels per release" in out) == bool(
        result["software"]["differs"])


def test_requests_served_before_an_earlier_arrival_are_counted_on_each_side():
    """First come, first served gives 0; a request whose first token beats one that arrived before it counts once,
    however many it beats; requests that arrived together do not overtake each other."""
    assert overtaken_count([0.0, 1.0, 2.0], [0.5, 1.5, 2.5]) == 0
    assert overtaken_count([0.0, 1.0, 2.0, 3.0], [5.0, 1.5, 2.5, 6.0]) == 2     # 1 and 2 beat request 0
    assert overtaken_count([1.0, 1.0, 0.0], [3.0, 2.0, 1.0]) == 0                # a tie in arrival is no overtake
    assert overtaken_count([1.0, 1.0, 0.0], [3.0, 2.0, 2.5]) == 1                # ... but beating an earlier one is
    assert overtaken_count([], []) == 0
    rows = {r["what"]: r for r in run_summary_rows(
        [MeasuredRequest(f"r{i}", 10, 5, q, f, f + 1.0) for i, (q, f) in enumerate([(0.0, 3.0), (1.0, 2.0)])],
        [RequestRecord(True, 10, 5, ttft_s=0.5, itl_s=[], latency_s=1.0, start_s=s) for s in (0.0, 1.0)])}
    row = rows["first_token_before_earlier_arrival"]
    assert (row["measured"], row["simulated"]) == (1, 0)
