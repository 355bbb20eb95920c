"""Images, videos and image embeddings in chat messages, as vLLM's chat front end takes them: the content parts found
and counted against ``--limit-mm-per-prompt``, each item fetched (data URL, http(s) under ``VLLM_IMAGE_FETCH_TIMEOUT``
/ ``VLLM_VIDEO_FETCH_TIMEOUT`` and ``--allowed-media-domains``, ``file://`` under ``--allowed-local-media-path``), its
header read for its size (a video's container for its frames and rate, under ``--media-io-kwargs``), the model's
processor applied, and the rendered prompt's placeholders expanded into the engine's ``MultimodalItem``s.
``image_embeds`` parts (with ``--enable-mm-embeds``) are ``torch.save`` payloads read without unpickling: their
rows are the item's tokens, and the encoder does not run for them.

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
    UnreadableVideoError,
    VideoSizeError,
    expand_media,
    expand_prompt,
    image_info,
    loader_frames,
    video_info,
)
from kernelsight.multimodal.hashing import mm_content_hash
from kernelsight.multimodal.qwen_vl import ImageSizeError
from kernelsight.multimodal.torch_payload import TensorRecord, UnsafePayloadError, read_torch_payload
from kernelsight.multimodal.videos import DEFAULT_NUM_FRAMES
from kernelsight.server.model.prompts import normalize_messages
from kernelsight.server.options import MediaOptions
from kernelsight.server.wire.errors import APIError, bad_request
from kernelsight.simcore.multimodal import MultimodalItem

DEFAULT_IMAGE_FETCH_TIMEOUT_S = 5.0   # VLLM_IMAGE_FETCH_TIMEOUT's default
DEFAULT_VIDEO_FETCH_TIMEOUT_S = 30.0  # VLLM_VIDEO_FETCH_TIMEOUT's default
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
    """A chat request's media: the messages to render, and per item (in prompt order) its modality and its URL
    (fetched later) or, for ``image_embeds``, its payload."""

    messages: list[dict[str, Any]]
    refs: list[tuple[str, Any]]

    @property
    def urls(self) -> list[Any]:
        """Every item's reference (truthy when the request carries media)."""
        return [r for _, r in self.refs]


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
    refs: list[tuple[str, Any]] = []
    counts = {"image": 0, "video": 0}
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
        placeholders: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES or kind == "image_embeds":
                if kind == "image_pil":
                    raise bad_request("image_pil content parts are only accepted by the offline LLM API.",
                                      "messages")
                if kind == "image_embeds":
                    if not options.enable_mm_embeds:
                        raise bad_request("You must set `--enable-mm-embeds` to input `image_embeds`",
                                          "image_embeds")
                    ref: tuple[str, Any] = ("image_embeds", _embeds_value(part))
                else:
                    ref = ("image", _image_url(part))
                if counts["image"] + 1 > options.limit("image"):
                    raise _too_many("image", options.limit("image"))
                counts["image"] += 1
                refs.append(ref)
                rendered.append({"type": "image"})
                placeholders.append(processor.placeholder_text)
            elif kind == "video_url":
                if processor.video is None:
                    raise _too_many("video", 0)      # a model whose processor takes no video: its limit is 0
                if counts["video"] + 1 > options.limit("video"):
                    raise _too_many("video", options.limit("video"))
                counts["video"] += 1
                refs.append(("video", _video_url(part)))
                rendered.append({"type": "video"})
                placeholders.append(processor.video_placeholder_text)
            elif kind in OTHER_MEDIA_PART_TYPES:
                modality = OTHER_MEDIA_PART_TYPES[kind]
                if modality.endswith("_embeds"):
                    raise bad_request(f"You must set `--enable-mm-embeds` to input `{modality}`", modality)
                # audio: no bundled model's processor takes it
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
            out.append({**m, "content": "\n".join(placeholders + ["\n".join(texts)])})
    normalized = [m if isinstance(m, dict) and isinstance(m.get("content"), list) and parts_format and
                  any(isinstance(p, dict) and p.get("type") in ("image", "video") for p in m["content"])
                  else normalize_messages([m])[0] for m in out]
    return ChatMedia(normalized, refs)


