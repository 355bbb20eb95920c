"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL images: smart resize to a multiple of patch_size*merge_size, then one grid of
patches per image, merged merge_size x merge_size into language-model tokens.

The rules are HF transformers' ``Qwen2VLImageProcessor`` (``smart_resize``), which vLLM runs for these models:
- each side is rounded to the nearest multiple of ``factor = patch_size * merge_size`` (28 px for 2.5-VL, 32 px for
  3-VL), with Python's round (half to even);
- if that exceeds ``max_pixels``, both sides are scaled down by ``sqrt(h*w / max_pixels)`` and floored to the factor
  (never below one factor); if it is under ``min_pixels``, scaled up by ``sqrt(min_pixels / (h*w))`` and ceiled;
- an aspect ratio over 200 is refused;
- an image is one temporal patch (the frame repeated ``temporal_patch_size`` times), so grid_t = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_ASPECT_RATIO = 200


class ImageSizeError(ValueError):
    """The processor refuses the image's shape (vLLM answers 400 with the processor's message)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, num_frames: int = 1,
                 temporal_factor: int = 1) -> tuple[int, int]:
    """(height, width) after the Qwen-VL resize; with ``num_frames`` > 1 the pixel budget is over the whole clip
    (Qwen3-VL's video resize: frames rounded to the temporal patch count against it)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
                             f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenVLRules:
    """What the token count depends on: the preprocessor config, with the served --mm-processor-kwargs on top."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid_thw(self, width_px: int, height_px: int) -> tuple[int, int, int]:
        """(frames, rows, cols) in patches of one image."""
        h, w = smart_resize(height_px, width_px, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)


def _pixels(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return int(value)


def qwen_vl_rules(preprocessor: dict[str, Any], patch_size: int, merge_size: int, temporal_patch_size: int,
                  kwargs: dict[str, Any] | None = None) -> QwenVLRules:
    """The rules from a Qwen-VL preprocessor_config.json (``min_pixels``/``max_pixels`` or the newer
    ``size: {shortest_edge, longest_edge}``, both pixel counts) and processor kwargs, which override it the way HF's
    processor takes them (``min_pixels``, ``max_pixels`` or ``size``)."""
    merged = {**preprocessor, **(kwargs or {})}
    size = merged.get("size") if isinstance(merged.get("size"), dict) else {}
    min_px = merged.get("min_pixels") if "min_pixels" in (kwargs or {}) else size.get("shortest_edge",
                                                                                        merged.get("min_pixels"))
    max_px = merged.get("max_pixels") if "max_pixels" in (kwargs or {}) else size.get("longest_edge",
                                                                                        merged.get("max_pixels"))
    # HF's defaults when the config names neither: 56*56 and 28*28*1280
    min_px = _pixels(min_px if min_px is not None else 56 * 56, "min_pixels")
    max_px = _pixels(max_px if max_px is not None else 28 * 28 * 1280, "max_pixels")
    if min_px > max_px:
        raise ValueError(f"min_pixels ({min_px}) must not exceed max_pixels ({max_px})")
    return QwenVLRules(patch_size=int(merged.get("patch_size", patch_size)),
                       merge_size=int(merged.get("merge_size", merge_size)),
                       temporal_patch_size=int(merged.get("temporal_patch_size", temporal_patch_size)),
                       min_pixels=min_px, max_pixels=max_px)
