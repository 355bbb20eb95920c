"""Device memory: weights, KV bytes per token and the number of KV blocks, sized the way vLLM does.

vLLM profiles one dummy forward pass of ``max_num_batched_tokens`` tokens plus a dummy sampler run of
``max_num_seqs`` rows, and gives the KV cache what is left of ``total · gpu_memory_utilization`` after
weights, that activation peak and non-torch allocations (cuBLAS workspaces, NCCL buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernelsight.simcore.expert_formats import expert_weight_bytes_per_param
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.hybrid_kv_cache import hybrid_layout, max_request_kv_blocks
from kernelsight.simcore.mla import mla_attention_params
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision

GIB = 1024**3
#: Non-torch allocations seen by vLLM's profiler on one GPU (CUDA/cuBLAS workspaces, allocator slack).
NON_TORCH_BYTES = 512 * 1024**2
#: Extra NCCL/custom all-reduce buffers per rank when tensor parallel.
TP_COMM_BUFFER_BYTES = 384 * 1024**2
#: The dummy sampler run holds logits, probabilities and a sorted copy in fp32.
SAMPLER_FP32_COPIES = 3


class InsufficientMemoryError(ValueError):
    """The model (or one max-length request's KV cache) does not fit, worded like vLLM's error."""


def param_counts(model: ModelSpec) -> tuple[int, int]:
    """(parameters in linear layers that quantization applies to, other parameters)."""
    h, d = model.hidden_size, model.head_dim
    if model.mla is not None:
        attn = mla_attention_params(model)
    else:
        attn = h * (model.num_attention_heads + 2 * model.num_kv_heads) * d + model.num_attention_heads * d * h
    n_moe = model.num_moe_layers if model.is_moe else 0
    dense_mlp = 3 * h * model.intermediate_size
    moe_mlp = model.num_experts * 3 * h * model.moe_intermediate_size + 3 * h * model.shared_expert_intermediate_size
    linear = model.num_layers * attn + (model.num_layers - n_moe) * dense_mlp + n_moe * moe_mlp
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    other = embed + model.num_layers * 2 * h + h + n_moe * h * model.num_experts   # norms + routers
    if model.vision is not None:
        other += model.vision.num_params      # the vision tower stays bf16 in quantized checkpoints
    return linear, other


def weight_bytes_per_rank(model: ModelSpec, precision: Precision, tp: int, ep_data_parallel: int = 1) -> float:
    """Weights one GPU holds: everything is sharded T ways except the (tiny) norms. With expert parallelism
    across ``ep_data_parallel`` data-parallel ranks the routed experts are further split that many ways (each
    rank keeps its own copy of everything else)."""
    linear, other = param_counts(model)
    w = precision.weight_bytes_per_param
    experts = model.num_moe_layers * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size
    w_expert = expert_weight_bytes_per_param(model, precision)   # MXFP4 experts: 4.25 bits
    total = ((linear - experts) * w + experts * w_expert + other * 2.0) / tp
    if ep_data_parallel > 1 and model.is_moe:
        total -= experts * w_expert / tp * (1.0 - 1.0 / ep_data_parallel)
    return total


def kv_bytes_per_token(model: ModelSpec, precision: Precision, tp: int) -> float:
    """KV-cache bytes per token on one rank (K and V, every layer).

    MLA caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer, whole on every
    tensor-parallel rank (vLLM replicates it: the latent has no heads to split)."""
    if model.mla is not None:
        return model.num_layers * model.mla.latent_dim * precision.kv_bytes_per_element
    kv_heads = max(model.num_kv_heads // tp, 1)
    return model.num_layers * kv_heads * model.head_dim * 2 * precision.kv_bytes_per_element


def activation_peak_bytes(model: ModelSpec, precision: Precision, tp: int, max_num_batched_tokens: int,
                          max_num_seqs: int) -> float:
    """Peak transient memory of vLLM's profiling run (largest MLP intermediates + sampler logits)."""
    inter = (model.moe_intermediate_size * model.experts_per_token if model.is_moe
             else model.intermediate_size) // tp
    qkv = (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim // tp
    per_token = (2 * inter + inter + 4 * model.hidden_size + qkv) * precision.act_bytes
    sampler = max_num_seqs * model.vocab_size * 4.0 * SAMPLER_FP32_COPIES
    return max_num_batched_tokens * per_token + sampler


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    total_bytes: int
    requested_bytes: int
    weight_bytes: float
    activation_bytes: float
    non_torch_bytes: float
    kv_cache_bytes: float
    block_bytes: float
    num_gpu_blocks: int
    #: blocks one max_model_len request holds at most (0: ceil(max_model_len / block_size), one group)
    request_blocks: int = 0

    def max_concurrency(self, max_model_len: int, block_size: int) -> float:
        if self.request_blocks:     # hybrid allocator: the sliding-window group holds only the window
            return self.num_gpu_blocks / self.request_blocks
        return self.num_gpu_blocks * block_size / max_model_len


def plan_memory(model: ModelSpec, hw: HardwareSpec, precision: Precision, *, tp: int, block_size: int,
                gpu_memory_utilization: float, max_model_len: int, max_num_batched_tokens: int,
                max_num_seqs: int, num_gpu_blocks_override: int | None = None,
                ep_data_parallel: int = 1, draft_weight_bytes: float = 0.0,
                draft_kv_bytes_per_token: float = 0.0) -> MemoryPlan:
    """``draft_*``: a speculative drafter's weights and KV bytes per token on this GPU (0 without one)."""
    total = hw.mem_capacity_bytes
    requested = math.ceil(total * gpu_memory_utilization)
    weights = weight_bytes_per_rank(model, precision, tp, ep_data_parallel) + draft_weight_bytes
    if weights >= requested:
        raise InsufficientMemoryError(
            f"Model weights take {weights / GIB:.2f} GiB per GPU, more than the {requested / GIB:.2f} GiB "
            f"allowed by gpu_memory_utilization={gpu_memory_utilization} on {hw.name} "
            f"({total / GIB:.2f} GiB). Try increasing `tensor_parallel_size` or `gpu_memory_utilization`, "
            "or use quantization."
        )
    activation = activation_peak_bytes(model, precision, tp, max_num_batched_tokens, max_num_seqs)
    non_torch = NON_TORCH_BYTES + (TP_COMM_BUFFER_BYTES if tp * ep_data_parallel > 1 else 0)
    kv_bytes = requested - weights - activation - non_torch
    per_token = kv_bytes_per_token(model, precision, tp)
    block_bytes = block_size * (per_token + draft_kv_bytes_per_token)
    needed_blocks = math.ceil(max_model_len / block_size)
    if model.is_hybrid_attention:
        # vLLM's hybrid allocator: a block is a page in each layer of one group (half the layers for gpt-oss), and
        # a request holds a table per group, the sliding-window one only the window's blocks
        layout = hybrid_layout(model)
        block_bytes = layout.block_bytes(block_size, per_token / model.num_layers)
        needed_blocks = max_request_kv_blocks(layout, block_size, max_model_len, max_num_batched_tokens)
    if kv_bytes <= 0:
        raise InsufficientMemoryError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine."
        )
    blocks = int(kv_bytes // block_bytes) if num_gpu_blocks_override is None else num_gpu_blocks_override
    needed_bytes = needed_blocks * block_bytes
    if blocks * block_bytes < needed_bytes:
        est_len = blocks * block_size
        raise InsufficientMemoryError(
            f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed_bytes / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({blocks * block_bytes / GIB:.2f} GiB). Based on the available memory, the estimated "
            f"maximum model length is {est_len}. Try increasing `gpu_memory_utilization` or decreasing "
            "`max_model_len` when initializing the engine."
        )
    return MemoryPlan(total, requested, weights, activation, non_torch, kv_bytes, block_bytes, blocks,
                      needed_blocks if model.is_hybrid_attention else 0)
