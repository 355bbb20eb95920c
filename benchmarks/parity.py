"""Parity and client cost: the same workload and seed through ``kernelsight bench`` against ``kernelsight serve``
(a separate process, as in a deployment) and through ``kernelsight simulate``.

Two runs, both 1,000 requests by default:

* ``parity``: A100, 2k-token prompts at 8 req/s (TTFT ≈ 0.7 s, TPOT ≈ 60 ms): mean TTFT and TPOT must agree
  within 3 %, request throughput within 1 %.
* ``client``: H100, 512/128 tokens at 50 req/s: how late the client sends vs its schedule, and its cost per
  streamed chunk (µs). The same comparison is printed for it too; with TTFTs of ~20 ms the few ms the HTTP round
  trip really costs are a visible share of TTFT there, and that is what it measures.

Usage: ``python benchmarks/parity.py [--num-prompts 1000] [--time-scale 1] [--only parity|client]``.
Prints a table and writes ``benchmarks/results/parity.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct_error, write_result  # noqa: E402

from kernelsight.cli import main  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402

RUNS = {
    "parity": {"engine": ["--hardware", "a100", "--max-model-len", "4096"],
               "workload": ["--request-rate", "8", "--random-input-len", "2048", "--random-output-len", "64",
                            "--random-range-ratio", "0.5", "--seed", "11"]},
    "client": {"engine": ["--hardware", "h100", "--max-model-len", "4096"],
               "workload": ["--request-rate", "50", "--random-input-len", "512", "--random-output-len", "128",
                            "--random-range-ratio", "0.25", "--seed", "5"]},
}
COMPARED = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
            "request_throughput", "output_throughput")
TOLERANCE_PCT = {"mean_ttft_ms": 3.0, "mean_tpot_ms": 3.0, "request_throughput": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(engine: list[str], time_scale: float):
    import kernelsight

    port = _free_port()
    # the server must run the same kernelsight as this script (a checkout may shadow an installed copy)
    src = str(Path(kernelsight.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "kernelsight.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--time-scale", str(time_scale), "--uvicorn-log-level", "warning", *engine],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _quiet_main(argv: list[str]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"kernelsight {' '.join(argv[:1])} failed (rc {rc}):\n{out.getvalue()[-2000:]}")


def run_one(name: str, num_prompts: int, time_scale: float, tmp: Path) -> dict:
    cfg = RUNS[name]
    workload = ["--num-prompts", str(num_prompts), *cfg["workload"], "--percentile-metrics", "ttft,tpot,itl,e2el"]
    sim_path, bench_path = tmp / f"{name}-sim.json", tmp / f"{name}-bench.json"
    t = time.perf_counter()
    _quiet_main(["simulate", *cfg["engine"], *workload, "--result-json", str(sim_path)])
    sim_wall = time.perf_counter() - t
    with serve(cfg["engine"], time_scale) as url:
        t = time.perf_counter()
        _quiet_main(["bench", "--base-url", url, "--time-scale", str(time_scale), *workload, "--disable-tqdm",
                     "--result-json", str(bench_path)])
        bench_wall = time.perf_counter() - t
    sim, bench = json.loads(sim_path.read_text()), json.loads(bench_path.read_text())
    metrics = {k: {"simulate": sim[k], "bench": bench[k], "diff_pct": pct_error(bench[k], sim[k])} for k in COMPARED}
    within = {k: abs(metrics[k]["diff_pct"]) <= tol for k, tol in TOLERANCE_PCT.items()}
    return {"engine": cfg["engine"], "workload": workload, "time_scale": time_scale, "completed": bench["completed"],
            "failed": bench["failed"], "metrics": metrics, "within_tolerance": within, "client": bench["client"],
            "simulate_wall_s": round(sim_wall, 2), "bench_wall_s": round(bench_wall, 2)}


def main_(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--time-scale", type=float, default=1.0, help="server --time-scale (bench reports in its seconds)")
    ap.add_argument("--only", choices=tuple(RUNS), default=None)
    ns = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in [ns.only] if ns.only else list(RUNS):
            results[name] = run_one(name, ns.num_prompts, ns.time_scale, Path(d))
    for name, r in results.items():
        print(f"\n{name}: {' '.join(r['engine'])} {' '.join(r['workload'][:10])} (time scale {r['time_scale']}, "
              f"{r['completed']} ok / {r['failed']} failed, bench {r['bench_wall_s']} s wall)")
        rows = [{"metric": k, "simulate": v["simulate"], "bench": v["bench"], "diff %": v["diff_pct"],
                 "tolerance %": TOLERANCE_PCT.get(k)} for k, v in r["metrics"].items()]
        print(format_table(rows, ["metric", "simulate", "bench", "diff %", "tolerance %"]))
        c = r["client"]
        lat = c["send_lateness_ms"]
        print(f"client: send lateness vs schedule mean {lat['mean']:.3f} ms, p50 {lat['p50']:.3f}, p99 {lat['p99']:.3f}"
              f", max {lat['max']:.3f} ms; {c['handle_us_per_sse_message']:.1f} µs per SSE message in the stream "
              f"handler, {c['process_cpu_us_per_sse_message']:.1f} µs of client-process CPU per message "
              f"({c['sse_messages']} messages)")
    path = write_result("parity", {"cpus_note": f"{os.cpu_count()} CPUs, shared with other work while measured",
                                   "runs": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
