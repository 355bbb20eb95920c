"""Images to placeholder tokens and ``MultimodalItem``s, per model family, and their expansion into a prompt.

A rendered prompt holds one placeholder token per image (Qwen-VL: ``<|image_pad|>`` between ``<|vision_start|>`` and
``<|vision_end|>``; Llama 4: ``<|image|>``). ``expand_prompt`` replaces each, in order, with the image's full
replacement, as vLLM's prompt updates do, and records where it landed: ``MultimodalItem.offset``/``num_tokens`` are
vLLM's ``PlaceholderRange`` (the whole replacement; for Llama 4 its tile separators and ``<|image|>`` are inside the
range but not embedded: ``num_embeds`` counts the encoder-output positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelsight.multimodal.llama4 import Llama4Rules, Llama4TokenIds, llama4_replacement
from kernelsight.multimodal.qwen_video import QwenVideoRules, VideoSizeError, qwen_video_rules
from kernelsight.multimodal.qwen_vl import ImageSizeError, QwenVLRules, qwen_vl_rules
from kernelsight.multimodal.videos import LoadedVideo
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.multimodal import MultimodalItem

__all__ = ["ImageLayout", "ImageSizeError", "MultimodalProcessor", "PlaceholderError", "VideoSizeError",
           "expand_media", "expand_prompt", "processor_for_model"]

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
    replaces_around: bool = False         # the replacement also takes the placeholder's <|vision_start|> before it
                                          # and <|vision_end|> after it (Qwen3-VL's videos)

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
    video: QwenVideoRules | None = None    # the video processor (None: the model takes no video)

    @property
    def video_placeholder_id(self) -> int:
        return QWEN_VIDEO_PAD_ID

    @property
    def video_placeholder_text(self) -> str:
        return "<|vision_start|><|video_pad|><|vision_end|>"

    def video_layout(self, video: LoadedVideo, encode: Callable[[str], list[int]]) -> ImageLayout:
        """One video after the processor (``encode``: the tokenizer, for Qwen3-VL's timestamp text). Raises
        VideoSizeError for a video the processor refuses."""
        rules = self.video
        if rules is None:
            raise VideoSizeError(f"{self.model} takes no video")
        indices = rules.frame_indices(video)
        grid = rules.grid_thw(len(indices), video.info.width_px, video.info.height_px)
        per_group = rules.tokens_per_frame_group(grid)
        # the ViT's sequences are the temporal patches (vLLM's cu_seqlens repeat h*w t times), windows within each
        patches = (grid[1] * grid[2],) * grid[0]
        if not rules.qwen3:
            return ImageLayout(video.info.width_px, video.info.height_px, (QWEN_VIDEO_PAD_ID,) * (grid[0] * per_group),
                               patches, grid)
        repl: list[int] = []
        for t in rules.timestamps_s(indices, video.info.fps):
            repl += encode(f"<{t:.1f} seconds>")
            repl += [QWEN_VISION_START_ID] + [QWEN_VIDEO_PAD_ID] * per_group + [QWEN_VISION_END_ID]
        return ImageLayout(video.info.width_px, video.info.height_px, tuple(repl), patches, grid,
                           num_embeds=grid[0] * per_group, replaces_around=True)

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
                        kwargs: dict[str, Any] | None = None,
                        video_preprocessor: dict[str, Any] | None = None) -> MultimodalProcessor | None:
    """The image processor of a model that takes images; None for a text-only model. ``kwargs`` are
    ``--mm-processor-kwargs`` (e.g. ``{"max_pixels": 802816}``); ValueError for ones that do not apply."""
    vision = spec.vision
    if vision is None:
        return None
    pre = dict(preprocessor or {})
    kw = dict(kwargs or {})
    if vision.kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        video_keys = {"fps", "do_sample_frames", "min_frames", "max_frames"}
        unknown = sorted(set(kw) - {"min_pixels", "max_pixels", "size", "do_resize"} - video_keys)
        if unknown:
            raise ValueError(f"unsupported mm_processor_kwargs for {spec.name}: {', '.join(unknown)}")
        image_kw = {k: v for k, v in kw.items() if k not in video_keys}
        rules = qwen_vl_rules(pre, vision.patch_size, vision.merge_size, vision.temporal_patch_size, image_kw)
        video = qwen_video_rules(vision.kind, pre, video_preprocessor, vision.patch_size, vision.merge_size,
                                 vision.temporal_patch_size, {k: v for k, v in kw.items() if k != "do_resize"})
        return MultimodalProcessor(model=spec.name, kind=vision.kind, placeholder_id=QWEN_IMAGE_PAD_ID,
                                   placeholder_text="<|vision_start|><|image_pad|><|vision_end|>", qwen=rules,
                                   kwargs=kw, video=video)
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
    return expand_media(ids, {modality: (placeholder_id, layouts, hashes)})


def expand_media(ids: list[int], groups: dict[str, tuple[int, list[ImageLayout], list[str]]]
                 ) -> tuple[list[int], list[MultimodalItem]]:
    """Replace each modality's placeholders (``{modality: (placeholder id, layouts, hashes)}``), in prompt order,
    by the items' replacements; the items in prompt order with their ranges."""
    by_id: dict[int, str] = {}
    for modality, (pid, layouts, _) in groups.items():
        found = sum(1 for t in ids if t == pid)
        if found != len(layouts):
            raise PlaceholderError(f"Expected there to be {len(layouts)} prompt placeholders corresponding to "
                                   f"{len(layouts)} {modality} items, but instead found {found} prompt placeholders! "
                                   f"Make sure the prompt has one placeholder per {modality} (the chat template "
                                   f"writes them for {modality} content parts).")
        by_id[pid] = modality
    out: list[int] = []
    items: list[MultimodalItem] = []
    taken = dict.fromkeys(groups, 0)
    i = 0
    while i < len(ids):
        t = ids[i]
        modality = by_id.get(t)
        if modality is None:
            out.append(t)
            i += 1
            continue
        _, layouts, hashes = groups[modality]
        k = taken[modality]
        lay = layouts[k]
        if lay.replaces_around:
            if not out or out[-1] != QWEN_VISION_START_ID or i + 1 >= len(ids) or ids[i + 1] != QWEN_VISION_END_ID:
                raise PlaceholderError(f"Failed to apply prompt replacement for mm_items['{modality}'][{k}]: the "
                                       f"prompt needs <|vision_start|><|video_pad|><|vision_end|> for it.")
            out.pop()
            i += 1                                   # the <|vision_end|>: the replacement ends with its own
        items.append(MultimodalItem(modality=modality, offset=len(out), num_tokens=lay.num_tokens,
                                    encoder_seq_lens=lay.encoder_seq_lens, mm_hash=hashes[k],
                                    grid_thw=lay.grid_thw))
        out.extend(lay.replacement)
        taken[modality] = k + 1
        i += 1
    return out, items
