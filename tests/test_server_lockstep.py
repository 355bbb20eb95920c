"""``kernelsight serve -dp 2 --enable-expert-parallel`` of a MoE model steps its ranks in lockstep, as vLLM's DP engine
core does and as ``simulate`` does (one implementation: ``simcore/dp_group.py``): an idle rank runs dummy batches, a
busy rank holds the other's tokens back, every rank's tokens go out at the group's step end. A dense model's ranks
stay independent. Checked through real HTTP against the fast-forward of the same arrivals on the virtual clock."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")

from kernelsight.loadgen.datasets import SampleRequest  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402
from kernelsight.simcore.engine import FIRST_TOKEN, TOKENS  # noqa: E402
from kernelsight.simcore.engine_config import build_dp_group, build_engine  # noqa: E402

MOE = "Qwen/Qwen3-30B-A3B-Instruct-2507"
DENSE = "meta-llama/Llama-3.1-8B"
COMMON = ["--max-model-len", "4096", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
          "--num-gpu-blocks-override", "2000", "--record-timings"]
#: rank 1's stream in the busy-rank tests: long enough (~0.7 s) that the other rank's request lands inside it on a
#: loaded machine
STREAM_TOKENS = 120


def _server(model: str, *extra: str) -> ServerThread:
    return ServerThread(["--model", model, "-dp", "2", *COMMON, *extra])


@pytest.fixture(scope="module")
def moe_srv():
    with _server(MOE, "--hardware", "rtx-pro-6000", "--enable-expert-parallel") as srv:
        yield srv


@pytest.fixture(scope="module")
def dense_srv():
    with _server(DENSE, "--hardware", "h100") as srv:
        yield srv


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 30000, n).tolist()


def _completion(c: httpx.Client, model: str, prompt: list[int], max_tokens: int, rank: int) -> dict:
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                         "ignore_eos": True}, headers={"X-data-parallel-rank": str(rank)})
    assert r.status_code == 200, r.text
    return r.json()


def _virtual_timing(srv: ServerThread, rank: int, response_id: str) -> tuple[float, list[float]]:
    """(virtual arrival, virtual release time of each token) the rank's bridge recorded for a response."""
    rec = srv.call(lambda: dict(srv.state.bridges[rank].timings[response_id]))
    return rec["arrival_s"], list(rec["token_times_s"])


def _fast_forward_token_times(srv: ServerThread, requests: list[tuple[list[int], int, float]]) -> list[list[float]]:
    """Each request's token times in loadgen's fast-forward run of the server's engine config (its DP group)."""
    samples = [SampleRequest(p, len(p), n) for p, n, _ in requests]
    res = run_fast_forward(srv.config, samples, [t for *_, t in requests], ignore_eos=True)
    out = []
    for r in res.records:
        assert r.success
        first = r.start_s + r.ttft_s
        out.append([first, *(first + np.cumsum(r.itl_s)).tolist()])
    return out


def _wait_idle(srv: ServerThread) -> None:
    assert srv.call(lambda: not any(b.engine.has_unfinished() for b in srv.state.bridges))


def test_a_request_on_one_rank_while_the_other_idles_gets_the_fast_forward_token_times(moe_srv):
    srv = moe_srv
    assert srv.state.lockstep is not None and srv.state.lockstep.group.moe.expert_parallel
    _wait_idle(srv)
    done = []
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for seed, (n_prompt, n_out) in enumerate([(700, 12), (90, 20)]):   # one after the other: the group idles
            prompt = _prompt(seed, n_prompt)
            body = _completion(c, MOE, prompt, n_out, rank=0)
            arrival, times = _virtual_timing(srv, 0, body["id"])
            assert len(times) == n_out
            done.append((prompt, n_out, arrival, times))
    steps = srv.call(lambda: [(st.num_steps, st.num_dummy_steps) for st in srv.state.lockstep.group.stats])
    assert steps[1][0] == 0 and steps[1][1] == steps[0][0] > 0      # rank 1 ran a dummy batch in every step
    expected = _fast_forward_token_times(srv, [(p, n, t) for p, n, t, _ in done])
    for (*_, times), ff in zip(done, expected, strict=True):
        assert times == pytest.approx(ff, rel=1e-12, abs=1e-12)