def _video_url(part: dict[str, Any]) -> str:
    value = part.get("video_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request("Invalid video_url content part: it needs a video URL (video_url.url).", "messages")
    return value


def _embeds_value(part: dict[str, Any]) -> str | dict[str, str]:
    value = part.get("image_embeds")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        return value
    raise bad_request("Invalid image_embeds content part: it needs a base64 torch.save payload, or an object of "
                      "them (e.g. image_embeds and image_grid_thw).", "image_embeds")


def fetch_timeout_s(modality: str = "image") -> float:
    name, default = (("VLLM_VIDEO_FETCH_TIMEOUT", DEFAULT_VIDEO_FETCH_TIMEOUT_S) if modality == "video"
                     else ("VLLM_IMAGE_FETCH_TIMEOUT", DEFAULT_IMAGE_FETCH_TIMEOUT_S))
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


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


async def load_image_bytes(url: str, options: MediaOptions, modality: str = "image") -> bytes:
    """The bytes of one image (or video) URL, fetched as vLLM's MediaConnector does."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url)
    if scheme.startswith("http"):
        host = urllib.parse.urlparse(url).hostname
        if options.allowed_media_domains and host not in options.allowed_media_domains:
            raise bad_request(f"The URL must be from one of the allowed domains: {list(options.allowed_media_domains)}"
                              f". Input URL domain: {host}")
        try:
            return await asyncio.to_thread(_http_get, url, fetch_timeout_s(modality))
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise bad_request(f"Failed to fetch {modality} from {url}: {reason}") from None
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


def _video_frames_jpeg(data_url: str) -> tuple[int, bytes] | None:
    """vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...``: the frames' count and the first frame's bytes."""
    spec, sep, data = data_url[len("data:"):].partition(",")
    if not sep or spec.lower() != "video/jpeg;base64":
        return None
    frames = data.split(",")
    try:
        first = base64.b64decode(frames[0], validate=False)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"Invalid base64 data in the video URL: {exc}") from None
    return len(frames), first


async def video_layouts(urls: list[str], processor: MultimodalProcessor, options: MediaOptions,
                        encode: Any) -> tuple[list[ImageLayout], list[str]]:
    """Each video fetched, its container read (frames, rate, size), vLLM's loader's frame selection under
    ``--media-io-kwargs`` and the model's video processor applied; with its content hash."""
    io_kw = options.media_io_kwargs.get("video", {})
    num_frames = int(io_kw.get("num_frames", DEFAULT_NUM_FRAMES))
    fps = float(io_kw.get("fps", -1))
    layouts, hashes = [], []
    for url in urls:
        jpeg = _video_frames_jpeg(url) if url[:5].lower() == "data:" else None
        try:
            if jpeg is not None:
                # JPEG frames: every frame is kept and no metadata comes with them (no rate: Qwen3-VL refuses)
                n, first = jpeg
                if processor.video is not None and processor.video.qwen3:
                    raise bad_request("video/jpeg frames carry no video metadata (fps, frame indices), which "
                                      f"{processor.model}'s processor needs; send an encoded video", "video")
                try:
                    size = image_info(first)
                except UnreadableImageError as exc:
                    raise bad_request(f"Failed to load video: {exc}", "video") from None
                from kernelsight.multimodal import LoadedVideo, VideoInfo

                info = VideoInfo(total_frames=n, fps=0.0, width_px=size.width_px, height_px=size.height_px)
                loaded = LoadedVideo(info, tuple(range(n)), do_sample_frames=False)
                data = url.encode()
            else:
                data = await load_image_bytes(url, options, "video")
                info = await asyncio.to_thread(video_info, data)
                loaded = loader_frames(info, num_frames, fps)
            layouts.append(processor.video_layout(loaded, encode))
        except UnreadableVideoError as exc:
            raise bad_request(f"Failed to load video: {exc}", "video") from None
        except VideoSizeError as exc:
            raise bad_request(str(exc), "video") from None
        hashes.append(mm_content_hash(processor.model, "video", data, {**processor.kwargs, **io_kw}))
    return layouts, hashes


def _tensor(value: str, what: str) -> tuple[Any, TensorRecord]:
    try:
        payload = read_torch_payload(base64.b64decode(value, validate=False))
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"Failed to load {what}: {exc}", "image_embeds") from None
    if not isinstance(payload.obj, TensorRecord):
        raise bad_request(f"Failed to load {what}: expected one tensor", "image_embeds")
    return payload, payload.obj


