"""Prefill/decode disaggregation through real HTTP sockets: a prefill and a decode kernelsight server with vLLM's
toy-proxy semantics between them (tests/pd_proxy.py); --kv-transfer-config's parsing and its one-line errors."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from kernelsight.server.integrations.kv_transfer import parse_kv_transfer_config
from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from tests.conftest import cli_one_line_error
from tests.pd_proxy import ProxyThread

NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
PLEN = 2000
TIME_SCALE = 0.25       # slower than real time: the simulated times dominate the HTTP hops in the wall-clock check
# what the client sees beyond the simulated clocks: the proxy's hops (client -> proxy -> prefill, prefill answer ->
# proxy -> decode, decode chunk -> proxy -> client) between threads of one Python process; measured 27-74 ms on this
# shared 2-core machine under a load average of 6-8 (the servers' own release lateness is added on top). The
# transfer alone is 0.84 s of wall time here, so leaving it out could not pass.
HOPS_S = 0.2


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 120000 + 1000 for i in range(PLEN)]


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    """Poll an expected state (reached asynchronously, by an HTTP notification) until it holds or time runs out."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from kernelsight.server.runner import ServerThread

    common = ["--served-model-name", "m", "--max-model-len", "4096", "--time-scale", str(TIME_SCALE),
              "--record-timings", "--lateness-warn-ms", "0", "--kv-transfer-config", NIXL]
    engine_id = "prefill-engine-0"
    p_cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id})
    with ServerThread([*common[:-1], p_cfg]) as p, ServerThread(
            [*common, "--kv-transfer-link", "tcp", "--kv-transfer-bandwidth-gbps", "10"]) as d, \
            ProxyThread([p.base_url], [d.base_url]) as proxy:
        yield p, d, proxy, engine_id


def _held(srv) -> int:
    return srv.call(lambda: srv.bridge.engine.num_held)


def _free_blocks(srv) -> int:
    return srv.call(lambda: srv.bridge.engine.kv.num_free_blocks)


