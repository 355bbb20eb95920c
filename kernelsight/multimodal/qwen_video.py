"""Qwen2.5-VL and Qwen3-VL videos: which frames the HF video processor keeps, its resize, the patch grid and, for
Qwen3-VL, the per-frame-group timestamps written into the prompt.

The rules are HF transformers' ``Qwen2VLVideoProcessor`` (Qwen2/2.5-VL) and ``Qwen3VLVideoProcessor``, as vLLM's
processors call them with the frames its loader kept (``videos.loader_frames``):
- Qwen2.5-VL: no frame sampling (``do_sample_frames`` False by default): every loaded frame is kept; each frame is
  smart-resized alone (``qwen_vl.smart_resize``: 28-px factor, the video processor's min/max pixels; a checkpoint
  without a ``video_preprocessor_config.json`` takes its image config's ``min_pixels``/``max_pixels``);
- Qwen3-VL: when the loader kept every frame (its metadata's ``do_sample_frames``, unless ``mm_processor_kwargs``
  says otherwise) the processor samples ``int(total / src_fps x fps)`` frames (fps 2 by default), clamped to
  [min_frames 4, max_frames 768] and to the total, at ``linspace(0, total-1, n).round()``; the resize budget is over
  the whole clip (``t_bar x h x w`` against ``longest_edge``), with t_bar the frames rounded to the temporal patch;
  fewer frames than the temporal patch (2) is refused;
- frames are padded with the last one to a multiple of ``temporal_patch_size`` (2): grid_t = ceil(frames / 2);
- tokens = grid_t x grid_h x grid_w / merge^2. Qwen2.5-VL writes them as ``<|video_pad|>`` x N (the template's
  ``<|vision_start|>``/``<|vision_end|>`` around them); Qwen3-VL replaces the template's
  ``<|vision_start|><|video_pad|><|vision_end|>`` with, per temporal patch, ``<{t:.1f} seconds>`` (tokenized) then
  ``<|vision_start|>`` + ``<|video_pad|>`` x (grid_h x grid_w / merge^2) + ``<|vision_end|>``; t is the mean of the
  group's first and last frame's time (frame index / source fps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelsight.multimodal.qwen_vl import ImageSizeError, smart_resize
from kernelsight.multimodal.videos import LoadedVideo


class VideoSizeError(ValueError):
    """The processor refuses the video (too few frames, a shape it cannot resize)."""


def smart_resize_clip(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                      min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video resize: (height, width) with the pixel budget over the whole clip; frames smaller than the
    factor are scaled up first."""
    if num_frames < temporal_factor:
        raise VideoSizeError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    try:
        return smart_resize(height, width, factor, min_pixels, max_pixels, num_frames, temporal_factor)
    except ImageSizeError as exc:
        raise VideoSizeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class QwenVideoRules:
    """The video processor's settings: its config, with the served and per-request processor kwargs on top."""

    qwen3: bool
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool | None = None    # None: Qwen3-VL follows the loader's metadata; Qwen2.5-VL never samples

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def frame_indices(self, video: LoadedVideo) -> tuple[int, ...]:
        """The source frame indices the processor keeps."""
        sample = self.do_sample_frames if self.do_sample_frames is not None else video.do_sample_frames
        if not self.qwen3 or not sample:
            return video.frame_indices
        total = video.info.total_frames
        src_fps = video.info.fps if video.info.fps > 0 else 24.0   # HF's default when metadata has no fps
        n = int(total / src_fps * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, total)
        return tuple(int(i) for i in np.linspace(0, total - 1, n).round().astype(int))

    def grid_thw(self, num_frames: int, width_px: int, height_px: int) -> tuple[int, int, int]:
        """(temporal patches, rows, cols) in patches of a clip of ``num_frames`` kept frames."""
        if self.qwen3:
            h, w = smart_resize_clip(num_frames, height_px, width_px, self.temporal_patch_size, self.factor,
                                     self.min_pixels, self.max_pixels)
        else:
            try:
                h, w = smart_resize(height_px, width_px, self.factor, self.min_pixels, self.max_pixels)
            except ImageSizeError as exc:
                raise VideoSizeError(str(exc)) from None
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t, h // self.patch_size, w // self.patch_size

    def tokens_per_frame_group(self, grid: tuple[int, int, int]) -> int:
        return grid[1] * grid[2] // (self.merge_size * self.merge_size)

    def timestamps_s(self, indices: tuple[int, ...], src_fps: float) -> list[float]:
        """Qwen3-VL: each temporal patch's time, the mean of its first and last frame's (indices padded)."""
        idx = list(indices)
        m = self.temporal_patch_size
        if len(idx) % m:
            idx += [idx[-1]] * (m - len(idx) % m)
        fps = src_fps if src_fps > 0 else 24.0
        ts = [i / fps for i in idx]
        return [(ts[i] + ts[i + m - 1]) / 2 for i in range(0, len(ts), m)]


def _pixels(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return int(value)


def qwen_video_rules(kind: str, image_config: dict[str, Any], video_config: dict[str, Any] | None,
                     patch_size: int, merge_size: int, temporal_patch_size: int,
                     kwargs: dict[str, Any] | None = None) -> QwenVideoRules:
    """The rules from the checkpoint's ``video_preprocessor_config.json`` (else, as transformers falls back, its
    image ``preprocessor_config.json``), the class defaults under both, and processor kwargs on top."""
    qwen3 = kind == "qwen3_vl"
    kw = dict(kwargs or {})
    if qwen3:
        defaults = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}, "fps": 2}
    else:
        defaults = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}}
    cfg = {**defaults, **(video_config if video_config is not None else image_config)}
    merged = {**cfg, **kw}
    size = merged.get("size") if isinstance(merged.get("size"), dict) else {}
    min_px = size.get("shortest_edge")
    max_px = size.get("longest_edge")
    # min_pixels / max_pixels override size (Qwen2VLVideoProcessor's backward compatibility; kwargs the same way)
    if merged.get("min_pixels") is not None:
        min_px = merged["min_pixels"]
    if merged.get("max_pixels") is not None:
        max_px = merged["max_pixels"]
    min_px, max_px = _pixels(min_px, "min_pixels"), _pixels(max_px, "max_pixels")
    if min_px > max_px:
        raise ValueError(f"min_pixels ({min_px}) must not exceed max_pixels ({max_px})")
    fps = merged.get("fps", 2)
    if isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0:
        raise ValueError(f"fps must be a positive number, got {fps!r}")
    dsf = kw.get("do_sample_frames")
    if dsf is not None and not isinstance(dsf, bool):
        raise ValueError(f"do_sample_frames must be a boolean, got {dsf!r}")
    frames = {k: merged.get(k, d) for k, d in (("min_frames", 4), ("max_frames", 768))}
    for k, v in frames.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    return QwenVideoRules(qwen3=qwen3, patch_size=int(merged.get("patch_size", patch_size)),
                          merge_size=int(merged.get("merge_size", merge_size)),
                          temporal_patch_size=int(merged.get("temporal_patch_size", temporal_patch_size)),
                          min_pixels=min_px, max_pixels=max_px, fps=float(fps),
                          min_frames=frames["min_frames"], max_frames=frames["max_frames"], do_sample_frames=dsf)
