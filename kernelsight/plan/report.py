"""What ``kernelsight plan`` shows: a text summary, JSON, CSV, and an HTML page drawn with plotly (one
self-contained file with plotly.js inlined, so it opens offline: the Pareto plot, latency-vs-load curves of the
front, and the chosen deployment's timeline)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from kernelsight.loadgen.report import format_table
from kernelsight.plan.search import PlanResult

__all__ = ["format_plan", "write_json", "write_csv", "write_html", "plan_json"]

CSV_COLUMNS = ("label", "hardware", "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel",
               "replicas", "pd", "num_gpus", "quantization", "kv_cache_dtype", "speculative_config",
               "max_num_seqs", "max_num_batched_tokens", "request_rate", "meets_slo", "goodput_rps",
               "throughput_rps", "usd_per_hour", "gpu_hours_per_mtok", "usd_per_mtok", "p50_ttft_ms", "p99_ttft_ms",
               "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "failed_requests", "cut_short_at_s", "why")


def _row(p: dict[str, Any]) -> dict[str, Any]:
    return {"deployment": p["label"], "GPUs": p["num_gpus"], "$/h": round(p["usd_per_hour"], 2),
            "$/Mtok": round(p["usd_per_mtok"], 3), "goodput": round(p["goodput_rps"], 2),
            "p99 TTFT": round(p["p99_ttft_ms"]), "p99 TPOT": round(p["p99_tpot_ms"], 1),
            "SLO": "meets" if p["meets_slo"] else "fails"}


def format_plan(r: PlanResult, *, model: str, simulate_command: str) -> str:
    load = (f"offered load {r.offered_tokens_per_s:,.0f} tokens/s (input + output); cost = GPUs × price ÷ that rate"
            if r.offered_tokens_per_s > 0 else
            "closed loop (no request rate); cost = GPUs × price ÷ the tokens/s each deployment served")
    lines = [f"kernelsight plan: {model} at {r.request_rate:g} req/s, SLO {r.slo.text()}",
             f"  {load}; prices: {r.prices.source}, {r.prices.as_of}"]
    s = r.summary()
    lines.append(f"  search space {s['space_points']} points: simulated {s['simulated']}, from cache "
                 f"{s['cache_hits']}, pruned {s['pruned']} ({s['wall_s']:.1f} s)")
    if s["stopped_early"] or s["rerun_in_full"]:
        lines.append(f"    cut short {s['stopped_early']:3d}  failing for certain and below a no-costlier point's "
                     f"goodput (re-run in full: {s['rerun_in_full']})")
    for reason, n in sorted(r.pruned.items(), key=lambda kv: -kv[1]):
        lines.append(f"    pruned {n:5d}  {reason}")
    lines.append("")
    lines.append("Pareto front (cost vs goodput at the requested load):")
    lines.append(format_table([_row(p) for p in r.front], list(_row(r.front[0]))) if r.front else "  (empty)")
    failing = [p for p in r.front if not p["meets_slo"]]
    if failing:
        lines.append("Why each front point fails:")
        lines += [f"  {p['label']}: {p['why']}" for p in failing]
    lines.append("")
    if r.chosen is None:
        lines.append("No deployment in the search space meets the SLO at this load.")
    else:
        c = r.chosen
        lines.append(f"Cheapest deployment meeting the SLO: {c['label']} ({c['num_gpus']} GPUs, "
                     f"${c['usd_per_hour']:.2f}/h, ${c['usd_per_mtok']:.3f} per million tokens, "
                     f"{c['gpu_hours_per_mtok']:.4f} GPU-h/Mtok): p99 TTFT {c['p99_ttft_ms']:.0f} ms, "
                     f"p99 TPOT {c['p99_tpot_ms']:.1f} ms, goodput {c['goodput_rps']:.2f} req/s")
        lines.append(f"  re-run it: {simulate_command}")
    return "\n".join(lines)


def plan_json(r: PlanResult, *, model: str, simulate_command: str) -> dict[str, Any]:
    def slim(p: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in p.items() if k != "engine_args"} | {"engine_args": p["engine_args"]}

    return {"model": model, "request_rate": r.request_rate, "slo": r.slo.text(),
            "goodput_slos_ms": r.slo.goodput_ms(), "offered_tokens_per_s": r.offered_tokens_per_s,
            "prices": {"usd_per_gpu_hour": r.prices.usd_per_gpu_hour, "as_of": r.prices.as_of,
                       "source": r.prices.source},
            "search": r.summary(), "pruned_examples": r.pruned_examples,
            "chosen": slim(r.chosen) if r.chosen else None, "simulate_command": simulate_command,
            "front": [p["key"] for p in r.front], "points": [slim(p) for p in r.points],
            "curves": {k: [slim(p) for p in v] for k, v in r.curves.items()}}


def write_json(path: str | Path, r: PlanResult, *, model: str, simulate_command: str) -> None:
    Path(path).write_text(json.dumps(plan_json(r, model=model, simulate_command=simulate_command), indent=1))


def write_csv(path: str | Path, r: PlanResult) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for p in r.points:
            w.writerow(p)


def write_html(path: str | Path, r: PlanResult, *, model: str, simulate_command: str) -> None:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise ValueError("--report-html needs plotly: pip install 'kernelsight[plan]' (or pip install plotly)") \
            from None
    figs = [_pareto_figure(go, r), _curves_figure(go, make_subplots, r)]
    if r.chosen is not None and r.chosen_timeline:
        figs.append(_timeline_figure(go, make_subplots, r.chosen["label"], r.chosen_timeline))
    parts = []
    for i, fig in enumerate(figs):
        # plotly.js inlined once, in the first figure: the page works offline and stays one file
        parts.append(fig.to_html(full_html=False, include_plotlyjs=i == 0))
    chosen = ("<p>No deployment in the search space meets the SLO at this load.</p>" if r.chosen is None else
              f"<p><b>Cheapest deployment meeting the SLO:</b> {r.chosen['label']} — {r.chosen['num_gpus']} GPUs, "
              f"${r.chosen['usd_per_hour']:.2f}/h, ${r.chosen['usd_per_mtok']:.3f}/Mtok.<br>Re-run: "
              f"<code>{_esc(simulate_command)}</code>"
              + ("<br>A P/D split records no per-step timeline (its instances' steps interleave); the why column "
                 "gives its instances' busy shares and KV pull times." if r.chosen.get("pd") else "") + "</p>")
    rows = "".join(f"<tr><td>{_esc(p['label'])}</td><td>{p['num_gpus']}</td><td>{p['usd_per_mtok']:.3f}</td>"
                   f"<td>{p['goodput_rps']:.2f}</td><td>{'meets' if p['meets_slo'] else 'fails'}</td>"
                   f"<td>{_esc(p['why'])}</td></tr>" for p in r.points)
    pruned = "".join(f"<li>{n} — {_esc(k)}</li>" for k, n in sorted(r.pruned.items(), key=lambda kv: -kv[1]))
    s = r.summary()
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>kernelsight plan: {_esc(model)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1200px}} table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:2px 6px}} code{{font-size:85%}}</style></head><body>
<h2>kernelsight plan: {_esc(model)} at {r.request_rate:g} req/s, SLO {_esc(r.slo.text())}</h2>
{chosen}
<p>Search space {s['space_points']} points: simulated {s['simulated']}, from cache {s['cache_hits']},
pruned {s['pruned']}:</p><ul>{pruned}</ul>
<p>Cost: GPUs × price ÷ the offered {r.offered_tokens_per_s:,.0f} tokens/s (input + output). Prices:
{_esc(r.prices.source)}, {_esc(r.prices.as_of)} — examples, override with <code>--prices</code>.</p>
{''.join(parts)}
<h3>Simulated points at the requested load</h3>
<table><tr><th>deployment</th><th>GPUs</th><th>$/Mtok</th><th>goodput req/s</th><th>SLO</th><th>why</th></tr>
{rows}</table></body></html>"""
    Path(path).write_text(html, encoding="utf-8")


