"""Images in chat messages, as vLLM's chat front end takes them: the content parts found and counted against
``--limit-mm-per-prompt``, each image fetched (data URL, http(s) under ``VLLM_IMAGE_FETCH_TIMEOUT`` and
``--allowed-media-domains``, ``file://`` under ``--allowed-local-media-path``), its header read for its size, the
model's processor applied, and the rendered prompt's placeholders expanded into the engine's ``MultimodalItem``s.

Every refusal is an ``APIError`` with vLLM's message, raised before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelsight.multimodal import (
    ImageLayout,
    MultimodalProcessor,
    PlaceholderError,
    UnreadableImageError,
    expand_prompt,
    image_info,
)
from kernelsight.multimodal.hashing import mm_content_hash
from kernelsight.multimodal.qwen_vl import ImageSizeError
from kernelsight.server.model.prompts import normalize_messages
from kernelsight.server.options import MediaOptions
from kernelsight.server.wire.errors import APIError, bad_request
from kernelsight.simcore.multimodal import MultimodalItem

DEFAULT_IMAGE_FETCH_TIMEOUT_S = 5.0   # VLLM_IMAGE_FETCH_TIMEOUT's default
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")
OTHER_MEDIA_PART_TYPES = {"video_url": "video", "audio_url": "audio", "input_audio": "audio",
                          "image_embeds": "image_embeds", "video_embeds": "video_embeds",
                          "audio_embeds": "audio_embeds"}
# a template that iterates over a message's content takes content parts (vLLM's "openai" content format);
# others take one string, into which vLLM writes each image's placeholder on a line of its own
_OPENAI_FORMAT = re.compile(r"for\s+\w+\s+in\s+(message|messages\[[^\]]+\]|msg|m)(\[['\"]content['\"]\]|\.content)"
                            r"|content\[['\"]type['\"]\]|content\.type|item\.type")


def takes_content_parts(template: str | None) -> bool:
    return bool(template) and _OPENAI_FORMAT.search(template or "") is not None


@dataclass
class ChatMedia:
    """A chat request's images: the messages to render, and per image its URL (fetched later)."""

    messages: list[dict[str, Any]]
    urls: list[str]


def _image_url(part: dict[str, Any]) -> str:
    kind = part.get("type")
    value = part.get("image_url") if kind in ("image_url", "input_image") else None
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request(f"Invalid {kind} content part: it needs an image URL (image_url.url).", "messages")
    return value


def _not_multimodal(model_name: str) -> APIError:
    return bad_request(f"{model_name} is not a multimodal model")


def _too_many(modality: str, limit: int) -> APIError:
    return bad_request(f"At most {limit} {modality}(s) may be provided in one prompt.", modality)


def split_chat_media(messages: list[dict[str, Any]], processor: MultimodalProcessor | None, model_name: str,
                     options: MediaOptions, template: str | None) -> ChatMedia:
    """Find the image parts of chat messages, in order, counted against the limit, and the messages to render:
    with content parts (``{"type": "image"}`` where an image was) for a template that takes them, else one string
    with the model's placeholder per image on a line before the text, as vLLM writes it."""
    urls: list[str] = []
    out: list[dict[str, Any]] = []
    parts_format = takes_content_parts(template)
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        kinds = [p.get("type") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        if not any(k in IMAGE_PART_TYPES or k in OTHER_MEDIA_PART_TYPES for k in kinds):
            out.append(m)
            continue
        if processor is None:
            raise _not_multimodal(model_name)
        rendered: list[dict[str, Any]] = []
        texts: list[str] = []
        n_images = 0
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                if kind == "image_pil":
                    raise bad_request("image_pil content parts are only accepted by the offline LLM API.",
                                      "messages")
                if len(urls) + 1 > options.limit("image"):
                    raise _too_many("image", options.limit("image"))
                urls.append(_image_url(part))
                n_images += 1
                rendered.append({"type": "image"})
            elif kind in OTHER_MEDIA_PART_TYPES:
                modality = OTHER_MEDIA_PART_TYPES[kind]
                if modality.endswith("_embeds"):
                    raise bad_request(f"You must set `--enable-mm-embeds` to input `{modality}`", modality)
                # only images are simulated: the model's processor here takes no video or audio
                raise _too_many(modality, 0)
            elif isinstance(part, str):
                rendered.append({"type": "text", "text": part})
                texts.append(part)
            elif kind == "text":
                rendered.append({"type": "text", "text": str(part.get("text", ""))})
                texts.append(str(part.get("text", "")))
        if parts_format:
            out.append({**m, "content": rendered})
        else:
            out.append({**m, "content": "\n".join([processor.placeholder_text] * n_images + ["\n".join(texts)])})
    normalized = [m if isinstance(m, dict) and isinstance(m.get("content"), list) and parts_format and
                  any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
                  else normalize_messages([m])[0] for m in out]
    return ChatMedia(normalized, urls)


def fetch_timeout_s() -> float:
    try:
        return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", DEFAULT_IMAGE_FETCH_TIMEOUT_S))
    except ValueError:
        return DEFAULT_IMAGE_FETCH_TIMEOUT_S


def _data_url(url: str) -> bytes:
    spec, sep, data = url[len("data:"):].partition(",")
    if not sep or ";" not in spec:
        raise bad_request("Invalid data URL: expected data:<media type>;base64,<data>.")
    _, data_type = spec.split(";", 1)
    if data_type != "base64":
        raise bad_request("Only base64 data URLs are supported for now.")
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"Invalid base64 data in the image URL: {exc}") from None


