"""vLLM's error bodies: ``APIError`` and its constructors, pydantic errors as vLLM reports them, the in-stream
error event, and the exception handler that answers an ``APIError``."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from kernelsight.server.wire.jsonio import dumps, json_response
from kernelsight.server.wire.protocol.openai import VLLMValidationError


class APIError(Exception):
    """An error answered in vLLM's nested shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, "BadRequestError", 400, param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(message, "NotFoundError", 404, param)


def validation_error(exc: ValidationError | list[dict[str, Any]]) -> APIError:
    """pydantic errors as vLLM 0.33 reports them: 400, type "Bad Request", param from the location."""
    errors = exc.errors() if isinstance(exc, ValidationError) else exc
    n = len(errors)
    lines = [f"{n} validation error{'s' if n != 1 else ''}:"]
    for e in errors:
        clean = {k: e.get(k) for k in ("type", "loc", "msg", "input") if k in e}
        if "input" in clean:
            clean["input"] = _short(clean["input"])
        lines.append(f"  {clean!r}")
    loc = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in loc) if loc else None
    for e in errors:     # a VLLMValidationError raised by a request-model check names its parameter
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, VLLMValidationError):
            param = err.parameter
            break
    return APIError("\n".join(lines), HTTPStatus.BAD_REQUEST.phrase, 400, param)


def _short(v: Any) -> Any:
    r = repr(v)
    return v if len(r) <= 200 else r[:200] + "..."


def sse_error_event(err: APIError, compact: bool) -> str:
    """In-stream error: chat writes compact JSON, completions uses json.dumps' default separators."""
    body = dumps(err.body()) if compact else json.dumps(err.body(), ensure_ascii=False)
    return f"data: {body}\n\n"


async def api_error_handler(_: Request, exc: APIError) -> Response:
    """The app's handler for ``APIError`` (registered by ``build_app``)."""
    return json_response(exc.body(), exc.status)
