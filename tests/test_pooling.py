"""An embedding model (--runner pooling / --convert embed): /v1/embeddings, /pooling, /score, /rerank over real HTTP
(the openai SDK for embeddings); vectors of the hidden size, deterministic and normalized; timed as prefills."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kernelsight.server.runner import ServerThread  # noqa: E402

ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--time-scale", "20", "--served-model-name", "m",
        "--record-timings"]


@pytest.fixture(scope="module")
def srv():
    with ServerThread([*ARGS, "--convert", "embed"]) as s:
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as client:
        yield client


def test_embeddings_with_the_openai_sdk(srv):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model="m", input=["the cat sat", "the cat sat", "a dog ran"])
    hidden = srv.config.model.hidden_size
    vecs = [np.array(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(v.shape == (hidden,) for v in vecs)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vecs)
    assert np.array_equal(vecs[0], vecs[1]) and not np.allclose(vecs[0], vecs[2])
    tok = srv.state.tok
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in ("the cat sat", "the cat sat", "a dog ran"))
    # asked for explicitly, the SDK hands base64 over as sent: little-endian float32 of the same vector
    b = client.embeddings.create(model="m", input="the cat sat", encoding_format="base64")
    assert np.allclose(np.frombuffer(base64.b64decode(b.data[0].embedding), dtype="<f4"), vecs[0], atol=1e-7)


def test_base64_and_pooling(c):
    f = c.post("/v1/embeddings", json={"model": "m", "input": "hello", "encoding_format": "float"}).json()
    b = c.post("/v1/embeddings", json={"model": "m", "input": "hello", "encoding_format": "base64"}).json()
    assert f["id"].startswith("embd-") and f["object"] == "list" and f["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.array(f["data"][0]["embedding"], dtype=np.float32))
    p = c.post("/pooling", json={"model": "m", "input": [[1, 2, 3, 4]]}).json()
    assert p["id"].startswith("pool-") and p["data"][0]["object"] == "pooling" and len(p["data"][0]["data"]) == \
        len(f["data"][0]["embedding"])


def test_score_and_rerank_rank_overlap_first(c):
    docs = ["quantum chromodynamics lecture notes", "the cat sat on the mat", "cats sit on mats"]
    s = c.post("/score", json={"model": "m", "queries": "the cat sat on a mat", "documents": docs}).json()
    scores = [d["score"] for d in s["data"]]
    assert s["object"] == "list" and [d["index"] for d in s["data"]] == [0, 1, 2]
    assert max(scores) == scores[1] and scores[0] < scores[1]
    same = c.post("/v1/score", json={"model": "m", "text_1": "the cat sat on a mat", "text_2": docs}).json()
    assert [d["score"] for d in same["data"]] == scores
    r = c.post("/v2/rerank", json={"model": "m", "query": "the cat sat on a mat", "documents": docs,
                                   "top_n": 2}).json()
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -scores[i])[:2]
    assert r["results"][0]["document"]["text"] == docs[1] and r["usage"]["total_tokens"] == s["usage"]["total_tokens"]
    bad = c.post("/score", json={"model": "m", "data_1": ["a", "b"], "data_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and "1:N or N:N" in bad.json()["error"]["message"]


def test_timed_as_a_prefill(c, srv):
    """The answer waits for the simulated prefill of the input: longer inputs take longer on the virtual clock."""
    waits = []
    for n in (16, 1500):
        r = c.post("/v1/embeddings", json={"model": "m", "input": [list(range(100, 100 + n))]}).json()
        t = srv.bridge.timings[r["id"]]
        (done,) = t["token_times_s"]          # one engine step: the prefill, nothing decoded after it
        waits.append(done - t["arrival_s"])
    assert waits[1] > 3 * waits[0] > 0
    assert srv.call(lambda: srv.bridge.engine.has_unfinished()) is False


def test_errors_and_generation_routes_absent(c):
    r = c.post("/v1/embeddings", json={"model": "m", "input": "x", "dimensions": 8})
    assert r.status_code == 400 and "matryoshka" in r.json()["error"]["message"]
    r = c.post("/v1/embeddings", json={"model": "m", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = c.post("/v1/embeddings", json={"model": "m", "input": [list(range(3000))]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens"
    assert c.post("/v1/embeddings", json={"model": "zz", "input": "x"}).status_code == 404
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert c.post(path, json={"model": "m"}).json() == {"detail": "Not Found"}
    inv = c.post("/invocations", json={"model": "m", "query": "a", "documents": ["a b", "c"]}).json()
    assert "results" in inv


def test_seed_changes_vectors_deterministically(srv):
    with ServerThread([*ARGS, "--task", "embed", "--seed", "5"]) as other, httpx.Client(timeout=30) as c:
        body = {"model": "m", "input": "hello world"}
        a = c.post(srv.base_url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
        b = c.post(other.base_url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
        b2 = c.post(other.base_url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    assert a != b and b == b2


def test_cohere_v2_embed(c):
    f = c.post("/v1/embeddings", json={"model": "m", "input": "the cat sat"}).json()["data"][0]["embedding"]
    r = c.post("/v2/embed", json={"model": "m", "texts": ["the cat sat"], "input_type": "search_document",
                                  "embedding_types": ["float", "ubinary", "binary", "base64"]}).json()
    emb = r["embeddings"]
    assert emb["float"][0] == f and r["texts"] == ["the cat sat"] and r["meta"]["api_version"] == {"version": "2"}
    bits = np.unpackbits(np.array(emb["ubinary"][0], dtype=np.uint8)).astype(bool)
    assert np.array_equal(bits, np.array(f) >= 0)
    assert [b + 128 for b in emb["binary"][0]] == emb["ubinary"][0]
    assert np.array_equal(np.frombuffer(base64.b64decode(emb["base64"][0]), dtype="<f4"), np.array(f, np.float32))
    assert r["meta"]["tokens"]["input_tokens"] == c.post("/v1/embeddings", json={
        "model": "m", "input": "the cat sat"}).json()["usage"]["prompt_tokens"]
