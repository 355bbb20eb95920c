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
