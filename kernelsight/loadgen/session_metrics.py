"""Prefix-cache and per-turn statistics of a run, from its ``RequestRecord``s (the same for ``bench`` and
``simulate``): each record's ``cached_tokens`` is the prompt tokens the server served from its prefix cache
(``usage.prompt_tokens_details.cached_tokens``; the simulated engine's own count in ``simulate``), and a multi-turn
run's records carry their session and turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernelsight.loadgen.metrics import RequestRecord, percentile_key

__all__ = ["prefix_cache_stats", "turn_stats", "TURN_COLUMNS", "turn_rows", "workload_extra", "format_workload_extra"]


def prefix_cache_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The hit rate over the successful requests that report cached tokens: cached / prompt tokens. ``hit_rate`` is
    None when none reports them (a server without ``--enable-prompt-tokens-details``)."""
    rep = [r for r in records if r.success and r.cached_tokens is not None]
    prompt = sum(r.prompt_len for r in rep)
    cached = sum(r.cached_tokens or 0 for r in rep)
    return {"hit_rate": cached / prompt if prompt else None, "cached_tokens": cached, "prompt_tokens": prompt,
            "requests_reporting": len(rep)}


def turn_stats(records: Sequence[RequestRecord], percentiles: Sequence[float] = (50, 99)) -> list[dict[str, Any]]:
    """One row per turn index (0-based) of a multi-turn run: its successful requests, TTFT mean and percentiles (ms),
    mean prompt length and the prefix-cache hit rate of that turn's prompts."""
    by_turn: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn is not None and r.success:
            by_turn.setdefault(r.turn, []).append(r)
    rows = []
    for k in sorted(by_turn):
        rs = by_turn[k]
        ttft_ms = 1e3 * np.asarray([r.ttft_s for r in rs])
        row: dict[str, Any] = {"turn": k + 1, "requests": len(rs), "mean_ttft_ms": float(ttft_ms.mean())}
        for p in percentiles:
            row[percentile_key(p, "ttft")] = float(np.percentile(ttft_ms, p))
        row["mean_prompt_tokens"] = float(np.mean([r.prompt_len for r in rs]))
        row.update({k2: v for k2, v in prefix_cache_stats(rs).items() if k2 in ("hit_rate", "cached_tokens")})
        rows.append(row)
    return rows


#: Columns of the per-turn table (the report prints hit rates in %).
TURN_COLUMNS = ("turn", "requests", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_prompt_tokens", "hit_%")


def turn_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``turn_stats`` rows for the report's table (hit rate in %, blank when the server did not report it)."""
    return [{**r, "hit_%": None if r["hit_rate"] is None else round(100 * r["hit_rate"], 1)} for r in rows]


def workload_extra(records: Sequence[RequestRecord], *, dataset_name: str, sessions: Any = None,
                   max_open_sessions: int | None = None) -> dict[str, Any]:
    """The result keys a Mooncake or multi-turn run adds (``bench`` and ``simulate`` alike): ``prefix_cache`` (the
    overall hit rate), and for sessions ``sessions`` (the workload, the most sessions open at once) and ``turns``
    (``turn_stats``)."""
    out: dict[str, Any] = {}
    if sessions is None and dataset_name != "mooncake":
        return out
    out["prefix_cache"] = prefix_cache_stats(records)
    if sessions is not None:
        out["sessions"] = {**sessions.summary(), "max_open_sessions": max_open_sessions}
        out["turns"] = turn_stats(records)
    return out


def format_workload_extra(extra: dict[str, Any]) -> str:
    """The report lines of ``workload_extra``'s keys ("" when there are none)."""
    from kernelsight.loadgen.report import format_table

    lines = []
    pc = extra.get("prefix_cache")
    if pc is not None:
        if pc["hit_rate"] is None:
            lines.append("Prefix cache: no request reported cached tokens (bench: serve with "
                         "--enable-prompt-tokens-details)")
        else:
            lines.append(f"Prefix cache: hit rate {100 * pc['hit_rate']:.1f}% ({pc['cached_tokens']} of "
                         f"{pc['prompt_tokens']} prompt tokens cached, over {pc['requests_reporting']} requests)")
    s = extra.get("sessions")
    if s is not None:
        lines.append(f"Sessions: {s['num_sessions']} ({s['source']}), {s['num_turns']} turns, "
                     f"{s['turns_per_session_mean']:.2f} per session; at most {s['max_open_sessions']} open at once "
                     f"(--session-concurrency {s['session_concurrency']})")
        lines.append("By turn:")
        lines.append(format_table(turn_rows(extra["turns"]), list(TURN_COLUMNS)))
    return "\n".join(lines)
