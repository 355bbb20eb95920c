"""A gRPC Generate's multimodal inputs (``mm_inputs``, ``extra_mm_inputs``) as the engine's ``MultimodalItem``s.

A gateway in front of vLLM's gRPC engine service runs the model's processor itself: the prompt's token ids already
hold the expanded placeholders, and each ``MultimodalInputs`` message carries the preprocessed pixels, where each
item's placeholders are (``mm_placeholders``), the items' content hashes (``mm_hashes``) and the model's grid tensors
(``image_grid_thw`` / ``video_grid_thw`` for the Qwen VL family). Timing needs only the counts: an item's placeholder
range and the patches its encoder pass covers (grid t·h·w, or the placeholder count times the merge factor when the
gateway sends no grid). Pixels are hashed only when the gateway sends no hashes."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from kernelsight.simcore.multimodal import MultimodalItem, VisionSpec

_DTYPES = {"int64": "<i8", "int32": "<i4", "uint32": "<u4", "uint64": "<u8"}


def _grid_rows(mm: Any, key: str) -> list[tuple[int, int, int]] | None:
    tensors = mm.model_specific_tensors
    if key not in tensors:
        return None
    t = tensors[key]
    if t.WhichOneof("payload") != "inline":
        raise ValueError(f"mm_inputs.model_specific_tensors[{key!r}]: only inline tensors are read")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"mm_inputs.model_specific_tensors[{key!r}]: dtype {t.dtype!r} is not an integer type")
    arr = np.frombuffer(t.inline, dtype=dtype)
    if arr.size % 3:
        raise ValueError(f"mm_inputs.model_specific_tensors[{key!r}]: expected rows of (t, h, w)")
    return [tuple(int(x) for x in row) for row in arr.reshape(-1, 3)]   # type: ignore[misc]


def mm_items_of(messages: list[Any], vision: VisionSpec) -> tuple[MultimodalItem, ...]:
    """The items of every ``MultimodalInputs`` message, in prompt order (ValueError on one the engine cannot take)."""
    items: list[MultimodalItem] = []
    for mm in messages:
        video = mm.modality == 2          # smg.grpc.common.Modality: 0 unset (image), 1 image, 2 video
        modality = "video" if video else "image"
        grids = _grid_rows(mm, "video_grid_thw" if video else "image_grid_thw")
        places = list(mm.mm_placeholders)
        if not places:
            raise ValueError("mm_inputs without mm_placeholders: where each item's tokens are must be given")
        if grids is not None and len(grids) != len(places):
            raise ValueError(f"mm_inputs: {len(grids)} grid rows for {len(places)} placeholders")
        hashes = list(mm.mm_hashes)
        if hashes and len(hashes) != len(places):
            raise ValueError(f"mm_inputs: {len(hashes)} mm_hashes for {len(places)} placeholders")
        pixels = mm.pixel_values.inline if mm.HasField("pixel_values") else b""
        for i, ph in enumerate(places):
            if grids is not None:
                grid = grids[i]
                # one ViT sequence per temporal patch, as vLLM's cu_seqlens (h*w repeated t times; an image: t = 1)
                seqs = (grid[1] * grid[2],) * grid[0]
            else:
                grid, seqs = (1, 0, 0), (ph.length * vision.patches_per_token,)
            key = hashes[i] if hashes else hashlib.sha256(pixels + i.to_bytes(4, "little")).hexdigest()
            items.append(MultimodalItem(modality, ph.offset, ph.length, seqs, key, grid))
    items.sort(key=lambda it: it.offset)
    return tuple(items)
