"""What the server writes: compact JSON as vLLM writes its responses and SSE chunks (``dumps``), and JSON
responses (``json_response``).

Below every other server module but the protocol package (errors, the request-body parser, rendering and the
stream fast path all write through ``dumps``), so it imports nothing of the server's."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

# json.dumps builds a new encoder per call when given options (~2 µs), and JSONEncoder.encode builds a C encoder per
# non-string value (~1.5 µs): SSE rendering calls this several times per token, mostly on str and None
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_ENCODE_STR = json.encoder.encode_basestring      # what that encoder uses for a str (ensure_ascii=False)


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM writes responses and SSE chunks (same bytes as json.dumps with those options)."""
    if obj is None:
        return "null"
    if type(obj) is str:
        return _ENCODE_STR(obj)
    return _ENCODE(obj)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)
