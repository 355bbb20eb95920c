"""The bench client's measurement rules (spec §7.4) on recorded chunk sequences and on a tiny local SSE server."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from kernelsight.loadgen.client import NO_TOKEN_ERROR, SSEBuffer, StreamTimer
from kernelsight.loadgen.metrics import compute_bench_metrics

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kernelsight.loadgen.bench import parse_gauges, run_bench  # noqa: E402
from kernelsight.loadgen.datasets import SampleRequest  # noqa: E402


def cmpl(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                      "finish_reason": finish}]}


def chat(delta: dict) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                     "completion_tokens": completion}}


def feed(timer: StreamTimer, events: list[tuple[float, dict]]) -> None:
    for t, msg in events:
        timer.on_message(msg, t)


# -- recorded streams, hand-computed -------------------------------------------------------------------------
def test_completions_first_token_bearing_chunk_itl_per_chunk_and_usage():
    t = StreamTimer(chat=False, start_s=10.0, prompt_len=7)
    # the first chunk's text is empty (a special token): it still is the first token-bearing chunk
    feed(t, [(10.25, cmpl("")), (10.30, cmpl(" a b")), (10.45, cmpl(" c")), (10.50, cmpl(" d", "length")),
             (10.90, usage(9, 5))])      # the usage chunk is late: it must count for neither ITL nor E2EL
    r = t.record(queue_s=0.0, start_rel_s=1.0)
    assert r.success and r.error == ""
    assert r.ttft_s == pytest.approx(0.25)
    assert r.itl_s == pytest.approx([0.05, 0.15, 0.05])          # one gap per chunk, not per token
    assert r.latency_s == pytest.approx(0.50)                     # last token-bearing chunk, not usage
    assert r.output_len == 5 and r.prompt_len == 9                # usage.completion_tokens / prompt_tokens
    assert r.generated_text == " a b c d"
    m = compute_bench_metrics([r], 1.0, percentile_metrics=("ttft", "tpot", "itl", "e2el"))
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["mean_tpot_ms"] == pytest.approx((500.0 - 250.0) / 4)   # excludes the first token
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.05 + 0.15 + 0.05) / 3)
    assert m["mean_e2el_ms"] == pytest.approx(500.0)


def test_chat_role_chunk_is_not_ttft():
    t = StreamTimer(chat=True, start_s=0.0, prompt_len=3)
    feed(t, [(0.10, chat({"role": "assistant", "content": ""})),   # opening role chunk
             (0.12, chat({"content": "Hi"})), (0.20, chat({"content": " there"})),
             (0.26, chat({"content": ""})),                         # empty content without role: token-bearing
             (0.30, usage(3, 3))])
    r = t.record(queue_s=0.0, start_rel_s=0.0)
    assert r.ttft_s == pytest.approx(0.12)
    assert r.itl_s == pytest.approx([0.08, 0.06])
    assert r.latency_s == pytest.approx(0.26) and r.output_len == 3
    assert r.generated_text == "Hi there"


def test_chat_reasoning_and_tool_calls_are_tokens():
    t = StreamTimer(chat=True, start_s=0.0, prompt_len=1)
    feed(t, [(0.1, chat({"role": "assistant"})), (0.2, chat({"reasoning": "hmm"})),
             (0.3, chat({"tool_calls": [{"index": 0}]}))])
    r = t.record(queue_s=0.0, start_rel_s=0.0)
    assert r.ttft_s == pytest.approx(0.2) and r.itl_s == pytest.approx([0.1])


def test_error_event_ignored_and_no_token_means_failed():
    t = StreamTimer(chat=False, start_s=0.0, prompt_len=4)
    feed(t, [(0.1, {"error": {"message": "boom", "code": 500}})])
    r = t.record(queue_s=0.5, start_rel_s=2.0)
    assert not r.success and r.error == NO_TOKEN_ERROR and r.output_len == 0 and r.queue_s == 0.5


def test_missing_usage_falls_back_to_token_count():
    t = StreamTimer(chat=False, start_s=0.0, prompt_len=4)
    feed(t, [(0.1, cmpl("ab")), (0.2, cmpl("cde"))])
    assert t.record(queue_s=0, start_rel_s=0, count_tokens=len).output_len == 5   # tokenizer count of the text
    assert t.record(queue_s=0, start_rel_s=0).output_len == 2                     # no tokenizer: chunks


def test_single_token_has_no_tpot_but_counts_as_good():
    t = StreamTimer(chat=False, start_s=0.0, prompt_len=4)
    feed(t, [(0.4, cmpl("x", "length")), (0.41, usage(4, 1))])
    r = t.record(queue_s=0, start_rel_s=0)
    m = compute_bench_metrics([r], 2.0, goodput_slos_ms={"tpot": 1.0, "ttft": 500.0})
    assert m["mean_tpot_ms"] == 0.0 and m["request_goodput"] == pytest.approx(0.5)


def test_sse_buffer_splits_across_reads_and_crlf():
    b = SSEBuffer()
    assert b.feed(b'data: {"a"') == []
    assert b.feed(b': 1}\n\ndata: [DO') == [b'{"a": 1}']
    assert b.feed(b"NE]\n\n") == [b"[DONE]"]
    assert b.feed(b": keep-alive comment\r\n\r\ndata: 2\r\n\r\n") == [b"2"]


def test_parse_gauges_sums_engines():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\nvllm:num_requests_waiting{engine="0"} 7\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:num_requests_waiting_by_reason{reason="x"} 9\n')
    assert parse_gauges(text) == {"running": 5.0, "waiting": 7.0, "kv_cache_usage": 0.25}


# -- a tiny SSE server on 127.0.0.1 ---------------------------------------------------------------------------
GAP_S = 0.03


async def _fake_server(chat_mode_log: list, arrivals_s: list | None = None) -> web.AppRunner:
    async def handler(request: web.Request) -> web.StreamResponse:
        if arrivals_s is not None:
            arrivals_s.append(time.perf_counter())
        body = await request.json()
        chat_mode_log.append((request.path, body))
        if body.get("model") == "bad":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        n = body.get("max_tokens") or body.get("max_completion_tokens")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat_ep = request.path.endswith("/chat/completions")
        await asyncio.sleep(2 * GAP_S)
        if chat_ep:
            await resp.write(b"data: " + json.dumps(chat({"role": "assistant", "content": ""})).encode() + b"\n\n")
        for k in range(n):
            if k:
                await asyncio.sleep(GAP_S)
            msg = chat({"content": f" t{k}"}) if chat_ep else cmpl(f" t{k}")
            await resp.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(usage(11, n)).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_run_bench_against_fake_server(endpoint):
    log: list = []
    runner = await _fake_server(log)
    try:
        url = f"http://127.0.0.1:{_port(runner)}"
        samples = [SampleRequest([5, 6, 7], 3, 4, prompt=None) for _ in range(4)]
        run = await run_bench(url, samples, [0.0, 0.05, 0.1, 0.15], model="m", endpoint=endpoint, ignore_eos=True,
                              max_concurrency=2, decode=lambda ids: "decoded", request_id_prefix="t-")
    finally:
        await runner.cleanup()
    assert len(run.records) == 4 and all(r.success for r in run.records)
    for r in run.records:
        assert r.output_len == 4 and r.prompt_len == 11
        # TTFT ≈ 2 gaps (the chat role chunk comes first but does not count), then 3 ITL samples of one gap
        assert 2 * GAP_S - 0.005 < r.ttft_s < 2 * GAP_S + 0.03
        assert len(r.itl_s) == 3 and all(GAP_S - 0.005 < x < GAP_S + 0.03 for x in r.itl_s)
        assert r.latency_s == pytest.approx(r.ttft_s + sum(r.itl_s), abs=1e-6)
    path, body = log[0]
    assert path == endpoint and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    if endpoint == "/v1/completions":
        assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4      # token ids go as ids
    else:
        assert body["messages"][0]["content"] == [{"type": "text", "text": "decoded"}]
        assert body["max_completion_tokens"] == 4
    # max_concurrency 2: the 3rd request waited for a slot (client queue time), the schedule did not slip
    assert max(r.queue_s for r in run.records) > 0.05
    assert run.client.num_messages >= 4 * 6
    assert run.send_lateness_s.max() < 0.05


async def test_run_bench_http_error_is_a_failed_request():
    runner = await _fake_server([])
    try:
        run = await run_bench(f"http://127.0.0.1:{_port(runner)}", [SampleRequest([1], 1, 2)], [0.0], model="bad")
    finally:
        await runner.cleanup()
    (r,) = run.records
    assert not r.success and r.error.startswith("HTTP 404")


async def test_connection_refused_is_a_failed_request():
    run = await run_bench("http://127.0.0.1:9", [SampleRequest([1], 1, 2)], [0.0], model="m")
    assert not run.records[0].success and run.records[0].error


async def test_time_scale_converts_to_server_seconds():
    arrivals_s: list[float] = []
    runner = await _fake_server([], arrivals_s)
    try:
        run = await run_bench(f"http://127.0.0.1:{_port(runner)}", [SampleRequest([1], 1, 3)] * 2, [0.0, 0.4],
                              model="m", time_scale=4.0)
    finally:
        await runner.cleanup()
    # the second request left 0.4/4 s of wall time after the first, not 0.4 s: judged on the server's arrival
    # gap (the midpoint 0.25 s is the threshold), which a loaded machine's start-up and teardown do not lengthen
    gap_s = arrivals_s[1] - arrivals_s[0]
    assert 0.1 - 0.01 < gap_s < 0.25, gap_s
    r = run.records[0]
    assert 4 * 2 * GAP_S - 0.02 < r.ttft_s < 4 * (2 * GAP_S + 0.03)
    assert run.records[1].start_s == pytest.approx(0.4, abs=4 * 0.02)
    assert np.isclose(run.duration_s, run.wall_s * 4)


def test_cached_tokens_and_streamed_token_ids_are_kept():
    t = StreamTimer(chat=False, start_s=0.0, prompt_len=4)
    first, second = cmpl("a"), cmpl("bc", "length")
    first["choices"][0]["token_ids"], second["choices"][0]["token_ids"] = [7], [8, 9]
    u = usage(40, 3)
    u["usage"]["prompt_tokens_details"] = {"cached_tokens": 32}
    feed(t, [(0.1, first), (0.2, second), (0.3, u)])
    r = t.record(queue_s=0.0, start_rel_s=0.0)
    assert r.cached_tokens == 32 and r.output_token_ids == [7, 8, 9] and r.prompt_len == 40
    # a server without --enable-prompt-tokens-details (details null) and without token ids
    t = StreamTimer(chat=False, start_s=0.0, prompt_len=4)
    u = usage(4, 1)
    u["usage"]["prompt_tokens_details"] = None
    feed(t, [(0.1, cmpl("a", "length")), (0.2, u)])
    r = t.record(queue_s=0.0, start_rel_s=0.0)
    assert r.cached_tokens is None and r.output_token_ids is None


def test_session_history_extends_with_what_the_server_returned():
    from kernelsight.loadgen.metrics import RequestRecord
    from kernelsight.loadgen.session_bench import _History
    from kernelsight.loadgen.sessions import Turn

    first, nxt = Turn(np.array([101, 102, 103]), 2, user_text="hello"), Turn(np.array([104, 105]), 2, 0.5)
    answer = RequestRecord(True, 3, 2, 0.1, [0.01], 0.2, generated_text=" hi there", output_token_ids=[900, 901])

    def decode(ids):
        return "-".join(map(str, ids))

    def encode(text):
        return [len(w) for w in text.split()]

    h = _History(False, first, decode)
    assert h.prompt() == [101, 102, 103]
    h.extend(answer, nxt, encode)
    assert h.prompt() == [101, 102, 103, 900, 901, 104, 105]      # the answer's own ids, then the new message
    h2 = _History(False, first, decode)
    answer.output_token_ids = None                                # the server did not return ids: encode its text
    h2.extend(answer, nxt, encode)
    assert h2.prompt() == [101, 102, 103, 2, 5, 104, 105]
    c = _History(True, first, decode)
    c.extend(answer, nxt, encode)
    msgs = c.prompt()
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0]["content"][0]["text"] == "hello" and msgs[1]["content"] == " hi there"
    assert msgs[2]["content"][0]["text"] == "104-105"             # a synthetic turn's ids, decoded


async def test_sessions_against_fake_server_keep_their_limit_and_send_their_history():
    from kernelsight.loadgen.session_bench import run_session_bench
    from kernelsight.loadgen.sessions import Session, SessionWorkload, Turn

    log: list = []
    runner = await _fake_server(log)
    sessions = [Session([Turn(np.array([100 + i]), 2, user_text=f"q{i}"), Turn(np.array([200 + i]), 2, 0.05,
                                                                                 user_text=f"r{i}")])
                for i in range(5)]
    wl = SessionWorkload(sessions, [0.0] * 5, 2, "synthetic")
    try:
        run = await run_session_bench(f"http://127.0.0.1:{_port(runner)}", wl, model="m", chat=True,
                                      endpoint="/v1/chat/completions", ignore_eos=True, decode=str,
                                      encode=lambda t: [1] * len(t.split()))
    finally:
        await runner.cleanup()
    assert len(run.records) == 10 and all(r.success for r in run.records) and run.max_open_sessions == 2
    second = [body for _, body in log if len(body["messages"]) == 3]
    assert len(second) == 5
    for body in second:
        user, answer, follow = body["messages"]
        i = int(user["content"][0]["text"][1:])
        assert answer == {"role": "assistant", "content": " t0 t1"}             # the text the server streamed
        assert follow["content"][0]["text"] == f"r{i}"
    by = {(r.session, r.turn): r for r in run.records}
    spans = []
    for i in range(5):
        t0, t1 = by[(i, 0)], by[(i, 1)]
        assert t1.start_s >= t0.start_s + t0.latency_s + 0.05 - 1e-3            # the think time after the answer
        spans.append((t0.start_s, t1.start_s + t1.latency_s))
    # at most two sessions open at once: the third starts only after one of the first two has ended
    starts = sorted(spans)
    assert starts[2][0] >= min(starts[0][1], starts[1][1]) - 1e-3
    assert sum(1 for r in run.records if r.turn == 0 and r.queue_s > 0.05) == 3
