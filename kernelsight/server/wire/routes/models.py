"""/v1/models: the served model names, then the LoRA adapters known now."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kernelsight.server.state import server_state
from kernelsight.server.wire.jsonio import json_response

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = server_state(request)
    opts = state.opts

    def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {"id": mid, "object": "model", "created": state.created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": state.created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
    data = [card(n, opts.model_root, None, state.max_model_len) for n in opts.served_model_names]
    data += [card(n, p, state.model_name, None) for n, p in state.loras.items()]
    return json_response({"object": "list", "data": data})
