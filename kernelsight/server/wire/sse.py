"""Responses that follow the client's connection: ``SSEResponse`` (a text/event-stream whose generator is
cancelled the moment the client disconnects, with the stream fast path's hand-off), and ``await_or_disconnect``
(a non-streaming request's wait, aborted if the client goes away)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from kernelsight.server.engine.bridge import EngineBridge, Submission
from kernelsight.server.engine.fastpath import RAW_SEND_KEY, FastStream


async def watch_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """text/event-stream whose generator is cancelled the moment the client disconnects (so the request is
    aborted at once, even while it waits in the queue and nothing is being written)."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, gen: AsyncIterator[str], headers: dict[str, str] | None = None,
                 fast: FastStream | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.body = b""
        raw = [(b"content-type", self.media_type.encode("latin-1"))]
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        self.raw_headers = raw     # no content-length: the body is streamed
        self.gen = gen
        self.fast = fast

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        me = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            await watch_disconnect(receive)
            if self.fast is not None and self.fast.completed:
                return                  # uvicorn reports its own end of the response as a disconnect
            gone = True
            if me is not None:
                me.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if self.fast is not None and await self.fast.run(scope.get(RAW_SEND_KEY), send):
                return                  # the engine loop wrote everything, the end of the response included
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (asyncio.CancelledError, OSError):
            if not gone:
                raise
            if me is not None:
                me.uncancel()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            with contextlib.suppress(Exception):
                await self.gen.aclose()


async def await_or_disconnect(request: Request, sub: Submission, bridge: EngineBridge,
                              until: Callable[[], bool] | None = None) -> bool:
    """Wait for a non-streaming submission (or, with ``until``, for that to hold after a release); False (and the
    request aborted) if the client went away."""
    watcher = asyncio.create_task(watch_disconnect(request.receive))
    try:
        while not sub.done and not (until is not None and until()):
            waiter = asyncio.create_task(sub.event.wait())
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                waiter.cancel()
                bridge.abort(sub)
                return False
            sub.event.clear()
        return True
    except asyncio.CancelledError:
        bridge.abort(sub)
        raise
    finally:
        watcher.cancel()