def _file_url(url: str, options: MediaOptions) -> bytes:
    if not options.allowed_local_media_path:
        raise bad_request("Cannot load local files without `--allowed-local-media-path`.")
    allowed = Path(options.allowed_local_media_path).resolve()
    spec = urllib.parse.urlparse(url)
    path = Path(urllib.request.url2pathname((spec.netloc or "") + (spec.path or "")))
    if allowed not in path.resolve().parents:
        raise bad_request(f"The file path {path} must be a subpath of `--allowed-local-media-path {allowed}`.")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise bad_request(f"Cannot read {path}: {exc.strerror or exc}") from None


def _http_get(url: str, timeout_s: float) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "kernelsight (vLLM-compatible media fetch)"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:     # noqa: S310 - http(s) only, checked above
        return resp.read()


async def load_image_bytes(url: str, options: MediaOptions) -> bytes:
    """The bytes of one image URL, fetched as vLLM's MediaConnector does."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url)
    if scheme.startswith("http"):
        host = urllib.parse.urlparse(url).hostname
        if options.allowed_media_domains and host not in options.allowed_media_domains:
            raise bad_request(f"The URL must be from one of the allowed domains: {list(options.allowed_media_domains)}"
                              f". Input URL domain: {host}")
        try:
            return await asyncio.to_thread(_http_get, url, fetch_timeout_s())
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise bad_request(f"Failed to fetch image from {url}: {reason}") from None
    if scheme == "file":
        return await asyncio.to_thread(_file_url, url, options)
    raise bad_request("The URL must be either a HTTP, data or file URL.")


async def image_layouts(urls: list[str], processor: MultimodalProcessor, options: MediaOptions
                        ) -> tuple[list[ImageLayout], list[str]]:
    """Each image fetched, its header read and the processor applied; with its content hash."""
    datas = await asyncio.gather(*(load_image_bytes(u, options) for u in urls))
    layouts, hashes = [], []
    for data in datas:
        try:
            info = image_info(data)
            layouts.append(processor.layout(info.width_px, info.height_px))
        except UnreadableImageError as exc:
            raise bad_request(f"Failed to load image: {exc}", "image") from None
        except ImageSizeError as exc:
            raise bad_request(str(exc), "image") from None
        hashes.append(mm_content_hash(processor.model, "image", data, processor.kwargs))
    return layouts, hashes


def expand_images(ids: list[int], processor: MultimodalProcessor, layouts: list[ImageLayout], hashes: list[str]
                  ) -> tuple[list[int], tuple[MultimodalItem, ...]]:
    """The prompt with each image's placeholder expanded, and the engine's items."""
    try:
        out, items = expand_prompt(ids, processor.placeholder_id, layouts, hashes)
    except PlaceholderError as exc:
        raise bad_request(str(exc)) from None
    return out, tuple(items)
