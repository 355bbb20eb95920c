"""Tests for kernelsight.loadgen.datasets (random and trace workloads)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_shared

from kernelsight.loadgen.datasets import SampleRequest, random_dataset, trace_dataset

SHARED_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/e2e/sharegpt-llama-3.1-8b-300-sps10.jsonl.gz"
)

# ---------------------------------------------------------------- random


def test_random_lengths_within_bounds_and_ids_match():
    reqs = random_dataset(500, input_len=100, output_len=50, range_ratio=0.3, vocab_size=1000, seed=1)
    assert len(reqs) == 500
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(in_lens) >= math.floor(100 * 0.7) and max(in_lens) <= math.ceil(100 * 1.3)
    assert min(out_lens) >= math.floor(50 * 0.7) and max(out_lens) <= math.ceil(50 * 1.3)
    # Uniform over the range: with 500 draws both ends of a 61-wide range should be approached.
    assert min(in_lens) <= 75 and max(in_lens) >= 125
    for r in reqs:
        assert isinstance(r, SampleRequest)
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len
        assert all(0 <= t < 1000 for t in r.prompt_token_ids)
        assert r.arrival_offset_s is None


def test_random_deterministic_for_seed():
    a = random_dataset(20, 64, 16, 0.5, 32000, seed=7, prefix_len=8)
    b = random_dataset(20, 64, 16, 0.5, 32000, seed=7, prefix_len=8)
    c = random_dataset(20, 64, 16, 0.5, 32000, seed=8, prefix_len=8)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_random_range_ratio_zero_gives_exact_lengths():
    reqs = random_dataset(50, input_len=37, output_len=5, range_ratio=0.0, vocab_size=100, seed=0)
    assert {r.prompt_len for r in reqs} == {37}
    assert {r.expected_output_len for r in reqs} == {5}


def test_random_body_is_consecutive_ids_mod_vocab():
    reqs = random_dataset(10, input_len=30, output_len=4, range_ratio=0.0, vocab_size=17, seed=3)
    for r in reqs:
        ids = r.prompt_token_ids
        assert all((ids[k + 1] - ids[k]) % 17 == 1 for k in range(len(ids) - 1))


def test_random_ids_are_the_formula_in_half_the_memory():
    """Each body is (offset_i + i + j) mod V after the prefix, whatever the array's width: ids in 4-byte ints (a
    1,000,000-request fleet's prompts in half the memory), the same values an int64 build gives, the prompt list
    the array's values."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 5000, size=24)
    lens = rng.integers(math.floor(40 * 0.5), math.ceil(40 * 1.5) + 1, size=300)
    rng.integers(2, 9, size=300)                                # output lengths: drawn, not needed here
    offsets = rng.integers(0, 5000, size=300)
    assert np.array_equal(prefix, np.random.default_rng(11).integers(0, 5000, size=24))
    reqs = random_dataset(300, 40, 5, 0.5, 5000, seed=11, prefix_len=24)
    for i, r in enumerate(reqs):
        assert r.token_array.dtype == np.int32
        body = [(int(offsets[i]) + i + j) % 5000 for j in range(int(lens[i]))]
        assert r.prompt_token_ids == [int(t) for t in prefix] + body == r.token_array.tolist()


def test_random_shared_prefix_in_all_prompts():
    reqs = random_dataset(30, input_len=20, output_len=4, range_ratio=0.5, vocab_size=50000, seed=2,
                          prefix_len=16)
    prefix = reqs[0].prompt_token_ids[:16]
    for r in reqs:
        assert r.prompt_token_ids[:16] == prefix
        assert 16 + math.floor(20 * 0.5) <= r.prompt_len <= 16 + 20 * 1.5
    # Bodies differ (per-request offset), so sharing stops at the prefix.
    assert len({tuple(r.prompt_token_ids[16:20]) for r in reqs}) > 1


