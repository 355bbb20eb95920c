"""`kernelsight simulate` from the command line: flags, errors, outputs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from kernelsight.cli import build_parser, main


def _simulate_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["simulate"]


def test_help_documents_every_flag(capsys):
    p = _simulate_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = capsys.readouterr().out
    flags = [s for a in p._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) > 35
    for a in p._actions:
        if a.option_strings and a.option_strings[0] != "--help":
            assert a.help, f"{a.option_strings} has no help"
    for flag in flags:
        assert flag in text, flag
    for required in ("--dataset-name", "--request-rate", "--burstiness", "--max-concurrency", "--ignore-eos",
                     "--tensor-parallel-size", "--no-enable-prefix-caching", "--kv-cache-dtype", "--timeline",
                     "--result-json", "--random-range-ratio", "--gpu-memory-utilization"):
        assert required in text


@pytest.mark.parametrize("argv", [
    ["--request-rate", "-1"],
    ["--num-prompts", "0"],
    ["--gpu-memory-utilization", "2"],
    ["--random-range-ratio", "1.5"],
    ["--dataset-name", "nope"],
    ["--model", "no-such-org/no-such-model"],
    ["--hardware", "tpu-v9"],
    ["--dataset-name", "trace", "--dataset-path", "/nonexistent.jsonl"],
    ["--model", "deepseek-ai/DeepSeek-V3"],
    ["--hardware", "4090"],          # Llama-3.1-8B's 128k context does not fit a 4090's KV cache
])
def test_bad_values_get_one_line_errors(argv):
    proc = subprocess.run([sys.executable, "-m", "kernelsight.cli", "simulate", *argv, "--num-prompts", "2"]
                          if "--num-prompts" not in argv else [sys.executable, "-m", "kernelsight.cli", "simulate",
                                                               *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "error" in lines[0]


def test_a_file_that_is_no_calibration_gets_a_one_line_error(tmp_path):
    """--calibration with a missing file, a file that is not JSON, or JSON that is not a calibration: one line
    naming the file, exit 2, no traceback (a JSON object without the keys used to end in a KeyError)."""
    not_json = tmp_path / "gemm.csv"
    not_json.write_text("dtype,m,n,k\nbf16,1,64,64\n")
    other_json = tmp_path / "meta.json"
    other_json.write_text('{"model": "meta-llama/Llama-3.1-8B"}')
    bad_form = tmp_path / "calib.json"
    bad_form.write_text('{"hardware": "h100-sxm", "tier": "x", "eta": {"gemm": {"form": "nope"}}, "overhead_s": {}}')
    cases = {tmp_path / "none.json": "not found", not_json: "not JSON", other_json: "no 'hardware' entry",
             bad_form: "unknown η model form 'nope'"}
    for path, says in cases.items():
        proc = subprocess.run([sys.executable, "-m", "kernelsight.cli", "simulate", "--calibration", str(path),
                               "--num-prompts", "2"], capture_output=True, text=True, timeout=60)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
        assert str(path) in lines[0] and says in lines[0]


def test_unknown_model_error_lists_bundled_ids(capsys):
    assert main(["simulate", "--model", "acme/unknown", "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "meta-llama/Llama-3.1-8B" in err and "Qwen/Qwen3-8B" in err


def test_ray_address_is_refused_where_there_are_no_replicas_to_spread(capsys):
    """--ray-address spreads --replicas engines: with one engine, --pd or sessions it is one line, before Ray is
    imported or a cluster joined."""
    had_ray = "ray" in sys.modules          # a slow test of the same session may have imported it
    for extra in ([], ["--pd", "1P1D"], ["--replicas", "2", "--num-sessions", "2"]):
        assert main(["simulate", "--ray-address", "local", "--num-prompts", "2", *extra]) == 2
        err = capsys.readouterr().err
        assert "--ray-address spreads the engines of --replicas N" in err and len(err.strip().splitlines()) == 1
    assert had_ray or "ray" not in sys.modules


def test_trace_replay_writes_result_and_timeline(tmp_path, shared_data, capsys):
    out = tmp_path / "r.json"
    tl = tmp_path / "t.csv"
    rc = main(["simulate", "--dataset-name", "trace", "--dataset-path",
               str(shared_data / "e2e/sharegpt-llama-3.1-8b-300-sps10.jsonl.gz"), "--num-prompts", "40",
               "--hardware", "4090", "--max-model-len", "32768", "--max-num-seqs", "256",
               "--max-num-batched-tokens", "2048", "--result-json", str(out), "--timeline", str(tl)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Simulated Serving Benchmark Result" in text and "Mean TTFT (ms)" in text
    result = json.loads(out.read_text())
    for key in ("completed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
                "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
                "total_input_tokens", "total_output_tokens"):
        assert key in result, key
    assert result["completed"] == 40
    assert 2400 < result["config"]["num_gpu_blocks"] < 2700
    assert result["config"]["max_num_batched_tokens"] == 2048
    assert result["kernel_time_breakdown"]["gemm"]["seconds"] > 0
    assert sum(v["fraction"] for v in result["kernel_time_breakdown"].values()) == pytest.approx(1.0, abs=1e-3)
    with open(tl) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["time_s", "running", "waiting", "kv_cache_usage", "scheduled_tokens", "step_s"]
    assert len(rows) == result["simulator"]["num_steps"]
    times = [float(r["time_s"]) for r in rows]
    assert times == sorted(times)
    assert all(0 <= float(r["kv_cache_usage"]) <= 1 for r in rows)
    # the trace's output lengths are generated exactly
    from kernelsight.loadgen.datasets import trace_dataset

    expected = trace_dataset(shared_data / "e2e/sharegpt-llama-3.1-8b-300-sps10.jsonl.gz", 40)
    assert result["total_output_tokens"] == sum(s.expected_output_len for s in expected)
    assert result["total_input_tokens"] == sum(s.prompt_len for s in expected)
    assert result["simulator"]["finish_reasons"] == {"length": 40}


def test_same_seed_identical_result_json(tmp_path):
    outs = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.json"
        assert main(["simulate", "--num-prompts", "60", "--request-rate", "15", "--random-input-len", "300",
                     "--random-output-len", "50", "--random-range-ratio", "0.5", "--no-ignore-eos", "--seed", "9",
                     "--max-model-len", "4096", "--result-json", str(path)]) == 0
        r = json.loads(path.read_text())
        for volatile in ("date", "simulator"):
            r.pop(volatile)
        outs.append(r)
    assert outs[0] == outs[1]


def test_bench_help_has_vllm_bench_serve_flags(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    with pytest.raises(SystemExit):
        sub.choices["bench"].parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--base-url", "--endpoint", "--model", "--tokenizer", "--dataset-name", "--dataset-path",
                 "--num-prompts", "--request-rate", "--burstiness", "--max-concurrency", "--random-input-len",
                 "--random-output-len", "--random-range-ratio", "--random-prefix-len", "--prefix-repetition-prefix-len",
                 "--prefix-repetition-suffix-len", "--prefix-repetition-num-prefixes", "--prefix-repetition-output-len",
                 "--ignore-eos", "--seed", "--goodput", "--percentile-metrics", "--metric-percentiles", "--result-json",
                 "--save-detailed", "--plot", "--scrape-metrics", "--time-scale"):
        assert flag in text, flag
    for a in sub.choices["bench"]._actions:
        if a.option_strings and a.option_strings[0] != "--help":
            assert a.help, f"{a.option_strings} has no help"


_WEB_STACK = ("fastapi", "uvicorn", "starlette", "aiohttp")
# a fresh interpreter runs ``main(argv)`` (or builds the subcommand's parser and imports the modules its command runs)
# and prints the web-stack modules it imported
_IMPORT_PROBE = """
import json, sys
from kernelsight.cli import build_parser, main
argv, modules, web = json.loads(sys.argv[1])
if modules:
    import importlib
    build_parser(argv[0])
    for m in modules:
        importlib.import_module(m)
