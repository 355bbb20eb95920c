"""vLLM's system endpoints: /health, /ping, /version, /load and the Prometheus /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.integrations.metrics import CONTENT_TYPE
from kernelsight.server.state import server_state
from kernelsight.server.wire.jsonio import json_response
from kernelsight.server.wire.protocol.version import VLLM_VERSION

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    state = server_state(request)
    if state.faults.config.unready:     # injected: answered as vLLM answers when its engine is dead
        state.metrics.on_fault("unready")
        return Response(status_code=503)
    ok = all(b.is_running for b in state.bridges)
    return Response(status_code=200 if ok else 503)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/version")
async def version() -> Response:
    return json_response({"version": VLLM_VERSION})


@router.get("/load")
async def load() -> Response:
    return json_response({"server_load": 0})


async def metrics_endpoint(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


# not in the schema, as in vLLM (which mounts prometheus_client's app there)
router.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
router.add_api_route("/metrics/", metrics_endpoint, methods=["GET"], include_in_schema=False)
