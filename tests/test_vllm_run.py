"""Engine arguments of a measured vLLM run from its meta.json (resolved config first, then the flags given)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import needs_shared

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.vllm_run import engine_args_from_run
from kernelsight.simcore.engine_config import EngineArgs

RUN = Path(__file__).resolve().parents[2] / "shared" / "data" / "e2e" / "llmservingsim_rtx4090_llama31_8b"


@needs_shared(RUN)
def test_the_shared_run_is_simulated_with_what_vllm_resolved():
    meta = json.loads((RUN / "meta.json").read_text())
    args = engine_args_from_run(meta, hardware="rtx-4090")
    assert (args.model, args.tensor_parallel_size, args.max_num_seqs, args.max_num_batched_tokens) == \
        ("meta-llama/Llama-3.1-8B", 1, 256, 2048)
    assert (args.max_model_len, args.block_size, args.enable_prefix_caching, args.seed) == (32768, 16, True, 42)
    assert args.dtype == "bfloat16" and args.async_scheduling and args.max_cudagraph_capture_size == 512
    assert create_engine_config(args).num_gpu_blocks > 0


def test_resolved_values_win_then_the_flags_given_then_the_defaults():
    meta = {
        "engine_kwargs": {"model": "Qwen/Qwen3-8B", "max_num_batched_tokens": 4096, "enforce_eager": True,
                          "tensor_parallel_size": 2},
        "kv_cache": {"block_size": 32, "gpu_memory_utilization": 0.8},
        "resolved_config": {
            "scheduler_config": {"max_num_batched_tokens": 8192, "async_scheduling": False, "policy": "priority"},
            "model_config": {"dtype": "torch.float16", "enforce_eager": None},
            "parallel_config": "<ParallelConfig>",   # not a mapping: ignored
        },
    }
    args = engine_args_from_run(meta, hardware="h100", calibration="c.json")
    assert args.max_num_batched_tokens == 8192 and not args.async_scheduling   # vLLM's resolution
    assert args.scheduling_policy == "priority" and args.dtype == "float16"
    assert args.enforce_eager and args.tensor_parallel_size == 2 and args.model == "Qwen/Qwen3-8B"   # given flags
    assert (args.block_size, args.gpu_memory_utilization) == (32, 0.8)   # the schema's kv_cache block
    assert (args.hardware, args.calibration) == ("h100", "c.json")
    defaults = EngineArgs()
    assert args.max_num_seqs is defaults.max_num_seqs and args.kv_cache_dtype == defaults.kv_cache_dtype
    assert engine_args_from_run({}) == defaults
    with pytest.raises(TypeError, match="not engine arguments: gpu"):
        engine_args_from_run(meta, gpu="h100")
