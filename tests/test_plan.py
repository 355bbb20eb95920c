"""``kernelsight plan``: a small search whose answer is checked by re-running it through ``kernelsight simulate``,
plus pruning, the cache, determinism, the process pool, the reports and the Ray path (where Ray is installed)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from kernelsight.cli import main
from kernelsight.plan.pareto import cheapest_meeting, pareto_front
from kernelsight.plan.prices import load_prices
from kernelsight.plan.slo import parse_slo

# Llama-3.1-8B, 60 random requests at 40 req/s: one L40S or one A100 queues up, two L40S decode too slowly for the
# TPOT limit, two A100s meet it (4 points simulated, ~1 s each).
SLO = "ttft_p99_ms=200,tpot_p99_ms=30"
SMALL = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--dataset-name", "random", "--num-prompts", "60",
         "--random-input-len", "512", "--random-output-len", "64", "--request-rate", "40", "--slo", SLO,
         "--gpus", "l40s,a100", "--tp", "1", "--replicas", "1-4", "--quantization", "none", "--curve-loads", "1",
         "--no-progress"]


def run_plan(tmp: Path, *extra: str, name: str = "plan.json") -> dict:
    out = tmp / name
    assert main([*SMALL, *extra, "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def run_simulate(command: str, tmp: Path) -> dict:
    argv = shlex.split(command)
    assert argv[:2] == ["kernelsight", "simulate"]
    out = tmp / "sim.json"
    assert main([*argv[1:], "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    return tmp, run_plan(tmp, "--cache-dir", str(tmp / "cache"), "--workers", "1")


def test_chosen_meets_the_slo_under_simulate_and_the_next_cheaper_front_point_does_not(small, tmp_path, capsys):
    _, plan = small
    chosen = plan["chosen"]
    assert chosen is not None and chosen["label"] == "2× a100-sxm TP1"
    sim = run_simulate(plan["simulate_command"], tmp_path)
    assert sim["config"]["replicas"] == 2
    assert sim["p99_ttft_ms"] <= 200 and sim["p99_tpot_ms"] <= 30
    # the same fast-forward path: simulate reproduces the planner's numbers exactly
    assert sim["p99_ttft_ms"] == pytest.approx(chosen["p99_ttft_ms"], abs=1e-3)
    assert sim["p99_tpot_ms"] == pytest.approx(chosen["p99_tpot_ms"], abs=1e-3)

    points = {p["key"]: p for p in plan["points"]}
    front = [points[k] for k in plan["front"]]
    i = [p["key"] for p in front].index(chosen["key"])
    assert i >= 1, "a cheaper point is on the front"
    cheaper = front[i - 1]
    assert cheaper["usd_per_mtok"] < chosen["usd_per_mtok"] and not cheaper["meets_slo"]
    cmd = plan["simulate_command"].replace("--hardware a100-sxm", f"--hardware {cheaper['hardware']}").replace(
        "--replicas 2", f"--replicas {cheaper['replicas']}")
    sim2 = run_simulate(cmd, tmp_path)
    assert sim2["p99_ttft_ms"] > 200 or sim2["p99_tpot_ms"] > 30
    # and why it fails is named: the SLO it breaks and where requests waited
    assert cheaper["why"].startswith(cheaper["violations"][0]["slo"])


def test_every_point_of_the_space_is_simulated_or_pruned_with_a_reason(small):
    _, plan = small
    s = plan["search"]
    assert s["space_points"] == 8          # 2 GPUs × TP 1 × 4 replica counts
    assert s["simulated"] == len(plan["points"]) == 4
    assert s["simulated"] + s["pruned"] == s["space_points"]
    reasons = s["pruned_by_reason"]
    # 3 and 4 replicas of the A100 need no simulation once 2 meet the SLO; 3-4 L40S cost more than 2 A100s
    assert sum(reasons.values()) == 4
    assert all(r.startswith(("dominated", "monotone")) for r in reasons)


def test_static_pruning_counts_memory_and_roofline(tmp_path):
    # 70B bf16 does not fit one 80 GB GPU; a 2 ms TPOT is below any L40S step (weights read at datasheet bandwidth)
    plan = run_plan(tmp_path, "--model", "meta-llama/Llama-3.1-70B", "--gpus", "h100", "--tp", "1", "--replicas", "1",
                    "--no-cache")
    assert plan["search"]["pruned_by_reason"] == {"does not fit in GPU memory": 1} and plan["chosen"] is None
    plan = run_plan(tmp_path, "--slo", "tpot_p99_ms=2", "--gpus", "l40s", "--replicas", "1-3", "--no-cache")
    assert plan["search"]["simulated"] == 0
    assert list(plan["search"]["pruned_by_reason"]) == ["roofline (the SLO is below the GPU's step floor)"]


def test_rerun_hits_the_cache_and_a_widened_search_simulates_only_new_points(small):
    tmp, first = small
    again = run_plan(tmp, "--cache-dir", str(tmp / "cache"), "--workers", "1", name="again.json")
    assert again["search"]["simulated"] == 0 and again["search"]["cache_hits"] == 4
    assert again["points"] == first["points"]
    # a percentile the cache does not hold is computed from the per-request numbers kept there
    p80 = run_plan(tmp, "--cache-dir", str(tmp / "cache"), "--workers", "1", "--slo", "ttft_p80_ms=200,"
                   "tpot_p80_ms=30", name="p80.json")
    # a looser SLO passes no later than p99 did: every point is cached, except those cut short under the p99 SLO
    # (a cut-short run holds only what it proved against that SLO)
    cut = {p["key"] for p in first["points"] if p["cut_short_at_s"] is not None}
    assert p80["search"]["simulated"] == len(cut & {p["key"] for p in p80["points"]})
    broken = {v["slo"] for p in p80["points"] for v in p["violations"]}
    assert broken and broken <= {"ttft_p80_ms", "tpot_p80_ms"}
    # a different SLO is judged on the cached per-request numbers: still nothing simulated
    looser = run_plan(tmp, "--cache-dir", str(tmp / "cache"), "--workers", "1", "--slo", "ttft_p99_ms=2000,"
                      "tpot_p99_ms=80", name="looser.json")
    assert looser["search"]["simulated"] == len(cut & {p["key"] for p in looser["points"]})
    assert looser["chosen"]["label"] == "1× l40s TP1"
    wider = run_plan(tmp, "--cache-dir", str(tmp / "cache"), "--workers", "1", "--max-num-seqs", "default,32",
                     name="wider.json")
    new = [p for p in wider["points"] if p["max_num_seqs"] == 32]
    assert wider["search"]["simulated"] == len(new) >= 1


# Llama-3.1-8B at 2 req/s on one H100: without speculation the decode steps alone are too slow for a 5.5 ms TPOT
# (p99 ~6.7 ms, no queue); n-gram drafting (k=3) gains ~1.8 tokens per verify step and meets it.
NGRAM3 = '{"method":"ngram","num_speculative_tokens":3}'
SPEC = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--dataset-name", "random", "--num-prompts", "40",
        "--random-input-len", "512", "--random-output-len", "64", "--request-rate", "2",
        "--slo", "ttft_p99_ms=200,tpot_p99_ms=5.5", "--gpus", "h100", "--tp", "1", "--replicas", "1-2",
        "--quantization", "none", "--curve-loads", "1", "--no-progress", "--workers", "1"]


def test_speculative_decoding_is_searched_chosen_for_the_tpot_limit_and_its_rerun_reproduces_it(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    out = tmp_path / "plain.json"
    assert main([*SPEC, *cache, "--result-json", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert plain["chosen"] is None            # no speculation: no deployment of one or two H100s meets it
    assert main([*SPEC, *cache, "--speculative-config", f"none; {NGRAM3}", "--result-json", str(out)]) == 0
    plan = json.loads(out.read_text())
    # the plain points are the cached ones (their key is unchanged); the speculative ones are new points
    assert plan["search"]["cache_hits"] >= 1
    by_label = {p["label"]: p for p in plan["points"]}
    rejected = by_label["1× h100-sxm TP1"]
    assert not rejected["meets_slo"] and rejected["speculative_config"] == ""
    assert rejected["why"].startswith("tpot_p99_ms") and "steps themselves are too slow" in rejected["why"]
    chosen = plan["chosen"]
    assert chosen["label"] == "1× h100-sxm TP1 spec ngram k3" and chosen["speculative_config"] == NGRAM3
    assert chosen["key"] != rejected["key"] and chosen["p99_tpot_ms"] < 5.5 < rejected["p99_tpot_ms"]
    argv = shlex.split(plan["simulate_command"])
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == json.loads(NGRAM3)
    sim = run_simulate(plan["simulate_command"], tmp_path)
    assert sim["config"]["speculative_config"]["method"] == "ngram"
    assert sim["p99_tpot_ms"] == pytest.approx(chosen["p99_tpot_ms"], abs=1e-3)
    assert sim["p99_ttft_ms"] == pytest.approx(chosen["p99_ttft_ms"], abs=1e-3)


def test_speculation_lowers_the_tpot_floor_pruning_by_one_plus_k(tmp_path):
    # 16 GB of weights at 3.35 TB/s: no H100 step is under ~4.8 ms, so a 3 ms TPOT is out of reach one token per step
    # but not four (1 + k); the TTFT floor stays one step
    out = tmp_path / "floor.json"
    argv = [*SPEC, "--no-cache", "--slo", "tpot_p99_ms=3", "--replicas", "1", "--result-json", str(out)]
    assert main([*argv, "--speculative-config", f"none;{NGRAM3}"]) == 0
    plan = json.loads(out.read_text())
    assert plan["search"]["pruned_by_reason"] == {"roofline (the SLO is below the GPU's step floor)": 1}
    assert [p["label"] for p in plan["points"]] == ["1× h100-sxm TP1 spec ngram k3"]
    assert main([*argv, "--slo", "ttft_p99_ms=3", "--speculative-config", NGRAM3]) == 0
    assert json.loads(out.read_text())["search"]["simulated"] == 0


def test_a_bad_speculative_config_stops_plan_at_start(capsys):
    for bad, says in (('none;{"method":"foo","num_speculative_tokens":3}', "Unsupported speculative method: 'foo'"),
                      ("none;[1]", "expected a JSON object")):
        try:
            rc = main([*SPEC, "--speculative-config", bad])
        except SystemExit as exc:     # argparse refuses the list itself
            rc = exc.code
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and err.splitlines()[-1].startswith("kernelsight plan: error: ")
        assert says in err.splitlines()[-1]


def test_results_are_deterministic_for_a_seed_and_pool_agrees_with_one_process(small, tmp_path):
    _, first = small
    pooled = run_plan(tmp_path, "--no-cache", "--workers", "2", name="pooled.json")
    assert [(p["label"], p["p99_ttft_ms"], p["p99_tpot_ms"], p["goodput_rps"]) for p in pooled["points"]] == \
        [(p["label"], p["p99_ttft_ms"], p["p99_tpot_ms"], p["goodput_rps"]) for p in first["points"]]
    other = run_plan(tmp_path, "--no-cache", "--workers", "1", "--seed", "7", name="seed7.json")
    assert [p["p99_ttft_ms"] for p in other["points"]] != [p["p99_ttft_ms"] for p in first["points"]][:len(
        other["points"])]


def test_reports_html_and_csv(small, tmp_path):
    pytest.importorskip("plotly")
    tmp, _ = small
    html, table = tmp_path / "r.html", tmp_path / "r.csv"
    assert main([*SMALL, "--cache-dir", str(tmp / "cache"), "--workers", "1", "--report-html", str(html),
                 "--csv", str(table)]) == 0
    page = html.read_text()
    assert "Cost vs goodput" in page and "Chosen deployment's timeline" in page
    assert "<script src=" not in page, "plotly.js is inlined: the page opens offline"
    rows = table.read_text().splitlines()
    assert rows[0].startswith("label,hardware") and len(rows) == 1 + 4


def test_slo_parsing_and_bad_input(capsys):
    slo = parse_slo("ttft_p99_ms=500, tpot_mean_ms=50,e2el_p90.5_ms=9000")
    assert [lim.result_key for lim in slo.limits] == ["p99_ttft_ms", "mean_tpot_ms", "p90.5_e2el_ms"]
    assert slo.goodput_ms() == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    assert slo.violations({"p99_ttft_ms": 501.0, "mean_tpot_ms": 50.0, "p90.5_e2el_ms": 1.0}) == [
        {"slo": "ttft_p99_ms", "value_ms": 501.0, "limit_ms": 500.0}]
    for bad in ("ttft=5", "ttft_p99_ms=abc", "ttft_p99_ms=-1", "queue_p99_ms=3", "", "itl_p42_ms=5"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    assert main([*SMALL[:-1], "--slo", "ttft_p99=1"]) == 2
    assert "--slo takes METRIC_STAT_ms=LIMIT" in capsys.readouterr().err
    assert main([*SMALL, "--gpus", "h100,tpu-v9", "--no-cache"]) == 2
    assert "tpu-v9" in capsys.readouterr().err
    assert main([a for a in SMALL if a not in ("--request-rate", "40")] + ["--no-cache"]) == 2
    assert "plan needs the load to plan for" in capsys.readouterr().err


def test_price_override_and_front(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"h100": 1.0}))
    t = load_prices(str(f), {"h100": "h100-sxm"})
    assert t.price("h100-sxm") == 1.0 and t.price("a100-sxm") == 1.79
    f.write_text(json.dumps({"h100": "cheap"}))
    with pytest.raises(ValueError, match="must be a number"):
        load_prices(str(f))
    pts = [{"label": k, "usd_per_mtok": c, "goodput_rps": g, "meets_slo": m}
           for k, c, g, m in (("a", 1, 1, False), ("b", 2, 0.5, False), ("c", 3, 5, True), ("d", 4, 5, True))]
    assert [p["label"] for p in pareto_front(pts)] == ["a", "c"]
    assert cheapest_meeting(pts)["label"] == "c"


@pytest.mark.slow
def test_ray_path_on_a_local_instance(small, tmp_path):
    pytest.importorskip("ray")
    _, first = small
    plan = run_plan(tmp_path, "--no-cache", "--ray-address", "local", "--workers", "2", name="ray.json")
    assert [(p["label"], p["p99_ttft_ms"]) for p in plan["points"]] == \
        [(p["label"], p["p99_ttft_ms"]) for p in first["points"]]
    assert plan["chosen"]["key"] == first["chosen"]["key"]


def test_progress_bar_follows_a_shrinking_total_and_stays_off_a_pipe():
    pytest.importorskip("tqdm")
    import io

    from kernelsight.loadgen.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress(40, "points", stream=tty)
    bar.update(3)
    bar.set_total(5)          # pruning removed 35 points: the bar (and its ETA) are over 5 now
    bar.update(2)
    bar.close()
    assert "5/5" in tty.getvalue() and "100%" in tty.getvalue()
    pipe = io.StringIO()
    quiet = Progress(40, "points", stream=pipe)
    quiet.update(40)
    quiet.close()
    assert pipe.getvalue() == "" and not quiet.enabled


def test_replicas_split_arrivals_round_robin():
    from kernelsight.engine_args import create_engine_config
    from kernelsight.loadgen.datasets import random_dataset
    from kernelsight.loadgen.fastforward import run_fast_forward, run_replicas
    from kernelsight.simcore.engine_config import EngineArgs

    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100"))
    samples = random_dataset(6, 256, 16, 0.0, cfg.model.vocab_size, seed=0)
    arrivals = [0.0, 0.0, 0.0, 0.01, 0.01, 0.01]
    # three engines, six requests: engine r gets requests r and r+3, exactly what one engine does with those two
    both = run_replicas(cfg, samples, arrivals, 3)
    for r in range(3):
        alone = run_fast_forward(cfg, [samples[r], samples[r + 3]], [arrivals[r], arrivals[r + 3]])
        assert [both.records[r].ttft_s, both.records[r + 3].ttft_s] == [x.ttft_s for x in alone.records]
    one = run_replicas(cfg, samples, arrivals, 1)
    assert max(r.ttft_s for r in one.records) > max(r.ttft_s for r in both.records)   # one engine queues them
    with pytest.raises(ValueError, match="replicas must be"):
        run_replicas(cfg, samples, arrivals, 0)


def _replicas_run(**kwargs):
    """A 3-replica run (90 requests, lengths ±50%) with its timeline, as one process or spread by ``kwargs``."""
    from kernelsight.engine_args import create_engine_config
    from kernelsight.loadgen.arrivals import arrival_times_s
    from kernelsight.loadgen.datasets import random_dataset
    from kernelsight.loadgen.fastforward import run_replicas
    from kernelsight.simcore.engine_config import EngineArgs

    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=3))
    samples = random_dataset(90, 300, 40, 0.5, cfg.model.vocab_size, seed=3)
    arrivals = arrival_times_s(90, 30.0, 1.0, seed=3).tolist()
    return run_replicas(cfg, samples, arrivals, 3, record_timeline=True, **kwargs)


def _assert_same_run(one, many) -> None:
    """The merged result (records, every ITL, steps, breakdown, timeline) is the one-process run's, but its wall
    time."""
    import dataclasses

    assert len(one.records) == len(many.records) == 90
    for a, b in zip(one.records, many.records, strict=True):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f.name
    skip = {"records", "wall_s"}
    for f in dataclasses.fields(one):
        if f.name not in skip:
            assert getattr(one, f.name) == getattr(many, f.name), f.name


def test_replicas_in_worker_processes_give_the_one_process_result_bit_for_bit():
    """simulate --replicas N --replica-processes P: each engine runs in a worker process."""
    finished: list[int] = []
    one = _replicas_run(processes=1)
    many = _replicas_run(processes=2, on_finished=finished.append)
    assert sum(finished) == 90
    _assert_same_run(one, many)


@pytest.mark.slow
def test_replicas_as_ray_tasks_give_the_one_process_result_bit_for_bit():
    """simulate --replicas N --ray-address local: each engine is a Ray task on a Ray started in this process."""
    ray = pytest.importorskip("ray")
    finished: list[int] = []
    try:
        many = _replicas_run(ray_address="local", processes=2, on_finished=finished.append)
        assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2
    finally:
        ray.shutdown()
    assert sum(finished) == 90
    _assert_same_run(_replicas_run(processes=1), many)
