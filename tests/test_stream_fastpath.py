"""The stream fast path (chunks written by the engine loop at the step deadline) against the general path."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httptools")

from kernelsight.server.engine.fastpath import sync_cycle  # noqa: E402
from kernelsight.server.engine.turns import MAX_HELD_S, turn_gate  # noqa: E402
from kernelsight.server.integrations.metrics import ServerMetrics  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

# time scale 0.1: a decode step lasts ~70 ms of wall time, so the general path's handler always writes a step's
# chunk before the next step (no merged chunks) and both paths must produce the very same bytes
ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--num-gpu-blocks-override", "400", "--time-scale", "0.1"]

CASES = [
    ("/v1/completions", {"prompt": "tell me a story", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [11, 12, 13, 14], "max_tokens": 4, "seed": 3, "ignore_eos": True,
                         "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                              "ignore_eos": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ids"}], "max_tokens": 3, "seed": 9,
                              "ignore_eos": True, "return_token_ids": True}),
]


@pytest.fixture(scope="module")
def fast():
    with ServerThread(ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def general():
    with ServerThread([*ARGS, "--disable-stream-fast-path"]) as s:
        yield s


def _normalize(body: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', body)


async def _stream(base_url: str, path: str, body: dict, rid: str) -> bytes:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        r = await c.post(path, json={**body, "stream": True}, headers={"X-Request-Id": rid})
        assert r.status_code == 200
        return r.content


async def test_fast_path_sends_the_general_paths_bytes(fast, general):
    for i, (path, body) in enumerate(CASES):
        rid = f"same-{i}"
        a = await _stream(fast.base_url, path, body, rid)
        b = await _stream(general.base_url, path, body, rid)
        assert a.endswith(b"data: [DONE]\n\n")
        assert _normalize(a) == _normalize(b), (path, body)
        n_events = a.count(b"\n\n") - 1
        assert n_events >= body["max_tokens"]        # one chunk per token: nothing was merged
    assert fast.call(lambda: fast.bridge.fast_writes) >= sum(b["max_tokens"] for _, b in CASES)
    assert general.call(lambda: general.bridge.fast_writes) == 0


async def test_ineligible_requests_keep_the_general_path(fast):
    before = fast.call(lambda: fast.bridge.fast_writes)
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    raw = await _stream(fast.base_url, "/v1/completions", body, "n2")
    assert raw.endswith(b"data: [DONE]\n\n") and b'"index":1' in raw
    raw = await _stream(fast.base_url, "/v1/completions", {**body, "n": 1, "logprobs": 1}, "lp")
    assert b'"top_logprobs"' in raw
    assert fast.call(lambda: fast.bridge.fast_writes) == before


def _sinks(srv) -> list:
    return [sub.sink for sub in set(srv.bridge._subs_of.values()) if sub.sink is not None]


async def test_paused_client_is_handed_back_without_blocking_others(fast):
    """A transport that uvicorn has paused (slow reader) makes the engine loop hand the stream back to its
    handler, which waits for the drain; other streams keep their fast path meanwhile, and the paused stream
    completes with every token once the transport drains."""
    async with httpx.AsyncClient(base_url=fast.base_url, timeout=60) as c:
        body = {"prompt": "slow reader", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            chunks = r.aiter_bytes()
            first = await chunks.__anext__()
            assert b'"text"' in first
            (sink,) = fast.call(lambda: _sinks(fast))
            handbacks = fast.call(lambda: fast.bridge.fast_handbacks)
            fast.call(lambda: sink.cycle.flow.pause_writing())
            # another stream runs to completion on the fast path while the first one is paused
            writes = fast.call(lambda: fast.bridge.fast_writes)
            other = await _stream(fast.base_url, "/v1/completions",
                                  {"prompt": "fast reader", "max_tokens": 4, "ignore_eos": True}, "other")
            assert other.count(b'"text"') == 4 and other.endswith(b"data: [DONE]\n\n")
            assert fast.call(lambda: fast.bridge.fast_writes) >= writes + 4
            assert fast.call(lambda: fast.bridge.fast_handbacks) == handbacks + 1
            assert fast.call(lambda: sink.sub.sink) is None
            fast.call(lambda: sink.cycle.flow.resume_writing())
            rest = b"".join([part async for part in chunks])
    raw = first + rest
    texts = re.findall(rb'"text":"([^"]*)"', raw)
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"finish_reason":"length"') == 1
    assert sum(t.count(b" ") for t in texts) == 10      # every token arrived (later ones merged into fewer chunks)
    async with httpx.AsyncClient(base_url=fast.base_url, timeout=60) as c:
        full = (await c.post("/v1/completions", json={**body, "stream": False})).json()["choices"][0]["text"]
    assert b"".join(texts).decode() == full


async def test_turn_gate_grants_one_waiter_per_loop_turn():
    gate = turn_gate()
    assert turn_gate() is gate                              # one per loop
    started: list[str] = []

    async def waiter(name: str, first: bool = False) -> None:
        await gate.wait(first=first)
        started.append(name)

    tasks = [asyncio.create_task(waiter(f"h{i}")) for i in range(4)]
    await asyncio.sleep(0)                                  # all four queued
    gone = asyncio.create_task(waiter("gone"))
    await asyncio.sleep(0)
    gone.cancel()                                           # a client that left: skipped, not granted
    urgent = asyncio.create_task(waiter("engine", first=True))
    seen = []
    for _ in range(16):
        await asyncio.sleep(0)
        seen.append(len(started))
    await asyncio.gather(*tasks, urgent)
    assert "gone" not in started
    assert [n for n in started if n.startswith("h")] == ["h0", "h1", "h2", "h3"]          # FIFO
    assert started.index("engine") < 3                      # jumped the queue
    assert all(b - a <= 1 for a, b in zip(seen, seen[1:], strict=False))   # never two in one turn
    assert len(gate) == 0


async def test_turn_gate_grants_nothing_while_held():
    gate = turn_gate()
    started: list[int] = []

    async def waiter(i: int) -> None:
        await gate.wait()
        started.append(i)

    with gate.held():            # an engine loop polling sockets just before a deadline
        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        for _ in range(8):
            await asyncio.sleep(0)
        assert started == [] and len(gate) == 3
    for _ in range(8):
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert started == [0, 1, 2]

    # engine loops holding in turn (overlapping holds) do not starve the handlers: a release lets one through once
    # the gate has been held MAX_HELD_S in a row
    outer = gate.held()
    outer.__enter__()
    late = asyncio.create_task(waiter(3))
    t_end = time.perf_counter() + 3 * MAX_HELD_S
    while not started[3:] and time.perf_counter() < t_end:
        with gate.held():
            time.sleep(MAX_HELD_S / 4)
            await asyncio.sleep(0)
        await asyncio.sleep(0)
    outer.__exit__(None, None, None)
    await late
    assert started == [0, 1, 2, 3]


def test_sync_cycle_refuses_anything_but_uvicorns_httptools_send():
    async def send(message: dict) -> None:
        return None

    assert sync_cycle(send) is None
    assert sync_cycle(None) is None


def test_batched_itl_observations_match_one_by_one():
    one, batch = ServerMetrics("m", 1, 2048, [{}]), ServerMetrics("m", 1, 2048, [{}])
    rng = random.Random(1)
    values = [rng.choice([0.0, 0.004, 0.01, 0.0123, 0.3, 99.0, 1e4]) for _ in range(500)]
    counts: dict[float, int] = {}
    for v in values:
        one.engines[0].on_itl(v)
        counts[v] = counts.get(v, 0) + 1
    batch.engines[0].on_itls(counts)

    def series(m: ServerMetrics) -> dict[str, float]:
        out = {}
        for line in m.render().decode().splitlines():
            if line.startswith("vllm:inter_token_latency_seconds") and "_created" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    a, b = series(one), series(batch)
    assert a.keys() == b.keys() and len(a) > 3
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12), k


def test_gc_collections_wait_for_slack_before_a_deadline(monkeypatch):
    """With automatic GC handed over to the engine loop, a due collection runs only when its expected duration
    fits before the next deadline; an overdue one runs regardless (bounded memory); an idle loop collects only
    once enough accumulated."""
    import gc

    from kernelsight.server import gc_policy as G

    monkeypatch.setattr(G, "GC_DUE_OBJECTS", 2000)
    monkeypatch.setattr(G, "GC_IDLE_OBJECTS", 500)
    monkeypatch.setattr(G._state, "cost_s", 0.001)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        few = [[i] for i in range(300)]
        G.collect_when_idle()                                   # idle, but too little to be worth a pass
        assert G.pending_objects() >= 300
        G.collect_in_slack(1.0)                                 # not due yet, however much room
        assert G.pending_objects() >= 300
        keep = [[i] for i in range(2000)]                       # container objects: due now
        before = G.pending_objects()
        G.collect_in_slack(0.0005)                              # no room before the deadline: nothing runs
        assert G.pending_objects() >= before
        G.collect_in_slack(1.0)                                 # room: collected
        assert G.pending_objects() < 300
        many = [[i] for i in range(G.GC_OVERDUE_FACTOR * 2000)]  # overdue: collected without slack
        G.collect_in_slack(0.0)
        assert G.pending_objects() < 300
        more = [[i] for i in range(600)]
        G.collect_when_idle()                                   # idle and worth it
        assert G.pending_objects() < 300
        assert len(few) + len(keep) + len(many) + len(more) > 0
    finally:
        if was_enabled:
            gc.enable()


def test_finished_requests_leave_no_cyclic_garbage(fast):
    """The serving path frees a finished request by reference counting alone (the engine loop runs the cyclic
    GC rarely, see gc_policy): no uvicorn request cycle or FastAPI exit stack is left for the collector, whether
    streamed on the fast path, streamed by the handler, not streamed, or rejected."""
    import gc

    was_enabled, flags = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.disable()
    try:
        with httpx.Client(base_url=fast.base_url, timeout=60) as c:
            for path, body in CASES:
                assert c.post(path, json={**body, "stream": True}).status_code == 200
                plain = {k: v for k, v in body.items() if k != "stream_options"}
                assert c.post(path, json={**plain, "stream": False}).status_code == 200
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
            assert c.get("/v1/models").status_code == 200
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage} & {"RequestResponseCycle", "AsyncExitStack",
                                                                  "H11Protocol", "HttpToolsProtocol"})
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert left == []


def test_arrival_during_a_step_that_finishes_everything_keeps_its_own_time():
    """A request that arrives while the step in flight finishes every other request (the engine already looks
    idle) arrives when it arrived: it waits for that step like any mid-step arrival, and the wait counts in its
    TTFT (it must not be stamped at the step's end)."""
    import time

    from kernelsight.engine_args import create_engine_config
    from kernelsight.server.engine.bridge import EngineBridge
    from kernelsight.server.model.tokenizer import load_tokenizer
    from kernelsight.simcore.engine_config import EngineArgs

    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", max_model_len=2048))
    bridge = EngineBridge(cfg, load_tokenizer("meta-llama/Llama-3.1-8B", None, cfg.model.vocab_size),
                          record_timings=True)
    first = bridge.submit([list(range(100, 1100))], [1], ignore_eos=True, label="a")
    res = bridge.engine.step(max_steps=1)       # the loop computes the step in flight: it finishes request "a"
    assert res is not None and not bridge.engine.has_unfinished()
    assert res.end_s > bridge.virtual_now()     # its end lies in the (wall) future
    second = bridge.submit([list(range(2000, 2100))], [4], ignore_eos=True, label="b",
                           arrival_wall_s=time.perf_counter())
    arrival_s = bridge.timings["b"]["arrival_s"]
    assert arrival_s < res.end_s
    assert arrival_s <= bridge.virtual_now()
    assert first.seqs and second.seqs


def test_admission_count_returns_to_zero(fast):
    """Every request that enters the app leaves the admission count exactly once: submitted, rejected, another
    route, or a client gone mid-stream. (The engine loop lets pending admissions through before computing a
    step; a leaked count would make it wait its whole room every step, a miscount below zero never.)"""
    from kernelsight.server.engine.admissions import admissions_pending

    async def main():
        async with httpx.AsyncClient(base_url=fast.base_url, timeout=60) as c:
            reqs = [c.post(path, json={**body, "stream": True}) for path, body in CASES]
            reqs += [c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}),
                     c.post("/v1/completions", content=b"{not json"),
                     c.post("/v1/chat/completions", json={"messages": [], "model": "nope"}),
                     c.get("/health"), c.get("/v1/models"), c.get("/no/such/route")]
            rs = await asyncio.gather(*reqs)
            assert sorted({r.status_code for r in rs}) == [200, 400, 404]
            async with c.stream("POST", "/v1/completions", json={"prompt": "bye", "max_tokens": 500,
                                                                 "ignore_eos": True, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break                                  # disconnect after the first line

    asyncio.run(main())
    # a handler's last bookkeeping may run just after its response reached us: wait for the count (bounded)
    deadline = time.monotonic() + 10
    while fast.call(admissions_pending) != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fast.call(admissions_pending) == 0


def test_output_token_slices_match_one_by_one(fast):
    """Short slices (the engine hashing a completed 16-token block) take a pure-Python path, long ones numpy:
    both must give the tokens that indexing one at a time gives (the ids the stream sends)."""
    from kernelsight.server.model.output_tokens import OutputTokens

    out = OutputTokens(fast.bridge.tok, 987654321, 600)
    one_by_one = [out[i] for i in range(600)]
    assert len(set(one_by_one)) > 100                      # not a constant
    for a, b in [(0, 16), (16, 32), (5, 37), (0, 33), (0, 600), (590, 600), (100, 100)]:
        assert out[a:b] == one_by_one[a:b]
    assert out[3:40:2] == one_by_one[3:40:2]


def test_read_window_shrinks_with_lag_and_closes_when_behind(fast):
    """The loop reads sockets before a step only while the next deadline leaves room: a loop behind the virtual
    clock (a late release) computes the next step at once."""

    def room(lag_s: float) -> float:
        b = fast.bridge
        saved = (b._step_walls_s.copy(), b._busy_s)
        try:
            b._step_walls_s.clear()
            b._step_walls_s.extend([0.009, 0.010])     # ~9 ms decode steps (256 streams)
            b._busy_s = 0.002
            return b.read_window_s(b.wall_of(b.engine.now_s) + lag_s)
        finally:
            b._step_walls_s.clear()
            b._step_walls_s.extend(saved[0])
            b._busy_s = saved[1]

    on_time, after_writes, behind = fast.call(room, 0.0), fast.call(room, 0.005), fast.call(room, 0.030)
    assert abs(on_time - (0.5 * 0.009 - 0.002)) < 1e-9       # half the shortest step, less the computing time
    assert 0 < after_writes < on_time                          # 5 ms already gone: less room
    assert behind <= 0                                         # 30 ms late: no window