def test_prefill_instance_keeps_blocks_and_answers_nixl_params(pd):
    p, _, _, engine_id = pd
    free0 = _free_blocks(p)
    body = {"model": "m", "prompt": _prompt(1), "max_tokens": 1, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    r = httpx.post(p.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert set(params) == {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                           "remote_request_id", "remote_host", "remote_port", "tp_size"}
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == engine_id and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.port
    (blocks,) = params["remote_block_ids"]                     # one KV-cache group
    assert len(blocks) == math.ceil(PLEN / 16) and len(set(blocks)) == len(blocks)
    assert _held(p) == 1 and _free_blocks(p) == free0 - len(blocks)
    # a plain request on the same server keeps nothing and answers null
    r2 = httpx.post(p.base_url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2},
                    timeout=30)
    assert r2.json()["kv_transfer_params"] is None and _held(p) == 1
    # the decode side's notification frees them
    note = {"remote_engine_id": engine_id, "remote_request_id": params["remote_request_id"]}
    assert httpx.post(p.base_url + "/kernelsight/kv_transfer/notify", json=note).json() == {"freed": True}
    assert _held(p) == 0 and _free_blocks(p) == free0
    assert httpx.post(p.base_url + "/kernelsight/kv_transfer/notify", json=note).json() == {"freed": False}
    bad = httpx.post(p.base_url + "/kernelsight/kv_transfer/notify", json={**note, "remote_engine_id": "nope"})
    assert bad.status_code == 404


def test_ttft_through_the_proxy_is_prefill_plus_transfer_plus_first_decode_step(pd):
    p, d, proxy, _ = pd
    p_free0, d_free0 = _free_blocks(p), _free_blocks(d)
    body = {"model": "m", "prompt": _prompt(2), "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        # warm up every hop's connections and first-request paths (not what the check is about)
        warm = c.post(proxy.base_url + "/v1/completions", json={"model": "m", "prompt": [7] * 40, "max_tokens": 2})
        assert warm.status_code == 200
        assert _wait_for(lambda: _held(p) == 0)
        for srv in (p, d):
            httpx.get(srv.base_url + "/kernelsight/timings", params={"reset_late": True})
            srv.call(srv.bridge.timings.clear)
        t0 = time.perf_counter()
        ttft = None
        with c.stream("POST", proxy.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = []
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - t0
                lines.append(line)
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {"))
    assert text
    tp = httpx.get(p.base_url + "/kernelsight/timings").json()
    td = httpx.get(d.base_url + "/kernelsight/timings").json()
    (rp,), (rd,) = tp["requests"].values(), td["requests"].values()
    p_ttft = rp["token_times_s"][0] - rp["arrival_s"]         # wall seconds (virtual / time scale)
    d_ttft = rd["token_times_s"][0] - rd["arrival_s"]
    assert len(rp["token_times_s"]) == 1 and len(rd["token_times_s"]) == 8
    # the decode side: the pull over its 10 Gb/s TCP link, then one step computing the last prompt token
    eng = d.bridge.engine
    pull_s = d.call(lambda: eng.kv_transfer.time_s(math.ceil(PLEN / 16)))
    first_step_s = d.call(lambda: eng.step_model.step(BatchShape((PrefillChunk(1, PLEN - 1, True),), 0, 0))[1])
    assert pull_s == pytest.approx(PLEN / 16 * 16 * 32 * 8 * 128 * 2 * 2 / 1.25e9 + 50e-6, rel=1e-9)
    assert d_ttft * TIME_SCALE == pytest.approx(pull_s + first_step_s, rel=1e-6)
    assert d.call(lambda: eng.num_pulls) == 2
    # at the client: prefill + transfer + first decode step, plus the hops (never less)
    late = max(tp["late_s_max"], td["late_s_max"])
    # the servers run in this process: their timings share the client's perf_counter clock, so each hop is known
    hops = (rp["wall0_s"] + rp["arrival_s"] - t0,                                           # client -> P
            rd["wall0_s"] + rd["arrival_s"] - (rp["wall0_s"] + rp["token_times_s"][0]),     # P's answer -> D
            t0 + ttft - (rd["wall0_s"] + rd["token_times_s"][0]))                           # D's token -> client
    assert min(hops) > -0.002, hops
    assert p_ttft + d_ttft - 0.002 <= ttft <= p_ttft + d_ttft + HOPS_S + late, (ttft, p_ttft, d_ttft, late, hops)
    # the pull's notification freed the prefill side's blocks; the decode side freed its own at the finish
    assert _wait_for(lambda: _held(p) == 0)
    assert _free_blocks(p) == p_free0
    assert _wait_for(lambda: _free_blocks(d) == d_free0)


def test_unpulled_blocks_are_freed_after_the_abort_timeout(monkeypatch):
    from kernelsight.server.runner import ServerThread

    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "5")     # simulated seconds: 0.1 s of wall at 50x
    argv = ["--served-model-name", "m", "--max-model-len", "4096", "--time-scale", "50", "--kv-transfer-config",
            NIXL]
    with ServerThread(argv) as p:
        free0 = _free_blocks(p)
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 1,
                "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}}      # chat answers them too
        r = httpx.post(p.base_url + "/v1/chat/completions", json=body, timeout=30)
        (blocks,) = r.json()["kv_transfer_params"]["remote_block_ids"]
        assert len(blocks) == math.ceil(r.json()["usage"]["prompt_tokens"] / 16)
        assert _held(p) == 1 or _free_blocks(p) == free0     # (a starved test thread may look only after 0.1 s)
        assert _wait_for(lambda: _held(p) == 0)
        assert _free_blocks(p) == free0


def test_without_a_connector_kv_transfer_params_are_ignored():
    from kernelsight.server.runner import ServerThread

    with ServerThread(["--served-model-name", "m", "--max-model-len", "1024", "--time-scale", "50"]) as s:
        body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        r = httpx.post(s.base_url + "/v1/chat/completions", json={**body, "prompt": None, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
        assert _held(s) == 0


def test_config_parsing_follows_vllm():
    cfg = parse_kv_transfer_config(NIXL)
    assert cfg.kv_connector == "NixlConnector" and cfg.kv_role == "kv_both" and len(cfg.engine_id) == 36
    assert cfg.kv_port == 14579 and cfg.kv_ip == "127.0.0.1" and cfg.kv_connector_extra_config == {}
    extra = parse_kv_transfer_config('{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer",'
                                     '"kv_connector_extra_config":{"proxy_port":"30001"}}')
    assert extra.kv_connector_extra_config == {"proxy_port": "30001"}



@pytest.mark.parametrize(("value", "message"), [
    ("{not json", "invalid JSON"),
    ('{"kv_connector": "WarpDriveConnector", "kv_role": "kv_both"}', "Unsupported connector type: WarpDriveConnector"),
    ('{"kv_connector": "NixlConnector"}', "Please specify kv_role"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_sideways"}', "Unsupported kv_role: kv_sideways"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_colour": 1}', "unknown field(s) kv_colour"),
])
def test_bad_configs_fail_at_start_with_one_line(capsys, value, message):
    err = cli_one_line_error(capsys, ["serve", "--kv-transfer-config", value])
    assert err.startswith("kernelsight serve: error: ") and "--kv-transfer-config" in err and message in err
