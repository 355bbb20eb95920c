"""vLLM's KV-cache routes: ``GET /kv_event_sources`` (0.33: where each DP rank publishes its KV events) and the
dev-mode ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.state import server_state
from kernelsight.server.wire.jsonio import json_response

router = APIRouter()
dev_router = APIRouter()


def dev_mode() -> bool:
    """vLLM registers its development endpoints only under VLLM_SERVER_DEV_MODE=1."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").lower() in ("1", "true")


@router.get("/kv_event_sources")
async def kv_event_sources(request: Request) -> Response:
    """A bare JSON array, one entry per DP rank that publishes: its endpoint (a wildcard host replaced by the
    host this request reached, so a router can connect to it), replay endpoint and topic. Empty when off."""
    host = request.url.hostname or "127.0.0.1"
    out = []
    for b in server_state(request).bridges:
        pub = b.kv_publisher
        if pub is None:
            continue
        out.append({"data_parallel_rank": pub.rank, "endpoint": _routable(pub.endpoint, host),
                    "replay_endpoint": _routable(pub.replay_endpoint, host), "topic": pub.cfg.topic})
    return json_response(out)


def _routable(endpoint: str | None, host: str) -> str | None:
    if endpoint is None:
        return None
    return endpoint.replace("://*:", f"://{host}:")


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = False,
                             reset_external: bool = False) -> Response:
    """vLLM 0.33: ``{"success": bool}``, false while a request still holds blocks (nothing is reset then).
    A reset publishes ``AllBlocksCleared`` at once, after the events of the steps already released.
    ``reset_external=true`` also empties KV offloading's CPU tier (vLLM's ``reset_connector``) when the GPU's reset."""
    ok = True
    for b in server_state(request).bridges:
        done = b.engine.kv.reset_prefix_cache()
        if done and reset_external and b.engine.offload is not None:
            b.engine.offload.reset()
        ok = done and ok
        b.publish_kv_events(b.virtual_now())
    return json_response({"success": ok})
