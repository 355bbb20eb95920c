"""gRPC status codes as vLLM's servicer picks them: a request the engine refuses (vLLM's ``ValueError`` /
``VLLMClientError``, an HTTP 400 on the HTTP server) is INVALID_ARGUMENT, not found NOT_FOUND, the admission
limits' and sleep mode's 503 UNAVAILABLE, a 429 RESOURCE_EXHAUSTED, anything else INTERNAL; the message is the
error's own (the same text the HTTP server puts in its error body)."""

from __future__ import annotations

import grpc

from kernelsight.server.wire.errors import APIError

_BY_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def grpc_code(err: APIError) -> grpc.StatusCode:
    """The status code of an error the HTTP server answers with ``err.status``."""
    return _BY_HTTP_STATUS.get(err.status, grpc.StatusCode.INTERNAL)


class RpcFailure(Exception):
    """An RPC that ends with a status other than OK (raised inside the servicer, turned into ``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, err: APIError) -> RpcFailure:
        return cls(grpc_code(err), err.message)
