"""An image's format and size from its encoded bytes: only the header is read (Pillow opens lazily and decodes
pixels only on demand), so a 20-megapixel JPEG costs microseconds, not a decode."""

from __future__ import annotations

import io
from dataclasses import dataclass


class UnreadableImageError(ValueError):
    """The bytes are not an image Pillow can identify (or its header is broken)."""


@dataclass(frozen=True, slots=True)
class ImageInfo:
    width_px: int
    height_px: int
    format: str          # "PNG", "JPEG", "WEBP", ...


def image_info(data: bytes) -> ImageInfo:
    """Width, height and format from the image header. Raises UnreadableImageError."""
    from PIL import Image, UnidentifiedImageError  # the server/loadgen extras' dependency: simulate never needs it

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            fmt = img.format or "unknown"
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise UnreadableImageError(f"cannot identify image file ({exc.__class__.__name__})") from None
    if width <= 0 or height <= 0:
        raise UnreadableImageError(f"image has no pixels ({width}x{height})")
    return ImageInfo(width_px=int(width), height_px=int(height), format=fmt)
