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
