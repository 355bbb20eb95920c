"""vLLM's gRPC front end (``serve --grpc``): a client built from smg-grpc-proto's stubs against a running server —
Generate on token ids and text (streaming or not, n, structured outputs, logprobs), the management RPCs, vLLM's
status codes for bad input and injected faults, Abort and client cancellation (blocks freed, other requests
unharmed), FlushCache, SubscribeKvEvents, GetTokenizer used as a gateway uses it, and the same token times as the
same request over HTTP."""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import zipfile

import httpx
import pytest

pytest.importorskip("fastapi")
grpc = pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")

from smg_grpc_proto.generated import common_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc  # noqa: E402

from kernelsight.server.wire.grpc.runner import GrpcServerThread  # noqa: E402
from tests.conftest import cli_one_line_error  # noqa: E402

MAX_MODEL_LEN = 2048
ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--time-scale", "20", "--seed", "0", "--served-model-name", "m"]
PROMPT = list(range(1000, 1064))          # 64 prompt ids
TIMEOUT_S = 30
LONG = MAX_MODEL_LEN - 2 * len(PROMPT)     # ~0.5 s of decoding at --time-scale 20: in flight while a test acts


@pytest.fixture(scope="module")
def srv():
    with GrpcServerThread([*ARGS, "--record-timings"]) as s:
        yield s


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.grpc_target) as ch:
        yield pb_grpc.VllmEngineStub(ch)


def _gen(ids=PROMPT, max_tokens=16, stream=True, rid="r", **sp) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, **sp))


