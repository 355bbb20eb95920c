"""An API-server process's routes that belong to the engine (``serve --api-server-count N``): /metrics, /health,
sleep mode, the prefix cache, LoRA adapters, the admin routes. They are answered by the engine process's own app,
which this ASGI layer reaches over a Unix socket (HTTP/1.1, one connection per request): every API server then shows
the one engine's /metrics and state, whichever process the kernel handed the connection to.

The routes an API server answers itself are those that only parse, tokenize and render: generation, pooling,
tokenization, /ping and /version (``LOCAL_PATHS``)."""

from __future__ import annotations

import asyncio
from typing import Any

#: answered in the API-server process (its own tokenizer, its RemoteBridge for generation)
LOCAL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
                         "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/invocations",
                         "/v1/embeddings", "/pooling", "/v2/embed", "/ping", "/version", "/openapi.json", "/docs",
                         "/redoc"})
LOCAL_PREFIXES = ("/v1/responses/", "/docs/")
#: hop-by-hop headers not passed on (RFC 9110 §7.6.1), and the framing this layer sets itself
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                  b"proxy-connection", b"content-length"})
_CHUNK = 65536


def is_local(path: str) -> bool:
    return path in LOCAL_PATHS or path.startswith(LOCAL_PREFIXES)


class EngineProxy:
    """ASGI middleware: requests for the engine's routes go to the engine process's app at ``uds_path``."""

    def __init__(self, app: Any, uds_path: str) -> None:
        self.app = app
        self.uds_path = uds_path
        self.state = app.state       # the launcher's shutdown drains the app's bridges through it

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or is_local(scope["path"]):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            reader, writer = await asyncio.open_unix_connection(self.uds_path)
        except OSError:
            await _send_plain(send, 503, b'{"error":"the engine process is not reachable"}')
            return
        try:
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            head = [scope["method"].encode() + b" " + target + b" HTTP/1.1", b"host: engine", b"connection: close",
                    b"content-length: " + str(len(body)).encode()]
            head += [k + b": " + v for k, v in scope["headers"] if k.lower() not in _HOP and k.lower() != b"host"]
            writer.write(b"\r\n".join(head) + b"\r\n\r\n" + bytes(body))
            await writer.drain()
            await _relay_response(reader, send)
        finally:
            writer.close()


async def _send_plain(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _relay_response(reader: asyncio.StreamReader, send: Any) -> None:
    status_line = await reader.readline()
    status = int(status_line.split(b" ", 2)[1])
    headers: list[tuple[bytes, bytes]] = []
    chunked = False
    length: int | None = None
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.rstrip(b"\r\n").partition(b":")
        k, v = k.strip().lower(), v.strip()
        if k == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
        elif k == b"content-length":
            length = int(v)
        if k not in _HOP:
            headers.append((k, v))
    if length is not None and not chunked:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            await send({"type": "http.response.body", "body": data, "more_body": True})
    elif length is not None:
        left = length
        while left > 0:
            data = await reader.read(min(left, _CHUNK))
            if not data:
                break
            left -= len(data)
            await send({"type": "http.response.body", "body": data, "more_body": True})
    else:
        while data := await reader.read(_CHUNK):
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