else:
    assert main(argv) == 0
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(web))))
"""


@pytest.mark.parametrize(("argv", "modules"), [
    (["simulate", "--num-prompts", "3", "--random-input-len", "64", "--random-output-len", "4"], []),
    (["plan"], ["kernelsight.plan.cli", "kernelsight.plan.search", "kernelsight.plan.runner", "kernelsight.plan.report",
                "kernelsight.plan.point", "kernelsight.loadgen.workload", "kernelsight.loadgen.tokenizer"]),
    (["validate"], ["kernelsight.loadgen.validate"]),
    (["predict"], ["kernelsight.calibrate.cli"]),
])
def test_the_simulator_commands_never_import_the_web_stack(argv, modules):
    """simulate, plan, validate and predict import only what they use: no FastAPI, uvicorn or aiohttp (~0.3 s of
    start-up that ``serve`` and ``bench`` alone need)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, json.dumps([argv, modules, _WEB_STACK])], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_main_builds_the_named_subcommand_alone_and_every_one_for_help():
    def choices(parser):
        return list(next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices)

    assert choices(build_parser("simulate")) == ["simulate"]
    assert choices(build_parser())[:4] == ["simulate", "validate", "plan", "profiles"]
    assert {"bench", "calibrate", "predict"} <= set(choices(build_parser()))


def test_the_console_entry_runs_a_simulate_without_the_cyclic_gc_and_keeps_it_for_the_rest(monkeypatch):
    """``kernelsight`` (the console script, ``python -m kernelsight``) turns the collector off for a one-shot
    ``simulate`` and freezes its objects at the end; every other command (serve and bench run for hours) keeps it."""
    import gc
    import tomllib
    from pathlib import Path

    import kernelsight.__main__ as entry
    import kernelsight.cli

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kernelsight"] == "kernelsight.__main__:main"
    seen = []
    monkeypatch.setattr(kernelsight.cli, "main", lambda argv: seen.append((argv[0], gc.isenabled())) or 0)
    try:
        assert entry.main(["simulate", "--num-prompts", "3"]) == 0
        assert gc.isenabled() and gc.get_freeze_count() > 0
        gc.unfreeze()
        for cmd in ("serve", "bench", "plan", "profiles"):
            assert entry.main([cmd]) == 0
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen == [("simulate", False), ("serve", True), ("bench", True), ("plan", True), ("profiles", True)]
    out = subprocess.run([sys.executable, "-m", "kernelsight", "simulate", "--num-prompts", "3", "--random-input-len",
                          "32", "--random-output-len", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Successful requests:" in out.stdout
