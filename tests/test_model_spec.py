"""HF config parsing (pure) and the model loader (bundled, local dir, HF cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kernelsight.profiles import UnknownModelError, list_models, load_model, model_config_path
from kernelsight.simcore.model_spec import ModelSpec, UnsupportedArchitectureError, model_spec_from_hf_config

LLAMA_8B = "meta-llama/Llama-3.1-8B"
SUPPORTED_BUNDLED = list_models()   # NVFP4 ones parse; their format fails later, naming what is missing


def _bundled_config(model_id: str) -> dict:
    path = model_config_path(model_id)
    assert path is not None
    return json.loads(path.read_text())


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the HF cache at an empty dir so the developer's real cache never leaks into a test."""
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def test_required_models_are_bundled() -> None:
    required = {
        LLAMA_8B, "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B",
        "Qwen/Qwen3-32B", "Qwen/Qwen3-32B-FP8", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B",
        "mistralai/Mixtral-8x7B-v0.1", "deepseek-ai/DeepSeek-V3", "nvidia/Llama-3.1-70B-Instruct-FP8",
    }
    assert required <= set(list_models())


@pytest.mark.parametrize("model_id", SUPPORTED_BUNDLED)
def test_every_supported_bundled_model_loads(model_id: str) -> None:
    spec = load_model(model_id)
    assert isinstance(spec, ModelSpec) and spec.name == model_id
    assert spec.num_attention_heads % spec.num_kv_heads == 0
    assert spec.eos_token_ids and spec.num_layers > 0 and spec.vocab_size > 0
    assert spec.is_moe == (spec.num_moe_layers > 0)
    block_fp8 = spec.architecture == "DeepseekV3ForCausalLM" and "FP4" not in model_id   # DeepSeek/Kimi ship FP8
    expected = ("fp8" if "FP8" in model_id or block_fp8 else "nvfp4" if "FP4" in model_id
                else "mxfp4" if spec.architecture == "GptOssForCausalLM" else None)
    assert spec.quantization == expected


def test_llama_31_8b_numbers() -> None:
    s = load_model(LLAMA_8B)
    assert (s.architecture, s.model_type) == ("LlamaForCausalLM", "llama")
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads) == (32, 4096, 32, 8)
    assert (s.head_dim, s.intermediate_size, s.vocab_size) == (128, 14336, 128256)
    assert (s.q_size, s.kv_size) == (4096, 1024)
    assert not s.is_moe and s.sliding_window is None and not s.tie_word_embeddings
    assert s.eos_token_ids == (128001,) and s.bos_token_id == 128000 and s.max_position_embeddings == 131072


def test_qwen3_30b_a3b_moe_numbers() -> None:
    s = load_model("Qwen/Qwen3-30B-A3B")
    assert s.is_moe and s.architecture == "Qwen3MoeForCausalLM"
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (128, 8, 768)
    assert (s.num_layers, s.num_moe_layers, s.head_dim, s.num_kv_heads) == (48, 48, 128, 4)
    assert s.shared_expert_intermediate_size == 0 and s.sliding_window is None


def test_qwen3_head_dim_comes_from_config_not_hidden_over_heads() -> None:
    s = load_model("Qwen/Qwen3-0.6B")        # hidden 1024 / 16 heads = 64, but head_dim is 128
    assert s.head_dim == 128 and s.q_size == 2048 and s.tie_word_embeddings


def test_mixtral_numbers() -> None:
    s = load_model("mistralai/mixtral-8x7b-v0.1")
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (8, 2, 14336)
    assert s.num_moe_layers == s.num_layers == 32 and s.intermediate_size == 0
    assert s.vocab_size == 32000 and s.sliding_window is None


def test_fp8_llama_merges_hf_quant_config() -> None:
    s = load_model("nvidia/Llama-3.1-70B-Instruct-FP8")
    assert s.quantization == "fp8" and s.eos_token_ids == (128001, 128008, 128009) and s.num_layers == 80


@pytest.mark.parametrize(("alias", "name"), [
    ("meta-llama/Meta-Llama-3.1-8B", LLAMA_8B),
    ("META-LLAMA/llama-3.1-8b", LLAMA_8B),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ("qwen/qwen3-8b", "Qwen/Qwen3-8B"),
    ("Qwen/Qwen3-8B-Instruct", "Qwen/Qwen3-8B"),
])
def test_model_aliases_and_case_insensitivity(alias: str, name: str) -> None:
    spec = load_model(alias)
    assert spec.name == name
    assert spec.num_layers == (32 if "llama" in alias.lower() else 36)


def test_instruct_variant_keeps_architecture_but_uses_instruct_eos() -> None:
    base, instruct = load_model(LLAMA_8B), load_model("meta-llama/Llama-3.1-8B-Instruct")
    assert instruct.eos_token_ids == (128001, 128008, 128009)
    assert (instruct.num_layers, instruct.hidden_size, instruct.vocab_size) == (
        base.num_layers, base.hidden_size, base.vocab_size)


