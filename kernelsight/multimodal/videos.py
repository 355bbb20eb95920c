"""A video's frame count, frame rate and size from its container, and the frames vLLM's video loader keeps.

vLLM reads a video with OpenCV (``VLLM_VIDEO_LOADER_BACKEND=opencv``): ``CAP_PROP_FRAME_COUNT`` (FFmpeg's
``nb_frames``, else duration x fps rounded), ``CAP_PROP_FPS`` (the stream's average frame rate, else its guessed
rate), width and height. We read the same fields with PyAV (FFmpeg's demuxer, the library OpenCV's FFmpeg backend
wraps) and decode no frame: the token count needs nothing else.

``loader_frames`` is vLLM's ``OpenCVVideoBackend.load_bytes`` selection: at most ``num_frames`` (the
``--media-io-kwargs`` ``video.num_frames``, 32 by default) and, with ``fps`` > 0, at most floor(duration x fps),
never fewer than one; all frames when that is all of them, else ``linspace(0, total-1, n)`` truncated to ints. Its
metadata says ``do_sample_frames`` exactly when every frame was kept (the HF processor may then sample again).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

DEFAULT_NUM_FRAMES = 32          # vLLM's VideoMediaIO default


class UnreadableVideoError(ValueError):
    """The bytes are not a video FFmpeg can open, or it has no video stream or no frames."""


@dataclass(frozen=True, slots=True)
class VideoInfo:
    total_frames: int
    fps: float                    # the source's frame rate (0 when the container gives none)
    width_px: int
    height_px: int

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.fps if self.fps > 0 else 0.0


def video_info(data: bytes) -> VideoInfo:
    """Frame count, frame rate and size from the container's headers (no frame decoded)."""
    try:
        import av  # the server/loadgen extras' dependency: simulate never needs it
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise UnreadableVideoError("reading videos needs PyAV (pip install 'kernelsight[server]')") from exc
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise UnreadableVideoError("Could not open video stream (no video stream)")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            total = int(stream.frames or 0)
            if total <= 0:
                # OpenCV's fallback: the duration times the rate, rounded
                if stream.duration is not None and stream.time_base is not None:
                    duration_s = float(stream.duration * stream.time_base)
                elif container.duration is not None:
                    duration_s = container.duration / 1e6
                else:
                    duration_s = 0.0
                total = int(math.floor(duration_s * fps + 0.5))
    except UnreadableVideoError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as exc:
        raise UnreadableVideoError(f"Could not open video stream ({exc.__class__.__name__})") from None
    if width <= 0 or height <= 0:
        raise UnreadableVideoError(f"Invalid video frame size: width={width}, height={height}")
    if total <= 0:
        raise UnreadableVideoError("the video has no frames")
    return VideoInfo(total_frames=total, fps=fps, width_px=width, height_px=height)


@dataclass(frozen=True, slots=True)
class LoadedVideo:
    """What vLLM's loader hands the processor: the kept frames' indices and the source's metadata."""

    info: VideoInfo
    frame_indices: tuple[int, ...]
    do_sample_frames: bool        # every frame kept: the HF processor may sample them itself

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices)


def loader_frames(info: VideoInfo, num_frames: int = DEFAULT_NUM_FRAMES, fps: float = -1) -> LoadedVideo:
    """The frames vLLM's OpenCV loader keeps (``num_frames`` -1: no cap; ``fps`` <= 0: no rate cap)."""
    total = info.total_frames
    n = total
    if num_frames > 0:
        n = min(num_frames, total)
    if fps > 0:
        n = min(n, math.floor(info.duration_s * fps))
    n = max(1, n)
    if n == total:
        idx = tuple(range(total))
    else:
        idx = tuple(int(i) for i in np.linspace(0, total - 1, n, dtype=int))
    return LoadedVideo(info=info, frame_indices=idx, do_sample_frames=n == total)
