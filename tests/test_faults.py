"""The fault suite: one bad client cannot break the server. Hand-made bad inputs (vLLM's status and error shape,
never a 5xx or a hang), a storm of client disconnects beside healthy streams, more requests than --max-num-seqs,
and --api-key bypass attempts. After each, the engine is idle: running = waiting = 0, KV usage 0, no leaked blocks."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
MAX_LEN = 2048
ARGS = ["--max-model-len", str(MAX_LEN), "--seed", "0", "--time-scale", "20", "--num-gpu-blocks-override", "3000",
        "--served-model-name", MODEL, "--enable-lora", "--lora-modules", "adapter=/tmp/ks-adapter"]
JSON = {"content-type": "application/json"}
TIMEOUT = httpx.Timeout(20.0)


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


# -- the engine is idle: /metrics gauges, and the block pool -----------------------------------------------------
_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)$",
                    re.M)


def gauges(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in _GAUGE.finditer(text)}


def generation_tokens(text: str) -> float:
    m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "vllm:generation_tokens_total missing"
    return float(m.group(1))


async def wait_metrics_idle(c: httpx.AsyncClient, timeout_s: float = 15.0) -> dict[str, float]:
    """Poll /metrics until running = waiting = 0 and KV usage 0 (bounded); return the last gauges."""
    t_end = time.monotonic() + timeout_s
    while True:
        g = gauges((await c.get("/metrics")).text)
        assert len(g) == 3, g
        if all(v == 0 for v in g.values()) or time.monotonic() > t_end:
            return g
        await asyncio.sleep(0.02)


def assert_no_leaked_blocks(s: ServerThread) -> None:
    kv = s.bridge.engine
    free, unfinished = s.call(lambda: (kv.kv.num_free_blocks, kv.has_unfinished()))
    assert not unfinished
    assert free == s.config.num_gpu_blocks - 1, "KV blocks leaked (free != total - the null block)"


async def assert_serves_and_idle(s: ServerThread, c: httpx.AsyncClient) -> None:
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "still alive", "max_tokens": 5,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert await wait_metrics_idle(c) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                          "vllm:kv_cache_usage_perc": 0}
    assert_no_leaked_blocks(s)


# -- 1. hand-made bad inputs ---------------------------------------------------------------------------------------
def _j(obj) -> bytes:
    return json.dumps(obj).encode()


CMPL, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "hi"}]
DEEP = b"[" * 10_000 + b"]" * 10_000

# (id, path, body bytes, content type, status, error type, exact message or None)
CASES = [
    ("malformed-json", CMPL, b'{"prompt": "x",', "application/json", 400, "Bad Request", None),
    ("malformed-json-chat", CHAT, b'{"messages": [}', "application/json", 400, "Bad Request", None),
    ("malformed-json-tok", TOK, b"{bad", "application/json", 400, "Bad Request", None),
    ("malformed-json-detok", DETOK, b"{bad", "application/json", 400, "Bad Request", None),
    ("empty-body", CMPL, b"", "application/json", 400, "Bad Request", None),
    ("empty-body-chat", CHAT, b"", "application/json", 400, "Bad Request", None),
    ("json-array-body", CMPL, b"[]", "application/json", 400, "Bad Request", None),
    ("deep-nesting-body", CMPL, DEEP, "application/json", 400, "Bad Request", "There was an error parsing the body"),
    ("deep-nesting-prompt", CMPL, b'{"prompt": ' + DEEP + b"}", "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("deep-nesting-chat", CHAT, b'{"messages": ' + DEEP + b"}", "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("deep-nesting-tok", TOK, b'{"prompt": ' + DEEP + b"}", "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("deep-nesting-detok", DETOK, b'{"tokens": ' + DEEP + b"}", "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("invalid-utf8", CMPL, b'{"prompt": "\xff\xfe abc"}', "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("invalid-utf8-chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "application/json", 400,
     "Bad Request", "There was an error parsing the body"),
    ("invalid-utf8-detok", DETOK, b"\xff", "application/json", 400, "Bad Request",
     "There was an error parsing the body"),
    ("content-type-text", CMPL, _j({"prompt": "x"}), "text/plain", 400, "Bad Request",
     "Unsupported Media Type: Only 'application/json' is allowed"),
    ("content-type-form", CHAT, _j({"messages": MSG}), "application/x-www-form-urlencoded", 400, "Bad Request",
     "Unsupported Media Type: Only 'application/json' is allowed"),
    ("content-type-none", TOK, _j({"prompt": "x"}), "", 400, "Bad Request",
     "Unsupported Media Type: Only 'application/json' is allowed"),
    # wrong types, one main field at a time
    ("type-prompt-int", CMPL, _j({"prompt": 5}), "application/json", 400, "Bad Request", None),
    ("type-prompt-mixed-list", CMPL, _j({"prompt": [[1, 2], "x"]}), "application/json", 400, "Bad Request", None),
    ("type-max-tokens", CMPL, _j({"prompt": "x", "max_tokens": "many"}), "application/json", 400, "Bad Request", None),
    ("type-temperature", CMPL, _j({"prompt": "x", "temperature": "hot"}), "application/json", 400, "Bad Request",
     None),
    ("type-stream", CMPL, _j({"prompt": "x", "stream": "yes please"}), "application/json", 400, "Bad Request", None),
    ("type-n", CMPL, _j({"prompt": "x", "n": "two"}), "application/json", 400, "Bad Request", None),
    ("type-stop", CMPL, _j({"prompt": "x", "stop": 7}), "application/json", 400, "Bad Request", None),
    ("type-model", CMPL, _j({"prompt": "x", "model": 42}), "application/json", 400, "Bad Request", None),
    ("type-messages-str", CHAT, _j({"messages": "hi"}), "application/json", 400, "Bad Request", None),
    ("type-messages-list-of-lists", CHAT, _j({"messages": [["user", "hi"]]}), "application/json", 400,
     "Bad Request", None),
    ("type-max-completion-tokens", CHAT, _j({"messages": MSG, "max_completion_tokens": [1]}), "application/json", 400,
     "Bad Request", None),
    ("type-tok-prompt", TOK, _j({"prompt": 5}), "application/json", 400, "Bad Request", None),
    ("type-tok-messages", TOK, _j({"messages": "x"}), "application/json", 400, "Bad Request", None),
    ("type-detok-tokens", DETOK, _j({"tokens": "abc"}), "application/json", 400, "Bad Request", None),
    ("type-detok-token-str", DETOK, _j({"tokens": [1, "x"]}), "application/json", 400, "Bad Request", None),
    # messages of the wrong shape
    ("messages-empty", CHAT, _j({"messages": []}), "application/json", 400, "BadRequestError", None),
    ("messages-no-role", CHAT, _j({"messages": [{"content": "x"}]}), "application/json", 400, "BadRequestError",
     None),
    ("messages-content-int", CHAT, _j({"messages": [{"role": "user", "content": 5}]}), "application/json", 400,
     "BadRequestError", None),
    # found by tests/test_fuzz.py: the chat template raised on an empty list and /tokenize answered a bare 500
    ("tok-messages-empty", TOK, _j({"messages": []}), "application/json", 400, "BadRequestError", None),
    # sizes: a huge body, prompts beyond max_model_len
    ("huge-text-prompt-20MB", CMPL, _j({"prompt": "x" * (20 << 20)}), "application/json", 400, "BadRequestError",
     None),
    ("text-prompt-too-long", CMPL, _j({"prompt": "hello " * 3000}), "application/json", 400, "BadRequestError",
     None),
    ("token-prompt-too-long", CMPL, _j({"prompt": [5] * 3000}), "application/json", 400, "BadRequestError", None),
    ("chat-too-long", CHAT, _j({"messages": [{"role": "user", "content": "hello " * 3000}]}), "application/json",
     400, "BadRequestError", None),
    ("max-tokens-over-max-model-len", CMPL, _j({"prompt": "x", "max_tokens": 10**9}), "application/json", 400,
     "BadRequestError", None),
    # token ids out of vocabulary
    ("oov-token-id", CMPL, _j({"prompt": [1, 200_000]}), "application/json", 400, "BadRequestError", None),
    ("negative-token-id", CMPL, _j({"prompt": [1, -5]}), "application/json", 400, "BadRequestError", None),
    ("token-id-beyond-int64", CMPL, _j({"prompt": [1, 2**64]}), "application/json", 400, "BadRequestError", None),
    ("detok-oov", DETOK, _j({"tokens": [1, 200_000]}), "application/json", 400, "BadRequestError", None),
    ("detok-negative", DETOK, _j({"tokens": [-1]}), "application/json", 400, "BadRequestError", None),
    # limits
    ("n-zero", CMPL, _j({"prompt": "x", "n": 0}), "application/json", 400, "BadRequestError",
     "n must be at least 1, got 0."),
    ("n-negative-chat", CHAT, _j({"messages": MSG, "n": -1}), "application/json", 400, "BadRequestError",
     "n must be at least 1, got -1."),
    ("logprobs-over-20", CMPL, _j({"prompt": "x", "logprobs": 100}), "application/json", 400, "BadRequestError",
     "Requested sample logprobs of 100, which is greater than max allowed: 20"),
    ("top-logprobs-over-20", CHAT, _j({"messages": MSG, "logprobs": True, "top_logprobs": 100}), "application/json",
     400, "BadRequestError", "Requested sample logprobs of 100, which is greater than max allowed: 20"),
    ("max-tokens-negative", CMPL, _j({"prompt": "x", "max_tokens": -3}), "application/json", 400, "BadRequestError",
     "max_tokens must be at least 1, got -3."),
    ("temperature-negative", CMPL, _j({"prompt": "x", "temperature": -1}), "application/json", 400,
     "BadRequestError", None),
    # unknown model, unknown LoRA, path-like LoRA names: 404 before anything runs
    ("unknown-model", CMPL, _j({"prompt": "x", "model": "foo"}), "application/json", 404, "NotFoundError", None),
    ("unknown-lora", CMPL, _j({"prompt": "x", "model": "other-adapter"}), "application/json", 404, "NotFoundError",
     None),
    ("lora-dotdot", CHAT, _j({"messages": MSG, "model": "../x"}), "application/json", 404, "NotFoundError", None),
    ("lora-etc-passwd", CMPL, _j({"prompt": "x", "model": "/etc/passwd"}), "application/json", 404,
     "NotFoundError", None),
    ("lora-path-of-adapter", CMPL, _j({"prompt": "x", "model": "/tmp/ks-adapter"}), "application/json", 404,
     "NotFoundError", None),
    ("unknown-model-stream", CHAT, _j({"messages": MSG, "model": "foo", "stream": True}), "application/json", 404,
     "NotFoundError", None),
    ("unknown-model-tok", TOK, _j({"prompt": "x", "model": "zz"}), "application/json", 404, "NotFoundError", None),
]


@pytest.mark.parametrize("path,body,ctype,status,etype,msg", [pytest.param(*c[1:], id=c[0]) for c in CASES])
async def test_bad_input(srv, path, body, ctype, status, etype, msg):
    headers = {"content-type": ctype} if ctype else {}
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as c:
        r = await c.post(path, content=body, headers=headers)
    assert r.status_code == status, r.text[:400]
    body_json = r.json()
    assert list(body_json) == ["error"], body_json
    e = body_json["error"]
    assert list(e) == ["message", "type", "param", "code"], e
    assert e["type"] == etype and e["code"] == status and isinstance(e["message"], str) and e["message"]
    if msg is not None:
        assert e["message"] == msg
    if etype == "NotFoundError":
        assert e["param"] == "model"
    if msg == "There was an error parsing the body" or (msg or "").startswith("Unsupported Media Type"):
        assert e["param"] is None


async def test_best_of_is_an_ignored_extra_field(srv):
    """0.33 dropped best_of: any value (1000, a string) is an ignored extra field, not an error (wire contract §2.1)."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as c:
        for v in (1000, "all"):
            r = await c.post(CMPL, json={"prompt": "x", "best_of": v, "n": 1, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["choices"]) == 1


async def test_huge_tokenize_does_not_stall_the_server(srv):
    """A stream in flight keeps its cadence while another client tokenizes a 2 MB prompt (/tokenize has no length
    limit, as in vLLM). Before the fix the encode ran on the loop and the stream stalled ~2 s (4 s at 4 MB)."""
    body = {"model": MODEL, "prompt": "steady", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as c:
        async with c.stream("POST", CMPL, json=body) as r:
            it = r.aiter_bytes()
            await it.__anext__()                                   # the stream is running
            big = asyncio.create_task(c.post(TOK, content=_j({"prompt": "hello world " * ((2 << 20) // 12)}),
                                             headers=JSON))
            small_task = asyncio.gather(*[c.post(TOK, json={"prompt": f"hello {i}"}) for i in range(50)])
            gaps, last = [], time.monotonic()
            async for _ in it:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            # the loop's own encodes run beside the thread's (one HF tokenizer, no truncation changes: shared borrows)
            small = await small_task
            assert [x.json()["tokens"] for x in small] == [srv.state.tok.encode(f"hello {i}") for i in range(50)]
            rb = await big
            assert rb.status_code == 200 and rb.json()["count"] == 2 + 2 * ((2 << 20) // 12)
    assert max(gaps) < 0.5, f"the stream stalled {max(gaps):.1f} s behind one /tokenize"


def test_bad_input_table_covers_every_route():
    assert {c[1] for c in CASES} == {CMPL, CHAT, TOK, DETOK}
    assert len({c[0] for c in CASES}) == len(CASES)


async def test_server_whole_after_bad_inputs(srv):
    """After the table (module order: it ran first), and after the table again on one keep-alive connection."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as c:
        for _, path, body, ctype, status, *_ in CASES:
            r = await c.post(path, content=body, headers={"content-type": ctype} if ctype else {})
            assert r.status_code == status
        await assert_serves_and_idle(srv, c)


# -- 2. disconnect storm -----------------------------------------------------------------------------------------
async def _read_stream(c: httpx.AsyncClient, body: dict) -> list[str]:
    async with c.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        raw = b"".join([b async for b in r.aiter_bytes()]).decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    return [p[len("data: "):] for p in raw.split("\n\n")[:-1]]


async def _disconnect_after(c: httpx.AsyncClient, body: dict, n_chunks: int) -> int:
    seen = 0
    async with c.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        async for chunk in r.aiter_bytes():
            seen += chunk.count(b"data: ")
            if seen >= n_chunks:
                break          # leaving the block closes the connection mid-stream
    return seen


@pytest.mark.parametrize("n_bad,n_good", [(200, 16), pytest.param(1000, 32, marks=pytest.mark.slow)])
async def test_disconnect_storm(srv, n_bad, n_good):
    rng = random.Random(n_bad)
    good_body = {"model": MODEL, "prompt": "a healthy stream", "max_tokens": 48, "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT, limits=limits) as c:
        sem = asyncio.Semaphore(100)

        async def bad(i: int) -> int:
            async with sem:
                body = {"model": MODEL, "prompt": f"doomed stream {i} " * rng.randint(1, 40), "max_tokens": 1500,
                        "ignore_eos": True, "stream": True}
                return await _disconnect_after(c, body, rng.randint(1, 5))

        gen0 = generation_tokens((await c.get("/metrics")).text)
        bad_tasks = [asyncio.create_task(bad(i)) for i in range(n_bad)]
        good = await asyncio.gather(*[_read_stream(c, good_body) for _ in range(n_good)])
        seen = await asyncio.gather(*bad_tasks)
        assert all(s >= 1 for s in seen)
        for events in good:
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in ch for ch in chunks)
            text_chunks = [ch for ch in chunks if ch["choices"]]
            assert len(text_chunks) == 48
            assert [ch["choices"][0]["finish_reason"] for ch in text_chunks] == [None] * 47 + ["length"]
        await assert_serves_and_idle(srv, c)
        # the disconnects aborted their requests: run to the end they would have made n_bad * 1500 tokens
        generated = generation_tokens((await c.get("/metrics")).text) - gen0
        assert generated < n_bad * 100 + n_good * 48 + 5, generated


# -- 3. overload: more concurrent requests than --max-num-seqs -------------------------------------------------------
@pytest.mark.parametrize("n_req,scale", [(100, "20"), pytest.param(2000, "50", marks=pytest.mark.slow)])
async def test_overload_queues_everything(n_req, scale):
    args = ["--max-model-len", "1024", "--seed", "0", "--time-scale", scale, "--max-num-seqs", "8",
            "--num-gpu-blocks-override", "400"]
    with ServerThread(args) as s:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=s.base_url, timeout=httpx.Timeout(120.0), limits=limits) as c:
            peak = {"running": 0, "waiting": 0}
            stop = threading.Event()

            async def watch():
                # sampled on the server's loop: a /metrics scraper on this loop is starved by the requests' sends
                sched = s.bridge.engine.scheduler
                while not stop.is_set():
                    peak["running"] = max(peak["running"], len(sched.running))
                    peak["waiting"] = max(peak["waiting"], len(sched.waiting))
                    await asyncio.sleep(0.001)

            assert s.loop is not None
            watcher = asyncio.run_coroutine_threadsafe(watch(), s.loop)
            body = {"prompt": "overload me", "max_tokens": 16, "ignore_eos": True}
            rs = await asyncio.gather(*[c.post(CMPL, json=body) for _ in range(n_req)])
            stop.set()
            watcher.result(timeout=10)
            assert [r.status_code for r in rs] == [200] * n_req
            assert all(r.json()["usage"]["completion_tokens"] == 16 for r in rs)
            assert peak["running"] == 8          # the batch filled to --max-num-seqs, never beyond
            assert peak["waiting"] > 0, ("no request ever waited: the test did not overload the engine", peak)
        async with httpx.AsyncClient(base_url=s.base_url, timeout=TIMEOUT) as c:
            await assert_serves_and_idle(s, c)


# -- 4. --api-key bypass attempts ------------------------------------------------------------------------------------
KEY = "sekret"


async def raw_request(port: int, method: str, target: str, headers: dict[str, str] | None = None,
                      body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with the target sent byte for byte (httpx would normalise dot segments and slashes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    hdrs = {"Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body)), **(headers or {})}
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.fixture(scope="module")
def keyed():
    with ServerThread(["--max-model-len", "1024", "--seed", "0", "--api-key", KEY, "--num-gpu-blocks-override", "64",
                       "--served-model-name", MODEL]) as s:
        yield s


CMPL_BODY = _j({"prompt": "x", "max_tokens": 2})
PROTECTED = [("GET", "/v1/models", b""), ("POST", CMPL, CMPL_BODY), ("POST", CHAT, _j({"messages": MSG})),
             ("POST", "/v1/load_lora_adapter", _j({"lora_name": "a", "lora_path": "/tmp/a"})),
             ("POST", "/v1/unload_lora_adapter", _j({"lora_name": "a"})), ("POST", "/v2/embed", b"{}"),
             ("POST", "/inference/v1/generate", b"{}"), ("POST", "/v1/embeddings", b"{}")]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p[1] for p in PROTECTED])
async def test_api_key_guards_protected_routes(keyed, method, path, body):
    for auth in (None, "Bearer nope", f"Bearer {KEY}x", KEY, f"Basic {KEY}", "Bearer"):
        hdrs = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
        status, resp = await raw_request(keyed.port, method, path, hdrs, body)
        assert (status, json.loads(resp)) == (401, {"error": "Unauthorized"}), (auth, status, resp[:200])


BYPASS = [
    ("GET", "/v1/models", {"authorization": "bearer " + KEY}),          # the Bearer scheme's case is exact in vLLM
    ("GET", "/v1/models", {"Authorization": "BEARER " + KEY}),
    ("GET", "/v1/models", {"Authorization": "Bearer  " + KEY}),
    ("GET", "/v1/models", {"Authorization": "Bearer " + KEY.upper()}),
    ("GET", "/v1/models/", {}), ("GET", "//v1/models", {}), ("POST", "//v1/completions", {}),
    ("POST", "/v1//completions", {}), ("POST", "/v1/../v1/completions", {}), ("GET", "/./v1/models", {}),
    ("GET", "/%761/models", {}), ("GET", "/%2Fv1/models", {}), ("GET", "/v1%2Fmodels", {}), ("GET", "/V1/models", {}),
    ("POST", "/v1/completions?x=/health", {}), ("GET", "http://127.0.0.1/v1/models", {}),
    ("GET", "/health/../v1/models", {}), ("HEAD", "/v1/models", {}), ("OPTIONS", "/v1/models", {}),
    ("OPTIONS", CMPL, {}), ("POST", "/v1/completions;x", {}), ("POST", "/v1/completions%00", {}),
]


@pytest.mark.parametrize("method,target,headers", BYPASS, ids=[f"{m} {t} {list(h.values())}" for m, t, h in BYPASS])
async def test_api_key_no_bypass(keyed, method, target, headers):
    """Without the right key, no spelling of a protected route reaches its handler: the answer is the 401, or a
    routing answer (404 no such path, 405 OPTIONS/HEAD on a route without that method) — never 2xx, never a 400
    from a handler's body check, never a 5xx."""
    body = CMPL_BODY if method == "POST" else b""
    status, resp = await raw_request(keyed.port, method, target, {"Content-Type": "application/json", **headers},
                                     body)
    assert status in (401, 404, 405), (status, resp[:300])
    if status == 401 and method != "HEAD":
        assert json.loads(resp) == {"error": "Unauthorized"}
    if status == 404:
        assert json.loads(resp) == {"detail": "Not Found"}
    if method not in ("OPTIONS",) and target.split("?")[0].rstrip("/") in ("/v1/models", CMPL, "/%761/models"):
        assert status == 401, "a path that routes to a protected handler must need the key"


OPEN = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping"), ("POST", "/ping"),
        ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/load")]


@pytest.mark.parametrize("method,path", OPEN, ids=[f"{m} {p}" for m, p in OPEN])
async def test_open_routes_stay_open(keyed, method, path):
    body = {"/tokenize": _j({"prompt": "hi"}), "/detokenize": _j({"tokens": [9906]})}.get(path, b"")
    status, resp = await raw_request(keyed.port, method, path, {"Content-Type": "application/json"}, body)
    assert status == 200, (status, resp[:200])


async def test_api_key_accepts_the_key_and_stays_whole(keyed):
    good = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, resp = await raw_request(keyed.port, "POST", CMPL, good, CMPL_BODY)
    assert status == 200 and json.loads(resp)["usage"]["completion_tokens"] >= 1
    status, _ = await raw_request(keyed.port, "GET", "/v1/models", {"AUTHORIZATION": f"Bearer {KEY}"})
    assert status == 200                           # header names are case-insensitive (ASGI lower-cases them)
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=TIMEOUT) as c:
        assert await wait_metrics_idle(c) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                              "vllm:kv_cache_usage_perc": 0}
    assert_no_leaked_blocks(keyed)
