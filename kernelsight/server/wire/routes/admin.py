"""kernelsight's own endpoints (not vLLM's, not in the schema): /kernelsight/timings (debug) and
/kernelsight/faults (fault injection settings, read and changed live; behind --api-key)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.state import ServerState, server_state
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.jsonio import json_response

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


def _faults_json(state: ServerState) -> dict:
    out = state.faults.config.to_json()
    out["injected"] = state.metrics.faults_injected()
    return out


@router.get("/kernelsight/faults", include_in_schema=False)
async def get_faults(request: Request) -> Response:
    """The fault injection settings and what was injected so far, by type."""
    return json_response(_faults_json(server_state(request)))


@router.post("/kernelsight/faults", include_in_schema=False)
async def set_faults(request: Request) -> Response:
    """Change the fault settings now: a JSON object with any of ``rate``, ``types``, ``seed``, ``slow_factor``,
    ``stall_s``, ``timeout_s`` (llm-d-inference-sim's ``failure-injection-rate`` in percent and ``failure-types``
    too); the others keep their values. A ``seed`` restarts the per-request picks from it. Answers the new
    settings; 400 in vLLM's error shape on a bad body (nothing changed)."""
    state = server_state(request)
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    try:
        config = state.faults.config.updated(body)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    state.configure_faults(config, reseed="seed" in body)
    return json_response(_faults_json(state))
