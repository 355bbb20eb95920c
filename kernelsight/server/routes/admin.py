"""kernelsight's own debug endpoint (not vLLM's, not in the schema): /kernelsight/timings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.state import server_state
from kernelsight.server.wire import json_response

router = APIRouter()


@router.get("/kernelsight/timings", include_in_schema=False)
async def timings(request: Request, reset_late: bool = False) -> Response:
    """Virtual arrival and token-release times (scaled to wall seconds), with --record-timings; ``wall0_s``
    maps them to time.perf_counter() (CLOCK_MONOTONIC: a client on the same host can compare directly).
    ``late_s_max``: the worst release lateness since the last ``?reset_late=true``."""
    state = server_state(request)
    ts = state.opts.time_scale
    out = {}
    for b in state.bridges:
        for sid, rec in b.timings.items():
            out[sid] = {"arrival_s": rec["arrival_s"] / ts, "token_times_s": [t / ts for t in rec["token_times_s"]],
                        "wall0_s": b._wall0}
    late_s_max = max(b.late_s_max for b in state.bridges)
    if reset_late:
        for b in state.bridges:
            b.late_s_max = 0.0
    return json_response({"time_scale": ts, "requests": out, "late_s_max": late_s_max,
                          "fast_writes": sum(b.fast_writes for b in state.bridges),
                          "fast_handbacks": sum(b.fast_handbacks for b in state.bridges)})