def _esc(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _pareto_figure(go: Any, r: PlanResult) -> Any:
    fig = go.Figure()
    front_keys = {p["key"] for p in r.front}
    for meets, color, name in ((True, "#2a9d8f", "meets SLO"), (False, "#e76f51", "fails SLO")):
        pts = [p for p in r.points if p["meets_slo"] == meets]
        fig.add_trace(go.Scatter(
            x=[p["usd_per_mtok"] for p in pts], y=[p["goodput_rps"] for p in pts], mode="markers", name=name,
            marker={"color": color, "size": [12 if p["key"] in front_keys else 7 for p in pts]},
            text=[f"{p['label']}<br>{p['why'] or 'meets the SLO'}" for p in pts], hoverinfo="text+x+y"))
    fig.add_trace(go.Scatter(x=[p["usd_per_mtok"] for p in r.front], y=[p["goodput_rps"] for p in r.front],
                             mode="lines", line={"shape": "hv", "color": "#264653"}, name="Pareto front"))
    if r.chosen is not None:
        fig.add_trace(go.Scatter(x=[r.chosen["usd_per_mtok"]], y=[r.chosen["goodput_rps"]], mode="markers+text",
                                 marker={"symbol": "star", "size": 18, "color": "#f4a261"}, name="chosen",
                                 text=[r.chosen["label"]], textposition="top left"))
    fig.add_hline(y=r.request_rate, line_dash="dot", annotation_text="requested load",
                  annotation_position="bottom left")
    fig.update_layout(title="Cost vs goodput (requests/s meeting the SLO)", xaxis_title="USD per million tokens",
                      yaxis_title="goodput (req/s)", height=480)
    return fig


def _curves_figure(go: Any, make_subplots: Any, r: PlanResult) -> Any:
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p99 TTFT vs load", "p99 TPOT vs load"))
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
    for i, (label, pts) in enumerate(r.curves.items()):
        x = [p["request_rate"] for p in pts]
        line = {"color": palette[i % len(palette)]}     # one colour per deployment in both panels
        fig.add_trace(go.Scatter(x=x, y=[p["p99_ttft_ms"] for p in pts], mode="lines+markers", name=label,
                                 legendgroup=label, line=line), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[p["p99_tpot_ms"] for p in pts], mode="lines+markers", name=label,
                                 legendgroup=label, showlegend=False, line=line), row=1, col=2)
    rates = sorted({p["request_rate"] for pts in r.curves.values() for p in pts})
    for lim in r.slo.limits:
        if lim.metric in ("ttft", "tpot") and lim.stat == "p99" and rates:
            # a trace, not a layout shape: shapes on a log axis take log10 coordinates
            fig.add_trace(go.Scatter(x=[rates[0], rates[-1]], y=[lim.limit_ms] * 2, mode="lines", name="SLO",
                                     line={"dash": "dot", "color": "black"}, showlegend=lim.metric == "ttft"),
                          row=1, col=1 if lim.metric == "ttft" else 2)
    fig.update_xaxes(title_text="request rate (req/s)")
    fig.update_yaxes(title_text="ms", type="log")
    fig.update_layout(title="Latency vs load (the chosen deployment and its neighbours on the front)", height=460)
    return fig


def _timeline_figure(go: Any, make_subplots: Any, label: str, tl: dict[str, list]) -> Any:
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=("requests", "KV cache use", "step time"))
    fig.add_trace(go.Scatter(x=tl["time_s"], y=tl["running"], name="running", line={"shape": "hv"}), row=1, col=1)
    fig.add_trace(go.Scatter(x=tl["time_s"], y=tl["waiting"], name="waiting", line={"shape": "hv"}), row=1, col=1)
    fig.add_trace(go.Scatter(x=tl["time_s"], y=[100 * v for v in tl["kv_cache_usage"]], name="KV %"), row=2, col=1)
    fig.add_trace(go.Scatter(x=tl["time_s"], y=[1000 * v for v in tl["step_s"]], name="step ms", mode="markers",
                             marker={"size": 3}), row=3, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=3, col=1)
    fig.update_layout(title=f"Chosen deployment's timeline (engine 0 of {label})", height=640)
    return fig
