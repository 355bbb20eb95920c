"""Human-readable rendering of benchmark results, laid out like ``vllm bench serve``'s summary."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["RANK_COLUMNS", "format_report", "format_table", "rank_rows"]

_WIDTH = 50  # total width of the title and section rules
_LABEL_W = 40

# (result key, label, is_integer). Rows render only when the key is present (and not None).
_HEADER_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("completed", "Successful requests:", True),
    ("failed", "Failed requests:", True),
    ("max_concurrency", "Maximum request concurrency:", True),
    ("request_rate", "Request rate configured (RPS):", False),
    ("duration", "Benchmark duration (s):", False),
    ("total_input_tokens", "Total input tokens:", True),
    ("total_output_tokens", "Total generated tokens:", True),
    ("request_throughput", "Request throughput (req/s):", False),
    ("request_goodput", "Request goodput (req/s):", False),
    ("output_throughput", "Output token throughput (tok/s):", False),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s):", False),
    ("max_concurrent_requests", "Peak concurrent requests:", False),
    ("total_token_throughput", "Total token throughput (tok/s):", False),
)

# metric -> (section title, short name used in row labels)
_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
    ("client_queue_time", "Client Queue Time", "Client queue time"),
    ("e2el_including_client_queue", "E2E Latency incl. Client Queue", "E2EL+queue"),
)


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _value(v: object, is_int: bool) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if is_int or isinstance(v, bool):
        return str(int(v))  # type: ignore[arg-type]
    return f"{float(v):.2f}"  # type: ignore[arg-type]


def _row(label: str, value: str) -> str:
    return f"{label:<{_LABEL_W}} {value:<10}".rstrip()


def format_report(result: dict, title: str = "Serving Benchmark Result") -> str:
    """Fixed-width summary of a result dict (as from ``compute_bench_metrics``, possibly with the
    benchmark header keys too). Renders whatever keys are present and skips absent ones; for each
    metric section it prints Mean, Median, Std and every ``p<P>_<m>_ms`` key found, in dict order.
    """
    lines = [_rule(f" {title} ", "=")]
    for key, label, is_int in _HEADER_ROWS:
        if result.get(key) is not None:
            lines.append(_row(label, _value(result[key], is_int)))

    for metric, section, short in _SECTIONS:
        # Exact suffix match: "_e2el_ms" must not pick up "_e2el_including_client_queue_ms".
        pct_re = re.compile(rf"^p(\d+(?:\.\d+)?)_{re.escape(metric)}_ms$")
        rows: list[str] = []
        for stat, stat_label in (("mean", "Mean"), ("median", "Median"), ("std", "Std")):
            key = f"{stat}_{metric}_ms"
            if result.get(key) is not None:
                rows.append(_row(f"{stat_label} {short} (ms):", _value(result[key], False)))
        for key, v in result.items():
            m = pct_re.match(key)
            if m and v is not None:
                rows.append(_row(f"P{m.group(1)} {short} (ms):", _value(v, False)))
        if rows:
            lines.append(_rule(section, "-"))
            lines.extend(rows)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _cell(v: object, float_fmt: str) -> str:
    if v is None:
        return ""
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return format(v, float_fmt)
    return str(v)


def format_table(rows: list[dict], columns: list[str], *, float_fmt: str = ".2f") -> str:
    """Aligned plain-text table: one header line, a dash rule, one line per row. Numbers are
    right-aligned, text left-aligned; a missing key renders as an empty cell."""
    cells: list[list[str]] = [[_cell(r.get(c), float_fmt) for c in columns] for r in rows]
    numeric = [
        all(isinstance(r.get(c), int | float) or r.get(c) is None for r in rows) and bool(rows)
        for c in columns
    ]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def fmt_line(vals: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [fmt_line(columns), "  ".join("-" * w for w in widths)]
    out.extend(fmt_line(row) for row in cells)
    return "\n".join(out)


#: Columns of the per-rank table of a data-parallel run (fast-forward's ``data_parallel_ranks``).
RANK_COLUMNS = ("rank", "requests", "steps", "dummy_steps", "mean_waiting", "mean_running", "peak_kv_%",
                "own_step_s", "all2all_s", "sync_wait_s")


def rank_rows(ranks: Sequence[dict]) -> list[dict]:
    """Table rows of a data-parallel run's per-rank summaries: queue, KV usage and where the time went (its own
    work, the MoE all-to-all, waiting for a slower rank of a lockstep group)."""
    return [{**{k: r[k] for k in RANK_COLUMNS if k in r}, "peak_kv_%": round(100 * r["peak_kv_usage"], 2)}
            for r in ranks]
