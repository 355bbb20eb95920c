"""vLLM 0.33's scale-out routes (render / derender, the tokens-in generate API): registered always, and without
``--enable-scale-out`` each answers 403 ``PermissionDeniedError`` — what a client or router probing them sees from a
default vLLM server. The simulator does not implement them, so ``--enable-scale-out`` is accepted with no effect."""

from __future__ import annotations

from fastapi import APIRouter

from kernelsight.server.wire.errors import APIError

router = APIRouter()

#: The routes, as the wire contract lists them (§1.2).
SCALE_OUT_PATHS = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                   "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                   "/inference/v1/generate", "/inference/v1/abort_requests")
DISABLED_MESSAGE = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


async def scale_out_disabled() -> None:
    raise APIError(DISABLED_MESSAGE, "PermissionDeniedError", 403)


for _path in SCALE_OUT_PATHS:
    router.add_api_route(_path, scale_out_disabled, methods=["POST"], include_in_schema=False)
