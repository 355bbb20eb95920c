"""The bundled tokenizers encode exactly as the models' own tokenizers, offline, from pinned publisher files.

Independent references: Meta's own expected ids (llama-models' llama3/tests/api/test_tokenizer.py), and the
publishers' reference implementations run on the same pinned file: tiktoken for Llama 3 and Llama 4 (Meta's
llama_models/llama3/tokenizer.py and llama4/tokenizer.py are tiktoken with the pattern in index.json), for Qwen (Qwen's
tokenization_qwen.py is tiktoken after NFC) and for gpt-oss (tiktoken's own o200k_harmony, reading the file
through its cache under the name and hash OpenAI pins), and sentencepiece for Mistral v0.1 (the library
that model was trained and shipped with).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from kernelsight.server.model import bundled_tokenizer as bt
from kernelsight.server.model.tokenizer import load_tokenizer

SENTENCE = "This is a test sentence."
MIXED = "Hello, 世界! Ünïcödé 12345 \n\n  spaces\tand tabs 😀"

# family -> [(text, add_special_tokens, ids)]; each list was produced by the family's reference (module doc)
EXPECTED = {
    "llama3": [
        # Meta's test_encode (bos=True; HF adds no EOS) and test_encode_message
        (SENTENCE, True, [128000, 2028, 374, 264, 1296, 11914, 13]),
        ("<|start_header_id|>user<|end_header_id|>\n\nThis is a test sentence.<|eot_id|>", False,
         [128006, 882, 128007, 271, 2028, 374, 264, 1296, 11914, 13, 128009]),
        (MIXED, False, [9906, 11, 127365, 0, 105766, 38672, 66, 3029, 67, 978, 220, 4513, 1774, 4815, 220, 12908,
                        53577, 23204, 91416]),
    ],
    "llama4": [
        # Meta's llama4 Tokenizer (tiktoken, bos=True) on the same three strings
        (SENTENCE, True, [200000, 3231, 373, 262, 1600, 17705, 26]),
        ("<|header_start|>user<|header_end|>\n\nThis is a test sentence.<|eot|>", False,
         [200005, 1556, 200006, 368, 3231, 373, 262, 1600, 17705, 26, 200008]),
        (MIXED, False, [19873, 24, 100788, 13, 11563, 90, 14323, 79, 20003, 397, 220, 7235, 2127, 7283, 220, 15174,
                        103956, 42988, 51358, 222]),
    ],
    "qwen3": [
        (SENTENCE, True, [1986, 374, 264, 1273, 11652, 13]),
        (MIXED, True, [9707, 11, 220, 99489, 0, 30512, 77, 37572, 66, 2956, 128505, 220, 16, 17, 18, 19, 20, 4710,
                       220, 12621, 52477, 22398, 90316]),
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True,
         [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198, 151667, 198]),
    ],
    "gpt-oss": [
        (SENTENCE, True, [2500, 382, 261, 1746, 21872, 13]),
        (MIXED, True, [13225, 11, 185558, 0, 120241, 191375, 43369, 377, 220, 7633, 2548, 1202, 220, 18608, 128995,
                       38191, 88038]),
        ("<|start|>user<|message|>Hi<|end|><|start|>assistant", True,
         [200006, 1428, 200008, 12194, 200007, 200006, 173781]),
    ],
    "mistral-v1": [
        (SENTENCE, True, [1, 851, 349, 264, 1369, 12271, 28723]),
        (MIXED, True, [1, 22557, 28725, 28705, 30050, 29822, 28808, 13156, 28711, 28920, 28717, 14697, 28797, 28705,
                       28740, 28750, 28770, 28781, 28782, 28705, 13, 13, 28705, 10599, 12, 391, 261, 4737, 28705,
                       30575]),
        ("[INST] Hi [/INST]", True, [1, 733, 16289, 28793, 15359, 733, 28748, 16289, 28793]),
    ],
}

# every bundled model profile (ids and variants) and the family its tokenizer comes from; None = not bundled
PROFILE_FAMILIES = {
    "meta-llama/Llama-3.1-8B": "llama3", "meta-llama/Llama-3.1-8B-Instruct": "llama3",
    "meta-llama/Llama-3.1-70B": "llama3", "meta-llama/Llama-3.1-405B-Instruct": "llama3",
    "nvidia/Llama-3.1-70B-Instruct-FP8": "llama3",
    "Qwen/Qwen3-0.6B": "qwen3", "Qwen/Qwen3-8B": "qwen3", "Qwen/Qwen3-32B-FP8": "qwen3",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3", "Qwen/Qwen3-235B-A22B-FP8": "qwen3",
    "mistralai/Mixtral-8x7B-v0.1": "mistral-v1", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mistral-v1",
    "openai/gpt-oss-20b": "gpt-oss", "openai/gpt-oss-120b": "gpt-oss",
    "meta-llama/Llama-4-Scout-17B-16E": "llama4", "meta-llama/Llama-4-Scout-17B-16E-Instruct": "llama4",
    "deepseek-ai/DeepSeek-V3": None, "moonshotai/Kimi-K2-Instruct": None,
}


def _vocab_size(model: str) -> int:
    from kernelsight import profiles

    path = profiles.model_config_path(model)
    if path is None:
        return {"openai": 201088, "moonshotai": 163840}[model.split("/")[0]]
    config = json.loads(path.read_text())
    return config.get("vocab_size") or config["text_config"]["vocab_size"]     # Llama 4 nests it


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_fixed_strings_encode_to_the_reference_ids(family):
    tok = bt.load_bundled(family)
    for text, special, ids in EXPECTED[family]:
        assert tok.encode(text, add_special_tokens=special) == ids, (family, text)
        body = ids[1:] if special and tok.bos_token_id is not None and ids[0] == tok.bos_token_id else ids
        assert tok.decode(body, skip_special_tokens=False) == text, (family, text)     # and back


def test_vocabulary_sizes_and_special_ids_match_the_models():
    sizes = {name: len(bt.load_bundled(name)) for name in EXPECTED}
    # tokenizer lengths as the models' HF tokenizers report them (Qwen3 pads its embedding to 151936)
    assert sizes == {"llama3": 128256, "llama4": 202048, "qwen3": 151669, "gpt-oss": 201088, "mistral-v1": 32000}
    qwen = bt.load_bundled("qwen3")
    assert qwen.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>"]) == [151645, 151667, 151668]
    # special=false in Qwen3's tokenizer_config: <think> survives skip_special_tokens, <|im_end|> does not
    assert qwen.decode([151667, 13048, 151645], skip_special_tokens=True) == "<think>Hi"
    oss = bt.load_bundled("gpt-oss")
    assert oss.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|endofprompt|>", "<|reserved_201087|>"]) == [
        200002, 200012, 200018, 201087]


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    frags = ["Hello", " world", "  ", "\n", "\r\n", "\t", "1234567", "3.14159", "don't", "I'M", "we'll",
             "naïve café", "日本語のテキスト", "中文文本测试", "한국어", "Русский текст", "العربية", "हिन्दी",
             "😀🎉👍🏽", "ﬁ", "e\u0301", "Å", "  \n\n  ", "```python\ndef f(x):\n    return x**2\n```",
             "$$x^2$$", "a/b/c", "...", "—", "</think>"]
    ranges = [(32, 126), (0xA0, 0x2FF), (0x370, 0x52F), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F), (0x3040, 0x30FF)]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 25)):
            if rng.random() < 0.7:
                parts.append(rng.choice(frags))
            else:
                parts.append("".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


def _tiktoken_reference(enc, nfc: bool):
    return lambda text: enc.encode(unicodedata.normalize("NFC", text) if nfc else text, allowed_special="all")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The publishers' reference encoders over the pinned files (text -> ids, no BOS)."""
    tiktoken = pytest.importorskip("tiktoken")
    spm = pytest.importorskip("sentencepiece")
    from tiktoken.load import load_tiktoken_bpe

    d = tmp_path_factory.mktemp("ref")
    files = {}
    for name, fam in bt.families().items():
        files[name] = d / name
        files[name].write_bytes(bt.read_verified(fam))
    refs = {}
    for name in ("llama3", "llama4", "qwen3"):
        fam, tok = bt.families()[name], bt.load_bundled(name)
        ranks = load_tiktoken_bpe(str(files[name]))
        specials = {t: i for t, i in tok.get_vocab().items() if i >= len(ranks)}
        enc = tiktoken.Encoding(name, pat_str=fam.spec["pattern"], mergeable_ranks=ranks, special_tokens=specials)
        refs[name] = _tiktoken_reference(enc, nfc=fam.spec["normalizer"] == "NFC")
    # tiktoken's own o200k_harmony, offline: its cache holds the file under sha1(url), and tiktoken checks the hash
    cache = d / "tiktoken-cache"
    cache.mkdir()
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    shutil.copy(files["gpt-oss"], cache / hashlib.sha1(url.encode()).hexdigest())
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        harmony = tiktoken.get_encoding("o200k_harmony")
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR") if old is None else os.environ.__setitem__("TIKTOKEN_CACHE_DIR", old)
    assert harmony._pat_str == bt.families()["gpt-oss"].spec["pattern"]
    refs["gpt-oss"] = lambda t: harmony.encode(t, allowed_special="all")
    sp = spm.SentencePieceProcessor(model_file=str(files["mistral-v1"]))
    refs["mistral-v1"] = lambda t: sp.encode(t)
    return refs


