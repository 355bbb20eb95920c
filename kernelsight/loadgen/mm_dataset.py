"""``--dataset-name random-mm``: vLLM bench's random multimodal workload (random text + synthetic images), for
``bench`` (which sends real images) and ``simulate`` (which builds the same prompts and ``MultimodalItem``s without
encoding a pixel).

vLLM's semantics (``RandomMultiModalDataset``):
- items per request are uniform in ``[floor(n(1-r)), ceil(n(1+r))]`` (n = ``--random-mm-base-items-per-request``,
  r = ``--random-mm-num-mm-items-range-ratio`` in [0, 1]), the maximum clamped to the sum of the per-modality limits
  (``--random-mm-limit-mm-per-prompt``, default ``{"image": 255, "video": 1}``);
- each item's (height, width, frames) is drawn from ``--random-mm-bucket-config`` (probabilities; zero entries
  dropped, the rest renormalised; frames 1 = an image, > 1 a video); a modality at its limit has its buckets removed;
- the chat message is ``[{"type": "text", "text": prompt}, *items]``, in the order drawn: an image as an
  ``image_url`` part, a video (frames > 1) as a ``video_url`` part with an MP4 data URL (vLLM writes an ``mp4v``
  file of random frames at 30 fps with OpenCV).

Differences, on purpose: the images are flat PNGs, the videos MPEG-4 (``mpeg4`` in MP4, 30 fps, written by PyAV)
of flat frames coloured from the request and item index (distinct content, so distinct hashes, as
vLLM's random pixels are), cheap to make and small on the wire; the processor only needs their sizes, frame counts
and rates, which are the bucket's. The text is kernelsight's ``random`` dataset's ids over the tokenizer's text
vocabulary (its special tokens excluded, as vLLM does). ``simulate`` builds the same items from the same numbers
(frames, 30 fps, size) without writing a file.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest, random_dataset

DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 255, "video": 1}
DEFAULT_BUCKET_CONFIG = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}
SYNTHETIC_VIDEO_FPS = 30.0          # vLLM bench's synthetic videos' rate


def parse_bucket_config(text: str) -> dict[tuple[int, int, int], float]:
    """``--random-mm-bucket-config`` as vLLM takes it: a Python dict literal ``{(h, w, frames): p, ...}``."""
    try:
        data = ast.literal_eval(text)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"--random-mm-bucket-config: not a dict literal ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError("--random-mm-bucket-config takes a dict {(height, width, frames): probability, ...}")
    out = {}
    for key, p in data.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v > 0 for v in key)):
            raise ValueError(f"--random-mm-bucket-config: key {key!r} is not (height, width, frames) of positive ints")
        if not isinstance(p, int | float) or p < 0:
            raise ValueError("Bucket config values must be non-negative.")
        out[key] = float(p)
    return out


def parse_limit(text: str) -> dict[str, int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--random-mm-limit-mm-per-prompt takes JSON, e.g. '{{\"image\": 3}}' ({exc.msg})") from None
    if not isinstance(data, dict) or not all(isinstance(v, int) and v >= 0 for v in data.values()):
        raise ValueError("--random-mm-limit-mm-per-prompt takes a JSON object of counts, e.g. '{\"image\": 3}'")
    return {str(k): int(v) for k, v in data.items()}


def _modality(cfg: tuple[int, int, int]) -> str:
    return "image" if cfg[2] == 1 else "video"


def _normalize(bucket: dict[tuple[int, int, int], float]) -> dict[tuple[int, int, int], float]:
    bucket = {k: v for k, v in bucket.items() if v > 0}
    if not bucket:
        raise ValueError("Got invalid bucket config. Bucket config values must be non-zero.")
    total = sum(bucket.values())
    return {k: v / total for k, v in bucket.items()}


def item_count_range(base: int, ratio: float, limits: dict[str, int],
                     bucket: dict[tuple[int, int, int], float]) -> tuple[int, int, dict[str, int]]:
    """(min, max) items per request and the limits of the modalities the buckets use, as vLLM derives them."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("num_mm_items_range_ratio must be in [0, 1].")
    for k in bucket:
        if _modality(k) not in limits:
            raise ValueError(f"Modality {_modality(k)} is not in limit_mm_per_prompt: {list(limits)}")
    used = {_modality(k) for k in _normalize(bucket)}
    limits = {k: v for k, v in limits.items() if k in used}
    if not limits:
        raise ValueError("No valid limits for modalities present in bucket_config.")
    hi = min(sum(limits.values()), math.ceil(base * (1 + ratio)))
    lo = max(0, math.floor(base * (1 - ratio)))
    if lo > hi:
        raise ValueError(f"Min num mm items is greater than max mm items: {lo} > {hi}")
    return lo, hi, limits


