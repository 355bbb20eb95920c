"""Text datasets (ShareGPT, custom), prefix repetition, and the workload layer bench and simulate share."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.cli import build_parser
from kernelsight.loadgen.datasets import (
    custom_dataset,
    oversample,
    prefix_repetition_dataset,
    sharegpt_dataset,
)
from kernelsight.loadgen.tokenizer import ByteTokenizer
from kernelsight.loadgen.workload import build_workload, metric_options

TOK = ByteTokenizer()   # one token per byte: lengths are easy to hand-compute


def _conv(prompt: str, completion: str) -> dict:
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": completion}]}


@pytest.fixture()
def sharegpt_file(tmp_path):
    data = [
        _conv("abcdefgh", "0123456789"),        # kept: 8 in, 10 out
        _conv("abc", "0123456789"),             # prompt < 4 tokens
        _conv("abcdefgh", "012"),               # output < 4 tokens (unless fixed)
        _conv("x" * 1025, "0123"),              # prompt > 1024
        _conv("y" * 1000, "z" * 1049),          # prompt + output > 2048
        _conv("y" * 1000, "z" * 1048),          # kept: exactly 2048
        {"conversations": [{"value": "only one turn"}]},
        _conv("hello world", "four"),           # kept
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_filters_like_vllm(sharegpt_file):
    s = sharegpt_dataset(sharegpt_file, 100, TOK, seed=0, do_oversample=False)
    assert sorted((x.prompt_len, x.expected_output_len) for x in s) == [(8, 10), (11, 4), (1000, 1048)]
    assert all(x.prompt is not None and x.prompt_token_ids == TOK.encode(x.prompt) for x in s)
    # a fixed output length lifts the output < 4 filter (but not the length caps)
    fixed = sharegpt_dataset(sharegpt_file, 100, TOK, seed=0, output_len=2, do_oversample=False)
    assert sorted(x.prompt_len for x in fixed) == [8, 8, 11, 1000, 1000]
    assert all(x.expected_output_len == 2 for x in fixed)


def test_sharegpt_shuffled_by_seed_and_oversampled(sharegpt_file):
    a = [x.prompt for x in sharegpt_dataset(sharegpt_file, 2, TOK, seed=1)]
    assert a == [x.prompt for x in sharegpt_dataset(sharegpt_file, 2, TOK, seed=1)]
    orders = {tuple(x.prompt_len for x in sharegpt_dataset(sharegpt_file, 3, TOK, seed=k)) for k in range(8)}
    assert len(orders) > 1
    assert len(sharegpt_dataset(sharegpt_file, 10, TOK, seed=0)) == 10          # 3 distinct, oversampled
    assert len(sharegpt_dataset(sharegpt_file, 10, TOK, seed=0, do_oversample=False)) == 3


class _BatchTok(ByteTokenizer):
    """The byte tokenizer with a batch encoder that counts its calls and texts."""

    def __init__(self) -> None:
        self.calls = self.texts = 0

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls += 1
        self.texts += len(texts)
        return [self.encode(t, add_special_tokens) for t in texts]


def test_sharegpt_tokenizes_in_chunks_and_picks_what_one_by_one_picks(tmp_path):
    """The batched path keeps vLLM's rule exactly: the shuffled conversations in order, each kept if it passes the
    filters, until --num-prompts; it tokenizes a few chunks, not one conversation at a time."""
    rng = np.random.default_rng(4)
    data = [_conv("p" * int(rng.integers(1, 1300)), "c" * int(rng.integers(1, 1300))) for _ in range(3000)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(data))

    def one_by_one(n, seed, output_len=None):
        out = []
        for k in np.random.default_rng(seed).permutation(len(data)):
            p, c = data[k]["conversations"][0]["value"], data[k]["conversations"][1]["value"]
            n_out = output_len if output_len is not None else len(c)
            if len(p) < 4 or (output_len is None and n_out < 4) or len(p) > 1024 or len(p) + n_out > 2048:
                continue
            out.append((len(p), n_out, p))
            if len(out) == n:
                break
        return out

    for n, seed, output_len in ((1, 0, None), (37, 1, None), (900, 2, None), (5000, 3, None), (400, 4, 700)):
        tok = _BatchTok()
        got = sharegpt_dataset(path, n, tok, seed, output_len=output_len, do_oversample=False)
        assert [(x.prompt_len, x.expected_output_len, x.prompt) for x in got] == one_by_one(n, seed, output_len)
        assert all(x.prompt_token_ids == TOK.encode(x.prompt) for x in got)
        assert tok.calls <= 12 and (n > 1000 or tok.texts < 3 * n + 100), (n, tok.calls, tok.texts)


_TEXTS = ["Hello, world!", "", "  two  spaces\n\nand lines", "naïve café ☕ 日本語", "a" * 3000, " leading space",
          "<|begin_of_text|> literal <s> </s> <unk> <|endoftext|> <|im_start|> specials", "tab\there 🤖 3.14159"]


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "mistralai/Mixtral-8x7B-Instruct-v0.1"])
def test_the_bundled_tokenizers_batch_and_bare_encoders_give_the_servers_ids(model):
    """The server's tokenizer one text at a time, its batch encoder, and the bare family tokenizer ShareGPT counts
    with (no transformers import) give the same ids, BOS or not (a tiktoken and a sentencepiece family)."""
    pytest.importorskip("transformers")
    from kernelsight.loadgen.tokenizer import EncoderTokenizer, LocalTokenizer, resolve_tokenizer

    tok = resolve_tokenizer(model, None)
    bare = resolve_tokenizer(model, None, encode_only=True)
    assert isinstance(tok, LocalTokenizer) and isinstance(bare, EncoderTokenizer)
    assert bare.vocab_size == tok.vocab_size
    for special in (True, False):
        one_by_one = [tok.encode(t, add_special_tokens=special) for t in _TEXTS]
        assert tok.encode_batch(_TEXTS, add_special_tokens=special) == one_by_one
        assert bare.encode_batch(_TEXTS, add_special_tokens=special) == one_by_one
        assert [bare.encode(t, add_special_tokens=special) for t in _TEXTS] == one_by_one


def test_a_sharegpt_simulate_counts_tokens_without_importing_transformers(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("tokenizers")
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv("Tell me about the weather in Paris today.", "It is sunny and warm.")] * 3))
    probe = ("import sys; from kernelsight.cli import main; "
             f"rc = main(['simulate', '--dataset-name', 'sharegpt', '--dataset-path', {str(path)!r}, "
             "'--num-prompts', '3']); print(rc, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "0 False"


def test_prefix_repetition_shares_prefixes():
    s = prefix_repetition_dataset(40, prefix_len=32, suffix_len=8, num_prefixes=4, output_len=5, vocab_size=1000,
                                  seed=3)
    assert len(s) == 40 and all(x.prompt_len == 40 and x.expected_output_len == 5 for x in s)
    prefixes = {tuple(x.prompt_token_ids[:32]) for x in s}
    assert len(prefixes) == 4
    assert len({tuple(x.prompt_token_ids) for x in s}) == 40                       # suffixes differ
    assert [x.prompt_token_ids[:32] for x in s[:4]] != [list(p) for p in sorted(prefixes)]  # shuffled
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_dataset(3, 8, 8, 4, 5, 1000, 0)


def test_prefix_repetition_remainder_is_oversampled():
    s = prefix_repetition_dataset(10, 16, 4, 3, 2, 500, 0)   # 3 per prefix = 9, then one repeat
    assert len(s) == 10 and len({tuple(x.prompt_token_ids) for x in s}) == 9


def test_custom_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "hello", "output_tokens": 7}\n\n{"prompt": "abc", "output_tokens": 3}\n')
    s = custom_dataset(path, 10, TOK, 0, output_len=-1, do_oversample=False)
    assert [(x.prompt, x.prompt_len, x.expected_output_len) for x in s] == [("hello", 5, 7), ("abc", 3, 3)]
    s = custom_dataset(path, 4, TOK, 0, output_len=20, chat_template=lambda p: f"<u>{p}</u>")
    assert len(s) == 4 and s[0].prompt == "<u>hello</u>" and s[0].expected_output_len == 20
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 1"):
        custom_dataset(path, 1, TOK, 0)


def test_oversample_deterministic():
    from kernelsight.loadgen.datasets import SampleRequest

    base = [SampleRequest([i], 1, 1) for i in range(3)]
    a = oversample(base, 8, 5)
    assert len(a) == 8 and a[:3] == base
    assert [x.prompt_token_ids for x in a] == [x.prompt_token_ids for x in oversample(base, 8, 5)]


def _ns(cmd: str, *argv: str):
    return build_parser().parse_args([cmd, *argv])


@pytest.mark.parametrize("cmd", ["bench", "simulate"])
def test_both_commands_share_workload_flags(cmd):
    ns = _ns(cmd, "--dataset-name", "prefix_repetition", "--num-prompts", "20", "--prefix-repetition-num-prefixes",
             "2", "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4", "--request-rate", "5",
             "--burstiness", "0.5", "--seed", "7", "--goodput", "ttft:100", "tpot:20", "--metric-percentiles",
             "50,99.9")
    assert ns.dataset_name == "prefix-repetition"
    wl = build_workload(ns, 1000, lambda: TOK)
    assert len(wl.samples) == 20 and len(wl.arrivals_s) == 20
    assert wl.arrivals_s[-1] == pytest.approx(20 / 5)          # gamma gaps rescaled so the last send is N/rate
    assert wl.request_rate == 5.0 and wl.ignore_eos is False   # vLLM forces ignore_eos only for random
    m = metric_options(ns)
    assert m.goodput_slos_ms == {"ttft": 100.0, "tpot": 20.0} and m.percentiles == [50.0, 99.9]


def test_workload_identical_for_bench_and_simulate():
    argv = ["--num-prompts", "30", "--random-input-len", "50", "--random-range-ratio", "0.5", "--request-rate", "9",
            "--seed", "4"]
    a = build_workload(_ns("bench", *argv), 5000, lambda: TOK)
    b = build_workload(_ns("simulate", *argv), 5000, lambda: TOK)
    assert [s.prompt_token_ids for s in a.samples] == [s.prompt_token_ids for s in b.samples]
    assert np.array_equal(a.arrivals_s, b.arrivals_s) and a.ignore_eos and b.ignore_eos


def test_workload_errors():
    with pytest.raises(ValueError, match="needs --dataset-path"):
        build_workload(_ns("bench", "--dataset-name", "sharegpt"), 100, lambda: TOK)
    with pytest.raises(ValueError, match="percentile-metrics"):
        metric_options(_ns("bench", "--percentile-metrics", "ttft,nope"))
    with pytest.raises(ValueError, match="goodput"):
        metric_options(_ns("bench", "--goodput", "ttft=5"))