def _agree(family: str, reference, texts: list[str]) -> list[str]:
    tok = bt.load_bundled(family)
    bos = family in ("llama3", "llama4", "mistral-v1")
    bad = []
    for text in texts:
        if family == "mistral-v1" and any(s in text for s in ("<s>", "</s>", "<unk>")):
            continue    # HF matches these as control tokens, sentencepiece as text: not a tokenizer difference
        ids = tok.encode(text, add_special_tokens=False)
        if ids != reference(text) or (bos and tok.encode(text)[0] != tok.bos_token_id):
            bad.append(text)
    return bad


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_random_text_encodes_as_the_publishers_reference(family, references):
    assert _agree(family, references[family], _corpus(150, seed=1)) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_large_corpus_encodes_as_the_publishers_reference(family, references):
    texts = _corpus(3000, seed=2)
    for path in sorted(Path(json.__file__).parent.glob("*.py")):     # real source code, whitespace runs
        texts.append(path.read_text(encoding="utf-8"))
    assert _agree(family, references[family], texts) == []


def test_files_carry_their_pinned_hash_and_licences():
    for fam in bt.families().values():
        data = lzma.decompress((bt.TOKENIZER_DIR / fam.file).read_bytes())
        assert hashlib.sha256(data).hexdigest() == fam.sha256
        for lic in fam.spec["licence_files"]:
            assert (bt.TOKENIZER_DIR / lic).stat().st_size > 500, lic
    for version in ("3.1", "4"):     # the attribution the Llama licences require in a "Notice" file
        notice = (bt.TOKENIZER_DIR / "licences" / f"Llama-{version}-NOTICE.txt").read_text(encoding="utf-8")
        assert f"Llama {version} is licensed under the Llama {version} Community License, Copyright © Meta " \
               "Platforms, Inc. All Rights Reserved." in notice and "Built with Llama" in notice