def sample_items(rng: np.random.Generator, lo: int, hi: int, bucket: dict[tuple[int, int, int], float],
                 limits: dict[str, int]) -> list[tuple[int, int, int]]:
    """One request's items (height, width, frames), drawn as vLLM's ``get_mm_item_iterator`` draws them."""
    n = int(rng.integers(lo, hi + 1))
    out: list[tuple[int, int, int]] = []
    if n == 0:
        return out
    counts = {_modality(k): 0 for k in bucket}
    probs = _normalize(bucket)
    while len(out) < n:
        keys = list(probs)
        cfg = keys[int(rng.choice(len(keys), p=list(probs.values())))]
        mod = _modality(cfg)
        if counts[mod] < limits[mod]:
            counts[mod] += 1
            out.append(cfg)
        else:
            probs = {k: (0.0 if _modality(k) == mod else v) for k, v in probs.items()}
            if all(v == 0 for v in probs.values()):
                break
            probs = _normalize(probs)
    return out


def _text_vocab(tok: Any, vocab_size: int) -> int:
    """Ids below the tokenizer's first added (special) token: random text never spells a placeholder."""
    inner = getattr(getattr(tok, "_tok", None), "hf", None)
    base = None
    if inner is not None:
        try:
            base = int(inner.get_vocab_size(with_added_tokens=False))
        except (AttributeError, TypeError):
            base = getattr(inner, "vocab_size", None)
    return min(vocab_size, base) if base else vocab_size


def random_mm_dataset(ns: Any, vocab_size: int, tok: Any) -> list[SampleRequest]:
    """The samples: each with its prompt text and ``mm_sizes`` [(width, height), ...] (images only)."""
    limits = ns.random_mm_limit_mm_per_prompt or dict(DEFAULT_LIMIT_MM_PER_PROMPT)
    bucket = ns.random_mm_bucket_config or dict(DEFAULT_BUCKET_CONFIG)
    lo, hi, limits = item_count_range(ns.random_mm_base_items_per_request, ns.random_mm_num_mm_items_range_ratio,
                                      limits, bucket)
    text_vocab = _text_vocab(tok, vocab_size)
    base = random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                          text_vocab, ns.seed, ns.random_prefix_len)
    rng = np.random.default_rng([ns.seed, 0x6D6D])      # its own stream: the text draws stay the random dataset's
    out = []
    for s in base:
        ids = s.prompt_token_ids or []
        text = tok.decode(ids)
        sample = SampleRequest(None, len(ids), s.expected_output_len, prompt=text)
        drawn = sample_items(rng, lo, hi, bucket, limits)
        sample.mm_sizes = [(w, h) for h, w, _ in drawn]
        sample.mm_frames = [f for _, _, f in drawn]
        out.append(sample)
    return out


