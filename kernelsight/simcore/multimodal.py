"""Multimodal inputs as the engine sees them: the vision tower's shape (``VisionSpec``) and each image or video in a
prompt (``MultimodalItem``), already expanded into placeholder tokens by the model's processor.

The processor (pixels -> patches -> placeholder tokens) runs before the engine, where the request is tokenized; the
engine only needs counts: how many prompt positions an item occupies, and how many patches its encoder pass covers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """A ViT-style vision encoder plus the merger/projector that maps its patches to language-model tokens."""

    kind: str                       # the processor family: "qwen2_5_vl", "qwen3_vl", "llama4", ...
    depth: int                      # ViT blocks
    hidden_size: int                # ViT width
    num_heads: int
    intermediate_size: int          # ViT MLP width
    gated_mlp: bool                 # SwiGLU-style gate+up (Qwen2.5-VL) or a plain two-GEMM MLP (Qwen3-VL, Llama 4)
    patch_size: int                 # pixels per patch side
    temporal_patch_size: int        # frames per patch (2 for Qwen's video-capable patch embed, 1 otherwise)
    merge_size: int                 # patches per LM token along each side (Qwen spatial merge, Llama 4 pixel shuffle)
    out_hidden_size: int            # the language model's hidden size: the projector's output width
    in_channels: int = 3
    window_size_px: int | None = None            # windowed attention (Qwen2.5-VL: 112 px windows) ...
    full_attention_layers: tuple[int, ...] = ()  # ... except these blocks, which attend the whole image
    num_deepstack_mergers: int = 0               # Qwen3-VL: extra mergers feeding intermediate features to the LM
    merger_hidden_size: int = 0                  # the merger MLP's inner width (0: merge² × hidden_size, as Qwen's)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_token(self) -> int:
        return self.merge_size * self.merge_size

    @property
    def num_params(self) -> int:
        """Parameters of the tower and its merger(s) (bf16 in memory whatever the LM's format)."""
        h, inter = self.hidden_size, self.intermediate_size
        block = 4 * h * h + (3 if self.gated_mlp else 2) * h * inter + 4 * h
        merged_in = self.patches_per_token * h
        merged_hidden = self.merger_hidden_size or merged_in
        merger = merged_in * merged_hidden + merged_hidden * self.out_hidden_size + 2 * h
        patch = self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size * h
        return patch + self.depth * block + (1 + self.num_deepstack_mergers) * merger


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """One image or video in a prompt, after its processor expanded it into placeholder tokens."""

    modality: str                   # "image" | "video" | "audio"
    offset: int                     # prompt index of its first placeholder token
    num_tokens: int                 # prompt positions it occupies (what the LM prefills for it)
    encoder_seq_lens: tuple[int, ...]  # patches per independent encoder sequence (one per image, or per tile)
    mm_hash: str                    # content hash: keys the encoder cache and the prefix cache's block hashes
    grid_thw: tuple[int, int, int] = (1, 0, 0)  # (frames, rows, cols) in patches, for models with a patch grid

    @property
    def num_patches(self) -> int:
        """Patches the encoder runs over for this item (its compute and encoder-cache size)."""
        return sum(self.encoder_seq_lens)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def check_mm_items(items: tuple[MultimodalItem, ...], prompt_len: int) -> None:
    """Items must lie in the prompt, in order, without overlapping (ValueError otherwise)."""
    end = 0
    for it in items:
        if it.num_tokens < 1 or not it.encoder_seq_lens or min(it.encoder_seq_lens) < 1:
            raise ValueError(f"multimodal item {it.mm_hash!r} has no tokens or no patches")
        if it.offset < end:
            raise ValueError(f"multimodal item {it.mm_hash!r} at {it.offset} overlaps or precedes the one before")
        end = it.offset + it.num_tokens
        if end > prompt_len:
            raise ValueError(f"multimodal item {it.mm_hash!r} ends at {end}, past the prompt's {prompt_len} tokens")
