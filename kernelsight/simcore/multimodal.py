"""Multimodal inputs as the engine sees them: the vision tower's shape (``VisionSpec``) and each image or video in a
prompt (``MultimodalItem``), already expanded into placeholder tokens by the model's processor.

The processor (pixels -> patches -> placeholder tokens) runs before the engine, where the request is tokenized; the
engine only needs counts: how many prompt positions an item occupies, and how many patches its encoder pass covers.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    encoder_seq_lens: tuple[int, ...]  # patches per independent encoder sequence (one per image, per tile, or per
                                       # video frame group); () for an item given as embeddings: no encoder pass
    mm_hash: str                    # content hash: keys the encoder cache and the prefix cache's block hashes
    grid_thw: tuple[int, int, int] = (1, 0, 0)  # (frames, rows, cols) in patches, for models with a patch grid

    @property
    def num_patches(self) -> int:
        """Patches the encoder runs over for this item (its compute and encoder-cache size)."""
        return sum(self.encoder_seq_lens)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def check_mm_items(items: Sequence[MultimodalItem], prompt_len: int) -> None:
    """Items must lie in the prompt, in order, without overlapping (ValueError otherwise)."""
    end = 0
    for it in items:
        if it.num_tokens < 1 or (it.encoder_seq_lens and min(it.encoder_seq_lens) < 1):
            raise ValueError(f"multimodal item {it.mm_hash!r} has no tokens or no patches")
        if it.offset < end:
            raise ValueError(f"multimodal item {it.mm_hash!r} at {it.offset} overlaps or precedes the one before")
        end = it.offset + it.num_tokens
        if end > prompt_len:
            raise ValueError(f"multimodal item {it.mm_hash!r} ends at {end}, past the prompt's {prompt_len} tokens")


def _vision_int(vc: dict, key: str, default: int | None = None) -> int:
    value = vc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"key {key!r} must be a positive integer, got {value!r}")
    return value


def _text_hidden_size(config: dict) -> int | None:
    text = config.get("text_config")
    value = (text if isinstance(text, dict) else config).get("hidden_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def vision_spec_from_hf_config(config: dict) -> VisionSpec | None:
    """The vision tower of a HF ``config.json`` (its ``vision_config``), or None for a text-only model. Pure.

    Known: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Llama 4. A config whose architecture takes images in a
    way not modelled here raises ValueError rather than being served as text-only.
    """
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else ""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    if arch in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                "Qwen3VLMoeForConditionalGeneration"):
        qwen3 = arch != "Qwen2_5_VLForConditionalGeneration"
        patch = _vision_int(vc, "patch_size", 16 if qwen3 else 14)
        window = None if qwen3 else vc.get("window_size")
        return VisionSpec(
            kind="qwen3_vl" if qwen3 else "qwen2_5_vl",
            depth=_vision_int(vc, "depth"),
            hidden_size=_vision_int(vc, "hidden_size"),
            num_heads=_vision_int(vc, "num_heads"),
            intermediate_size=_vision_int(vc, "intermediate_size"),
            gated_mlp=not qwen3,              # Qwen2.5-VL: SwiGLU gate/up/down; Qwen3-VL: linear_fc1/fc2
            patch_size=patch,
            temporal_patch_size=_vision_int(vc, "temporal_patch_size", 2),
            merge_size=_vision_int(vc, "spatial_merge_size", 2),
            out_hidden_size=_vision_int(vc, "out_hidden_size", _text_hidden_size(config)),
            in_channels=_vision_int(vc, "in_channels", 3),
            window_size_px=int(window) if isinstance(window, int) and window > 0 else None,
            full_attention_layers=tuple(int(i) for i in vc.get("fullatt_block_indexes") or ()) if not qwen3 else (),
            num_deepstack_mergers=len(vc.get("deepstack_visual_indexes") or ()) if qwen3 else 0,
        )
    if arch == "Qwen2VLForConditionalGeneration":
        embed = _vision_int(vc, "embed_dim")
        return VisionSpec(
            kind="qwen2_vl", depth=_vision_int(vc, "depth"), hidden_size=embed,
            num_heads=_vision_int(vc, "num_heads"),
            intermediate_size=int(embed * float(vc.get("mlp_ratio", 4))), gated_mlp=False,
            patch_size=_vision_int(vc, "patch_size", 14), temporal_patch_size=_vision_int(vc, "temporal_patch_size", 2),
            merge_size=_vision_int(vc, "spatial_merge_size", 2),
            out_hidden_size=_vision_int(vc, "hidden_size", _text_hidden_size(config)),
            in_channels=_vision_int(vc, "in_channels", 3))
    if arch == "Llama4ForConditionalGeneration":
        ratio = float(vc.get("pixel_shuffle_ratio", 0.5))
        if not 0 < ratio <= 1 or round(1 / ratio) != 1 / ratio:
            raise ValueError(f"pixel_shuffle_ratio {ratio!r} is not 1/n")
        return VisionSpec(
            kind="llama4", depth=_vision_int(vc, "num_hidden_layers"), hidden_size=_vision_int(vc, "hidden_size"),
            num_heads=_vision_int(vc, "num_attention_heads"), intermediate_size=_vision_int(vc, "intermediate_size"),
            gated_mlp=False, patch_size=_vision_int(vc, "patch_size"), temporal_patch_size=1,
            merge_size=round(1 / ratio),        # pixel shuffle 0.5: 2x2 patches per LM token
            out_hidden_size=_vision_int({"h": _text_hidden_size(config)}, "h"),
            in_channels=_vision_int(vc, "num_channels", 3),
            # the pixel-shuffle MLP's width (projector_output_dim), then the projector to the LM's width
            merger_hidden_size=_vision_int(vc, "projector_output_dim", 4096))
    raise ValueError(f"{arch or 'this architecture'}'s vision tower is not modelled")
