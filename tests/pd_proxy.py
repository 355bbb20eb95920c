"""A toy prefill/decode proxy with the semantics of vLLM's disaggregated-serving toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in vLLM's repository), for the P/D tests and for trying
P/D by hand:

    python tests/pd_proxy.py --port 8000 --prefiller-port 8100 --decoder-port 8200

For each /v1/completions or /v1/chat/completions request: send it to a prefill instance (round robin) with
``max_tokens`` 1, ``stream`` false and ``kv_transfer_params {"do_remote_decode": true, ...}``; take the
``kv_transfer_params`` of its answer; send the original request with them to a decode instance and stream its
answer back. Needs fastapi, httpx and uvicorn (the test extra)."""

from __future__ import annotations

import argparse
import itertools
import threading
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def make_proxy(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    app = FastAPI()
    prefill = [httpx.AsyncClient(base_url=u + "/v1", timeout=None) for u in prefill_urls]
    decode = [httpx.AsyncClient(base_url=u + "/v1", timeout=None) for u in decode_urls]
    p_cycle, d_cycle = itertools.cycle(range(len(prefill))), itertools.cycle(range(len(decode)))

    async def handle(api: str, request: Request) -> StreamingResponse:
        body = await request.json()
        request_id = str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        p_body = dict(body)
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                        "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                        "remote_port": None}
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body.pop("stream_options", None)
        p_body.pop("min_tokens", None)             # not supported on P
        p_body.pop("min_completion_tokens", None)
        resp = await prefill[next(p_cycle)].post(api, json=p_body, headers=headers)
        resp.raise_for_status()
        params = resp.json().get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
        client = decode[next(d_cycle)]

        async def stream():
            async with client.stream("POST", api, json=body, headers=headers) as r:
                r.raise_for_status()
                async for chunk in r.aiter_bytes():
                    yield chunk

        return StreamingResponse(stream(), media_type="application/json")

    @app.get("/v1/models")
    async def models():
        # not in vLLM's toy proxy; load generators (kernelsight bench, vllm bench serve) ask for it first
        r = await decode[0].get("/models")
        return r.json()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/chat/completions", request)

    return app


class ProxyThread:
    """``with ProxyThread([p_url], [d_url]) as proxy: proxy.base_url`` — the proxy on an ephemeral port."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        import uvicorn

        cfg = uvicorn.Config(make_proxy(prefill_urls, decode_urls), host="127.0.0.1", port=0, log_level="warning",
                             access_log=False)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="pd-proxy")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __enter__(self) -> ProxyThread:
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            self.thread.join(0.01)
        raise RuntimeError("proxy did not start within 6 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-host", default="127.0.0.1")
    p.add_argument("--prefiller-port", type=int, nargs="+", default=[8100])
    p.add_argument("--decoder-host", default="127.0.0.1")
    p.add_argument("--decoder-port", type=int, nargs="+", default=[8200])
    a = p.parse_args()
    app = make_proxy([f"http://{a.prefiller_host}:{port}" for port in a.prefiller_port],
                     [f"http://{a.decoder_host}:{port}" for port in a.decoder_port])
    uvicorn.run(app, host=a.host, port=a.port)


if __name__ == "__main__":
    main()