def _wait_idle(srv, timeout_s: float = 10.0) -> None:
    """Until no sequence is in flight and no KV block is held (bounded)."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if srv.call(lambda: srv.bridge.num_unfinished == 0 and srv.bridge.engine.kv.usage == 0.0):
            return
        time.sleep(0.01)
    raise AssertionError("the engine still holds requests or KV blocks")


def _code(stub, req: pb.GenerateRequest, metadata=None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, metadata=metadata, timeout=TIMEOUT_S))
    return info.value.code(), info.value.details()


# -- Generate ------------------------------------------------------------------------------------------------
def test_streams_a_generate_on_token_ids(srv, stub):
    msgs = list(stub.Generate(_gen(rid="stream-64-16", ignore_eos=True), timeout=TIMEOUT_S))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    done = [m.complete for m in msgs if m.HasField("complete")]
    assert msgs[-1].HasField("complete") and len(done) == 1
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 16 and all(c.prompt_tokens == 64 for c in chunks)
    assert all(c.token_ids for c in chunks) and len(chunks) <= 16     # a chunk per release the handler saw
    assert done[0].finish_reason == "length" and done[0].prompt_tokens == 64
    # vLLM's stream: the complete repeats the last delta (one step's token, or several when the handler woke late)
    assert list(done[0].output_ids) == list(chunks[-1].token_ids)
    times = srv.bridge.timings["stream-64-16"]["token_times_s"]
    assert len(times) == 16 and all(b > a for a, b in zip(times, times[1:], strict=False))
    _wait_idle(srv)


def test_non_streaming_n2_text_input_and_stop_string(srv, stub):
    req = pb.GenerateRequest(request_id="n2", text="Hello there", stream=False,
                             sampling_params=pb.SamplingParams(max_tokens=12, n=2, seed=3, ignore_eos=True))
    msgs = list(stub.Generate(req, timeout=TIMEOUT_S))
    assert [m.complete.index for m in msgs] == [0, 1]
    assert all(len(m.complete.output_ids) == 12 and m.complete.finish_reason == "length" for m in msgs)
    assert msgs[0].complete.output_ids != msgs[1].complete.output_ids
    prompt_ids = srv.state.tok.encode("Hello there", True)
    assert msgs[0].complete.prompt_tokens == len(prompt_ids)
    # a stop string cut from the first choice's text: it stops there, reported as matched_stop_str
    text = srv.state.tok.decode(list(msgs[0].complete.output_ids))
    stop = text.split()[3]
    req.sampling_params.n = 1
    del req.sampling_params.stop[:]
    req.sampling_params.stop.append(stop)
    (m,) = list(stub.Generate(req, timeout=TIMEOUT_S))
    assert m.complete.finish_reason == "stop" and m.complete.matched_stop_str == stop
    assert len(m.complete.output_ids) < 12
    _wait_idle(srv)


def test_structured_output_constraints(srv, stub):
    choice = pb.SamplingParams(max_tokens=50, choice=pb.ChoiceConstraint(choices=["alpha", "beta"]))
    (m,) = list(stub.Generate(pb.GenerateRequest(request_id="c", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                 sampling_params=choice), timeout=TIMEOUT_S))
    assert srv.state.tok.decode(list(m.complete.output_ids)) in ("alpha", "beta")
    assert m.complete.finish_reason == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    js = pb.SamplingParams(max_tokens=200, json_schema=json.dumps(schema))
    (m,) = list(stub.Generate(pb.GenerateRequest(request_id="j", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                 sampling_params=js), timeout=TIMEOUT_S))
    assert isinstance(json.loads(srv.state.tok.decode(list(m.complete.output_ids)))["n"], int)


def test_logprobs_per_token_and_prompt(stub):
    msgs = list(stub.Generate(_gen(max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True),
                              timeout=TIMEOUT_S))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    for c in chunks:
        assert list(c.output_logprobs.token_ids) == list(c.token_ids)
        assert all(lp < 0 for lp in c.output_logprobs.token_logprobs)
        assert all(len(t.values) == 2 for t in c.output_logprobs.top_logprobs)
    first = chunks[0].input_logprobs
    assert list(first.token_ids) == PROMPT and not first.token_logprobs[0].HasField("value")
    assert all(t.HasField("value") for t in first.token_logprobs[1:])
    assert not chunks[1].HasField("input_logprobs")       # the prompt's logprobs come once, on the first chunk


# -- management RPCs -----------------------------------------------------------------------------------------
def test_health_model_info_server_info_and_loads(srv, stub):
    h = stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert h.healthy and h.message == "Health"
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)
    m = srv.config.model
    assert (info.max_context_length, info.vocab_size, info.served_model_name) == (MAX_MODEL_LEN, m.vocab_size, "m")
    assert info.is_generation and list(info.architectures) == [m.architecture]
    assert list(info.eos_token_ids) == list(m.eos_token_ids)
    assert info.tokenizer_path == info.model_path == m.name          # the bundled tokenizer: the model's id
    si = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
    assert si.server_type == "vllm-grpc" and si.block_size == srv.config.scheduler.block_size
    assert si.data_parallel_size == 1 and si.model_dtype.startswith("torch.")
    # loads while a request runs: the engine's own counts
    it = stub.Generate(_gen(rid="loaded", max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT_S)
    next(it)                                                   # its first token is out: it is running
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT_S)
    assert loads.dp_rank_count == 1 and loads.version
    (load,) = loads.loads
    assert load.num_running_reqs == 1 and load.num_total_reqs == 1 and 0 < load.token_usage < 1
    assert load.max_running_requests == srv.config.scheduler.max_num_seqs
    stub.Abort(pb.AbortRequest(request_ids=["loaded"]), timeout=TIMEOUT_S)
    assert list(it)[-1].complete.finish_reason == "abort"
    _wait_idle(srv)
    (load,) = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT_S).loads
    assert load.num_running_reqs == 0
    prof = stub.StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT_S)
    assert not prof.success and "simulated" in prof.message


def test_flush_cache(srv, stub):
    list(stub.Generate(_gen(rid="fill", max_tokens=2), timeout=TIMEOUT_S))
    _wait_idle(srv)
    r = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=TIMEOUT_S)
    assert r.success
    # refused while a request holds blocks (0: one attempt), and a bad timeout is INVALID_ARGUMENT
    it = stub.Generate(_gen(rid="holding", max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT_S)
    next(it)
    r = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=TIMEOUT_S)
    assert not r.success and "in flight" in r.message
    stub.Abort(pb.AbortRequest(request_ids=["holding"]), timeout=TIMEOUT_S)
    list(it)
    _wait_idle(srv)
    with pytest.raises(grpc.RpcError) as info:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- errors: vLLM's status codes, and one bad client harms no one -------------------------------------------
BAD = [
    (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(min_tokens=40), "min_tokens must be less than or equal to max_tokens=16, got 40."),
    (dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (dict(stop=[""]), "stop cannot contain an empty string."),
    (dict(repetition_penalty=-0.5), "repetition_penalty must be greater than zero, got -0.5."),
    (dict(choice=pb.ChoiceConstraint(choices=[])), "cannot be an empty list"),
    (dict(regex="a\x00"), "must not contain a NUL character"),
]


@pytest.mark.parametrize("params,message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_sampling_params_are_invalid_argument(srv, stub, params, message):
    max_tokens = params.pop("max_tokens", 16)
    code, details = _code(stub, _gen(max_tokens=max_tokens, **params))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details


def test_bad_prompts_are_invalid_argument_and_the_server_goes_on(srv, stub):
    long = list(range(1000, 1000 + MAX_MODEL_LEN))
    code, details = _code(stub, _gen(ids=long))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"The decoder prompt (length {MAX_MODEL_LEN}) plus the number of requested output")
    code, details = _code(stub, _gen(ids=[srv.state.tok.vocab_size + 5]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of vocabulary" in details
    code, details = _code(stub, _gen(ids=[]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot be empty" in details
    code, details = _code(stub, pb.GenerateRequest(request_id="none"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    mm = _gen()
    mm.media_refs.items.add(url="https://example.com/cat.png")
    code, details = _code(stub, mm)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a multimodal model" in details
    code, details = _code(stub, pb.GenerateRequest(request_id="kv", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                   kv_transfer_params_json="{not json"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "kv_transfer_params_json" in details
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=PROMPT)), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT     # a generation model serves no embeddings
    _wait_idle(srv)                                                  # nothing was admitted, nothing is held
    msgs = list(stub.Generate(_gen(rid="after-bad", max_tokens=3, ignore_eos=True), timeout=TIMEOUT_S))
    assert msgs[-1].complete.finish_reason == "length"


FAULTS = [("429", grpc.StatusCode.RESOURCE_EXHAUSTED, "Too many requests for model m"),
          ("503", grpc.StatusCode.UNAVAILABLE, "The engine is currently busy"),
          ("500", grpc.StatusCode.INTERNAL, "Internal server error"),
          ("model_not_found", grpc.StatusCode.NOT_FOUND, "The model `m` does not exist"),
          ("context_length", grpc.StatusCode.INVALID_ARGUMENT, "maximum context length is 2048"),
          ("invalid_api_key", grpc.StatusCode.UNAUTHENTICATED, "Unauthorized")]


@pytest.mark.parametrize("fault,code,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_injected_faults_answer_with_vllms_codes(srv, stub, fault, code, message):
    before = _injected(srv, fault)
    got, details = _code(stub, _gen(), metadata=(("x-kernelsight-fault", fault),))
    assert got == code and message in details
    assert _injected(srv, fault) == before + 1          # counted in /metrics as an HTTP request's fault is


def _injected(srv, fault: str) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=TIMEOUT_S).text
    pattern = r'^kernelsight:injected_faults_total\{[^}]*type="' + re.escape(fault) + r'"[^}]*\} (\S+)$'
    m = re.search(pattern, text, re.MULTILINE)
    assert m is not None, fault
    return float(m.group(1))


def test_timeout_fault_never_answers_and_holds_nothing(srv, stub):
    from kernelsight.server.engine.admissions import admissions_pending

    before = _injected(srv, "timeout")
    call = stub.Generate(_gen(rid="hung"), metadata=(("x-kernelsight-fault", "timeout"),), timeout=TIMEOUT_S)
    t_end = time.monotonic() + 10
    while _injected(srv, "timeout") == before and time.monotonic() < t_end:     # until the server holds it
        time.sleep(0.01)
    assert _injected(srv, "timeout") == before + 1
    assert srv.call(admissions_pending) == 0          # held outside the engine: the engine loops do not wait for it
    call.cancel()                                     # the client gives up, as its own timeout would
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    _wait_idle(srv)


def test_stream_abort_fault_cuts_the_stream_and_frees_the_blocks(srv, stub):
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for m in stub.Generate(_gen(rid="cut", max_tokens=20, ignore_eos=True),
                               metadata=(("x-kernelsight-fault", "stream-abort"),), timeout=TIMEOUT_S):
            got.append(m)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 0 < len(got) < 20 and not any(m.HasField("complete") for m in got)
    _wait_idle(srv)


def test_abort_rpc_ends_the_stream_with_abort_and_spares_the_others(srv, stub):
    victim = stub.Generate(_gen(rid="victim", max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT_S)
    other = stub.Generate(_gen(ids=list(range(5000, 5064)), rid="other", max_tokens=30, ignore_eos=True),
                          timeout=TIMEOUT_S)
    first = next(victim)
    assert first.HasField("chunk")
    stub.Abort(pb.AbortRequest(request_ids=["victim"]), timeout=TIMEOUT_S)
    rest = list(victim)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    n = len(first.chunk.token_ids) + sum(len(m.chunk.token_ids) for m in rest if m.HasField("chunk"))
    assert n < LONG
    out = list(other)
    assert out[-1].complete.finish_reason == "length"
    assert sum(len(m.chunk.token_ids) for m in out if m.HasField("chunk")) == 30
    _wait_idle(srv)


def test_client_cancel_frees_the_request_at_once(srv, stub):
    call = stub.Generate(_gen(rid="gone", max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT_S)
    next(call)
    assert srv.call(lambda: srv.bridge.num_unfinished) == 1           # still decoding when the client leaves
    call.cancel()
    _wait_idle(srv)
    assert "gone" not in srv.servicer.inflight.calls


# -- the same request over both front ends: the same token times -------------------------------------------
def _relative(timing: dict) -> list[float]:
    return [t - timing["arrival_s"] for t in timing["token_times_s"]]


def test_same_token_times_and_ids_as_http():
    """One request (64 prompt ids, 16 tokens, seeded) on two identical fresh servers, once over HTTP and once over
    gRPC: the simulated token times from arrival, and the token ids, are the same."""
    argv = [*ARGS, "--record-timings"]
    with GrpcServerThread(argv) as a, httpx.Client(base_url=a.base_url, timeout=TIMEOUT_S) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 16, "seed": 11,
                                            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        http_ids = r.json()["choices"][0]["token_ids"]
        (http_timing,) = a.bridge.timings.values()
    with GrpcServerThread(argv) as b, grpc.insecure_channel(b.grpc_target) as ch:
        msgs = list(pb_grpc.VllmEngineStub(ch).Generate(_gen(rid="g", seed=11, ignore_eos=True), timeout=TIMEOUT_S))
        grpc_ids = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
        grpc_timing = b.bridge.timings["g"]
    assert grpc_ids == http_ids and len(grpc_ids) == 16
    assert _relative(grpc_timing) == pytest.approx(_relative(http_timing), abs=1e-9)


# -- a gateway's route: tokenize with the worker's tokenizer, Generate on ids, detokenize -------------------
@pytest.mark.slow        # ~4 s: saving, zipping and loading a 128k-token tokenizer
def test_gateway_chat_through_get_tokenizer(srv, stub, tmp_path):
    from transformers import AutoTokenizer

    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT_S))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    messages = [{"role": "user", "content": "Say something about GPUs."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    req = pb.GenerateRequest(request_id="gw", tokenized=pb.TokenizedInput(original_text=prompt, input_ids=ids),
                             sampling_params=pb.SamplingParams(max_tokens=24, seed=5, ignore_eos=True),
                             stream=True)
    out = [t for m in stub.Generate(req, timeout=TIMEOUT_S) if m.HasField("chunk") for t in m.chunk.token_ids]
    text = tok.decode(out, skip_special_tokens=True)
    # the same conversation through the HTTP chat route: same prompt tokens, same (seeded) answer
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=TIMEOUT_S,
                   json={"model": "m", "messages": messages, "max_tokens": 24, "seed": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == text and text


# -- KV events ------------------------------------------------------------------------------------------------
def test_subscribe_kv_events_is_unimplemented_without_the_config(stub):
    with pytest.raises(grpc.RpcError) as info:
        next(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--kv-events-config" in info.value.details()


def test_subscribe_kv_events_streams_the_publishers_batches(monkeypatch):
    from tests.conftest import free_port_run

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    port = free_port_run(1)
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    with GrpcServerThread([*ARGS, "--kv-events-config", json.dumps(cfg)]) as s, \
            grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.VllmEngineStub(ch)
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT_S)
        events.initial_metadata()                       # subscribed: what follows is on the stream
        list(stub.Generate(_gen(rid="kv", max_tokens=2), timeout=TIMEOUT_S))
        batch = next(events)
        assert batch.sequence_number == 0 and batch.dp_rank == 0 and batch.timestamp > 1.6e9
        stored = [e.stored for e in batch.events if e.HasField("stored")]
        blocks = [b for st in stored for b in st.blocks]
        bs = s.config.scheduler.block_size
        assert [list(b.token_ids) for b in blocks[:4]] == [PROMPT[i * bs:(i + 1) * bs] for i in range(4)]
        assert not stored[0].HasField("parent_block_hash") and stored[0].medium == "GPU"
        assert len({b.block_hash for b in blocks}) == len(blocks)
        assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=TIMEOUT_S).success
        nxt = next(events)
        assert nxt.sequence_number == 1 and nxt.events[-1].HasField("cleared")
        events.cancel()


# -- flags ------------------------------------------------------------------------------------------------------
def test_serve_parses_vllms_grpc_flags():
    from kernelsight.server.serve_args import ignored_flags, serve_parser
    from kernelsight.server.wire.grpc.launch import http_port_of

    ns = serve_parser().parse_args(["--grpc", "--port", "50051", "--disable-log-stats-server"])
    assert ns.grpc and ns.port == 50051 and http_port_of(ns) == 50052
    assert ignored_flags(ns) == ["--disable-log-stats-server"]
    assert http_port_of(serve_parser().parse_args(["--grpc", "--grpc-http-port", "0"])) == 0


def test_grpc_with_replica_processes_is_one_line(capsys):
    err = cli_one_line_error(capsys, ["serve", "--grpc", "--replicas", "2", "--replica-processes", "2"])
    assert "--replica-processes" in err


def test_admission_limit_and_sleep_are_unavailable(srv, stub):
    import dataclasses

    opts = srv.state.opts
    srv.state.opts = dataclasses.replace(opts, max_num_queued_reqs=0)     # --max-num-queued-reqs 0: all refused
    try:
        code, details = _code(stub, _gen(rid="refused"))
    finally:
        srv.state.opts = opts
    assert code == grpc.StatusCode.UNAVAILABLE and "currently busy" in details
    srv.call(srv.state.sleep.sleep, 1)                                    # sleep mode: refused the same way
    try:
        code, details = _code(stub, _gen(rid="asleep"))
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S).is_paused
    finally:
        srv.call(srv.state.sleep.wake_up, None)
    assert code == grpc.StatusCode.UNAVAILABLE and "sleeping" in details
    _wait_idle(srv)


# -- P/D over gRPC, and the admission limit ---------------------------------------------------------------
@pytest.mark.slow        # two more servers (~3 s)
def test_prefill_decode_over_grpc_and_the_admission_limit():
    """A gateway's P/D legs over gRPC: the prefill instance keeps the blocks and answers NIXL's params in its
    ``complete``; the decode instance pulls them (its announcement, to the prefill's HTTP app, frees them). The
    decode instance's --max-num-queued-reqs 1 refuses a second request with UNAVAILABLE, as vLLM's 503."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    common = [*ARGS, "--lateness-warn-ms", "0"]
    p_cfg = json.dumps({**nixl, "engine_id": "prefill-0"})
    with GrpcServerThread([*common, "--kv-transfer-config", p_cfg]) as p, \
            GrpcServerThread([*common, "--kv-transfer-config", json.dumps(nixl), "--max-num-queued-reqs", "1",
                              "--time-scale", "1"]) as d, \
            grpc.insecure_channel(p.grpc_target) as pch, grpc.insecure_channel(d.grpc_target) as dch:
        pstub, dstub = pb_grpc.VllmEngineStub(pch), pb_grpc.VllmEngineStub(dch)
        info = pstub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
        assert (info.kv_connector, info.kv_role, info.kv_engine_id) == ("NixlConnector", "kv_both", "prefill-0")
        leg = pb.GenerateRequest(request_id="p1", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=False,
                                 sampling_params=pb.SamplingParams(max_tokens=1, ignore_eos=True),
                                 kv_transfer_params_json=json.dumps({"do_remote_decode": True}))
        (m,) = list(pstub.Generate(leg, timeout=TIMEOUT_S))
        params = json.loads(m.complete.kv_transfer_params_json)
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)     # its HTTP app
        assert len(params["remote_block_ids"][0]) == len(PROMPT) // 16
        assert p.call(lambda: p.bridge.engine.num_held) == 1
        dec = pb.GenerateRequest(request_id="d1", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
                                 sampling_params=pb.SamplingParams(max_tokens=1500, ignore_eos=True),
                                 kv_transfer_params_json=json.dumps(params))
        first = dstub.Generate(dec, timeout=TIMEOUT_S)          # ~10 s of decoding in real time: still in flight
        assert next(first).HasField("chunk")
        # one request in flight on the decode instance: the next is refused (vLLM's QueueOverflowError)
        code, details = _code(dstub, _gen(rid="over", max_tokens=4))
        assert code == grpc.StatusCode.UNAVAILABLE and "currently busy" in details
        dstub.Abort(pb.AbortRequest(request_ids=["d1"]), timeout=TIMEOUT_S)
        assert list(first)[-1].complete.finish_reason == "abort"
        t_end = time.monotonic() + 10                  # the pull's announcement reaches the prefill side
        while p.call(lambda: p.bridge.engine.num_held) and time.monotonic() < t_end:
            time.sleep(0.01)
        assert p.call(lambda: p.bridge.engine.num_held) == 0


@pytest.mark.slow        # one more server (~2 s)
def test_embed_on_an_embedding_model_is_the_http_vector():
    with GrpcServerThread([*ARGS, "--convert", "embed", "--record-timings"]) as s, \
            grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.VllmEngineStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert not info.is_generation
        r = stub.Embed(pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=PROMPT)),
                       timeout=TIMEOUT_S)
        assert r.prompt_tokens == 64 and r.embedding_dim == s.config.model.hidden_size == len(r.embedding)
        assert s.bridge.timings["e1"]["token_times_s"]                    # after its simulated prefill
        http = httpx.post(f"{s.base_url}/v1/embeddings", json={"model": "m", "input": PROMPT}, timeout=TIMEOUT_S)
        assert http.status_code == 200, http.text
        assert list(r.embedding) == pytest.approx(http.json()["data"][0]["embedding"], abs=1e-6)
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(pb.EmbedRequest(request_id="e2"), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "EmbedRequest requires tokenized input"
