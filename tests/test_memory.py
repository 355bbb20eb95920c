from __future__ import annotations

import json

import pytest

from kernelsight import profiles
from kernelsight.simcore.engine_config import EngineArgs, resolve_engine_config
from kernelsight.simcore.memory import InsufficientMemoryError, kv_bytes_per_token, param_counts
from kernelsight.simcore.precision import Precision


def test_llama8b_parameter_count(llama8b):
    linear, other = param_counts(llama8b)
    assert linear + other == pytest.approx(8.03e9, rel=0.005)


def test_kv_bytes_per_token(llama8b):
    assert kv_bytes_per_token(llama8b, Precision(), 1) == 32 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(llama8b, Precision(kv_dtype="fp8"), 2) == 32 * 4 * 128 * 2


def test_rtx4090_block_count_matches_measured_vllm(llama8b, shared_data):
    meta = json.loads((shared_data / "e2e/llmservingsim_rtx4090_llama31_8b/meta.json").read_text())
    measured = meta["kv_cache"]["num_gpu_blocks"]
    hw = profiles.load_hardware("rtx-4090")
    args = EngineArgs(hardware="rtx-4090", max_model_len=32768, gpu_memory_utilization=0.9,
                      max_num_seqs=256, max_num_batched_tokens=2048)
    cfg = resolve_engine_config(args, llama8b, hw, profiles.load_calibration("rtx-4090"))
    assert measured == 2588
    assert abs(cfg.num_gpu_blocks - measured) / measured < 0.03


def test_default_batch_limits_follow_vllm(llama8b):
    calib = profiles.load_calibration("h100")
    h100 = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, profiles.load_hardware("h100"), calib)
    a100 = resolve_engine_config(EngineArgs(hardware="a100", max_model_len=8192), llama8b,
                                 profiles.load_hardware("a100"), calib)
    assert (h100.scheduler.max_num_batched_tokens, h100.scheduler.max_num_seqs) == (8192, 1024)
    assert (a100.scheduler.max_num_batched_tokens, a100.scheduler.max_num_seqs) == (2048, 256)


def test_model_that_does_not_fit_fails_clearly():
    model = profiles.load_model("meta-llama/Llama-3.1-70B")
    hw = profiles.load_hardware("4090")
    with pytest.raises(InsufficientMemoryError, match="tensor_parallel_size"):
        resolve_engine_config(EngineArgs(model="meta-llama/Llama-3.1-70B", hardware="4090", max_model_len=4096),
                              model, hw, profiles.load_calibration("4090"))


def test_max_model_len_that_does_not_fit_kv_fails_like_vllm(llama8b):
    hw = profiles.load_hardware("4090")
    with pytest.raises(InsufficientMemoryError, match="estimated maximum model length"):
        resolve_engine_config(EngineArgs(hardware="4090"), llama8b, hw, profiles.load_calibration("4090"))


@pytest.mark.parametrize("kw,match", [
    ({"tensor_parallel_size": 3}, "divisible"),
    ({"max_model_len": 10**7}, "max_model_len"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"block_size": 7}, "block_size"),
    ({"kv_cache_dtype": "int3"}, "kv-cache-dtype"),
])
def test_bad_engine_args_are_rejected(llama8b, h100, kw, match):
    with pytest.raises(ValueError, match=match):
        resolve_engine_config(EngineArgs(**kw), llama8b, h100, profiles.load_calibration("h100"))
