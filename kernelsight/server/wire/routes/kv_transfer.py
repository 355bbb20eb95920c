"""The prefill side's end of the modelled NIXL notification (``integrations/kv_transfer.py``): a decode instance that
pulled (or gave up on) a request's KV posts ``{"remote_engine_id", "remote_request_id"}`` here,
and the blocks are freed."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.integrations.kv_transfer import NOTIFY_PATH
from kernelsight.server.state import server_state
from kernelsight.server.wire.errors import bad_request, not_found
from kernelsight.server.wire.jsonio import json_response

router = APIRouter()


@router.post(NOTIFY_PATH, include_in_schema=False)
async def notify(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
        engine_id, request_id = str(body["remote_engine_id"]), str(body["remote_request_id"])
    except (ValueError, KeyError, TypeError):
        raise bad_request("expected a JSON object with remote_engine_id and remote_request_id") from None
    for agent in server_state(request).kv_agents:
        if agent.engine_id == engine_id:
            freed = agent.release(request_id)
            bridge = next(b for b in server_state(request).bridges if b.kv_agent is agent)
            bridge.refresh_gauges()
            bridge.wake()             # requests waiting for blocks may run now
            return json_response({"freed": freed})
    raise not_found(f"no KV transfer engine {engine_id!r} here", "remote_engine_id")
