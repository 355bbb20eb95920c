"""A vision encoder's pass as kernels: patch embedding, ViT blocks, the merger that maps patches to LM tokens.

vLLM V1 runs the encoder of every item a step schedules in one batched pass before the language model's forward
(``GPUModelRunner._execute_mm_encoder``): the items' patches are concatenated, the token-parallel layers (GEMMs,
norms, activations) run over all of them, and attention runs per item (varlen FlashAttention over each image's, or
each tile's, or each window's patches), bidirectional. Per ViT block, with tensor-parallel degree T (the encoder
sharded as the LM is, vLLM's default ``mm_encoder_tp_mode="weights"``):

    norm → QKV GEMM → RoPE → attention → proj GEMM → [all-reduce] → norm → MLP (gate_up·act·down, or fc1·act·fc2)
    → [all-reduce]

then the merger: norm, a two-GEMM MLP over groups of merge² patches, into the LM's hidden size (Qwen3-VL adds a
merger per deepstack layer). The all-reduces are priced by the step model (communication lives there). The
encoder runs in bf16 whatever the LM's checkpoint format: quantized VLM checkpoints leave the vision tower out.
"""

from __future__ import annotations

import math

from kernelsight.simcore.kernel_shapes import (
    _ATTN_Q_TILE,
    ACTIVATION,
    ATTN_ENCODER,
    NORM,
    ROPE,
    Kernel,
    elementwise_kernel,
    gemm_kernel,
)
from kernelsight.simcore.multimodal import MultimodalItem, VisionSpec

_ACT_BYTES = 2.0        # bf16 activations and weights
_WEIGHT_BYTES = 2.0


def window_seq_lens(grid_thw: tuple[int, int, int], window_patches: int) -> tuple[int, ...]:
    """Patches per attention window of one item: each frame's patch grid cut into ``window_patches``-square windows
    (Qwen2.5-VL's window attention; edge windows are smaller, as its window index leaves them)."""
    t, h, w = grid_thw
    rows = [min(window_patches, h - r) for r in range(0, h, window_patches)]
    cols = [min(window_patches, w - c) for c in range(0, w, window_patches)]
    return tuple(r * c for _ in range(t) for r in rows for c in cols)


def attention_varlen_kernel(seq_lens: tuple[int, ...], num_heads: int, head_dim: int, count: int) -> Kernel:
    """One varlen bidirectional attention launch per layer over independent sequences of patches.

    FLOPs and bytes are exact for the ragged lengths; the η features take the prefill kernel's layout with the
    sequences' root-mean-square length (the length whose square-law work equals theirs)."""
    n = len(seq_lens)
    squares = float(sum(s * s for s in seq_lens))
    total = float(sum(seq_lens))
    flops = 4.0 * num_heads * head_dim * squares
    bytes_moved = 4.0 * total * num_heads * head_dim * _ACT_BYTES      # Q, K, V read, O written
    tiles = max(sum(math.ceil(s / _ATTN_Q_TILE) for s in seq_lens) * num_heads, 1)
    rms = math.sqrt(squares / n) if n else 0.0
    features = (float(n), rms, rms, float(num_heads), float(num_heads), float(head_dim), _ACT_BYTES, 0.0)
    return Kernel("attention_encoder", ATTN_ENCODER, flops, bytes_moved, tiles, "bf16", features, count)