def _stream_token_times(c: httpx.Client, model: str, prompt: list[int], max_tokens: int, rank: int,
                        start_other) -> str:
    """Stream a request pinned to ``rank``; after its 4th chunk run ``start_other()``. Returns the response id."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    rid = None
    with c.stream("POST", "/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)}) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid = rid or line.split('"id":"', 1)[1].split('"', 1)[0]
                n += 1
                if n == 4:
                    start_other()
    assert rid is not None
    return rid


def _busy_other_rank(srv: ServerThread, model: str) -> tuple[list[float], list[float], float]:
    """Rank 1 streams 120 tokens; meanwhile rank 0 prefills a 3,000-token prompt (three 1,024-token chunks) and
    decodes 5. Returns (rank 1's token times, rank 0's token times, rank 0's arrival), virtual."""
    out: dict[str, str] = {}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c, httpx.Client(base_url=srv.base_url, timeout=60) as c2:
        def other() -> None:
            out["busy"] = _completion(c2, model, _prompt(11, 3000), 5, rank=0)["id"]
        rid = _stream_token_times(c, model, _prompt(10, 200), STREAM_TOKENS, 1, other)
    _, times1 = _virtual_timing(srv, 1, rid)
    arrival0, times0 = _virtual_timing(srv, 0, out["busy"])
    return times1, times0, arrival0


def test_a_busy_rank_holds_back_the_other_ranks_stream(moe_srv):
    srv = moe_srv
    _wait_idle(srv)
    times1, times0, arrival0 = _busy_other_rank(srv, MOE)
    assert len(times1) == STREAM_TOKENS and len(times0) == 5
    # lockstep: every token rank 0 releases goes out at a step end of rank 1's stream (both decoding then)
    assert set(times0) <= set(times1)
    itl = np.diff(times1)
    before = itl[np.asarray(times1[1:]) < arrival0]
    during = itl[(np.asarray(times1[:-1]) >= arrival0) & (np.asarray(times1[1:]) <= times0[0])]
    assert len(before) >= 2 and len(during) >= 1
    # the steps that carry rank 0's prefill chunks last as long as the chunk's 1,024 rows: rank 1 waits for them
    assert during.max() > 3 * np.median(before)
    # alone, the same tokens take as many lone steps (the fast-forward of that request alone)
    alone = _fast_forward_token_times(srv, [(_prompt(10, 200), STREAM_TOKENS, 0.0)])[0]
    assert times1[-1] - times1[0] > (alone[-1] - alone[0]) + 2 * np.median(before)
    # each rank still has its own queue, KV cache and /metrics engine label
    metrics = httpx.get(srv.base_url + "/metrics").text
    for rank in (0, 1):
        assert re.search(rf'^vllm:request_success_total\{{[^}}]*engine="{rank}"[^}}]*\}} [1-9]', metrics, re.M)


def test_dense_ranks_stay_independent(dense_srv):
    srv = dense_srv
    assert srv.state.lockstep is None
    _wait_idle(srv)
    times1, times0, _ = _busy_other_rank(srv, DENSE)
    rid_arrival = srv.call(lambda: [r["arrival_s"] for r in srv.state.bridges[1].timings.values()])
    assert len(rid_arrival) == 1
    # rank 1's tokens are exactly those of its request alone on one engine stepped as the bridge steps it (one
    # step at a time: fast-forward's decode windows sum the same steps in another order): rank 0's prefill does
    # not touch them
    alone = build_engine(srv.config)
    alone.add_request("r", _prompt(10, 200), STREAM_TOKENS, ignore_eos=True, arrival_s=rid_arrival[0])
    expected = []
    while (res := alone.step(1)) is not None:
        expected += [res.end_s] * sum(ev.num_tokens for ev in res.events if ev.kind in (FIRST_TOKEN, TOKENS))
    assert times1 == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert not set(times0) <= set(times1)


def test_a_lockstep_decode_instance_decodes_after_its_pull_in_step_with_the_idle_rank():
    """P/D with DP MoE on both sides (vLLM's toy-proxy semantics): the decode group's first step for the pulled
    request starts at the pull's end, it then decodes with rank 1 running dummy batches (token times as the same
    request replayed on the group), and the prefill side frees its held blocks on the decode side's notification."""
    import json

    from tests.pd_proxy import ProxyThread

    nixl = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    common = ["--model", MOE, "--hardware", "rtx-pro-6000", "-dp", "2", "--enable-expert-parallel",
              "--served-model-name", "m", "--max-model-len", "4096", "--record-timings", "--kv-transfer-config", nixl]
    plen = 1500
    with ServerThread(common) as p, ServerThread([*common, "--kv-transfer-link", "tcp",
                                                  "--kv-transfer-bandwidth-gbps", "10"]) as d, \
            ProxyThread([p.base_url], [d.base_url]) as proxy:
        r = httpx.post(proxy.base_url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": _prompt(20, plen), "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        eng = d.state.bridges[0].engine
        (rec,) = d.call(lambda: list(d.state.bridges[0].timings.values()))
        pull_s = d.call(lambda: eng.kv_transfer.time_s(-(-plen // 16)))
        assert d.call(lambda: eng.num_pulls) == 1 and pull_s > 0.05
        # the same request replayed on a fresh group of the decode config: the pull starts at its arrival, the first
        # step at the pull's end (not before: the server's group waited for it), the ranks in lockstep after it
        replay = build_dp_group(d.config)
        replay.engines[0].kv_transfer = eng.kv_transfer
        replay.engines[0].add_request("x", _prompt(20, plen), 6, ignore_eos=True, arrival_s=rec["arrival_s"],
                                      remote_prefill=True)
        expected = []
        while (step := replay.step()) is not None:
            for _, res in step:
                expected += [res.end_s] * sum(ev.num_tokens for ev in res.events if ev.kind in (FIRST_TOKEN, TOKENS))
        assert rec["token_times_s"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert expected[0] > rec["arrival_s"] + pull_s
        stats = d.call(lambda: [(s.num_steps, s.num_dummy_steps) for s in d.state.lockstep.group.stats])
        assert stats[0][0] == 6 and stats[1] == (0, 6)
        deadline = time.monotonic() + 20
        while p.call(lambda: p.state.bridges[0].engine.num_held) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.call(lambda: sum(b.engine.num_held for b in p.state.bridges)) == 0


def test_the_slow_fault_slows_the_whole_lockstep_group(moe_srv):
    """The "slow" replica state multiplies the group's steps (a LockstepStepModel behind ScaledStepModel would price
    the rank's batch unscaled): every virtual token time after the arrival ×3 exactly, and back after."""
    srv = moe_srv
    _wait_idle(srv)

    def relative_times(c: httpx.Client, seed: int) -> list[float]:
        body = _completion(c, MOE, _prompt(seed, 300), 8, rank=1)
        arrival, times = _virtual_timing(srv, 1, body["id"])
        return [t - arrival for t in times]

    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        normal = relative_times(c, 30)
        assert c.post("/kernelsight/faults", json={"types": ["slow"], "slow_factor": 3}).status_code == 200
        try:
            slow = relative_times(c, 31)
        finally:
            assert c.post("/kernelsight/faults", json={"types": []}).status_code == 200
        again = relative_times(c, 32)
    assert len(slow) == len(normal) == 8
    assert slow == pytest.approx([3 * t for t in normal], rel=1e-9)
    assert again == pytest.approx(normal, rel=1e-9)
