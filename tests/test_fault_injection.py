"""Fault injection and admission limits through real HTTP: each fault type as a client sees it (vLLM's error bodies, a
request never answered, a stream cut or paused half-way, a slow or unready replica), the seeded picks, the header
that forces a fault, the admin endpoint turning a healthy replica bad and back mid-test, the counters, and vLLM
0.33's --max-num-queued-reqs / --max-num-queued-tokens rejecting exactly beyond their limits. After every type the
engine is consistent: running = waiting = 0, KV usage 0, every block back in the pool."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.integrations.faults import (  # noqa: E402
    BUSY_MESSAGE,
    LLM_D_FAULTS,
    REQUEST_FAULTS,
    TOKEN_BACKLOG_MESSAGE,
    FaultConfig,
    FaultPicker,
)
from kernelsight.server.runner import ServerThread  # noqa: E402
from kernelsight.server.serve_args import fault_config_from, serve_parser  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
ARGS = ["--max-model-len", "2048", "--seed", "0", "--time-scale", "20", "--num-gpu-blocks-override", "3000",
        "--served-model-name", MODEL, "--record-timings"]
CMPL, CHAT, FAULTS = "/v1/completions", "/v1/chat/completions", "/kernelsight/faults"
TIMEOUT = httpx.Timeout(20.0)
DEFAULTS = {"rate": 0.0, "types": [], "seed": 0, "slow_factor": 4.0, "stall_s": 5.0, "timeout_s": 60.0}


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


@pytest.fixture
async def c(srv):
    """A client on the shared server, whose fault settings start from the defaults (nothing injected)."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as client:
        assert (await client.post(FAULTS, json=DEFAULTS)).status_code == 200
        yield client


def body(stream: bool = False, max_tokens: int = 8, chat: bool = False, **kw) -> dict:
    if chat:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream, "return_token_ids": True, **kw}
    return {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "return_token_ids": True, **kw}


# -- the engine is consistent ---------------------------------------------------------------------------------------
_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)$",
                    re.M)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics text (labels given must match; others are ignored)."""
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"{name}{labels} not in /metrics")


async def assert_engine_clean(s: ServerThread, c: httpx.AsyncClient) -> None:
    """Gauges at 0 (polled: they drop at the next step), nothing unfinished in engine or bridge, no leaked block."""
    t_end = time.monotonic() + 15
    while True:
        g = {m.group(1): float(m.group(2)) for m in _GAUGE.finditer((await c.get("/metrics")).text)}
        if all(v == 0 for v in g.values()) or time.monotonic() > t_end:
            break
        await asyncio.sleep(0.02)
    assert g == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0}
    eng = s.bridge.engine
    free, unfinished, seqs = s.call(lambda: (eng.kv.num_free_blocks, eng.has_unfinished(), s.bridge.num_unfinished))
    assert not unfinished and seqs == 0
    assert free == s.config.num_gpu_blocks - 1, "KV blocks leaked (free != total - the null block)"


async def injected(c: httpx.AsyncClient) -> dict[str, int]:
    """Injected faults by type, from /metrics, checked against the admin endpoint's own count."""
    text = (await c.get("/metrics")).text
    from_metrics = {t: int(metric(text, "kernelsight:injected_faults_total", type=t))
                    for t in (*REQUEST_FAULTS, "slow", "unready")}
    assert (await c.get(FAULTS)).json()["injected"] == from_metrics
    return from_metrics