def test_random_output_at_least_one():
    reqs = random_dataset(200, input_len=10, output_len=1, range_ratio=0.9, vocab_size=100, seed=0)
    assert min(r.expected_output_len for r in reqs) >= 1
    assert max(r.expected_output_len for r in reqs) <= 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(range_ratio=1.0), "range_ratio"),
        (dict(range_ratio=-0.1), "range_ratio"),
        (dict(input_len=0), "input_len"),
        (dict(output_len=0), "output_len"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(prefix_len=-1), "prefix_len"),
        (dict(num_prompts=-1), "num_prompts"),
    ],
)
def test_random_validation(kwargs, match):
    args = dict(num_prompts=5, input_len=10, output_len=5, range_ratio=0.0, vocab_size=100, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        random_dataset(**args)


# ---------------------------------------------------------------- trace


@needs_shared(SHARED_TRACE)
def test_trace_reads_shared_gz_file():
    reqs = trace_dataset(SHARED_TRACE)
    assert len(reqs) == 300
    assert reqs[0].arrival_offset_s == pytest.approx(0.0469, abs=1e-4)
    offsets = [r.arrival_offset_s for r in reqs]
    assert offsets == sorted(offsets)
    for r in reqs:
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len
        assert r.expected_output_len >= 1
    first10 = trace_dataset(SHARED_TRACE, num_prompts=10)
    assert first10 == reqs[:10]
    # No oversampling: asking for more than the trace has returns just the trace.
    assert len(trace_dataset(SHARED_TRACE, num_prompts=1000)) == 300


def _write_jsonl(path: Path, objs: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(o) + "\n" for o in objs)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_trace_plain_jsonl_sorted_and_truncated(tmp_path):
    p = _write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"arrival_time_ns": 2_000_000_000, "input_toks": 3, "output_toks": 2, "input_tok_ids": [7, 8, 9]},
            {"arrival_time_ns": 500_000_000, "input_toks": 2, "output_toks": 4, "input_tok_ids": [1, 2]},
            {"arrival_time_ns": 1_000_000_000, "input_toks": 1, "output_toks": 1, "input_tok_ids": [5]},
        ],
    )
    reqs = trace_dataset(p)
    assert [r.arrival_offset_s for r in reqs] == [0.5, 1.0, 2.0]
    assert [r.prompt_token_ids for r in reqs] == [[1, 2], [5], [7, 8, 9]]
    assert [r.expected_output_len for r in reqs] == [4, 1, 2]
    assert [r.prompt_len for r in trace_dataset(p, num_prompts=2)] == [2, 1]


def test_trace_gzip_detected_by_magic_not_extension(tmp_path):
    objs = [{"arrival_time_ns": 0, "input_toks": 2, "output_toks": 1, "input_tok_ids": [3, 4]}]
    gz_no_ext = _write_jsonl(tmp_path / "trace.jsonl", objs, gz=True)
    plain_gz_ext = _write_jsonl(tmp_path / "trace2.jsonl.gz", objs, gz=False)
    assert trace_dataset(gz_no_ext)[0].prompt_token_ids == [3, 4]
    assert trace_dataset(plain_gz_ext)[0].prompt_token_ids == [3, 4]


def test_trace_missing_ids_synthesized_distinct_and_deterministic(tmp_path):
    objs = [{"arrival_time_ns": i * 1000, "input_toks": 40, "output_toks": 3} for i in range(50)]
    p = _write_jsonl(tmp_path / "noids.jsonl", objs)
    reqs = trace_dataset(p)
    assert all(len(r.prompt_token_ids) == 40 for r in reqs)
    # Distinct already on the first block of 16 tokens -> no false prefix-cache hits.
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 50
    assert len({r.prompt_token_ids[0] for r in reqs}) > 40
    assert trace_dataset(p) == reqs


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ('{"arrival_time_ns": 0, "input_toks": 3, "output_toks": 1, "input_tok_ids": [1, 2]}', "line 2"),
        ('{"arrival_time_ns": 0, "output_toks": 1}', "line 2.*input_toks"),
        ("not json", "line 2"),
        ('{"arrival_time_ns": 0, "input_toks": 3, "output_toks": 0}', "line 2.*output_toks"),
        ("[1, 2]", "line 2"),
    ],
)
def test_trace_bad_line_raises_with_line_number(tmp_path, bad_line, match):
    good = '{"arrival_time_ns": 0, "input_toks": 1, "output_toks": 1}'
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n" + bad_line + "\n" + good + "\n")
    with pytest.raises(ValueError, match=match):
        trace_dataset(p)


def test_trace_blank_lines_skipped_line_numbers_kept(tmp_path):
    p = tmp_path / "blank.jsonl"
    p.write_text(
        '{"arrival_time_ns": 0, "input_toks": 1, "output_toks": 1}\n\n'
        '{"arrival_time_ns": 5, "input_toks": 2, "output_toks": 1, "input_tok_ids": [1]}\n'
    )
    with pytest.raises(ValueError, match="line 3"):
        trace_dataset(p)
