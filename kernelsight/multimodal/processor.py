"""Images to placeholder tokens and ``MultimodalItem``s, per model family, and their expansion into a prompt.

A rendered prompt holds one placeholder token per image (Qwen-VL: ``<|image_pad|>`` between ``<|vision_start|>`` and
``<|vision_end|>``; Llama 4: ``<|image|>``). ``expand_prompt`` replaces each, in order, with the image's full
replacement, as vLLM's prompt updates do, and records where it landed: ``MultimodalItem.offset``/``num_tokens`` are
vLLM's ``PlaceholderRange`` (the whole replacement; for Llama 4 its tile separators and ``<|image|>`` are inside the
range but not embedded: ``num_embeds`` counts the encoder-output positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernelsight.multimodal.llama4 import Llama4Rules, Llama4TokenIds, llama4_replacement
from kernelsight.multimodal.qwen_vl import ImageSizeError, QwenVLRules, qwen_vl_rules
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.multimodal import MultimodalItem

__all__ = ["ImageLayout", "ImageSizeError", "MultimodalProcessor", "PlaceholderError", "expand_prompt",
           "processor_for_model"]

# Qwen-VL's special tokens (the Qwen2 vocabulary's added tokens, the same ids for Qwen2-VL, 2.5-VL and 3-VL)
QWEN_VISION_START_ID = 151652
QWEN_VISION_END_ID = 151653
QWEN_IMAGE_PAD_ID = 151655
QWEN_VIDEO_PAD_ID = 151656


class PlaceholderError(ValueError):
    """The prompt's placeholders do not match the images sent (vLLM: a failed prompt update, 400)."""


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """One image after the model's processor: what the prompt gets and what the encoder runs over."""

    width_px: int
    height_px: int
    replacement: tuple[int, ...]          # the token ids that replace the image's placeholder
    encoder_seq_lens: tuple[int, ...]     # patches per encoder sequence (one per Qwen image, one per Llama-4 tile)
    grid_thw: tuple[int, int, int] = (1, 0, 0)
    num_embeds: int = 0                   # positions the encoder output fills (0: all of the replacement)

    @property
    def num_tokens(self) -> int:
        return len(self.replacement)


@dataclass(frozen=True)
class MultimodalProcessor:
    """A served model's image processor: its placeholder and how one image of a given size expands."""

    model: str
    kind: str                              # VisionSpec.kind
    placeholder_id: int                    # the one token per image in a rendered prompt
    placeholder_text: str                  # what vLLM writes for an image into a string-content chat template
    qwen: QwenVLRules | None = None
    llama4: Llama4Rules | None = None
    llama4_ids: Llama4TokenIds = field(default_factory=Llama4TokenIds)
    kwargs: dict[str, Any] = field(default_factory=dict)   # the --mm-processor-kwargs in force (part of the hash)

    def layout(self, width_px: int, height_px: int) -> ImageLayout:
        """Raises ImageSizeError for a shape the processor refuses."""
        if self.qwen is not None:
            grid = self.qwen.grid_thw(width_px, height_px)
            n = self.qwen.num_tokens(grid)
            return ImageLayout(width_px, height_px, (QWEN_IMAGE_PAD_ID,) * n, (grid[0] * grid[1] * grid[2],), grid)
        assert self.llama4 is not None
        rows, cols = self.llama4.tiles(width_px, height_px)
        repl = llama4_replacement(rows, cols, self.llama4.tokens_per_tile, self.llama4_ids)
        tiles = self.llama4.num_encoder_tiles(rows, cols)
        return ImageLayout(width_px, height_px, tuple(repl), (self.llama4.patches_per_tile,) * tiles,
                           num_embeds=tiles * self.llama4.tokens_per_tile)


def processor_for_model(spec: ModelSpec, preprocessor: dict[str, Any] | None,
                        kwargs: dict[str, Any] | None = None) -> MultimodalProcessor | None:
    """The image processor of a model that takes images; None for a text-only model. ``kwargs`` are
    ``--mm-processor-kwargs`` (e.g. ``{"max_pixels": 802816}``); ValueError for ones that do not apply."""
    vision = spec.vision
    if vision is None:
        return None
    pre = dict(preprocessor or {})
    kw = dict(kwargs or {})
    if vision.kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        unknown = sorted(set(kw) - {"min_pixels", "max_pixels", "size", "fps", "do_resize"})
        if unknown:
            raise ValueError(f"unsupported mm_processor_kwargs for {spec.name}: {', '.join(unknown)}")
        rules = qwen_vl_rules(pre, vision.patch_size, vision.merge_size, vision.temporal_patch_size, kw)
        return MultimodalProcessor(model=spec.name, kind=vision.kind, placeholder_id=QWEN_IMAGE_PAD_ID,
                                   placeholder_text="<|vision_start|><|image_pad|><|vision_end|>", qwen=rules,
                                   kwargs=kw)
    if vision.kind == "llama4":
        unknown = sorted(set(kw) - {"max_patches", "resize_to_max_canvas"})
        if unknown:
            raise ValueError(f"unsupported mm_processor_kwargs for {spec.name}: {', '.join(unknown)}")
        merged = {**pre, **kw}
        size = merged.get("size") if isinstance(merged.get("size"), dict) else {}
        rules = Llama4Rules(tile_px=int(size.get("height", 336)), patch_size=vision.patch_size,
                            max_tiles=int(merged.get("max_patches", 16)),
                            resize_to_max_canvas=bool(merged.get("resize_to_max_canvas", False)),
                            merge_size=vision.merge_size)
        return MultimodalProcessor(model=spec.name, kind="llama4", placeholder_id=Llama4TokenIds().image,
                                   placeholder_text="<|image|>", llama4=rules, kwargs=kw)
    raise ValueError(f"{spec.name}: no image processor for vision kind {vision.kind!r}")


def expand_prompt(ids: list[int], placeholder_id: int, layouts: list[ImageLayout], hashes: list[str],
                  modality: str = "image") -> tuple[list[int], list[MultimodalItem]]:
    """Replace the prompt's placeholders, in order, by the images' replacements; the items with their ranges."""
    found = sum(1 for t in ids if t == placeholder_id)
    if found != len(layouts):
        raise PlaceholderError(f"Expected there to be {len(layouts)} prompt placeholders corresponding to "
                               f"{len(layouts)} {modality} items, but instead found {found} prompt placeholders! "
                               f"Make sure the prompt has one placeholder per {modality} (the chat template writes "
                               f"them for {modality} content parts).")
    out: list[int] = []
    items: list[MultimodalItem] = []
    k = 0
    for t in ids:
        if t != placeholder_id:
            out.append(t)
            continue
        lay = layouts[k]
        items.append(MultimodalItem(modality=modality, offset=len(out), num_tokens=lay.num_tokens,
                                    encoder_seq_lens=lay.encoder_seq_lens, mm_hash=hashes[k],
                                    grid_thw=lay.grid_thw))
        out.extend(lay.replacement)
        k += 1
    return out, items
