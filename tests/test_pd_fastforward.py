"""``simulate --pd XPyD``: the fast-forward of a prefill/decode deployment (loadgen/pd_fastforward.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kernelsight import profiles
from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.pd_fastforward import parse_pd, run_pd
from kernelsight.simcore.engine_config import build_engine
from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.kv_transfer import kv_link
from tests.conftest import make_config


def _samples(n: int, plen: int, olen: int, seed: int = 0) -> list[SampleRequest]:
    return [SampleRequest(prompt_len=plen, expected_output_len=olen,
                          prompt_token_ids=[(seed * 131 + i * 977 + j * 31) % 120000 + 1000 for j in range(plen)])
            for i in range(n)]


def test_parse_pd():
    assert parse_pd("1P1D") == (1, 1) and parse_pd("2p3d") == (2, 3)
    for bad in ("0P1D", "1P", "P1D1", "xPyD"):
        with pytest.raises(ValueError, match="XPyD"):
            parse_pd(bad)


def test_one_request_ttft_is_prefill_plus_pull_plus_first_decode_step():
    cfg = make_config()
    link = kv_link(profiles.load_hardware("h100"), "roce")
    plen, olen = 3000, 20
    res = run_pd(cfg, _samples(1, plen, olen), [1.0], 1, 1, link=link)
    (rec,) = res.records
    ref = build_engine(cfg, link=link)          # price the pieces on a fresh engine of the same configuration
    _, prefill_s = ref.step_model.step(BatchShape((PrefillChunk(plen, 0, True),), 0, 0))
    pull_s = ref.kv_transfer.time_s(math.ceil(plen / 16))
    _, first_decode_s = ref.step_model.step(BatchShape((PrefillChunk(1, plen - 1, True),), 0, 0))
    assert rec.ttft_s == pytest.approx(prefill_s + pull_s + first_decode_s, rel=1e-9)
    assert rec.output_len == olen and res.finish_reasons == {"length": 1}
    p0, d0 = res.pd["instances"]
    assert p0["instance"] == "P0" and d0["instance"] == "D0" and d0["pulls"] == 1
    assert d0["kv_transfer_s"] == pytest.approx(pull_s, abs=1e-6)     # rounded to µs in the report
    assert res.pd["link"]["kind"] == "roce"


def test_xpyd_under_load_leaks_nothing_and_is_deterministic():
    # a small prefill KV cache: held blocks fill it, so prefill engines wait for the decode side's pulls
    cfg = make_config(num_gpu_blocks_override=700, max_model_len=4096)
    samples = _samples(80, 1500, 60, seed=3)
    arrivals = [0.01 * i for i in range(80)]
    a = run_pd(cfg, samples, arrivals, 2, 3)
    b = run_pd(cfg, samples, arrivals, 2, 3)
    assert [r.ttft_s for r in a.records] == [r.ttft_s for r in b.records]
    assert [list(r.itl_s) for r in a.records] == [list(r.itl_s) for r in b.records]
    assert all(r.success and r.output_len == 60 for r in a.records)
    inst = {x["instance"]: x for x in a.pd["instances"]}
    assert sum(inst[f"P{i}"]["requests"] for i in range(2)) == 80
    assert sum(inst[f"D{i}"]["pulls"] for i in range(3)) == 80
    assert max(inst["P0"]["peak_kv_usage"], inst["P1"]["peak_kv_usage"]) > 0.9      # the pressure was real
    for x in a.pd["instances"]:
        assert x["held_at_end"] == 0 and x["blocks_in_use_at_end"] == 0, x


def test_a_slower_link_costs_ttft_not_tpot():
    cfg = make_config()
    samples, arrivals = _samples(20, 2500, 40, seed=5), [0.2 * i for i in range(20)]
    h100 = profiles.load_hardware("h100")
    fast = run_pd(cfg, samples, arrivals, 1, 1, link=kv_link(h100, "nvlink"))
    slow = run_pd(cfg, samples, arrivals, 1, 1, link=dataclasses.replace(kv_link(h100, "tcp"), bytes_per_s=1e9))
    extra_pull_s = 2500 / 16 * 16 * 32 * 8 * 128 * 2 * 2 / 1e9       # ~0.33 s per request more over 8 Gb/s
    mean_ttft = [sum(r.ttft_s for r in res.records) / 20 for res in (fast, slow)]
    assert mean_ttft[1] - mean_ttft[0] == pytest.approx(extra_pull_s, rel=0.05)
    tpot = [sum((r.latency_s - r.ttft_s) / (r.output_len - 1) for r in res.records) / 20 for res in (fast, slow)]
    assert tpot[1] == pytest.approx(tpot[0], rel=0.05)


def test_simulate_cli_reports_the_instances(capsys, tmp_path):
    from kernelsight.cli import main

    out_json = tmp_path / "pd.json"
    rc = main(["simulate", "--pd", "1P2D", "--kv-transfer-link", "infiniband", "--num-prompts", "12",
               "--request-rate", "20", "--random-input-len", "1024", "--random-output-len", "16",
               "--max-model-len", "4096", "--result-json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "on 1P2D × h100-sxm" in text and "KV pulled over infiniband: 360 Gb/s per GPU, 5 µs per pull" in text
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith(("P0 ", "D0 ", "D1 "))}
    assert set(lines) == {"P0", "D0", "D1"} and lines["P0"][1] == "12"
    import json
    pd = json.loads(out_json.read_text())["simulator"]["pd"]
    assert pd["prefill"] == 1 and pd["decode"] == 2 and pd["link"]["kind"] == "infiniband"
    assert sum(x.get("pulls", 0) for x in pd["instances"]) == 12


def test_simulate_cli_rejects_pd_with_replicas(capsys):
    from kernelsight.cli import main

    rc = main(["simulate", "--pd", "1P1D", "--replicas", "2", "--num-prompts", "2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith("kernelsight simulate: error:") and "--replicas" in err


def _prefill_only_ends(cfg, samples, arrivals) -> list[float]:
    """Each request's prefill end on one engine fed only the prefills (max_tokens 1, nothing held): what a prefill
    instance must reproduce when nothing on the decode side holds it back."""
    eng = build_engine(cfg, per_token_events=False)
    reqs = []
    for i, (s, a) in enumerate(zip(samples, arrivals, strict=True)):
        eng.add_request(f"r{i}", s.prompt_token_ids, 1, ignore_eos=True, arrival_s=a)
        reqs.append(eng.get_request(f"r{i}"))
    while eng.step(max_steps=256) is not None:
        pass
    return [r.first_token_s for r in reqs]


def test_under_poisson_load_the_prefill_side_queues_as_a_prefill_only_engine_and_stages_add_up():
    # ~60% prefill utilisation with Poisson arrivals: the prefill queue is real queueing, and nothing else. A P/D
    # stepping order that delayed arrivals, a prefill engine waiting on held blocks it need not wait for, or a decode
    # window running past a hand-off would each move a prefill end or open a gap between the stages and the TTFT.
    from kernelsight.loadgen.arrivals import arrival_times_s

    cfg = make_config()
    samples = _samples(120, 2000, 30, seed=11)
    arrivals = arrival_times_s(120, 18.0, seed=4).tolist()
    res = run_pd(cfg, samples, arrivals, 1, 1)
    st = res.pd_stages
    assert st is not None and st.request_ids == [f"ff-{i}" for i in range(120)]
    sec = st.seconds
    ends = arrivals + sec["prefill_queue"] + sec["prefill"]
    assert ends.tolist() == pytest.approx(_prefill_only_ends(cfg, samples, arrivals), rel=0, abs=1e-9)
    assert [r.ttft_s for r in res.records] == pytest.approx(st.total_s().tolist(), rel=1e-9)
    assert (sec["prefill_queue"] > 0).sum() > 20              # the load queued some (the test means something)
    assert (sec["prefill_queue"] == 0).sum() > 20             # and an idle prefill engine started others at once
    # the decode side: one pull per request; before it and after it, the step in flight and (async scheduling: it
    # was scheduled before the request, or the pull's end, was in) the next one
    p0, d0 = res.pd["instances"]
    pull_s = d0["kv_transfer_s"] / d0["pulls"]
    step_bound_s = max(sec["first_decode_step"])
    assert min(sec["kv_ready"]) >= pull_s - 1e-6
    assert max(sec["kv_ready"]) <= pull_s + 2 * step_bound_s + 1e-6
    assert max(sec["step_after_pull"]) <= 2 * step_bound_s
    summary = res.pd["ttft_stages"]
    assert summary["requests"] == 120 and [r["stage"] for r in summary["stages"]][-1] == "ttft"
    assert summary["stages"][-1]["mean_ms"] == pytest.approx(1e3 * st.total_s().mean(), abs=1e-3)


def test_an_idle_prefill_engine_starts_a_request_at_its_arrival_while_the_decode_engine_runs_long_windows():
    cfg = make_config()
    link = kv_link(profiles.load_hardware("h100"), "nvlink")
    plen = 1000
    samples = _samples(2, plen, 800, seed=2)[:1] + _samples(1, plen, 5, seed=9)
    res = run_pd(cfg, samples, [0.0, 1.0], 1, 1, link=link)       # at 1 s the decode engine is mid-way through A
    sec = res.pd_stages.seconds
    ref = build_engine(cfg, link=link)
    _, prefill_s = ref.step_model.step(BatchShape((PrefillChunk(plen, 0, True),), 0, 0))
    _, decode_step_s = ref.step_model.step(BatchShape((), 1, plen + 800))     # A's longest decode step
    pull_s = ref.kv_transfer.time_s(math.ceil(plen / 16))
    assert sec["prefill_queue"][1] == 0.0
    assert sec["prefill"][1] == pytest.approx(prefill_s, rel=1e-9)
    # the decode engine's window was cut at B's hand-off: B waits for at most the step in flight and the one
    # scheduled behind it (async scheduling), not the window
    assert pull_s <= sec["kv_ready"][1] <= pull_s + 2.01 * decode_step_s
    assert sec["step_after_pull"][1] <= 2.01 * decode_step_s
    assert res.records[1].ttft_s == pytest.approx(sum(sec[s][1] for s in sec), rel=1e-9)
