"""The API-key check (--api-key / VLLM_API_KEY): ``Authorization: Bearer KEY`` on vLLM's guarded path prefixes,
as a pure-ASGI layer."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kernelsight.server.options import ServerOptions

#: vLLM's guarded prefixes, plus kernelsight's fault settings (they turn the replica bad: not for anyone to change)
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/kernelsight/faults")


def add_api_key_auth(app: FastAPI, opts: ServerOptions) -> None:
    """Pure-ASGI middleware (BaseHTTPMiddleware would break streaming disconnect detection)."""
    keys = {f"Bearer {k}" for k in opts.api_keys}
    if not keys:
        return
    inner = app.build_middleware_stack

    def build():
        downstream = inner()

        async def auth(scope, receive, send):
            if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                    scope["path"].startswith(GUARDED_PREFIXES):
                hdr = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if hdr not in keys:
                    resp = JSONResponse({"error": "Unauthorized"}, status_code=401)
                    await resp(scope, receive, send)
                    return
            await downstream(scope, receive, send)
        return auth

    app.build_middleware_stack = build  # type: ignore[method-assign]
