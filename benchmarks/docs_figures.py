"""The documentation's figures, as PNG under ``docs/images/`` (``pip install -e '.[figures]'`` for matplotlib).

- ``validate-<run>.png`` for each validated run (the shared e2e runs, else the one in ``examples/``): what
  ``kernelsight validate RUN --plot`` shows — measured vs simulated TTFT / TPOT / E2EL CDFs, and the timeseries
  (output tokens/s, running, waiting, KV-cache %) on the run's ticks — from the same functions.
- ``plan-report.png``: the capacity-planning example of ``docs/planning.md`` (``kernelsight plan`` on the trace in
  ``examples/``): cost vs goodput of every simulated point with the Pareto front, and the latency-vs-load curves
  of the chosen deployment and its neighbours on the front (what ``--report-html`` draws).

    python benchmarks/docs_figures.py              # every figure
    python benchmarks/docs_figures.py --only plan  # one of: validate, plan

Deterministic inputs (fixed seeds), so a re-run draws the same figures unless the simulator changed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import ROOT, SHARED_DATA

IMAGES = ROOT / "docs" / "images"
EXAMPLES = ROOT / "examples"
TRACE = EXAMPLES / "sharegpt-llama-3.1-8b-300-sps10.jsonl.gz"
#: The runs `benchmarks/accuracy_bands.py` validates, with the GPU it names where meta.json's device is ambiguous.
RUNS = {"llmservingsim_rtx4090_llama31_8b": None, "llmservingsim_rtxpro6000_llama31_8b": "rtx-pro-6000"}
#: The planning example of docs/planning.md, with the search cached in a temporary directory.
PLAN_ARGS = ["--model", "meta-llama/Llama-3.1-70B", "--dataset-name", "trace", "--dataset-path", str(TRACE),
             "--num-prompts", "300", "--request-rate", "20", "--slo", "ttft_p99_ms=1000,tpot_p99_ms=60"]
MEASURED, SIMULATED = "#1f77b4", "#d62728"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_dir(name: str) -> Path | None:
    """The shared copy of a run, else the one the project ships in ``examples/``."""
    for base in (SHARED_DATA / "e2e", EXAMPLES):
        if (base / name / "meta.json").exists():
            return base / name
    return None


def validate_figure(run: Path, hardware: str | None, out: Path) -> Path:
    from kernelsight.loadgen.plot import cdf_xy
    from kernelsight.loadgen.validate import (
        measured_tpot_s,
        simulated_tpot_s,
        timeseries_rows,
        token_times_s,
        validate_run,
    )

    v = validate_run(run, hardware=hardware)
    reqs, ok = v.run.requests, [r for r in v.sim.records if r.success]
    measured = {"TTFT": [r.first_token_s - r.queued_s for r in reqs],
                "TPOT": [measured_tpot_s(r) for r in reqs if r.output_toks > 1],
                "E2EL": [r.last_token_s - r.queued_s for r in reqs]}
    simulated = {"TTFT": [r.ttft_s for r in ok], "TPOT": [simulated_tpot_s(r) for r in ok if r.output_len > 1],
                 "E2EL": [r.latency_s for r in ok]}
    _, rows = timeseries_rows(v.run.timeseries, v.run.tick_s, token_times_s(v.sim.records), v.sim.timeline or [],
                              bin_s=v.run.tick_s)
    series = [k.removeprefix("measured_") for k in (rows[0] if rows else {}) if k.startswith("measured_")]
    plt = _plt()
    ncols = max(3, len(series))
    fig, axes = plt.subplots(2, ncols, figsize=(4.2 * ncols, 7.2))
    for ax, name in zip(axes[0], measured, strict=False):
        for label, vals, colour in (("measured", measured[name], MEASURED), ("simulated", simulated[name], SIMULATED)):
            x, y = cdf_xy(1e3 * np.asarray(vals, dtype=float))
            ax.plot(x, y, label=label, color=colour)
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction", ylim=(0, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    for ax in axes[0][len(measured):]:
        ax.axis("off")
    t = [r["t_end_s"] for r in rows]
    for ax, name in zip(axes[1], series, strict=False):
        for side, colour in (("measured", MEASURED), ("simulated", SIMULATED)):
            ax.step(t, [r[f"{side}_{name}"] for r in rows], where="post", label=side, color=colour)
        ax.set(title=name, xlabel="time (s)")
        ax.grid(alpha=0.3)
    for ax in axes[1][len(series):]:
        ax.axis("off")
    r = v.result
    errs = {row["metric"]: row["error_pct"] for row in r["latency"] if row["stat"] == "mean"}
    fig.suptitle(f"kernelsight validate {r['run']}: {r['config']['model']} on {r['config']['hardware']} "
                 f"({r['config']['calibration_tier']} tier); mean error TTFT {errs['ttft']:+.1f}%, "
                 f"TPOT {errs['tpot']:+.1f}%, E2EL {errs['e2el']:+.1f}%")
    fig.tight_layout()
    fig.savefig(out, dpi=80, metadata={"Description": json.dumps(validate_summary(r))})
    plt.close(fig)
    return out


def validate_summary(result: dict[str, Any]) -> dict[str, Any]:
    """What a validate figure shows, stored in the PNG (``tests/test_docs.py`` compares it with today's replay)."""
    errs = {row["metric"]: row["error_pct"] for row in result["latency"] if row["stat"] == "mean"}
    return {"run": result["run"], "tier": result["config"]["calibration_tier"],
            **{f"{m}_mean_error_pct": round(errs[m], 1) for m in ("ttft", "tpot", "e2el")}}


def plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    """What the plan figure shows, stored in the PNG (``tests/test_docs.py`` compares it with the example's run)."""
    c = plan["chosen"]
    return {"chosen": c["label"], "p99_ttft_ms": round(c["p99_ttft_ms"]), "p99_tpot_ms": round(c["p99_tpot_ms"], 1),
            "front": [p["label"] for p in plan["points"] if p["key"] in set(plan["front"])]}


def png_description(path: Path) -> dict[str, Any]:
    """The summary a figure of this script carries (its PNG tEXt chunk 'Description')."""
    data, pos = path.read_bytes(), 8
    while pos < len(data):
        n, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        if kind == b"tEXt":
            key, _, text = data[pos + 8:pos + 8 + n].partition(b"\0")
            if key == b"Description":
                return json.loads(text.decode("latin-1"))
        pos += 12 + n
    raise ValueError(f"{path}: no Description (not drawn by benchmarks/docs_figures.py)")


def plan_result(workdir: Path) -> dict[str, Any]:
    """Run the planning example (as docs/planning.md shows it) and read its --result-json."""
    out = workdir / "plan.json"
    subprocess.run([sys.executable, "-m", "kernelsight.cli", "plan", *PLAN_ARGS, "--result-json", str(out),
                    "--cache-dir", str(workdir / "cache")], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def plan_figure(plan: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 5))
    front = set(plan["front"])
    pts = [p for p in plan["points"] if p.get("cut_short_at_s") is None]
    for meets, marker, label in ((True, "o", "meets the SLO"), (False, "x", "fails the SLO")):
        sel = [p for p in pts if bool(p["meets_slo"]) is meets]
        ax0.scatter([p["usd_per_mtok"] for p in sel], [p["goodput_rps"] for p in sel], marker=marker, label=label,
                    alpha=0.6)
    fr = sorted((p for p in plan["points"] if p["key"] in front), key=lambda p: p["usd_per_mtok"])
    ax0.plot([p["usd_per_mtok"] for p in fr], [p["goodput_rps"] for p in fr], "k--", label="Pareto front")
    for p in fr:
        ax0.annotate(p["label"], (p["usd_per_mtok"], p["goodput_rps"]), fontsize=8, xytext=(4, -10),
                     textcoords="offset points")
    ax0.set(title=f"cost vs goodput at {plan['request_rate']:g} req/s", xlabel="USD per million tokens",
            ylabel="goodput (req/s)")
    ax0.grid(alpha=0.3)
    ax0.legend(fontsize=8)
    slo = plan["goodput_slos_ms"]
    for ax, key, limit, title in ((ax1, "p99_ttft_ms", slo.get("ttft"), "p99 TTFT"),
                                  (ax2, "p99_tpot_ms", slo.get("tpot"), "p99 TPOT")):
        for label, curve in plan["curves"].items():
            curve = sorted(curve, key=lambda p: p["request_rate"])
            ax.plot([p["request_rate"] for p in curve], [p[key] for p in curve], "o-", label=label)
        if limit:
            ax.axhline(limit, color="k", ls=":", label="SLO")
        ax.set(title=f"{title} vs load", xlabel="request rate (req/s)", ylabel=f"{title} (ms)", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    c = plan["chosen"]
    fig.suptitle(f"kernelsight plan {plan['model']}, SLO {plan['slo']}: cheapest meeting it {c['label']} "
                 f"(p99 TTFT {c['p99_ttft_ms']:.0f} ms, p99 TPOT {c['p99_tpot_ms']:.1f} ms)")
    fig.tight_layout()
    fig.savefig(out, dpi=80, metadata={"Description": json.dumps(plan_summary(plan))})
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("validate", "plan"), default=None)
    ns = ap.parse_args(argv)
    IMAGES.mkdir(parents=True, exist_ok=True)
    if ns.only in (None, "validate"):
        for name, hardware in RUNS.items():
            run = run_dir(name)
            if run is None:
                print(f"skip {name}: not in {SHARED_DATA / 'e2e'} nor in examples/")
                continue
            print(f"wrote {validate_figure(run, hardware, IMAGES / f'validate-{name}.png')}")
    if ns.only in (None, "plan"):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"wrote {plan_figure(plan_result(Path(tmp)), IMAGES / 'plan-report.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