def embeds_layouts(values: list[str | dict[str, str]], processor: MultimodalProcessor
                   ) -> tuple[list[ImageLayout], list[str]]:
    """Each ``image_embeds`` item's layout: its tensor's rows are its placeholder tokens (a Qwen-VL model also needs
    ``image_grid_thw``, whose merged patches must match them); no encoder patches."""
    layouts, hashes = [], []
    for value in values:
        fields = value if isinstance(value, dict) else {"image_embeds": value}
        if "image_embeds" not in fields:
            raise bad_request("image_embeds needs the embeddings under the key 'image_embeds'", "image_embeds")
        _, emb = _tensor(fields["image_embeds"], "image_embeds")
        shape = emb.shape[1:] if len(emb.shape) == 3 and emb.shape[0] == 1 else emb.shape
        if len(shape) != 2 or shape[0] < 1:
            raise bad_request(f"image_embeds must be a 2-D tensor (tokens, hidden), got shape {list(emb.shape)}",
                              "image_embeds")
        rows = shape[0]
        grid = (1, 0, 0)
        if processor.qwen is not None:
            if "image_grid_thw" not in fields:
                raise bad_request(f"{processor.model} takes image_embeds with their image_grid_thw "
                                  "({'image_embeds': ..., 'image_grid_thw': ...})", "image_embeds")
            payload, g = _tensor(fields["image_grid_thw"], "image_grid_thw")
            try:
                vals = payload.int_values(g)
            except UnsafePayloadError as exc:
                raise bad_request(f"Failed to load image_grid_thw: {exc}", "image_embeds") from None
            if len(vals) != 3 or min(vals) < 1:
                raise bad_request(f"image_grid_thw must hold one (t, h, w), got {vals}", "image_embeds")
            grid = (vals[0], vals[1], vals[2])
            want = vals[0] * vals[1] * vals[2] // (processor.qwen.merge_size ** 2)
            if want != rows:
                raise bad_request(f"image_embeds has {rows} rows but image_grid_thw {vals} gives {want} tokens",
                                  "image_embeds")
        repl = (processor.placeholder_id,) * rows if processor.qwen is not None else None
        if repl is None:
            raise bad_request(f"{processor.model}: image_embeds are not supported for this model", "image_embeds")
        layouts.append(ImageLayout(0, 0, repl, (), grid))
        blob = "\0".join(f"{k}={fields[k]}" for k in sorted(fields)).encode()
        hashes.append(mm_content_hash(processor.model, "image_embeds", blob))
    return layouts, hashes


async def expand_chat_media(ids: list[int], media: ChatMedia, processor: MultimodalProcessor, options: MediaOptions,
                            encode: Any) -> tuple[list[int], tuple[MultimodalItem, ...]]:
    """The rendered prompt with every image's, embedding's and video's placeholder expanded, and the engine's
    items in prompt order (``encode``: text to ids, for Qwen3-VL's video timestamps)."""
    image_refs = [(m, r) for m, r in media.refs if m in ("image", "image_embeds")]
    video_urls = [r for m, r in media.refs if m == "video"]
    img_layouts: list[ImageLayout] = [None] * len(image_refs)  # type: ignore[list-item]
    img_hashes: list[str] = [""] * len(image_refs)
    plain = [i for i, (m, _) in enumerate(image_refs) if m == "image"]
    if plain:
        lays, hs = await image_layouts([image_refs[i][1] for i in plain], processor, options)
        for i, lay, h in zip(plain, lays, hs, strict=True):
            img_layouts[i], img_hashes[i] = lay, h
    embeds = [i for i, (m, _) in enumerate(image_refs) if m == "image_embeds"]
    if embeds:
        lays, hs = embeds_layouts([image_refs[i][1] for i in embeds], processor)
        for i, lay, h in zip(embeds, lays, hs, strict=True):
            img_layouts[i], img_hashes[i] = lay, h
    groups: dict[str, tuple[int, list[ImageLayout], list[str]]] = {}
    if image_refs:
        groups["image"] = (processor.placeholder_id, img_layouts, img_hashes)
    if video_urls:
        v_layouts, v_hashes = await video_layouts(video_urls, processor, options, encode)
        groups["video"] = (processor.video_placeholder_id, v_layouts, v_hashes)
    try:
        out, items = expand_media(ids, groups)
    except PlaceholderError as exc:
        raise bad_request(str(exc)) from None
    return out, tuple(items)


def expand_images(ids: list[int], processor: MultimodalProcessor, layouts: list[ImageLayout], hashes: list[str]
                  ) -> tuple[list[int], tuple[MultimodalItem, ...]]:
    """The prompt with each image's placeholder expanded, and the engine's items."""
    try:
        out, items = expand_prompt(ids, processor.placeholder_id, layouts, hashes)
    except PlaceholderError as exc:
        raise bad_request(str(exc)) from None
    return out, tuple(items)
