"""/v1/load_lora_adapter and /v1/unload_lora_adapter. Mounted only with --enable-lora and
VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM (otherwise both paths are 404)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kernelsight.server.state import server_state
from kernelsight.server.wire.body import parse_body
from kernelsight.server.wire.errors import APIError, not_found
from kernelsight.server.wire.openapi_bodies import request_body
from kernelsight.server.wire.protocol.lora import LoadLoRARequest, UnloadLoRARequest

router = APIRouter()


@router.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRARequest))
async def load_lora(request: Request) -> Response:
    state = server_state(request)
    req: LoadLoRARequest = await parse_body(request, LoadLoRARequest)
    if not req.lora_name or not req.lora_path:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
    if req.lora_name in state.opts.served_model_names:
        raise APIError(f"The lora adapter '{req.lora_name}' conflicts with a base model name.",
                       "InvalidUserInput", 400)
    if req.lora_name in state.loras and not req.load_inplace:
        raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded.", "InvalidUserInput",
                       400)
    state.loras[req.lora_name] = req.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRARequest))
async def unload_lora(request: Request) -> Response:
    state = server_state(request)
    req: UnloadLoRARequest = await parse_body(request, UnloadLoRARequest)
    if req.lora_name not in state.loras:
        raise not_found(f"The lora adapter '{req.lora_name}' cannot be found.")
    del state.loras[req.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
