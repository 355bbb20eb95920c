"""The Pareto front of cost (lower is better) vs goodput (higher is better), and the cheapest point that meets
the SLO."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["pareto_front", "cheapest_meeting"]


def _order(p: dict[str, Any]) -> tuple:
    # cost ascending; at equal cost the higher goodput first, then the label (deterministic)
    return (p["usd_per_mtok"], -p["goodput_rps"], p["label"])


def pareto_front(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both axes (no point at most as costly with at least as much goodput,
    better on one); cost ascending."""
    front: list[dict[str, Any]] = []
    best = float("-inf")
    for p in sorted(points, key=_order):
        if p["goodput_rps"] > best:
            if front and front[-1]["usd_per_mtok"] == p["usd_per_mtok"]:
                continue       # same cost, less goodput than the one already kept
            front.append(p)
            best = p["goodput_rps"]
    return front


def cheapest_meeting(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [p for p in points if p["meets_slo"]]
    return min(ok, key=_order) if ok else None