def encoder_attention_seq_lens(vision: VisionSpec, items: tuple[MultimodalItem, ...]
                               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sequences of the full-attention layers, sequences of the windowed layers; empty when none are windowed)."""
    full = tuple(s for it in items for s in it.encoder_seq_lens)
    if not vision.window_size_px:
        return full, ()
    window_patches = max(vision.window_size_px // vision.patch_size, 1)
    windows: list[int] = []
    for it in items:
        if it.grid_thw[1] and it.grid_thw[2]:
            windows.extend(window_seq_lens(it.grid_thw, window_patches))
        else:                       # no patch grid known: the item attends as one sequence
            windows.extend(it.encoder_seq_lens)
    return full, tuple(windows)


def encoder_kernels(vision: VisionSpec, items: tuple[MultimodalItem, ...], tp: int = 1) -> list[Kernel]:
    """Every kernel of one batched encoder pass over ``items`` on one of ``tp`` ranks (all blocks, the merger)."""
    m = sum(it.num_patches for it in items)
    if m <= 0:
        return []
    h, a, w = vision.hidden_size, _ACT_BYTES, _WEIGHT_BYTES
    heads = max(vision.num_heads // tp, 1)
    d = vision.head_dim
    inter = max(vision.intermediate_size // tp, 1)
    depth = vision.depth
    patch_k = vision.in_channels * vision.temporal_patch_size * vision.patch_size * vision.patch_size
    out = [
        gemm_kernel("vit_patch_embed", m, h, patch_k, "bf16", w, a),
        elementwise_kernel("vit_pos_embed", ROPE, 3.0 * m * h * a, "bf16"),
        elementwise_kernel("vit_norm", NORM, 3.0 * m * h * a, "bf16", 2 * depth),
        gemm_kernel("vit_qkv", m, 3 * heads * d, h, "bf16", w, a, depth),
        elementwise_kernel("vit_rope", ROPE, 2.0 * 2.0 * m * heads * d * a, "bf16", depth),
        gemm_kernel("vit_proj", m, h, heads * d, "bf16", w, a, depth),
    ]
    full, windows = encoder_attention_seq_lens(vision, items)
    n_full = len(vision.full_attention_layers) if windows else depth
    n_full = min(n_full, depth)
    if n_full:
        out.append(attention_varlen_kernel(full, heads, d, n_full))
    if depth - n_full:
        out.append(attention_varlen_kernel(windows, heads, d, depth - n_full))
    if vision.gated_mlp:
        out += [gemm_kernel("vit_gate_up", m, 2 * inter, h, "bf16", w, a, depth),
                elementwise_kernel("vit_act_and_mul", ACTIVATION, 3.0 * m * inter * a, "bf16", depth)]
    else:
        out += [gemm_kernel("vit_fc1", m, inter, h, "bf16", w, a, depth),
                elementwise_kernel("vit_act", ACTIVATION, 2.0 * m * inter * a, "bf16", depth)]
    out.append(gemm_kernel("vit_down", m, h, inter, "bf16", w, a, depth))
    # the merger: groups of merge² patches → one LM token
    mergers = 1 + vision.num_deepstack_mergers
    rows = max(m // vision.patches_per_token, 1)
    merged_in = vision.patches_per_token * h
    merged_hidden = max((vision.merger_hidden_size or merged_in) // tp, 1)
    out += [
        elementwise_kernel("merger_norm", NORM, 3.0 * m * h * a, "bf16", mergers),
        gemm_kernel("merger_fc1", rows, merged_hidden, merged_in, "bf16", w, a, mergers),
        elementwise_kernel("merger_act", ACTIVATION, 2.0 * rows * merged_hidden * a, "bf16", mergers),
        gemm_kernel("merger_fc2", rows, vision.out_hidden_size, merged_hidden, "bf16", w, a, mergers),
    ]
    return out


def encoder_allreduces(vision: VisionSpec, items: tuple[MultimodalItem, ...]) -> tuple[int, float]:
    """(all-reduces per pass, bytes of each) under tensor parallelism: after each block's proj and MLP down
    projection (the merger's, whose message is smaller, is counted as one more of the same size)."""
    m = sum(it.num_patches for it in items)
    return 2 * vision.depth + 1 + vision.num_deepstack_mergers, float(m * vision.hidden_size) * _ACT_BYTES


def encoder_kernel_launches(vision: VisionSpec) -> int:
    """Kernel launches of one eager encoder pass (the step model's launch cost: vLLM runs the encoder eagerly)."""
    return 2 + 9 * vision.depth + 4 * (1 + vision.num_deepstack_mergers)
