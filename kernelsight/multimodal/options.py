"""The multimodal flags' values as vLLM takes them (``--limit-mm-per-prompt``, ``--mm-processor-kwargs``): shared by
``serve`` and ``simulate``."""

from __future__ import annotations

import json
from typing import Any


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt`` as vLLM takes it: JSON ``{"image": 4, "video": 0}`` (a modality's value may also be
    ``{"count": N, ...}``)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--limit-mm-per-prompt takes JSON, e.g. '{{\"image\": 4}}' ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("--limit-mm-per-prompt takes a JSON object, e.g. '{\"image\": 4}'")
    out = {}
    for modality, value in data.items():
        count = value.get("count") if isinstance(value, dict) else value
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} needs a count >= 0, got {value!r}")
        out[str(modality)] = count
    return out


def parse_mm_processor_kwargs(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--mm-processor-kwargs takes JSON, e.g. '{{\"max_pixels\": 802816}}' ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("--mm-processor-kwargs takes a JSON object")
    return data


def parse_media_io_kwargs(text: str) -> dict[str, dict[str, Any]]:
    """``--media-io-kwargs`` as vLLM takes it: JSON ``{"video": {"num_frames": 16}}``; the video loader's keys
    ``num_frames`` (int, -1: all) and ``fps`` (number, <= 0: no cap) are checked, others kept as given."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--media-io-kwargs takes JSON, e.g. '{{\"video\": {{\"num_frames\": 16}}}}' ({exc.msg})"
                         ) from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError("--media-io-kwargs takes a JSON object of objects, e.g. '{\"video\": {\"num_frames\": 16}}'")
    video = data.get("video", {})
    nf = video.get("num_frames", -1)
    if isinstance(nf, bool) or not isinstance(nf, int) or (nf < 1 and nf != -1):
        raise ValueError(f"--media-io-kwargs: video.num_frames must be a positive integer or -1, got {nf!r}")
    fps = video.get("fps", -1)
    if isinstance(fps, bool) or not isinstance(fps, int | float):
        raise ValueError(f"--media-io-kwargs: video.fps must be a number, got {fps!r}")
    return {str(k): dict(v) for k, v in data.items()}
