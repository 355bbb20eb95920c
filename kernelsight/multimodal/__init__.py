"""Multimodal inputs before the engine: an image's size from its header (``images``), the model's own resize and
patch rules (``qwen_vl``, ``llama4``), the placeholder expansion into the prompt and the ``MultimodalItem``s handed to
the engine (``processor``), and the content hash that keys them (``hashing``).

Importable without the web stack: the server, ``bench`` and ``simulate`` share it.
"""

from kernelsight.multimodal.images import ImageInfo, UnreadableImageError, image_info
from kernelsight.multimodal.processor import (
    ImageLayout,
    MultimodalProcessor,
    PlaceholderError,
    VideoSizeError,
    expand_media,
    expand_prompt,
    processor_for_model,
)
from kernelsight.multimodal.videos import LoadedVideo, UnreadableVideoError, VideoInfo, loader_frames, video_info

__all__ = [
    "ImageInfo",
    "ImageLayout",
    "MultimodalProcessor",
    "PlaceholderError",
    "UnreadableImageError",
    "UnreadableVideoError",
    "VideoInfo",
    "LoadedVideo",
    "VideoSizeError",
    "expand_media",
    "expand_prompt",
    "loader_frames",
    "video_info",
    "image_info",
    "processor_for_model",
]
