"""logprobs / top_logprobs / prompt_logprobs on /v1/completions and /v1/chat/completions (vLLM 0.33 shapes)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kernelsight.server.model.logprobs import LogprobSynth  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--num-gpu-blocks-override", "600", "--time-scale", "50",
        "--served-model-name", MODEL]
MSGS = [{"role": "user", "content": "Say something"}]
CMPL_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                    "prompt_token_ids", "routed_experts", "weight_versions"]
CMPL_CHUNK_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                          "token_ids", "weight_versions"]
CMPL_LP_KEYS = ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
CHAT_CONTENT_KEYS = ["token", "logprob", "bytes", "top_logprobs"]


@pytest.fixture(scope="module")
def srv():
    with ServerThread(ARGS) as s:
        yield s


@pytest.fixture()
def http(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        yield c


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)


def sse(raw: str) -> list[dict]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    return [json.loads(p[len("data: "):]) for p in raw.split("\n\n")[:-2]]


def check_single_token(srv, t: str) -> None:
    assert srv.state.tok.encode(t, add_special_tokens=False).__len__() == 1, t


def check_cmpl_logprobs(srv, lp: dict, k: int, text: str | None = None, offset0: int = 0) -> None:
    assert list(lp) == CMPL_LP_KEYS
    n = len(lp["tokens"])
    assert len(lp["text_offset"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    if text is not None:
        assert "".join(lp["tokens"]) == text
    off = offset0
    for tok, tlp, top, o in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"],
                                strict=True):
        assert o == off
        off += len(tok)
        if tlp is None:
            assert top is None
            continue
        assert -3 < tlp <= 0
        items = list(top.items())
        assert items[0] == (tok, tlp)                       # the sampled token leads its dict
        assert len(items) in (k, k + 1) if k else len(items) == 1
        alts = [v for _, v in items[1:]]
        assert alts == sorted(alts, reverse=True)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        for t in top:
            check_single_token(srv, t)


def check_chat_logprobs(srv, lp: dict, k: int, text: str) -> None:
    assert list(lp) == ["content"]
    assert "".join(c["token"] for c in lp["content"]) == text
    for c in lp["content"]:
        assert list(c) == CHAT_CONTENT_KEYS
        assert -3 < c["logprob"] <= 0 and c["bytes"] == list(c["token"].encode())
        top = c["top_logprobs"]
        assert len(top) == k
        for e in top:
            assert list(e) == ["token", "logprob", "bytes"] and e["bytes"] == list(e["token"].encode())
            check_single_token(srv, e["token"])
        rest = [e["logprob"] for e in top if e["token"] != c["token"]]
        assert rest == sorted(rest, reverse=True)
        assert all(e["logprob"] == c["logprob"] for e in top if e["token"] == c["token"])
        assert sum(math.exp(e["logprob"]) for e in top) <= 1 + 1e-6


# -- the synthesizer ----------------------------------------------------------------------------------
def test_synth_invariants(srv):
    syn = LogprobSynth(srv.state.tok)
    tid, text = srv.state.tok.pool_token(7)
    ranks = set()
    for pos in range(400):
        big = syn.entries(12345, pos, tid, text, 20)
        small = syn.entries(12345, pos, tid, text, 3)
        assert big[0][:3] == small[0][:3] and -3 < big[0][2] <= 0
        ranks.add(big[0][3])
        by_rank = sorted(big, key=lambda e: e[3])
        lps = [e[2] for e in by_rank]
        assert [e[3] for e in by_rank] == list(range(1, len(by_rank) + 1))
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-6
        assert len({e[0] for e in big}) == len(big)
        assert {e[:3] for e in small} <= {e[:3] for e in big}      # fewer alternatives: the same values
    assert min(ranks) == 1 and max(ranks) > 1                     # often, but not always, the argmax


# -- completions ---------------------------------------------------------------------------------------
def test_completions_nonstream_and_stream(srv, http):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 3, "seed": 7,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    ch = r["choices"][0]
    assert list(ch) == CMPL_CHOICE_KEYS and ch["prompt_logprobs"] is None
    check_cmpl_logprobs(srv, ch["logprobs"], 3, ch["text"])
    assert len(ch["logprobs"]["tokens"]) == r["usage"]["completion_tokens"] == 6
    # same seed: identical values; streaming concatenates to the same lists
    assert http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"] == ch["logprobs"]
    chunks = sse(http.post("/v1/completions", json={**body, "stream": True}).text)
    merged = {k: [] for k in CMPL_LP_KEYS}
    for c in chunks:
        (cc,) = c["choices"]
        assert list(cc) == CMPL_CHUNK_CHOICE_KEYS
        for k in CMPL_LP_KEYS:
            merged[k] += cc["logprobs"][k]
    assert merged == ch["logprobs"]
    other = http.post("/v1/completions", json={**body, "seed": 8}).json()["choices"][0]["logprobs"]
    assert other["token_logprobs"] != ch["logprobs"]["token_logprobs"]


def test_completions_logprobs_zero_and_n(srv, http):
    r = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 4, "logprobs": 0, "n": 2,
                                           "seed": 3, "ignore_eos": True}).json()
    a, b = r["choices"]
    for ch in (a, b):
        check_cmpl_logprobs(srv, ch["logprobs"], 0, ch["text"])
        assert all(len(t) == 1 for t in ch["logprobs"]["top_logprobs"])
    assert a["logprobs"] != b["logprobs"]


def test_completions_echo(srv, http):
    prompt = "Hello world again"
    ids = srv.state.tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 2, "echo": True, "seed": 5, "ignore_eos": True}
    ch = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["tokens"][0] == "<|begin_of_text|>" and lp["token_logprobs"][0] is None
    assert "".join(lp["tokens"][1:]) == ch["text"]
    check_cmpl_logprobs(srv, lp, 2)
    plp = ch["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos, d in enumerate(plp[1:], 1):
        first_id, first = next(iter(d.items()))
        assert first_id == str(ids[pos]) and list(first) == ["logprob", "rank", "decoded_token"]
        assert lp["token_logprobs"][pos] == first["logprob"] and lp["tokens"][pos] == first["decoded_token"]
    # streaming: the first chunk carries the prompt and the first token; offsets then count generated text only
    chunks = sse(http.post("/v1/completions", json={**body, "stream": True}).text)
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["tokens"] == lp["tokens"][: len(ids) + 1] and first["text_offset"] == lp["text_offset"][: len(ids) + 1]
    second = chunks[1]["choices"][0]["logprobs"]
    assert second["text_offset"] == [len(lp["tokens"][len(ids)])]
    # echo with max_tokens=0: the prompt's logprobs only
    only = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()["choices"][0]
    assert only["logprobs"]["tokens"] == lp["tokens"][: len(ids)]
    assert only["prompt_logprobs"] == plp


def test_completions_prompt_logprobs(srv, http):
    ch = http.post("/v1/completions", json={"prompt": "One two three", "max_tokens": 2,
                                            "prompt_logprobs": 1}).json()["choices"][0]
    assert ch["logprobs"] is None and ch["prompt_logprobs"][0] is None
    assert all(1 <= len(d) <= 2 for d in ch["prompt_logprobs"][1:])
    long_ids = [srv.state.tok.pool_token(i % 50)[0] for i in range(300)]      # computed off the event loop
    long = http.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 1, "prompt_logprobs": 2,
                                              "echo": True, "logprobs": 1}).json()["choices"][0]
    assert len(long["prompt_logprobs"]) == 300 and len(long["logprobs"]["tokens"]) == 301
    assert [int(next(iter(d))) for d in long["prompt_logprobs"][1:]] == long_ids[1:]
    assert all(len(t) <= 2 for t in long["logprobs"]["top_logprobs"][1:])      # at most logprobs + 1 entries
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True})
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "Bad Request" and e["param"] == "prompt_logprobs"
    assert "`prompt_logprobs` are not available when `stream=True`." in e["message"]


def test_completions_errors(http):
    r = http.post("/v1/completions", json={"prompt": "x", "logprobs": 21})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Requested sample logprobs of 21, which is greater than max allowed: 20",
                                  "type": "BadRequestError", "param": "logprobs", "code": 400}}
    r = http.post("/v1/completions", json={"prompt": "x", "logprobs": -1})
    assert r.json()["error"]["message"].startswith("Requested sample logprobs of 128256,")
    r = http.post("/v1/completions", json={"prompt": "x", "logprobs": -2})
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "Bad Request" and e["param"] == "logprobs"
    assert "Value error, `logprobs` must be a positive value or -1." in e["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 25})
    assert r.json()["error"]["message"] == "Requested prompt logprobs of 25, which is greater than max allowed: 20"
    # streaming: the engine-side check arrives in the stream (completions: json.dumps separators)
    r = http.post("/v1/completions", json={"prompt": "x", "logprobs": 21, "stream": True})
    assert r.status_code == 200
    assert r.text == ('data: {"error": {"message": "Requested sample logprobs of 21, which is greater than max '
                      'allowed: 20", "type": "BadRequestError", "param": "logprobs", "code": 400}}\n\ndata: [DONE]\n\n')


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_nonstream_and_stream(srv, http):
    body = {"messages": MSGS, "max_tokens": 5, "logprobs": True, "top_logprobs": 4, "seed": 11, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body).json()
    ch = r["choices"][0]
    check_chat_logprobs(srv, ch["logprobs"], 4, ch["message"]["content"])
    assert len(ch["logprobs"]["content"]) == 5 and r["prompt_logprobs"] is None
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"] == ch["logprobs"]
    chunks = sse(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["logprobs"] is None
    content = []
    for c in chunks[1:]:
        (cc,) = c["choices"]
        assert list(cc)[:3] == ["index", "delta", "logprobs"]
        assert "".join(e["token"] for e in cc["logprobs"]["content"]) == cc["delta"]["content"]
        content += cc["logprobs"]["content"]
    assert content == ch["logprobs"]["content"]
    # logprobs without top_logprobs: entries with an empty top list
    r0 = http.post("/v1/chat/completions", json={**body, "top_logprobs": None}).json()["choices"][0]
    assert [c["top_logprobs"] for c in r0["logprobs"]["content"]] == [[]] * 5
    assert [c["logprob"] for c in r0["logprobs"]["content"]] == [c["logprob"] for c in ch["logprobs"]["content"]]


def test_chat_prompt_logprobs(http):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 2}).json()
    assert r["choices"][0]["logprobs"] is None
    plp = r["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]


def test_chat_errors(http):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "top_logprobs": 2})
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "Bad Request" and e["param"] == "top_logprobs" and e["code"] == 400
    assert e["message"].startswith("1 validation error:\n")
    assert "Value error, when using `top_logprobs`, `logprobs` must be set to true." in e["message"]
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": True, "top_logprobs": -3})
    assert "`top_logprobs` must be a positive value or -1." in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Requested sample logprobs of 21, which is greater than max allowed: 20",
                                  "type": "BadRequestError", "param": "logprobs", "code": 400}}
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": True, "top_logprobs": 21,
                                                "stream": True})
    assert r.text == ('data: {"error":{"message":"Requested sample logprobs of 21, which is greater than max allowed: '
                      '20","type":"BadRequestError","param":"logprobs","code":400}}\n\ndata: [DONE]\n\n')
    # top_logprobs=0 without logprobs is fine, and returns no logprobs
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


# -- openai SDK ----------------------------------------------------------------------------------------
def test_sdk_parses_logprobs(srv, client):
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=4, logprobs=2, seed=1,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert lp.top_logprobs[0][lp.tokens[0]] == lp.token_logprobs[0]
    streamed = []
    for c in client.completions.create(model=MODEL, prompt="Tell me", max_tokens=4, logprobs=2, seed=1,
                                       stream=True, extra_body={"ignore_eos": True}):
        streamed += c.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs

    c = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=3,
                                       seed=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content
    streamed_chat = []
    for ch in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, logprobs=True,
                                             top_logprobs=3, seed=2, stream=True, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed_chat += ch.choices[0].logprobs.content
    assert [t.model_dump() for t in streamed_chat] == [t.model_dump() for t in content]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, top_logprobs=2)


def test_return_tokens_as_token_ids(srv, http):
    """Per request (and, by default, by the server flag): every token in logprobs is written "token_id:<id>" —
    chosen and alternatives, completions and chat, streamed and not — with the same logprobs, and completion
    offsets advance by the label's length as in vLLM."""
    body = {"prompt": "Hi there", "max_tokens": 4, "logprobs": 2, "seed": 11, "ignore_eos": True,
            "return_token_ids": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert ids["text"] == plain["text"]
    lp, lp0 = ids["logprobs"], plain["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids["token_ids"]]
    assert lp["token_logprobs"] == lp0["token_logprobs"]
    assert all(k.startswith("token_id:") for d in lp["top_logprobs"] for k in d)
    assert [sorted(d.values()) for d in lp["top_logprobs"]] == [sorted(d.values()) for d in lp0["top_logprobs"]]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    streamed = sse(http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True,
                                                      "stream": True}).text)
    assert [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]

    chat = {"messages": MSGS, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "seed": 4, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    ch = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ch["token_ids"]]
    for c in content:
        assert c["bytes"] == list(c["token"].encode())
        assert all(a["token"].startswith("token_id:") and a["bytes"] == list(a["token"].encode())
                   for a in c["top_logprobs"])


def test_return_tokens_as_token_ids_server_flag():
    with ServerThread([*ARGS, "--return-tokens-as-token-ids"]) as s, httpx.Client(base_url=s.base_url) as c:
        body = {"prompt": "Hi", "max_tokens": 2, "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
        ch = c.post("/v1/completions", json=body).json()["choices"][0]
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        off = c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
        assert "".join(off["logprobs"]["tokens"]) == off["text"]