def synthetic_png(width: int, height: int, key: Sequence[int]) -> bytes:
    """A flat PNG of the given size whose first pixels spell ``key`` (distinct keys, distinct bytes)."""
    from PIL import Image

    img = Image.new("RGB", (width, height), (128, 128, 128))
    raw = b"".join(int(k).to_bytes(8, "little", signed=False) for k in key)
    for p in range(min((len(raw) + 2) // 3, width * height)):
        chunk = raw[3 * p:3 * p + 3].ljust(3, b"\0")
        img.putpixel((p % width, p // width), tuple(chunk))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def synthetic_mp4(width: int, height: int, num_frames: int, key: Sequence[int],
                  fps: float = SYNTHETIC_VIDEO_FPS) -> bytes:
    """An MPEG-4 video in MP4 of the given size and frames, each frame a flat colour drawn from ``key``'s digest
    (deterministic bytes for the same arguments, distinct for distinct keys)."""
    import hashlib

    import av
    import numpy as np

    digest = hashlib.sha256(b"".join(int(k).to_bytes(8, "little", signed=False) for k in key)).digest()
    buf = io.BytesIO()
    # bit-exact and single-threaded: the same arguments give the same bytes
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("mpeg4", rate=int(round(fps)), options={"flags": "+bitexact"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        for i in range(num_frames):
            # each frame a flat colour from the key's digest, on a 16-level grid a lossy codec keeps apart
            rgb = [16 * (digest[(3 * i + c) % len(digest)] % 16) + 8 for c in range(3)]
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), rgb, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def custom_image_dataset(path: str, num_prompts: int, output_len: int, seed: int, *,
                         do_oversample: bool = True) -> list[SampleRequest]:
    """vLLM bench's ``custom_image``: a JSONL of ``{"prompt": str, "image_files": [path or URL, ...]}``; as in vLLM
    only the first image is sent. A local path is sent as an absolute ``file://`` URL (the server needs
    ``--allowed-local-media-path``); its size is read from its header here, so ``simulate`` needs local files."""
    from pathlib import Path

    from kernelsight.loadgen.datasets import jsonl_objects, oversample
    from kernelsight.multimodal import image_info

    base = Path(path).resolve().parent
    out: list[SampleRequest] = []
    for lineno, obj in jsonl_objects(path, str(path)):
        if len(out) >= num_prompts:
            break
        files = obj.get("image_files")
        if not isinstance(obj.get("prompt"), str) or not isinstance(files, list) or not files:
            raise ValueError(f"{path} line {lineno}: expected {{\"prompt\": str, \"image_files\": [path, ...]}}")
        first = str(files[0])
        sample = SampleRequest(None, 0, output_len, prompt=obj["prompt"])
        if first.startswith(("http://", "https://")):
            sample.mm_urls, sample.mm_sizes = [first], None
        else:
            local = Path(first[len("file://"):] if first.startswith("file://") else first)
            local = local if local.is_absolute() else (base / local)
            try:
                info = image_info(local.read_bytes())
            except OSError as exc:
                raise ValueError(f"{path} line {lineno}: cannot read {local} ({exc.strerror or exc})") from None
            sample.mm_urls, sample.mm_sizes = [local.resolve().as_uri()], [(info.width_px, info.height_px)]
        out.append(sample)
    if not out:
        raise ValueError(f"{path}: no request")
    return oversample(out, num_prompts, seed) if do_oversample else out


def image_parts(sample: SampleRequest, seed: int, index: int) -> list[dict[str, Any]]:
    """The chat content parts of a sample's images and videos: its files' URLs, else synthetic PNGs and MP4s as
    data URLs (bench)."""
    if sample.mm_urls:
        return [{"type": "image_url", "image_url": {"url": u}} for u in sample.mm_urls]
    sizes = sample.mm_sizes or []
    frames = sample.mm_frames or [1] * len(sizes)
    out: list[dict[str, Any]] = []
    for j, ((w, h), f) in enumerate(zip(sizes, frames, strict=True)):
        if f > 1:
            out.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(
                synthetic_mp4(w, h, f, (seed, index, j))).decode()}})
        else:
            out.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
                synthetic_png(w, h, (seed, index, j))).decode()}})
    return out


