"""Sleep mode (dev-mode /sleep, /wake_up, /is_sleeping) and --show-hidden-metrics-for-version, over real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.runner import ServerThread  # noqa: E402

ARGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--num-gpu-blocks-override", "64", "--time-scale", "20",
        "--enable-prompt-tokens-details", "--served-model-name", "m"]
PROMPT = list(range(1000, 1064))         # 4 full blocks of 16


def _serve(monkeypatch: pytest.MonkeyPatch, *extra: str) -> ServerThread:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")     # vLLM registers the sleep routes only in dev mode
    return ServerThread([*ARGS, *extra])


@pytest.fixture(scope="module")
def srv():
    with pytest.MonkeyPatch.context() as mp, _serve(mp, "--enable-sleep-mode",
                                                    "--show-hidden-metrics-for-version", "0.10") as s:
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as client:
        yield client


def _complete(c: httpx.Client, prompt: list[int] = PROMPT, max_tokens: int = 4) -> httpx.Response:
    return c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens})


def _samples(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name``'s family (suffixes kept, the name itself replaced by ``*``) → value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            rest = key[len(name):]
            if rest[:1] in ("{", " ", "_") or rest == "":
                out["*" + rest] = float(value)
    return out


def _sleep_state(c: httpx.Client) -> dict[str, float]:
    text = c.get("/metrics").text
    return {st: _samples(text, "vllm:engine_sleep_state")[
        f'*{{engine="0",model_name="m",sleep_state="{st}"}}'] for st in ("awake", "weights_offloaded", "discard_all")}


def test_sleep_refuses_work_until_every_tag_is_awake(c):
    assert _complete(c).status_code == 200
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_state(c) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}

    assert c.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert c.get("/is_sleeping").json() == {"is_sleeping": True}
    assert _sleep_state(c) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    r = _complete(c)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503 and "sleeping" in r.json()["error"]["message"]
    chat = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 503
    assert c.post("/tokenize", json={"model": "m", "prompt": "hi"}).status_code == 200   # needs no weights

    # half awake (weights back, KV cache not yet) still refuses work
    assert c.post("/wake_up", params={"tags": "weights"}).json() == {"status": "sleeping", "tags": ["weights"]}
    assert _complete(c).status_code == 503
    assert c.post("/wake_up", params={"tags": "kv_cache"}).json() == {"status": "awake", "tags": ["kv_cache"]}
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_state(c)["awake"] == 1
    assert _complete(c).status_code == 200


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_the_prefix_cache(c, level):
    prompt = [level * 10_000 + i for i in range(64)]
    _complete(c, prompt)
    again = _complete(c, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again == 48            # the first 3 blocks hit (the last block is recomputed, as in vLLM)
    assert c.post("/sleep", params={"level": level}).status_code == 200
    if level == 2:
        assert _sleep_state(c)["discard_all"] == 1
    assert c.post("/wake_up").json() == {"status": "awake", "tags": None}
    after = _complete(c, prompt).json()["usage"]["prompt_tokens_details"]
    assert not after or after["cached_tokens"] == 0


def test_sleep_aborts_the_request_in_flight_and_frees_its_blocks(srv, c):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None      # in flight now
        with httpx.Client(base_url=srv.base_url, timeout=30) as other:
            assert other.post("/sleep").json() == {"status": "sleeping", "level": 1}
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    reasons = [json.loads(x)["choices"][0]["finish_reason"] for x in rest[:-1] if json.loads(x)["choices"]]
    assert reasons[-1] == "abort"
    assert srv.bridge.engine.kv.usage == 0.0 and srv.bridge.num_unfinished == 0
    assert c.post("/wake_up").json()["status"] == "awake"


def test_bad_sleep_parameters_answer_400(c):
    assert c.post("/sleep", params={"level": 3}).status_code == 400
    assert c.post("/sleep", params={"mode": "drain"}).status_code == 400
    r = c.post("/wake_up", params={"tags": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}


def test_hidden_metrics_equal_their_successors(c):
    _complete(c, max_tokens=8)
    _complete(c, max_tokens=8)
    text = c.get("/metrics").text
    pairs = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
             "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
             "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
             "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds"}
    for old, new in pairs.items():
        got, want = _samples(text, old), _samples(text, new)
        assert got and got == want, old
    assert _samples(text, "vllm:gpu_prefix_cache_hits")['*_total{engine="0",model_name="m"}'] > 0
    assert '*_count{engine="0",model_name="m"}' in _samples(text, "vllm:time_per_output_token_seconds")


def test_without_the_flags_no_aliases_and_no_sleep(monkeypatch):
    with _serve(monkeypatch, "--show-hidden-metrics-for-version", "0.32") as s, \
            httpx.Client(base_url=s.base_url, timeout=30) as c:
        assert _complete(c).status_code == 200
        text = c.get("/metrics").text
        assert "vllm:kv_cache_usage_perc" in text and "vllm:gpu_cache_usage_perc" not in text
        assert "vllm:time_per_output_token_seconds" not in text
        r = c.post("/sleep")
        assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _complete(c).status_code == 200


def test_sleep_routes_need_dev_mode(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with ServerThread([*ARGS, "--enable-sleep-mode"]) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        assert c.post("/sleep").status_code == 404 and c.get("/is_sleeping").status_code == 404


def test_sleep_and_wake_are_priced_as_one_weight_copy_over_pcie(srv):
    from kernelsight.server.integrations.sleep_mode import SleepMode, sleep_copy_s, wake_copy_s, weight_copy_s

    cfg = srv.config
    copy_s = weight_copy_s(cfg)
    assert copy_s == pytest.approx(cfg.memory.weight_bytes / cfg.hardware.pcie_bytes_per_s)
    assert 0.1 < copy_s < 1.0          # Llama-3.1-8B in bf16 (~16 GB) over a 64 GB/s PCIe 5 x16 link
    assert sleep_copy_s(cfg, 1) == copy_s and sleep_copy_s(cfg, 0) == sleep_copy_s(cfg, 2) == 0.0
    mode = SleepMode()
    mode.sleep(2)
    assert wake_copy_s(cfg, mode, ["kv_cache"]) == 0.0        # reallocating the KV cache moves no bytes
    assert wake_copy_s(cfg, mode, None) == wake_copy_s(cfg, mode, ["weights"]) == copy_s
    mode.wake_up(["weights"])
    assert wake_copy_s(cfg, mode, ["weights"]) == 0.0         # already awake: nothing to copy
    mode.sleep(0)
    assert wake_copy_s(cfg, mode, None) == 0.0                # level 0 kept everything on the device


class _RecordingPublisher:
    """Takes the batches the bridge hands its KV-event publisher (the ZeroMQ path is tests/test_kv_events.py's)."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, ts: float, events: list) -> None:
        self.batches.append(list(events))

    def shutdown(self) -> None:
        pass


def test_level_2_sleep_publishes_all_blocks_cleared_and_level_0_keeps_the_cache(monkeypatch):
    from kernelsight.simcore.kv_events import AllBlocksCleared

    with _serve(monkeypatch, "--enable-sleep-mode") as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        pub = _RecordingPublisher()
        s.bridge.engine.kv.enable_events()
        s.bridge.kv_publisher = pub
        _complete(c)
        c.post("/sleep", params={"level": 0})
        assert not any(isinstance(e, AllBlocksCleared) for b in pub.batches for e in b)
        c.post("/wake_up")
        cached = _complete(c).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 48                           # level 0 kept the prefix cache
        n = len(pub.batches)
        assert c.post("/sleep", params={"level": 2}).status_code == 200
        # the last step's events may still be unpublished when its response is out: the sleep's batch takes them
        after = [e for b in pub.batches[n:] for e in b]
        assert after[-1] == AllBlocksCleared() and after.count(AllBlocksCleared()) == 1
