"""``kernelsight plan`` over data/expert parallelism (MoE) and prefill/decode splits: small searches whose answers
are re-run through ``kernelsight simulate``, the cache across widened searches, and the space's shape."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kernelsight.cli import main
from kernelsight.plan.point import point_key
from kernelsight.plan.prune import WorkloadShape, create_engine_config, roofline_bounds
from kernelsight.plan.space import Deployment, EngineChoice, SearchSpace
from kernelsight.simcore.engine_config import EngineArgs

# Qwen3-30B-A3B (bf16, ~61 GB) on 48 GB L40S: one GPU cannot hold it; two can, as TP2 or as two DP ranks that
# split the experts. 60 random requests at 20 req/s keep each point near a second.
MOE = ["plan", "--model", "Qwen/Qwen3-30B-A3B", "--dataset-name", "random", "--num-prompts", "60",
       "--random-input-len", "512", "--random-output-len", "64", "--request-rate", "20", "--gpus", "l40s",
       "--tp", "1,2", "--replicas", "1", "--quantization", "none", "--curve-loads", "1", "--no-progress",
       "--workers", "1"]
# Llama-3.1-8B at 40 req/s on L40S: more than one L40S can serve (its waiting queue grows), so only a split of
# several engines can meet the SLO.
PD = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--dataset-name", "random", "--num-prompts", "60",
      "--random-input-len", "512", "--random-output-len", "64", "--request-rate", "40", "--gpus", "l40s",
      "--tp", "1", "--replicas", "1", "--pd-max", "3", "--quantization", "none", "--curve-loads", "1",
      "--no-progress", "--workers", "1", "--slo", "ttft_p99_ms=500,tpot_p99_ms=50"]


def plan(tmp: Path, argv: list[str], *extra: str, name: str) -> dict:
    out = tmp / name
    assert main([*argv, *extra, "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def simulate(command: str, tmp: Path) -> dict:
    argv = shlex.split(command)
    assert argv[:2] == ["kernelsight", "simulate"]
    out = tmp / "sim.json"
    assert main([*argv[1:], "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_moe_dp2_ep_is_searched_where_tp1_does_not_fit_and_an_slo_between_two_answers_keeps_one(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    loose = ["--slo", "ttft_p99_ms=5000,tpot_p99_ms=200"]
    tp_only = plan(tmp_path, MOE, *cache, *loose, "--dp", "1", "--expert-parallel", "off", name="tp.json")
    assert tp_only["search"]["pruned_by_reason"] == {"does not fit in GPU memory": 1}     # TP1: weights > 48 GB
    assert [p["label"] for p in tp_only["points"]] == ["1× l40s TP2"]

    # widened to DP 2 with expert parallelism: only the new points are simulated. DP2+EP goes first (the higher
    # token ceiling) and serves every request well; TP2+EP costs the same and sorts after it by label, so it can at
    # best tie: dominated, not simulated
    wide = plan(tmp_path, MOE, *cache, *loose, "--dp", "1,2", "--expert-parallel", "on", name="wide.json")
    by_label = {p["label"]: p for p in wide["points"]}
    ep, tp2 = by_label["1× l40s TP1 DP2+EP"], tp_only["points"][0]
    assert wide["search"]["simulated"] == sum(p["data_parallel_size"] == 2 for p in wide["points"]) >= 1
    assert "1× l40s TP2" not in by_label and ep["goodput_rps"] == 20.0
    assert wide["search"]["pruned_by_reason"]["dominated (costs more than a deployment that meets the SLO)"] >= 1
    assert ep["num_gpus"] == tp2["num_gpus"] == 2 and ep["enable_expert_parallel"]
    assert ep["key"] != tp2["key"]
    assert wide["chosen"]["label"] == "1× l40s TP1 DP2+EP"
    # the pruning bounds stay bounds for a DP group: no decode step beats the floor (one rank's weights, its
    # share of the active experts), and no deployment serves more than its ranks' output-token ceiling
    shape = WorkloadShape.of([512] * 60, [64] * 60)
    for p in wide["points"]:
        b = roofline_bounds(create_engine_config(EngineArgs(**p["engine_args"])), shape)
        assert p["p50_tpot_ms"] >= 1000 * b.step_floor_s
        assert p["throughput_rps"] <= b.max_rate_per_replica * p["replicas"]

    # a TTFT SLO between the two 2-GPU answers keeps exactly the faster one, judged on the cached per-request
    # numbers (which one is faster is the kernel model's call: on the L40S's PCIe, TP2 all-reduces every layer,
    # the EP ranks exchange only the MoE tokens and step together)
    assert ep["p99_ttft_ms"] != pytest.approx(tp2["p99_ttft_ms"], rel=1e-3)
    limit = (ep["p99_ttft_ms"] + tp2["p99_ttft_ms"]) / 2
    tight = plan(tmp_path, MOE, *cache, "--slo", f"ttft_p99_ms={limit:.3f},tpot_p99_ms=200", "--dp", "1,2",
                 "--expert-parallel", "on", name="tight.json")
    assert tight["search"]["cache_hits"] == wide["search"]["simulated"]
    tight_tp = plan(tmp_path, MOE, *cache, "--slo", f"ttft_p99_ms={limit:.3f},tpot_p99_ms=200", "--dp", "1",
                    "--expert-parallel", "off", name="tight_tp.json")
    assert tight_tp["search"]["simulated"] == 0
    ep_wins = ep["p99_ttft_ms"] < tp2["p99_ttft_ms"]
    tight_ep = {p["label"]: p for p in tight["points"]}["1× l40s TP1 DP2+EP"]
    assert tight_ep["meets_slo"] is ep_wins and tight_tp["points"][0]["meets_slo"] is (not ep_wins)
    loser = tight_tp["points"][0] if ep_wins else tight_ep
    assert loser["why"].startswith("ttft_p99_ms")
    if ep_wins:
        assert tight["chosen"]["label"] == "1× l40s TP1 DP2+EP" and tight_tp["chosen"] is None
    else:
        assert tight_tp["chosen"]["label"] == "1× l40s TP2"

    # the DP group's simulate command reproduces its plan numbers
    chosen = wide["chosen"]
    cmd = wide["simulate_command"]
    assert "--data-parallel-size 2" in cmd and "--enable-expert-parallel" in cmd
    sim = simulate(cmd, tmp_path)
    assert sim["config"]["data_parallel_size"] == 2 and sim["config"]["enable_expert_parallel"]
    assert sim["p99_ttft_ms"] == pytest.approx(chosen["p99_ttft_ms"], abs=1e-3)
    assert sim["p99_tpot_ms"] == pytest.approx(chosen["p99_tpot_ms"], abs=1e-3)


def test_pd_splits_are_searched_with_the_pd_driver_and_reproduce_under_simulate(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    res = plan(tmp_path, PD, *cache, name="pd.json")
    assert res["search"]["space_points"] == 1 + 3            # 1 replica; 1P1D, 1P2D, 2P1D
    pd_points = [p for p in res["points"] if p["pd"]]
    assert pd_points
    for p in pd_points:
        x, _, y = p["pd"].rstrip("D").partition("P")
        assert p["num_gpus"] == int(x) + int(y) and p["replicas"] == 1
        assert p["queue"]["pd"] and p["queue"]["mean_pull_ms"] > 0      # KV was pulled: the P/D driver ran it
        assert p["queue"]["link"] == "pcie"                              # L40S: the profile's default link
        if not p["meets_slo"]:
            assert "prefill engines busy" in p["why"]
    one = {p["label"]: p for p in res["points"]}["1× l40s TP1"]
    assert not one["meets_slo"]
    chosen = res["chosen"]
    assert chosen is not None and chosen["pd"]
    cmd = res["simulate_command"]
    assert f"--pd {chosen['pd']}" in cmd and "--replicas" not in cmd
    sim = simulate(cmd, tmp_path)
    assert sim["config"]["pd"] == chosen["pd"]
    assert sim["p99_ttft_ms"] == pytest.approx(chosen["p99_ttft_ms"], abs=1e-3)
    assert sim["p99_tpot_ms"] == pytest.approx(chosen["p99_tpot_ms"], abs=1e-3)
    # a re-run with a wider split bound simulates only the new splits
    wider = plan(tmp_path, PD, *cache, "--pd-max", "4", name="wider.json")
    old = {p["key"] for p in res["points"]}
    assert wider["search"]["simulated"] == len([p for p in wider["points"] if p["key"] not in old])


def test_pd_link_flags_reach_the_splits_and_their_keys(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    pcie = plan(tmp_path, PD, *cache, name="pcie.json")
    ib = plan(tmp_path, PD, *cache, "--kv-transfer-link", "infiniband", name="ib.json")
    # the split points are new (their key names the link); the replica point comes from the cache
    assert ib["search"]["cache_hits"] == sum(not p["pd"] for p in ib["points"]) == 1
    assert ib["search"]["simulated"] == sum(bool(p["pd"]) for p in ib["points"]) >= 1
    before = {p["label"]: p for p in pcie["points"]}
    for p in (p for p in ib["points"] if p["pd"]):
        assert p["queue"]["link"] == "infiniband"
        if p["label"] in before:       # a 400 Gb/s NIC and the L40S's share of PCIe pull at different rates
            assert p["queue"]["mean_pull_ms"] != before[p["label"]]["queue"]["mean_pull_ms"]
    assert ib["chosen"] is not None and ib["chosen"]["pd"]        # one L40S still cannot serve the load
    assert "--kv-transfer-link infiniband" in ib["simulate_command"]
    sim = simulate(ib["simulate_command"], tmp_path)
    assert sim["p99_ttft_ms"] == pytest.approx(ib["chosen"]["p99_ttft_ms"], abs=1e-3)
    # a link the GPU lacks prunes its splits with the link's own error, before any simulation
    nv = plan(tmp_path, PD, "--no-cache", "--kv-transfer-link", "nvlink", name="nv.json")
    assert nv["search"]["pruned_by_reason"].get("engine cannot be built (TP, heads, format)") == 3
    assert all(not p["pd"] for p in nv["points"])


def test_point_key_names_dp_ep_and_the_split():
    args = EngineArgs(model="Qwen/Qwen3-30B-A3B", hardware="l40s")
    dp2 = EngineArgs(model="Qwen/Qwen3-30B-A3B", hardware="l40s", data_parallel_size=2)
    ep2 = EngineArgs(model="Qwen/Qwen3-30B-A3B", hardware="l40s", data_parallel_size=2, enable_expert_parallel=True)
    keys = {point_key(a, 1, 10.0, "w", pd) for a in (args, dp2, ep2) for pd in (None, (1, 1), (1, 2))}
    assert len(keys) == 9
    assert point_key(ep2, 1, 10.0, "w") == point_key(ep2, 1, 10.0, "w", None)


def test_space_dp_only_for_moe_and_pd_splits_counted():
    space = SearchSpace(gpus=("h100",), tensor_parallel_sizes=(1, 2), replicas=(1, 2), quantizations=(None,),
                        data_parallel_sizes=(1, 2), expert_parallel=(False, True), pd_max=3)
    assert space.pd_splits() == [(1, 1), (1, 2), (2, 1)]
    dense = space.engine_choices(moe=False)
    assert {(c.data_parallel_size, c.enable_expert_parallel) for c in dense} == {(1, False)}
    moe = space.engine_choices(moe=True)
    assert {(c.data_parallel_size, c.enable_expert_parallel) for c in moe} == {(1, False), (1, True), (2, False),
                                                                             (2, True)}
    # EP at one DP rank only where TP spreads the experts (TP 2): EP on one GPU is the same engine
    assert {c.tensor_parallel_size for c in moe if c.enable_expert_parallel and c.data_parallel_size == 1} == {2}
    # 2 TP × (2 replica counts + 3 splits) dense; MoE adds 2 TP × 2 DP2 variants × 2 replica counts (no splits)
    # and TP2+EP at one rank (2 replica counts + 3 splits)
    assert space.size(moe=False) == 2 * (2 + 3)
    assert space.size(moe=True) == 2 * (2 + 3) + 2 * 2 * 2 + (2 + 3)
    c = EngineChoice("h100", 2, data_parallel_size=2, enable_expert_parallel=True)
    assert Deployment(c, 3).num_gpus == 12 and Deployment(c, 3).label() == "3× h100 TP2 DP2+EP"
    assert Deployment(EngineChoice("h100", 2, enable_expert_parallel=True), 1).label() == "1× h100 TP2+EP"
    assert Deployment(EngineChoice("h100", 2), 1, (2, 3)).num_gpus == 10