def test_a_tampered_file_is_refused(tmp_path, monkeypatch):
    fam = bt.families()["mistral-v1"]
    data = bytearray(bt.read_verified(fam))
    data[-1] ^= 1
    (tmp_path / fam.file).write_bytes(lzma.compress(bytes(data)))
    monkeypatch.setattr(bt, "TOKENIZER_DIR", tmp_path)
    with pytest.raises(ValueError, match="sha256"):
        bt.read_verified(fam)


@pytest.mark.parametrize("model,family", sorted(PROFILE_FAMILIES.items()))
def test_each_bundled_model_reports_its_tokenizer_source(model, family):
    tok = load_tokenizer(model, None, _vocab_size(model))
    if family is None:
        assert tok.source.kind == "byte-fallback"     # documented in index.json's not_bundled
        return
    fam = bt.families()[family]
    assert tok.source.kind == "bundled"
    assert fam.publisher in tok.source.where and fam.sha256[:16] in tok.source.where
    assert tok.encode(SENTENCE, add_special_tokens=False) == [
        i for i in EXPECTED[family][0][2] if i not in (128000, 200000, 1)]


def test_loads_offline_with_no_hf_cache_and_an_empty_build_cache(tmp_path):
    """A fresh process, HF hub offline, an empty HF home and an empty kernelsight cache: the tokenizer is built
    from the bundled file alone (Mixtral's, the quickest to build) and the build is cached for the next run."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               KERNELSIGHT_CACHE_DIR=str(tmp_path / "ks"))
    code = ("from kernelsight.server.model.tokenizer import load_tokenizer as L; "
            "t = L('mistralai/Mixtral-8x7B-Instruct-v0.1', None, 32000); "
            "print(t.source.kind, t.encode('This is a test sentence.'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "bundled [1, 851, 349, 264, 1369, 12271, 28723]"
    assert [p.name for p in (tmp_path / "ks" / "tokenizers").iterdir()] == [
        f"mistral-v1-{bt.families()['mistral-v1'].sha256[:16]}-v{bt.BUILD_VERSION}.json"]
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("tokenizer*"))


def test_chat_templates_render_the_models_prompts():
    llama = load_tokenizer("meta-llama/Llama-3.1-8B-Instruct", None, 128256)
    msgs = [{"role": "user", "content": "Hi"}]
    assert llama.render_chat(msgs) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    qwen = load_tokenizer("Qwen/Qwen3-8B", None, 151936)
    assert qwen.render_chat(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.render_chat(msgs, chat_template_kwargs={"enable_thinking": False}) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    mixtral = load_tokenizer("mistralai/Mixtral-8x7B-Instruct-v0.1", None, 32000)
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert mixtral.render_chat(two) == "<s> [INST] Be brief.\n\nHi [/INST] Hello</s> [INST] Bye [/INST]"
    assert load_tokenizer("mistralai/Mixtral-8x7B-v0.1", None, 32000).chat_template is None   # base: none
    thinking = load_tokenizer("Qwen/Qwen3-30B-A3B-Thinking-2507", None, 151936)
    assert thinking.render_chat(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_llama4_special_tokens_are_metas():
    """Meta's llama4/tokenizer.py: 5 basic tokens from 200000, the text post-train block 200005..200079, the
    vision block 200080..201133, the reasoning block 201134..201143, then <|reserved_special_token_i|> up to
    2048 in all; BOS, EOS, eot, eom and pad as it names them; the image tokens the processor expands."""
    from kernelsight.multimodal.llama4 import Llama4TokenIds

    base, instruct = bt.load_bundled("llama4"), bt.load_bundled("llama4", instruct=True)
    names = {200000: "<|begin_of_text|>", 200004: "<|fim_suffix|>", 200005: "<|header_start|>",
             200007: "<|eom|>", 200008: "<|eot|>", 200015: "<|text_post_train_reserved_special_token_5|>",
             200016: "<|python_start|>", 200018: "<|finetune_right_pad|>",
             200019: "<|text_post_train_reserved_special_token_8|>",
             200079: "<|text_post_train_reserved_special_token_68|>", 200080: "<|image_start|>",
             200091: "<|vision_reserved_special_token_6|>", 200093: "<|vision_reserved_special_token_7|>",
             201133: "<|vision_reserved_special_token_1047|>", 201134: "<|reasoning_reserved_special_token_0|>",
             201142: "<|reasoning_thinking_start|>", 201143: "<|reasoning_thinking_end|>",
             201144: "<|reserved_special_token_0|>", 202047: "<|reserved_special_token_903|>"}
    assert {i: base.convert_ids_to_tokens(i) for i in names} == names
    ids = Llama4TokenIds()
    assert base.convert_tokens_to_ids(["<|image_start|>", "<|image_end|>", "<|tile_x_separator|>",
                                       "<|tile_y_separator|>", "<|image|>", "<|patch|>"]) == [
        ids.image_start, ids.image_end, ids.tile_x_separator, ids.tile_y_separator, ids.image, ids.patch]
    assert (base.bos_token_id, base.eos_token_id, base.pad_token_id, instruct.eos_token_id) == (
        200000, 200001, 200018, 200008)
    # every special token is one id, never split into text pieces, and is dropped by skip_special_tokens
    assert base.encode("<|image|><|patch|><|reserved_special_token_903|>", add_special_tokens=False) == [
        200090, 200092, 202047]
    assert base.decode([200005, 1556, 200006, 200008], skip_special_tokens=True) == "user"


def test_llama_families_do_not_take_each_others_ids():
    for model in ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "meta-llama/Llama-4-Maverick-17B-128E",
                  "/models/llama4-scout"):
        assert bt.family_for(model).name == "llama4", model
    for model in ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.3-70B-Instruct",
                  "meta-llama/Llama-3.1-405B", "unsloth/llama-3-8b"):
        assert bt.family_for(model).name == "llama3", model
    assert bt.family_for("meta-llama/Llama-4-Scout-17B-16E", 128256) is None     # a vocab that is not Llama 4's


def test_llama4_instruct_template_renders_images_as_the_processor_expects():
    tok = load_tokenizer("meta-llama/Llama-4-Scout-17B-16E-Instruct", None, 202048)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert tok.render_chat(msgs) == (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
        "<|header_start|>user<|header_end|>\n\n<|image|>What is this?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n")
    assert load_tokenizer("meta-llama/Llama-4-Scout-17B-16E", None, 202048).chat_template is None   # base: none