def test_llama4_scout_from_its_nested_text_config() -> None:
    m = load_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert (m.architecture, m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads) == (
        "Llama4ForConditionalGeneration", 5120, 48, 40, 8)
    # interleave_moe_layer_step 1: every layer MoE, 16 experts top-1 plus a shared expert of intermediate_size
    assert (m.num_moe_layers, m.num_experts, m.experts_per_token) == (48, 16, 1)
    assert (m.moe_intermediate_size, m.shared_expert_intermediate_size, m.intermediate_size) == (8192, 8192, 16384)
    # iRoPE: no_rope_layers [1, 1, 1, 0] x 12 -> 36 chunked-local (8192) RoPE layers, 12 NoPE full-attention layers
    assert (m.attention_chunk_size, m.num_chunked_layers) == (8192, 36)


@pytest.mark.parametrize(("edit", "match"), [
    ({"kv_lora_rank": 512}, "latent"),                      # MLA outside the DeepSeek architectures
    ({"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
    ({"architectures": []}, "architectures"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"vocab_size": "big"}, "vocab_size"),
    ({"num_key_value_heads": 5}, "multiple"),
])
def test_unsupported_or_broken_configs_raise(edit: dict, match: str) -> None:
    config = {**_bundled_config(LLAMA_8B), **edit}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(UnsupportedArchitectureError, match=match):
        model_spec_from_hf_config(config, "x/y")


def test_parse_defaults_and_variants() -> None:
    base = _bundled_config(LLAMA_8B)
    no_kv = {k: v for k, v in base.items() if k not in ("num_key_value_heads",)}
    assert model_spec_from_hf_config(no_kv, "x").num_kv_heads == 32          # MHA when unspecified
    listed_eos = model_spec_from_hf_config({**base, "eos_token_id": [1, 2]}, "x")
    assert listed_eos.eos_token_ids == (1, 2)
    mistral_cfg = {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                   "sliding_window": 4096}
    mistral = model_spec_from_hf_config(mistral_cfg, "m")
    assert mistral.sliding_window == 4096
    qwen = _bundled_config("Qwen/Qwen3-8B")
    assert model_spec_from_hf_config({**qwen, "sliding_window": 4096}, "q").sliding_window is None
    assert model_spec_from_hf_config(
        {**qwen, "sliding_window": 4096, "use_sliding_window": True}, "q").sliding_window == 4096


def test_qwen_moe_sparse_step_and_mlp_only_layers() -> None:
    cfg = _bundled_config("Qwen/Qwen3-30B-A3B")          # 48 layers
    assert model_spec_from_hf_config({**cfg, "decoder_sparse_step": 2}, "q").num_moe_layers == 24
    assert model_spec_from_hf_config({**cfg, "mlp_only_layers": [0, 1, 47]}, "q").num_moe_layers == 45
    qwen2_moe = {**cfg, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 5632}
    assert model_spec_from_hf_config(qwen2_moe, "q").shared_expert_intermediate_size == 5632


def test_local_directory(tmp_path: Path, empty_hf_cache: Path) -> None:
    config = {**_bundled_config("Qwen/Qwen3-8B"), "num_hidden_layers": 7}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_model(str(tmp_path))
    assert spec.name == str(tmp_path) and spec.num_layers == 7
    assert model_config_path(str(tmp_path)) == tmp_path / "config.json"


def test_local_directory_with_modelopt_quant_file(tmp_path: Path, empty_hf_cache: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_bundled_config(LLAMA_8B)))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    assert load_model(str(tmp_path)).quantization == "fp8"


def _fake_snapshot(hub: Path, repo: str, revision: str, layers: int) -> None:
    snap = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({**_bundled_config(LLAMA_8B), "num_hidden_layers": layers}))


def test_hf_cache_prefers_refs_main(empty_hf_cache: Path) -> None:
    repo = "acme/Tiny-Llama"
    _fake_snapshot(empty_hf_cache, repo, "aaaa", layers=3)
    _fake_snapshot(empty_hf_cache, repo, "bbbb", layers=5)
    newer = empty_hf_cache / "models--acme--Tiny-Llama" / "snapshots" / "bbbb" / "config.json"
    os.utime(newer, (2e9, 2e9))          # the newest snapshot is NOT the one refs/main names
    refs = empty_hf_cache / "models--acme--Tiny-Llama" / "refs"
    refs.mkdir()
    (refs / "main").write_text("aaaa\n")
    spec = load_model(repo)
    assert spec.name == repo and spec.num_layers == 3
    assert model_config_path(repo) == refs.parent / "snapshots" / "aaaa" / "config.json"


def test_hf_cache_without_refs_and_via_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    _fake_snapshot(tmp_path / "hfhome" / "hub", "acme/Other", "cccc", layers=9)
    assert load_model("acme/other").num_layers == 9      # hub ids are case-insensitive


@pytest.mark.parametrize("bad", ["acme/not-there", "no-slash-model", "../etc/passwd"])
def test_unknown_model_lists_bundled_ids(bad: str, empty_hf_cache: Path) -> None:
    with pytest.raises(UnknownModelError) as err:
        load_model(bad)
    assert isinstance(err.value, ValueError)
    for model_id in list_models():
        assert model_id in str(err.value)
    assert model_config_path(bad) is None
