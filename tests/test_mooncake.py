"""``--dataset-name mooncake``: Mooncake's trace format read into token-id prompts whose shared hash ids are shared
blocks, and what the simulator makes of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight.cli import build_parser, main
from kernelsight.loadgen.datasets import mooncake_dataset
from kernelsight.loadgen.workload import build_workload

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mooncake-trace-small.jsonl"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_shared_hash_ids_are_identical_blocks_and_lengths_exact(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 2500, "input_length": 1100, "output_length": 7, "hash_ids": [5, 6, 9]},
        {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [5, 6]},
        {"timestamp": 1000, "input_length": 600, "output_length": 4, "hash_ids": [5, 8]},
        {"timestamp": 1000, "input_length": 300, "output_length": 2},
    ])
    s = mooncake_dataset(path, vocab_size=32000, seed=1, block_size=512)
    # sorted by timestamp (ms → s), file order breaking the tie
    assert [x.arrival_offset_s for x in s] == [0.0, 1.0, 1.0, 2.5]
    assert [x.prompt_len for x in s] == [1024, 600, 300, 1100]
    assert [x.expected_output_len for x in s] == [3, 4, 2, 7]
    assert all(len(x.prompt_token_ids) == x.prompt_len for x in s)
    two, five_eight, lone, three = (np.asarray(x.prompt_token_ids) for x in s)
    # hash id 5 is the same 512 ids everywhere; 5,6 the same 1024
    assert np.array_equal(two, three[:1024]) and np.array_equal(two[:512], five_eight[:512])
    # different ids are different blocks; the last block is cut to input_length (the head of hash id 8's block)
    assert not np.array_equal(five_eight[512:600], two[512:600])
    assert not np.array_equal(three[1024:], two[:76])
    # a line without hash ids shares nothing
    assert not np.array_equal(lone[:16], two[:16])
    assert all(100 <= t < 32000 for x in s for t in x.prompt_token_ids)
    # the blocks depend on the seed, and only on it
    again = mooncake_dataset(path, vocab_size=32000, seed=1)
    other = mooncake_dataset(path, vocab_size=32000, seed=2)
    assert [x.prompt_token_ids for x in again] == [x.prompt_token_ids for x in s]
    assert other[0].prompt_token_ids != s[0].prompt_token_ids
    assert [x.prompt_len for x in mooncake_dataset(path, 2)] == [1024, 600]


@pytest.mark.parametrize("row, match", [
    ({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}, "must end in the last"),
    ({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}, "must end in the last"),
    ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}, "hash_ids"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "input_length"),
])
def test_bad_lines_say_why(tmp_path, row, match):
    with pytest.raises(ValueError, match=match):
        mooncake_dataset(_write(tmp_path / "bad.jsonl", [row]))


def test_workload_takes_trace_timestamps_unless_a_rate_is_given():
    ns = build_parser().parse_args(["simulate", "--dataset-name", "mooncake", "--dataset-path", str(EXAMPLE)])
    wl = build_workload(ns, 128256, lambda: None)
    assert wl.request_rate == "trace" and wl.ignore_eos
    assert wl.arrivals_s == [s.arrival_offset_s for s in wl.samples] and wl.arrivals_s == sorted(wl.arrivals_s)
    ns = build_parser().parse_args(["bench", "--dataset-name", "mooncake", "--dataset-path", str(EXAMPLE),
                                    "--request-rate", "4"])
    wl2 = build_workload(ns, 128256, lambda: None)
    assert wl2.request_rate == 4.0 and wl2.arrivals_s[-1] == pytest.approx(len(wl2.samples) / 4)
    # bench and simulate draw the same ids (both capped at 32000 ids)
    assert [s.prompt_token_ids for s in wl2.samples] == [s.prompt_token_ids for s in wl.samples]


def _simulate(tmp_path, name: str, rows: list[dict]) -> dict:
    trace = _write(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.json"
    assert main(["simulate", "--hardware", "a100", "--max-model-len", "8192", "--dataset-name", "mooncake",
                 "--dataset-path", str(trace), "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_shared_hash_ids_hit_the_prefix_cache_and_cut_ttft(tmp_path, capsys):
    # 12 requests of 6 blocks, 1 s apart (no queueing): the first 5 blocks are one shared system prompt
    shared = [{"timestamp": 1000 * i, "input_length": 3000, "output_length": 8, "hash_ids": [1, 2, 3, 4, 5, 100 + i]}
              for i in range(12)]
    distinct = [{**r, "hash_ids": [1000 + 10 * i + j for j in range(6)]} for i, r in enumerate(shared)]
    a, b = _simulate(tmp_path, "shared", shared), _simulate(tmp_path, "distinct", distinct)
    out = capsys.readouterr().out
    assert "Prefix cache: hit rate" in out
    assert b["prefix_cache"]["hit_rate"] == 0.0 and b["prefix_cache"]["cached_tokens"] == 0
    # every request after the first reuses the 2560 shared tokens (160 blocks of 16)
    assert a["prefix_cache"]["cached_tokens"] == 11 * 2560
    assert a["prefix_cache"]["hit_rate"] == pytest.approx(11 * 2560 / (12 * 3000))
    assert a["simulator"]["prefix_cache_hit_rate"] == pytest.approx(a["prefix_cache"]["hit_rate"], abs=1e-4)
    assert a["mean_ttft_ms"] < 0.6 * b["mean_ttft_ms"]
    assert a["total_input_tokens"] == b["total_input_tokens"] == 36000


def test_example_trace_shares_prefixes(tmp_path):
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    ids = [h for r in rows for h in r["hash_ids"]]
    assert len(rows) >= 20 and len(set(ids)) < len(ids)        # made to share blocks
    s = mooncake_dataset(EXAMPLE, vocab_size=32000)
    assert [x.prompt_len for x in s] == [r["input_length"] for r in sorted(rows, key=lambda r: r["timestamp"])]


def test_a_data_parallel_run_reports_the_hits_too(tmp_path):
    out = tmp_path / "dp.json"
    assert main(["simulate", "--data-parallel-size", "2", "--dataset-name", "mooncake", "--dataset-path",
                 str(EXAMPLE), "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prefix_cache"]["requests_reporting"] == 40
    assert r["prefix_cache"]["hit_rate"] == pytest.approx(r["simulator"]["prefix_cache_hit_rate"], abs=1e-4)
