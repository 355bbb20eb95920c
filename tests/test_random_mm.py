"""--dataset-name random-mm: vLLM bench's item-count and bucket rules, deterministic images, and the same workload
through ``kernelsight bench`` (real PNGs over HTTP) and ``kernelsight simulate`` (items without pixels)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kernelsight.loadgen.mm_dataset import (
    item_count_range,
    parse_bucket_config,
    sample_items,
    synthetic_png,
)


def test_item_count_range_follows_vllm():
    b = {(256, 256, 1): 1.0}
    assert item_count_range(2, 0.5, {"image": 255}, b)[:2] == (1, 3)        # floor(1), ceil(3)
    assert item_count_range(4, 1.0, {"image": 3}, b)[:2] == (0, 3)          # max clamped to the limit
    assert item_count_range(1, 0.0, {"image": 255, "video": 1}, b)[2] == {"image": 255}   # unused modality dropped
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        item_count_range(1, 1.5, {"image": 1}, b)
    with pytest.raises(ValueError, match="not in limit_mm_per_prompt"):
        item_count_range(1, 0.0, {"video": 1}, b)
    with pytest.raises(ValueError, match="non-zero"):
        item_count_range(1, 0.0, {"image": 1}, {(256, 256, 1): 0.0})


def test_bucket_draws_match_probabilities_and_limits():
    bucket = parse_bucket_config("{(256, 256, 1): 0.25, (720, 1280, 1): 0.75, (720, 1280, 16): 0.0}")
    assert bucket[(720, 1280, 16)] == 0.0
    rng = np.random.default_rng(0)
    draws = [sample_items(rng, 2, 2, bucket, {"image": 5}) for _ in range(4000)]
    assert all(len(d) == 2 for d in draws)
    share = sum(cfg == (720, 1280, 1) for d in draws for cfg in d) / 8000
    assert share == pytest.approx(0.75, abs=0.02)
    counts = [len(sample_items(rng, 0, 3, bucket, {"image": 3})) for _ in range(3000)]
    assert set(counts) == {0, 1, 2, 3}


def test_synthetic_images_are_distinct_and_deterministic():
    from PIL import Image

    a, b = synthetic_png(320, 200, (1, 0, 0)), synthetic_png(320, 200, (1, 0, 1))
    assert a != b and a == synthetic_png(320, 200, (1, 0, 0))
    assert Image.open(io.BytesIO(a)).size == (320, 200)


pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from kernelsight.cli import main  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
ENGINE = ["--model", MODEL, "--hardware", "h100", "--max-model-len", "8192"]
# busy enough (TTFT ~ 0.1-0.2 s simulated) that the server's own ~1 ms per request of parsing (x time scale)
# stays inside the tolerance
WORKLOAD = ["--dataset-name", "random-mm", "--num-prompts", "24", "--request-rate", "8", "--random-input-len", "1500",
            "--random-output-len", "24", "--random-mm-base-items-per-request", "2",
            "--random-mm-num-mm-items-range-ratio", "0.5",
            "--random-mm-bucket-config", "{(896, 896, 1): 0.5, (1008, 1344, 1): 0.5}", "--seed", "5",
            "--percentile-metrics", "ttft,tpot,itl,e2el"]
TIME_SCALE = 1.0    # the server's own parsing (~5 ms a request here) is queueing in its timeline: kept unscaled


def test_bench_vs_simulate_random_mm(tmp_path):
    sim_json, bench_json = tmp_path / "sim.json", tmp_path / "bench.json"
    assert main(["simulate", *ENGINE, *WORKLOAD, "--save-detailed", "--result-json", str(sim_json)]) == 0
    with ServerThread([*ENGINE, "--time-scale", str(TIME_SCALE)]) as srv:
        assert main(["bench", "--base-url", srv.base_url, "--endpoint", "/v1/chat/completions", "--time-scale",
                     str(TIME_SCALE), *WORKLOAD, "--save-detailed", "--result-json", str(bench_json)]) == 0
        queries = next(float(line.rsplit(" ", 1)[1]) for line in
                       __import__("httpx").get(srv.base_url + "/metrics").text.splitlines()
                       if line.startswith("vllm:mm_cache_queries_total"))
    sim, bench = json.loads(sim_json.read_text()), json.loads(bench_json.read_text())
    assert bench["completed"] == sim["completed"] == 24 and bench["failed"] == 0
    # the same prompts, image tokens included, request by request
    assert bench["input_lens"] == sim["input_lens"]
    assert sum(sim["input_lens"]) > 24 * (1500 + 1024)     # images are most of the prompt
    assert queries >= 24                               # every request carried images (1 to 3 each)
    report = {k: (sim[k], bench[k]) for k in ("mean_ttft_ms", "mean_tpot_ms", "request_throughput")}
    print(report)
    assert bench["mean_ttft_ms"] == pytest.approx(sim["mean_ttft_ms"], rel=0.05), report
    assert bench["mean_tpot_ms"] == pytest.approx(sim["mean_tpot_ms"], rel=0.05), report


def test_simulate_random_mm_is_deterministic(tmp_path):
    outs = []
    for k in range(2):
        path = tmp_path / f"r{k}.json"
        assert main(["simulate", *ENGINE, *WORKLOAD, "--save-detailed", "--result-json", str(path)]) == 0
        r = json.loads(path.read_text())
        outs.append((r["input_lens"], r["ttfts"], r["itls"]))
    assert outs[0] == outs[1]


def test_bench_random_mm_needs_the_chat_endpoint(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--model", MODEL, "--tokenizer", MODEL, *WORKLOAD]) == 2
    assert "chat endpoint" in capsys.readouterr().err


def test_simulate_random_mm_on_a_text_only_model(capsys):
    assert main(["simulate", "--model", "Qwen/Qwen3-8B", *WORKLOAD]) == 2
    assert "Qwen/Qwen3-8B is not a multimodal model" in capsys.readouterr().err


def test_custom_image_dataset_same_prompts_and_hashes_in_bench_and_simulate(tmp_path):
    from PIL import Image

    (tmp_path / "img").mkdir()
    for k, (w, h) in enumerate([(448, 448), (1000, 600), (300, 900)]):
        Image.new("RGB", (w, h), (k * 40, 20, 20)).save(tmp_path / "img" / f"{k}.png")
    lines = [{"prompt": f"What is in picture {k}?", "image_files": [f"img/{k}.png", "img/0.png"]} for k in range(3)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines))
    wl = ["--dataset-name", "custom_image", "--dataset-path", str(data), "--num-prompts", "6",
          "--custom-output-len", "8", "--request-rate", "20", "--seed", "2", "--save-detailed"]
    sim_json, bench_json = tmp_path / "sim.json", tmp_path / "bench.json"
    assert main(["simulate", *ENGINE, *wl, "--result-json", str(sim_json)]) == 0
    with ServerThread([*ENGINE, "--allowed-local-media-path", str(tmp_path)]) as srv:
        assert main(["bench", "--base-url", srv.base_url, "--endpoint", "/v1/chat/completions", *wl,
                     "--result-json", str(bench_json)]) == 0
        hits = next(float(line.rsplit(" ", 1)[1]) for line in
                    __import__("httpx").get(srv.base_url + "/metrics").text.splitlines()
                    if line.startswith("vllm:mm_cache_hits_total"))
    sim, bench = json.loads(sim_json.read_text()), json.loads(bench_json.read_text())
    assert bench["completed"] == 6 and bench["failed"] == 0
    assert bench["input_lens"] == sim["input_lens"]
    assert hits == 3          # 6 requests over 3 distinct files: the oversampled repeats hit the processor cache


def test_pd_split_takes_the_images_on_both_sides(tmp_path):
    small = [*ENGINE, "--dataset-name", "random-mm", "--num-prompts", "8", "--request-rate", "4", "--random-input-len",
             "100", "--random-output-len", "8", "--random-mm-bucket-config", "{(448, 448, 1): 1.0}", "--seed", "1",
             "--save-detailed"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["simulate", *small, "--result-json", str(a)]) == 0
    assert main(["simulate", *small, "--pd", "1P1D", "--result-json", str(b)]) == 0
    colocated, split = json.loads(a.read_text()), json.loads(b.read_text())
    assert split["completed"] == 8 and split["input_lens"] == colocated["input_lens"]
    # the split pays the KV pull on top of the same prefill (encoder included)
    assert split["mean_ttft_ms"] > colocated["mean_ttft_ms"]


def test_plan_digest_and_rerun_carry_the_images():
    from kernelsight.loadgen.datasets import SampleRequest
    from kernelsight.plan.point import PlanWorkload
    from kernelsight.simcore.multimodal import MultimodalItem

    def wl(h):
        s = SampleRequest([1, 2, 3, 4], 4, 8)
        s.mm_items = (MultimodalItem("image", 1, 2, (8,), h, (1, 2, 4)),)
        return PlanWorkload([s], [0.0], 1.0, True, None)

    assert wl("x").digest() != wl("y").digest() and wl("x").digest() == wl("x").digest()