# -- faults answered with an error ------------------------------------------------------------------------------------
ERRORS = [  # (header, status, type, exact message or None, param)
    ("429", 429, "Too Many Requests", f"Too many requests for model {MODEL}. Please try again later.", None),
    ("rate_limit", 429, "Too Many Requests", None, None),            # llm-d-inference-sim's name
    ("500", 500, "InternalServerError", "Internal server error", None),
    ("server_error", 500, "InternalServerError", "Internal server error", None),
    ("503", 503, "Service Unavailable", BUSY_MESSAGE, None),
    ("context_length", 400, "BadRequestError", None, "input_tokens"),
    ("invalid_request", 400, "BadRequestError", "Invalid request.", None),
    ("model_not_found", 404, "NotFoundError", None, "model"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("header,status,etype,msg,param", ERRORS, ids=[e[0] for e in ERRORS])
async def test_error_fault_as_client_sees_it(srv, c, header, status, etype, msg, param, chat, stream):
    canonical = {"rate_limit": "429", "server_error": "500"}.get(header, header)
    before = await injected(c)
    m0 = (await c.get("/metrics")).text
    r = await c.post(CHAT if chat else CMPL, json=body(stream, chat=chat), headers={"X-Kernelsight-Fault": header})
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")    # before any stream: a plain error answer
    e = r.json()["error"]
    assert list(e) == ["message", "type", "param", "code"]
    assert (e["type"], e["code"], e["param"]) == (etype, status, param)
    if msg is not None:
        assert e["message"] == msg
    after = await injected(c)
    assert after[canonical] == before[canonical] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    await assert_engine_clean(srv, c)
    # it never reached the engine: vLLM's request series did not move
    m1 = (await c.get("/metrics")).text
    for name in ("vllm:request_params_n_count", "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        assert metric(m1, name) == metric(m0, name), name


async def test_invalid_api_key_fault_is_vllms_401(srv, c):
    r = await c.post(CMPL, json=body(), headers={"X-Kernelsight-Fault": "invalid_api_key"})
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    await assert_engine_clean(srv, c)


async def test_header_must_name_a_request_fault(srv, c):
    for value, hint in (("bogus", "unknown fault type 'bogus'"), ("slow", "replica state")):
        r = await c.post(CMPL, json=body(), headers={"X-Kernelsight-Fault": value})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert hint in r.json()["error"]["message"]
    r = await c.post(CMPL, json=body(max_tokens=3), headers={"X-Kernelsight-Fault": ""})      # empty: no fault
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- timeout: never answered ------------------------------------------------------------------------------------------
async def test_timeout_client_gives_up_first(srv, c):
    """A hung replica: the client's own timeout fires; nothing entered the engine."""
    assert (await c.post(FAULTS, json={"timeout_s": 30})).status_code == 200
    timeouts0 = (await injected(c))["timeout"]
    with pytest.raises(httpx.ReadTimeout):
        await c.post(CMPL, json=body(), headers={"X-Kernelsight-Fault": "timeout"}, timeout=httpx.Timeout(0.4))
    assert (await injected(c))["timeout"] == timeouts0 + 1
    await assert_engine_clean(srv, c)


@pytest.mark.parametrize("stream", [False, True])
async def test_timeout_connection_dropped_after_timeout_s(srv, c, stream):
    """Held timeout_s, then the connection closes with no response at all (not a status, not a header)."""
    assert (await c.post(FAULTS, json={"timeout_s": 0.3})).status_code == 200
    t0 = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        await c.post(CMPL, json=body(stream), headers={"X-Kernelsight-Fault": "timeout"})
    assert time.monotonic() - t0 >= 0.3
    await assert_engine_clean(srv, c)


# -- stream-abort and stream-stall: in the engine, then broken --------------------------------------------------------
async def read_events(r: httpx.Response) -> tuple[list[str], Exception | None]:
    """The SSE data fields read until the stream ends or breaks (and how it broke)."""
    raw, err = b"", None
    try:
        async for chunk in r.aiter_bytes():
            raw += chunk
    except httpx.HTTPError as exc:
        err = exc
    return [p[len("data: "):] for p in raw.decode().split("\n\n") if p.startswith("data: ")], err


def generated(events: list[str], chat: bool) -> int:
    """Tokens streamed (the requests ask for return_token_ids: a chunk may carry several tokens)."""
    return sum(len(ch.get("token_ids") or []) for e in events if e != "[DONE]" for ch in json.loads(e)["choices"])


@pytest.mark.parametrize("chat", [False, True])
async def test_stream_abort_cuts_the_stream_and_frees_the_request(srv, c, chat):
    aborts0 = (await injected(c))["stream-abort"]
    gen0 = metric((await c.get("/metrics")).text, "vllm:generation_tokens_total")
    async with c.stream("POST", CHAT if chat else CMPL, json=body(True, max_tokens=400, chat=chat),
                        headers={"X-Kernelsight-Fault": "stream-abort"}) as r:
        assert r.status_code == 200
        events, err = await read_events(r)
    assert isinstance(err, httpx.RemoteProtocolError)       # closed mid-body: no terminating chunk
    assert "[DONE]" not in events
    assert 0 < generated(events, chat) < 200                 # it stops before the half-way chunk
    await assert_engine_clean(srv, c)
    # aborted in the engine at the cut: run to the end it would have made 400 tokens
    assert metric((await c.get("/metrics")).text, "vllm:generation_tokens_total") - gen0 < 250
    assert (await injected(c))["stream-abort"] == aborts0 + 1


async def test_stream_abort_non_streaming_gets_no_answer(srv, c):
    gen0 = metric((await c.get("/metrics")).text, "vllm:generation_tokens_total")
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        await c.post(CMPL, json=body(max_tokens=400), headers={"X-Kernelsight-Fault": "stream-abort"})
    await assert_engine_clean(srv, c)
    assert metric((await c.get("/metrics")).text, "vllm:generation_tokens_total") - gen0 < 250


@pytest.mark.parametrize("chat", [False, True])
async def test_stream_stall_pauses_half_way_then_completes(srv, c, chat):
    assert (await c.post(FAULTS, json={"stall_s": 0.8})).status_code == 200
    gaps: list[tuple[float, int]] = []       # (gap before this read, tokens read before it)
    raw = b""
    async with c.stream("POST", CHAT if chat else CMPL, json=body(True, max_tokens=40, chat=chat),
                        headers={"X-Kernelsight-Fault": "stream-stall"}) as r:
        assert r.status_code == 200
        last = time.monotonic()
        async for chunk in r.aiter_bytes():
            now = time.monotonic()
            gaps.append((now - last, generated([p[6:] for p in raw.decode().split("\n\n") if p[:6] == "data: "],
                                               chat)))
            last = now
            raw += chunk
    events = [p[6:] for p in raw.decode().split("\n\n") if p[:6] == "data: "]
    assert events[-1] == "[DONE]" and generated(events, chat) == 40     # nothing lost
    gap, before = max(gaps)
    # the stall: nothing for stall_s (less the client's own lag in reading the chunk before it) ...
    assert gap >= 0.7
    assert before >= 20                     # ... once half the tokens were out
    await assert_engine_clean(srv, c)


# -- replica states ---------------------------------------------------------------------------------------------------
async def test_slow_multiplies_simulated_step_times(srv, c):
    """Same shapes (distinct token ids: no prefix hit), alone on the engine: every virtual token time ×3 exactly."""
    async def virtual_times(rid: str, first_id: int) -> list[float]:
        r = await c.post(CMPL, json={"prompt": list(range(first_id, first_id + 64)), "max_tokens": 12,
                                     "ignore_eos": True}, headers={"X-Request-Id": rid})
        assert r.status_code == 200
        rec = (await c.get("/kernelsight/timings")).json()["requests"][f"cmpl-{rid}"]
        return [t - rec["arrival_s"] for t in rec["token_times_s"]]

    normal = await virtual_times("slow-test-a", 1000)
    slow0 = (await injected(c))["slow"]
    assert (await c.post(FAULTS, json={"types": ["slow"], "slow_factor": 3})).status_code == 200
    slow = await virtual_times("slow-test-b", 2000)
    assert (await injected(c))["slow"] == slow0 + 1
    assert len(slow) == len(normal) == 12
    assert slow == pytest.approx([3 * t for t in normal], rel=1e-9)
    assert (await c.post(FAULTS, json={"types": []})).status_code == 200
    again = await virtual_times("slow-test-c", 3000)
    assert again == pytest.approx(normal, rel=1e-9)          # healthy again
    await assert_engine_clean(srv, c)


async def test_admin_turns_a_replica_unready_and_back(srv, c):
    assert (await c.get("/health")).status_code == 200
    unready0 = (await injected(c))["unready"]
    r = await c.post(FAULTS, json={"types": ["unready"]})
    assert r.status_code == 200 and r.json()["types"] == ["unready"]
    for path, method in (("/health", "GET"), ("/ping", "GET"), ("/ping", "POST")):
        r = await c.request(method, path)
        assert (r.status_code, r.content) == (503, b"")    # vLLM's /health when its engine is dead: 503, empty
    assert (await c.get("/v1/models")).status_code == 200   # the API itself still answers
    r = await c.post(CMPL, json=body(max_tokens=4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert (await injected(c))["unready"] == unready0 + 3
    assert (await c.post(FAULTS, json={"failure-types": []})).status_code == 200     # llm-d's key works too
    assert (await c.get("/health")).status_code == 200
    assert (await injected(c))["unready"] == unready0 + 3
    await assert_engine_clean(srv, c)


# -- the seeded rate --------------------------------------------------------------------------------------------------
async def _statuses(c: httpx.AsyncClient, n: int) -> list[int]:
    out = []
    for _ in range(n):        # one at a time: the k-th request takes the k-th decision
        r = await c.post(CMPL, json=body(max_tokens=1))
        out.append(r.status_code)
    return out


async def test_seeded_rate_picks_the_same_requests(srv, c):
    settings = {"rate": 0.4, "types": ["429", "500", "503"], "seed": 7}
    assert (await c.post(FAULTS, json=settings)).status_code == 200
    before = await injected(c)
    first = await _statuses(c, 40)
    assert (await c.post(FAULTS, json={"seed": 7})).status_code == 200     # a seed restarts the picks
    second = await _statuses(c, 40)
    assert first == second
    # the decisions are the picker's, in request order
    picker = FaultPicker(FaultConfig(rate=0.4, types=("429", "500", "503"), seed=7))
    expect = [{None: 200, "429": 429, "500": 500, "503": 503}[picker.pick()] for _ in range(40)]
    assert first == expect
    assert 5 <= sum(s != 200 for s in first) <= 30 and len(set(first)) == 4
    assert (await c.post(FAULTS, json={"seed": 8})).status_code == 200
    third = await _statuses(c, 40)
    assert third != first
    # the counters add up to what the clients saw, type by type
    after = await injected(c)
    seen = first + second + third
    for t in ("429", "500", "503"):
        assert after[t] - before[t] == seen.count(int(t))
    assert sum(after.values()) - sum(before.values()) == sum(s != 200 for s in seen)
    await assert_engine_clean(srv, c)


async def test_rate_one_faults_every_request_and_counts_each(srv, c):
    assert (await c.post(FAULTS, json={"failure-injection-rate": 100, "failure-types": ["rate_limit"]})).json()[
        "types"] == ["429"]
    before = await injected(c)
    statuses = await _statuses(c, 10)
    assert statuses == [429] * 10
    after = await injected(c)
    assert after["429"] - before["429"] == 10 and sum(after.values()) - sum(before.values()) == 10
    await assert_engine_clean(srv, c)


# -- the admin endpoint -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"rate": 2}, {"rate": "x"}, {"types": ["nope"]}, {"types": 5}, {"seed": 1.5},
                                 {"slow_factor": 0}, {"stall_s": -1}, {"colour": "red"}, [1, 2], "x"])
async def test_admin_rejects_bad_settings_and_keeps_the_old(srv, c, bad):
    r = await c.post(FAULTS, json=bad)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    got = (await c.get(FAULTS)).json()
    assert {k: got[k] for k in DEFAULTS} == DEFAULTS


async def test_admin_is_behind_the_api_key():
    with ServerThread(["--max-model-len", "1024", "--api-key", "k3y", "--num-gpu-blocks-override", "64"]) as s:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=TIMEOUT) as c:
            assert (await c.get(FAULTS)).status_code == 401
            assert (await c.post(FAULTS, json={"types": ["unready"]})).status_code == 401
            assert (await c.get("/health")).status_code == 200          # unchanged
            ok = {"Authorization": "Bearer k3y"}
            assert (await c.post(FAULTS, json={"types": ["unready"]}, headers=ok)).status_code == 200
            assert (await c.get("/health")).status_code == 503


# -- flags ------------------------------------------------------------------------------------------------------------
def test_flags_and_llm_d_names():
    def cfg(*argv: str) -> FaultConfig:
        return fault_config_from(serve_parser().parse_args(list(argv)))

    assert cfg() == FaultConfig()                                    # off by default
    assert cfg("--fault-rate", "0.1").types == REQUEST_FAULTS        # a rate alone: any per-request fault
    c1 = cfg("--fault-rate", "0.2", "--fault-types", "429,stream-abort", "unready", "--seed", "5")
    assert (c1.rate, c1.types, c1.seed, c1.unready, c1.slow) == (0.2, ("429", "stream-abort", "unready"), 5, True,
                                                                  False)
    assert cfg("--fault-seed", "9", "--seed", "5").seed == 9
    c2 = cfg("--failure-injection-rate", "25", "--failure-types", "rate_limit", "server_error")
    assert (c2.rate, c2.types) == (0.25, ("429", "500"))
    c3 = cfg("--failure-injection-rate", "10")                        # llm-d: no types = any of its error types
    assert (c3.rate, c3.types) == (0.1, LLM_D_FAULTS) and not set(c3.types) & {"timeout", "stream-abort"}
    with pytest.raises(ValueError, match="unknown fault type"):
        cfg("--fault-types", "429,teapot")
    with pytest.raises(ValueError, match="not both"):
        cfg("--fault-rate", "0.1", "--failure-injection-rate", "10")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--fault-rate", "1.5"])


# -- back-pressure: vLLM 0.33's admission limits ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited():
    # one running slot, so everything after the first stream waits (and stays in prefill) for the test's length
    with ServerThread(["--max-model-len", "2048", "--seed", "0", "--max-num-seqs", "1", "--max-num-queued-reqs",
                       "4", "--max-num-queued-tokens", "100", "--num-gpu-blocks-override", "400",
                       "--served-model-name", MODEL]) as s:
        yield s


async def _open(c: httpx.AsyncClient, stack, prompt: list[int], n: int = 1) -> httpx.Response:
    """A long stream, opened: its 200 headers mean it was admitted and submitted to the engine."""
    r = await stack.enter_async_context(c.stream("POST", CMPL, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": True, "n": n}))
    return r


def _rejections(text: str, reason: str) -> float:
    return metric(text, "vllm:admission_rejections_total", reason=reason)


async def test_max_num_queued_reqs_rejects_exactly_beyond_the_limit(limited):
    import contextlib

    async with httpx.AsyncClient(base_url=limited.base_url, timeout=TIMEOUT,
                                 limits=httpx.Limits(max_connections=None)) as c:
        rej0 = _rejections((await c.get("/metrics")).text, "max_num_queued_reqs")
        async with contextlib.AsyncExitStack() as stack:
            for i in range(3):                                   # 3 in flight: 1 running, 2 waiting
                assert (await _open(c, stack, [10 + i] * 5)).status_code == 200
            r = await c.post(CMPL, json={"prompt": [7] * 5, "max_tokens": 4, "n": 2, "stream": True})
            assert r.status_code == 503                          # 3 + 2 > 4: n counts n
            assert r.json() == {"error": {"message": BUSY_MESSAGE, "type": "Service Unavailable", "param": None,
                                          "code": 503}}
            assert (await _open(c, stack, [20] * 5)).status_code == 200     # 3 + 1 = 4: admitted
            for stream in (False, True):                         # 4 + 1 > 4
                r = await c.post(CMPL, json={"prompt": [8] * 5, "max_tokens": 4, "stream": stream})
                assert r.status_code == 503 and r.json()["error"]["message"] == BUSY_MESSAGE
            text = (await c.get("/metrics")).text
            assert _rejections(text, "max_num_queued_reqs") - rej0 == 3
            assert limited.call(lambda: limited.bridge.num_unfinished) == 4      # the four admitted, no more
        # the streams closed (aborted): room again
        r = await c.post(CMPL, json={"prompt": [9] * 5, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        await assert_engine_clean(limited, c)


async def test_max_num_queued_tokens_rejects_while_the_backlog_is_full(limited):
    import contextlib

    async with httpx.AsyncClient(base_url=limited.base_url, timeout=TIMEOUT,
                                 limits=httpx.Limits(max_connections=None)) as c:
        rej0 = _rejections((await c.get("/metrics")).text, "max_num_queued_tokens")
        async with contextlib.AsyncExitStack() as stack:
            running = await _open(c, stack, [30] * 5)            # takes the one slot ...
            chunks = running.aiter_bytes()                       # (kept: dropping it would close the stream)
            await chunks.__anext__()                             # ... and is past its prefill (a token is out)
            assert (await _open(c, stack, list(range(100, 160)))).status_code == 200   # backlog 60 < 100
            assert (await _open(c, stack, list(range(200, 260)))).status_code == 200   # 60 < 100: admitted -> 120
            r = await c.post(CMPL, json={"prompt": [5] * 5, "max_tokens": 4})         # 120 >= 100
            assert r.status_code == 503
            assert r.json() == {"error": {"message": TOKEN_BACKLOG_MESSAGE, "type": "Service Unavailable",
                                          "param": None, "code": 503}}
            assert _rejections((await c.get("/metrics")).text, "max_num_queued_tokens") - rej0 == 1
        await assert_engine_clean(limited, c)


async def test_admission_counts_every_data_parallel_engine():
    """--max-num-queued-reqs is the API server's limit over all DP ranks (vLLM checks it in the frontend)."""
    import contextlib

    with ServerThread(["--max-model-len", "2048", "--seed", "0", "--data-parallel-size", "2", "--max-num-queued-reqs",
                       "2", "--num-gpu-blocks-override", "200", "--served-model-name", MODEL]) as s:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=TIMEOUT,
                                     limits=httpx.Limits(max_connections=None)) as c:
            async with contextlib.AsyncExitStack() as stack:
                for i in range(2):
                    assert (await _open(c, stack, [40 + i] * 5)).status_code == 200
                assert s.call(lambda: [b.num_unfinished for b in s.state.bridges]) == [1, 1]    # one per engine
                r = await c.post(CMPL, json={"prompt": [9] * 5, "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["message"] == BUSY_MESSAGE
            r = await c.post(CMPL, json={"prompt": [9] * 5, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200
