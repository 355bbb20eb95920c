"""Shared helpers for benchmark scripts: where the shared data is, and how results are written."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("KERNELSIGHT_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def pct_error(sim: float, real: float) -> float:
    return 100.0 * (sim - real) / real if real else float("nan")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server subprocess to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_jiffies() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal), or []."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return []


def steal_busy_pct(j0: list[int], j1: list[int]) -> tuple[float, float]:
    """(steal %, busy %) of the machine between two :func:`cpu_jiffies` readings (nan where unavailable)."""
    d = [b - a for a, b in zip(j0, j1, strict=True)] if j0 and j1 else []
    if not d:
        return float("nan"), float("nan")
    total = sum(d) or 1
    return 100.0 * d[7] / total, 100.0 * (total - d[3] - d[4]) / total


def steal_s() -> float:
    """CPU time the hypervisor gave to other guests (all CPUs), from /proc/stat; 0 where unavailable. On a
    shared VM it is the one disturbance no server can do anything about: reported beside every timing."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
