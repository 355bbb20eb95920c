"""``--plot FILE.html``: one self-contained page with the latency CDFs and, when there is one, the timeline of
running / waiting requests, KV-cache usage and scheduled tokens (simulate: every engine step; bench: the server's
/metrics gauges sampled during the run).

Charts are plotly's (zoom, hover, toggling series), with plotly.js inlined once in the page, so the file opens
offline and references nothing. plotly is an optional extra (``pip install 'kernelsight[plot]'``).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.loadgen.metrics import RequestRecord

__all__ = ["write_plot_html", "render_plot_html", "line_chart", "page_html", "cdf_xy", "require_plotly"]

_W, _H = 460, 280
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")
_MAX_POINTS = 800  # per series: enough for a smooth line, small enough for a light page


def require_plotly() -> Any:
    """``plotly.graph_objects``, or a one-line error saying how to install it."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ValueError("--plot needs plotly: pip install 'kernelsight[plot]' (or pip install plotly)") from None
    return go


def _thin(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if xs.size <= _MAX_POINTS:
        return xs, ys
    idx = np.unique(np.linspace(0, xs.size - 1, _MAX_POINTS).astype(np.int64))
    return xs[idx], ys[idx]


def line_chart(title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, step: bool = False, y_max: float | None = None) -> Any:
    """One chart (a plotly Figure): ``series`` = (name, xs, ys) lines sharing the axes; ``step`` holds each value
    until the next sample (a staircase, as gauges behave)."""
    go = require_plotly()
    fig = go.Figure()
    data = [(name, np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)) for name, xs, ys in series]
    data = [(n, x, y) for n, x, y in data if x.size]
    for k, (name, xs, ys) in enumerate(data):
        xs, ys = _thin(xs, ys)
        fig.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines",
                                 line={"color": _COLORS[k % len(_COLORS)], "width": 2,
                                       "shape": "hv" if step else "linear"}))
    if not data:
        fig.add_annotation(text="no data", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font={"color": "#888"})
    fig.update_layout(title={"text": title, "x": 0.5}, width=_W, height=_H, template="simple_white",
                      margin={"l": 60, "r": 16, "t": 40, "b": 44}, showlegend=bool(data),
                      # CDFs climb to the top right: their legend goes bottom right, the timelines' top right
                      legend={"x": 1, "xanchor": "right", "y": 0 if y_max == 1.0 else 1,
                              "yanchor": "bottom" if y_max == 1.0 else "top", "bgcolor": "rgba(255,255,255,0.6)"})
    # axes under the lines: a series at 0 (an empty waiting queue) stays visible over the x axis
    fig.update_xaxes(title_text=xlabel, showgrid=True, gridcolor="#eee", layer="below traces")
    if y_max is None:   # a little room below 0, so a series at 0 is drawn inside the plot, not clipped by its edge
        hi = max((float(np.nanmax(y)) for _, _, y in data), default=1.0)
        hi = hi if hi > 0 else 1.0
        y_range = [-0.03 * hi, 1.05 * hi]
    else:
        y_range = [0, y_max]
    fig.update_yaxes(title_text=ylabel, showgrid=True, gridcolor="#eee", layer="below traces", range=y_range)
    return fig


def _cdf(values_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values_ms)
    return v, np.arange(1, v.size + 1) / max(v.size, 1)


def latency_samples_ms(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    ok = [r for r in records if r.success]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = np.concatenate([np.asarray(r.itl_s, dtype=float) for r in ok]) if ok else np.zeros(0)
    return {"TTFT": 1e3 * np.asarray([r.ttft_s for r in ok]), "TPOT": 1e3 * np.asarray(tpot),
            "ITL": 1e3 * itl, "E2EL": 1e3 * np.asarray([r.latency_s for r in ok])}


def render_plot_html(title: str, records: Sequence[RequestRecord], *, summary: dict | None = None,
                     timeline: dict[str, Sequence[float]] | None = None, timeline_title: str = "Engine timeline"
                     ) -> str:
    """The page. ``timeline`` maps ``time_s`` and any of running, waiting, kv_cache_usage, scheduled_tokens
    to equally long lists."""
    charts = []
    for name, vals in latency_samples_ms(records).items():
        xs, ys = _cdf(vals)
        charts.append(line_chart(f"{name} CDF", [(name, xs, ys)], xlabel=f"{name} (ms)", ylabel="fraction",
                                     y_max=1.0))
    if timeline and len(timeline.get("time_s", ())):
        t = timeline["time_s"]
        reqs = [(k, t, timeline[k]) for k in ("running", "waiting") if k in timeline]
        if reqs:
            charts.append(line_chart("Requests", reqs, xlabel="time (s)", ylabel="requests", step=True))
        if "kv_cache_usage" in timeline:
            charts.append(line_chart("KV-cache usage", [("KV usage %", t, 100 * np.asarray(
                timeline["kv_cache_usage"], dtype=float))], xlabel="time (s)", ylabel="percent", step=True))
        if "scheduled_tokens" in timeline:
            charts.append(line_chart("Scheduled tokens per step", [("tokens", t, timeline["scheduled_tokens"])],
                                     xlabel="time (s)", ylabel="tokens", step=True))
    timeline_h = timeline_title if len(charts) > 4 else None
    return page_html(title, summary, [("Latency CDFs", charts[:4]), (timeline_h, charts[4:])])


def page_html(title: str, summary: dict | None, sections: Sequence[tuple[str | None, Sequence[Any]]]) -> str:
    """The self-contained page: a title, the ``summary`` table, then each section (heading or None, figures).
    plotly.js is inlined once, before the first chart."""
    rows = ""
    for k, v in (summary or {}).items():
        if isinstance(v, float):
            v = f"{v:.2f}"
        rows += f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
    first = True
    body = ""
    for heading, figs in sections:
        charts = []
        for fig in figs:
            charts.append(fig.to_html(full_html=False, include_plotlyjs=first, config={"displayModeBar": False}))
            first = False
        body += (f"<h2>{html.escape(heading)}</h2>" if heading else "") + f"<div class=\"grid\">{''.join(charts)}</div>"
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title>"
            "<style>body{font-family:sans-serif;margin:20px;color:#222}.grid{display:flex;flex-wrap:wrap;gap:12px}"
            "table{border-collapse:collapse;margin-bottom:16px}th,td{padding:2px 10px;border-bottom:1px solid #ddd;"
            "text-align:left;font-size:13px}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><table>{rows}</table>{body}</body></html>")


def cdf_xy(values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their cumulative fractions (a CDF's points)."""
    return _cdf(np.asarray(values, dtype=float))


def write_plot_html(path: str | Path, title: str, records: Sequence[RequestRecord], **kw) -> None:
    Path(path).write_text(render_plot_html(title, records, **kw), encoding="utf-8")
