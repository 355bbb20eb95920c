"""vLLM's dev-mode sleep routes (``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep``, ``POST /wake_up`` and
``GET /is_sleeping``, answered in vLLM 0.33's shapes. /sleep and /wake_up act only with --enable-sleep-mode."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from kernelsight.server.integrations.sleep_mode import SLEEP_TAGS, sleep_copy_s, wake_copy_s
from kernelsight.server.state import ServerState, server_state
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.jsonio import json_response

dev_router = APIRouter()
SLEEP_MODES = ("abort",)     # 0.33's default; the others (waiting for in-flight requests) are not simulated


def _require_sleep_mode(state: ServerState) -> None:
    if not state.opts.enable_sleep_mode:
        raise bad_request("Sleep mode is not enabled. Start the server with --enable-sleep-mode.")


@dev_router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "abort") -> Response:
    """Abort the requests in flight, drop the prefix cache (level ≥ 1; AllBlocksCleared when KV events are on)
    and refuse new generation requests until /wake_up."""
    state = server_state(request)
    _require_sleep_mode(state)
    if level not in (0, 1, 2):
        raise bad_request(f"level must be 0, 1 or 2, got {level}.", "level")
    if mode not in SLEEP_MODES:
        raise bad_request(f"mode must be one of {list(SLEEP_MODES)}, got {mode!r}.", "mode")
    state.sleep.sleep(level)       # first: nothing new is admitted while the in-flight requests are aborted
    for b in state.bridges:
        b.abort_all()
        if level >= 1:
            b.engine.kv.reset_prefix_cache()     # every block is free after the aborts, so this cannot be refused
            b.publish_kv_events(b.virtual_now())
    state.metrics.set_sleep_state(state.sleep.metric_state)
    # answered once the simulated weight offload is done (what a caller of vLLM's /sleep waits for)
    await asyncio.sleep(sleep_copy_s(state.config, level) / state.opts.time_scale)
    return json_response({"status": "sleeping", "level": level})


@dev_router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    state = server_state(request)
    _require_sleep_mode(state)
    bad = [t for t in tags or () if t not in SLEEP_TAGS]
    if bad:
        raise bad_request(f"Unknown sleep tags {bad}; expected any of {list(SLEEP_TAGS)}.", "tags")
    # still asleep while the simulated weights copy back: requests sent meanwhile get 503, as before the call
    await asyncio.sleep(wake_copy_s(state.config, state.sleep, tags) / state.opts.time_scale)
    try:
        state.sleep.wake_up(tags)
    except ValueError as exc:
        raise bad_request(str(exc), "tags") from None
    state.metrics.set_sleep_state(state.sleep.metric_state)
    return json_response({"status": "sleeping" if state.sleep.is_sleeping else "awake", "tags": tags})


@dev_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> Response:
    return json_response({"is_sleeping": server_state(request).sleep.is_sleeping})