def materialize_for_engine(samples: Sequence[SampleRequest], tok: Any, processor: Any, model: str, seed: int,
                           media_io_kwargs: dict[str, Any] | None = None) -> None:
    """Give each sample the token ids and ``MultimodalItem``s the server would give the engine for it (simulate):
    the chat template over ``[text, image or video, ...]``, encoded, each placeholder expanded by the model's
    processor (a video: ``frames`` at 30 fps of its size, through vLLM's loader's selection under
    ``media_io_kwargs``); the content hash is derived from (seed, request, item) since no bytes exist."""
    from kernelsight.multimodal import VideoInfo, expand_media, loader_frames
    from kernelsight.multimodal.hashing import synthetic_hash
    from kernelsight.multimodal.videos import DEFAULT_NUM_FRAMES

    inner = getattr(tok, "_tok", None)
    if inner is None or not hasattr(inner, "render_chat"):
        raise ValueError("simulate --dataset-name random-mm needs the model's tokenizer and chat template "
                         "(bundled, --tokenizer DIR, or the HF cache)")
    io_kw = (media_io_kwargs or {}).get("video", {})
    num_frames = int(io_kw.get("num_frames", DEFAULT_NUM_FRAMES))
    loader_fps = float(io_kw.get("fps", -1))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    for i, s in enumerate(samples):
        sizes = s.mm_sizes or []
        frames = s.mm_frames or [1] * len(sizes)
        if any(f > 1 for f in frames) and getattr(processor, "video", None) is None:
            raise ValueError(f"{model}'s processor takes no video: drop the video buckets (frames > 1)")
        parts = [{"type": "text", "text": s.prompt or ""}] + [{"type": "video" if f > 1 else "image"}
                                                              for f in frames]
        text = inner.render_chat([{"role": "user", "content": parts}])
        ids = tok.encode(text, add_special_tokens=False)
        if s.mm_urls and any(not u.startswith("file://") for u in s.mm_urls):
            raise ValueError("simulate needs local image files (an http(s) image's size is unknown offline)")
        img_layouts, img_hashes, vid_layouts, vid_hashes = [], [], [], []
        for j, ((w, h), f) in enumerate(zip(sizes, frames, strict=True)):
            if f > 1:
                info = VideoInfo(total_frames=f, fps=SYNTHETIC_VIDEO_FPS, width_px=w, height_px=h)
                vid_layouts.append(processor.video_layout(loader_frames(info, num_frames, loader_fps), encode))
                vid_hashes.append(synthetic_hash(model, "video", f"{seed}:{i}:{j}"))
            else:
                img_layouts.append(processor.layout(w, h))
                img_hashes.append(synthetic_hash(model, "image", f"{seed}:{i}:{j}"))
        if s.mm_urls:         # files: the hash the server computes from their bytes
            from urllib.request import url2pathname

            from kernelsight.multimodal.hashing import mm_content_hash

            img_hashes = [mm_content_hash(model, "image", open(url2pathname(u[len("file://"):]), "rb").read(),
                                          processor.kwargs) for u in s.mm_urls]
        groups = {"image": (processor.placeholder_id, img_layouts, img_hashes)}
        if vid_layouts:
            groups["video"] = (processor.video_placeholder_id, vid_layouts, vid_hashes)
        ids, items = expand_media(ids, groups)
        s.prompt_token_ids = ids
        s.token_array = np.asarray(ids, dtype=np.int64)
        s.prompt_len = len(ids)
        s.mm_items = tuple(items)


MM_DATASETS = ("random-mm", "custom-image")


def prepare_for_engine(ns: Any, samples: Sequence[SampleRequest], model: Any, get_tokenizer: Any) -> None:
    """For an image dataset, give the samples the prompts and items the server would (``simulate``, ``plan``):
    the model's processor from its preprocessor config and ``--mm-processor-kwargs``; nothing for the others."""
    if ns.dataset_name not in MM_DATASETS:
        return
    from kernelsight.multimodal import processor_for_model
    from kernelsight.profiles import load_preprocessor_config, load_video_preprocessor_config

    processor = processor_for_model(model, load_preprocessor_config(ns.model), getattr(ns, "mm_processor_kwargs", None),
                                    load_video_preprocessor_config(ns.model))
    if processor is None:
        raise ValueError(f"{model.name} is not a multimodal model: --dataset-name {ns.dataset_name} needs one")
    materialize_for_engine(samples, get_tokenizer(), processor, model.name, ns.seed,
                           getattr(ns, "media_io_kwargs", None))
