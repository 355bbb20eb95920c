"""``--plot FILE.html``: one self-contained page (inline SVG, no script, no CDN) with the latency CDFs and,
when there is one, the timeline of running / waiting requests, KV-cache usage and scheduled tokens
(simulate: every engine step; bench: the server's /metrics gauges sampled during the run)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kernelsight.loadgen.metrics import RequestRecord

__all__ = ["write_plot_html", "render_plot_html", "line_chart_svg", "page_html", "cdf_xy"]

_W, _H = 460, 280
_M_LEFT, _M_RIGHT, _M_TOP, _M_BOTTOM = 62, 16, 34, 44
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")
_MAX_POINTS = 800  # per series: enough for a smooth line, small enough for a light page


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _thin(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if xs.size <= _MAX_POINTS:
        return xs, ys
    idx = np.unique(np.linspace(0, xs.size - 1, _MAX_POINTS).astype(np.int64))
    return xs[idx], ys[idx]


def line_chart_svg(title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *,
                   xlabel: str, ylabel: str, step: bool = False, y_max: float | None = None) -> str:
    """One SVG chart: ``series`` = (name, xs, ys) lines sharing the axes."""
    data = [(name, np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)) for name, xs, ys in series]
    data = [(n, x, y) for n, x, y in data if x.size]
    pw, ph = _W - _M_LEFT - _M_RIGHT, _H - _M_TOP - _M_BOTTOM
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}" role="img" aria-label="{html.escape(title)}">',
             f'<rect width="{_W}" height="{_H}" fill="white"/>',
             f'<text x="{_W / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">'
             f'{html.escape(title)}</text>']
    if not data:
        parts.append(f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle" fill="#888">no data</text></svg>')
        return "".join(parts)
    x_lo = min(float(x.min()) for _, x, _ in data)
    x_hi = max(float(x.max()) for _, x, _ in data)
    y_lo = min(0.0, min(float(y.min()) for _, _, y in data))
    y_hi = y_max if y_max is not None else max(float(y.max()) for _, _, y in data)
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    if y_hi <= y_lo:
        y_hi = y_lo + 1.0
    y_hi *= 1.04 if y_max is None else 1.0

    def sx(v: np.ndarray | float) -> np.ndarray | float:
        return _M_LEFT + (np.asarray(v) - x_lo) / (x_hi - x_lo) * pw

    def sy(v: np.ndarray | float) -> np.ndarray | float:
        return _M_TOP + ph - (np.asarray(v) - y_lo) / (y_hi - y_lo) * ph

    for t in _nice_ticks(x_lo, x_hi):
        x = float(sx(t))
        parts.append(f'<line x1="{x:.1f}" y1="{_M_TOP}" x2="{x:.1f}" y2="{_M_TOP + ph}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="{_M_TOP + ph + 16}" text-anchor="middle" font-size="11">{_fmt(t)}</text>')
    for t in _nice_ticks(y_lo, y_hi):
        y = float(sy(t))
        parts.append(f'<line x1="{_M_LEFT}" y1="{y:.1f}" x2="{_M_LEFT + pw}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{_M_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(t)}</text>')
    parts.append(f'<rect x="{_M_LEFT}" y="{_M_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    parts.append(f'<text x="{_M_LEFT + pw / 2}" y="{_H - 8}" text-anchor="middle" font-size="12">'
                 f'{html.escape(xlabel)}</text>')
    parts.append(f'<text transform="translate(14 {_M_TOP + ph / 2}) rotate(-90)" text-anchor="middle" '
                 f'font-size="12">{html.escape(ylabel)}</text>')
    for k, (name, xs, ys) in enumerate(data):
        xs, ys = _thin(xs, ys)
        px, py = sx(xs), sy(ys)
        if step:  # hold each value until the next sample (a staircase, like the gauges behave)
            px = np.repeat(px, 2)[1:]
            py = np.repeat(py, 2)[:-1]
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py, strict=True))
        color = _COLORS[k % len(_COLORS)]
        parts.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.6" points="{pts}"/>')
        # CDFs climb to the top right: their legend goes bottom right, the timelines' top right
        ly = (_M_TOP + ph - 8 - 15 * (len(data) - 1 - k)) if y_max == 1.0 else (_M_TOP + 14 + 15 * k)
        parts.append(f'<line x1="{_M_LEFT + pw - 120}" y1="{ly - 4}" x2="{_M_LEFT + pw - 104}" y2="{ly - 4}" '
                     f'stroke="{color}" stroke-width="2"/><text x="{_M_LEFT + pw - 100}" y="{ly}" font-size="11">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


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
        charts.append(line_chart_svg(f"{name} CDF", [(name, xs, ys)], xlabel=f"{name} (ms)", ylabel="fraction",
                                     y_max=1.0))
    if timeline and len(timeline.get("time_s", ())):
        t = timeline["time_s"]
        reqs = [(k, t, timeline[k]) for k in ("running", "waiting") if k in timeline]
        if reqs:
            charts.append(line_chart_svg("Requests", reqs, xlabel="time (s)", ylabel="requests", step=True))
        if "kv_cache_usage" in timeline:
            charts.append(line_chart_svg("KV-cache usage", [("KV usage %", t, 100 * np.asarray(
                timeline["kv_cache_usage"], dtype=float))], xlabel="time (s)", ylabel="percent", step=True))
        if "scheduled_tokens" in timeline:
            charts.append(line_chart_svg("Scheduled tokens per step", [("tokens", t, timeline["scheduled_tokens"])],
                                         xlabel="time (s)", ylabel="tokens", step=True))
    timeline_h = timeline_title if len(charts) > 4 else None
    return page_html(title, summary, [("Latency CDFs", charts[:4]), (timeline_h, charts[4:])])


def page_html(title: str, summary: dict | None, sections: Sequence[tuple[str | None, Sequence[str]]]) -> str:
    """The self-contained page: a title, the ``summary`` table, then each section (heading or None, SVG charts)."""
    rows = ""
    for k, v in (summary or {}).items():
        if isinstance(v, float):
            v = f"{v:.2f}"
        rows += f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
    body = "".join((f"<h2>{html.escape(h)}</h2>" if h else "") + f"<div class=\"grid\">{''.join(c)}</div>"
                   for h, c in sections)
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
