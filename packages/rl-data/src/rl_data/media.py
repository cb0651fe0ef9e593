"""Image loading and video frame sampling (PyAV), in the form Qwen-VL processors accept.

Videos: :func:`sample_video` returns a :class:`VideoFrames` whose ``frames`` is a uint8 array
``[N, H, W, 3]`` and whose :meth:`VideoFrames.metadata` is the dict transformers builds its
``VideoMetadata`` from. Pass both, and tell the processor not to resample::

    video = sample_video("clip.mp4", fps=2.0, max_frames=64, max_pixels=448 * 448)
    inputs = processor(text=[text], videos=[video.frames], video_metadata=[video.metadata()],
                       do_sample_frames=False, return_tensors="pt")

Qwen3-VL writes ``<t seconds>`` before each temporal patch from ``frames_indices / fps``, and
Qwen2.5-VL derives ``second_per_grid_ts`` from ``len(frames_indices) / total_num_frames * fps``;
both are right only with the *source* fps and the *source* frame indices, which is what
``metadata()`` holds. CapRL itself used ~2 fps and no frame cap (docs/reference.md §1).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

from rl_data.records import ChatMessage, ImageSource

__all__ = [
    "VideoFrames", "chat_messages", "fit_image", "load_image", "load_pixels", "sample_video", "select_frame_indices",
]

MEDIA_MARKER = re.compile(r"<(image|video)>\n?")



def _av() -> ModuleType:
    """PyAV, imported on first use so that image-only users never load FFmpeg."""
    import av

    return av


def _resolve(path: str | Path, root: str | Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or root is None else Path(root) / p


def load_image(
    source: str | Path | bytes | ImageSource | Mapping[str, Any], *, root: str | Path | None = None
) -> Image.Image:
    """Decode an image from a path, raw bytes, ``{bytes, path}`` or :class:`ImageSource` into
    an RGB PIL image. Bytes win over the path when both are given; a relative path is joined to
    ``root``. Raises FileNotFoundError / ValueError naming the path or the source."""
    data: bytes | None
    path: str | Path | None
    fp: io.BytesIO | Path
    if isinstance(source, ImageSource):
        data, path = source.bytes, source.path
    elif isinstance(source, Mapping):
        data, path = source.get("bytes"), source.get("path")
    elif isinstance(source, bytes | bytearray):
        data, path = bytes(source), None
    else:
        data, path = None, source
    if data:
        what, fp = "image bytes" + (f" (path {path})" if path else ""), io.BytesIO(data)
    elif path:
        resolved = _resolve(path, root)
        if not resolved.is_file():
            raise FileNotFoundError(f"image not found: {resolved}")
        what, fp = str(resolved), resolved
    else:
        raise ValueError(f"image source has neither bytes nor path: {source!r}")
    try:
        with Image.open(fp) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode image from {what}: {exc}") from None


@dataclass(frozen=True)
class VideoFrames:
    """Frames sampled from one video.

    Attributes:
        frames: uint8 ``[N, H, W, 3]`` RGB.
        timestamps: presentation time of each frame in seconds from the stream start, ``[N]``.
        frame_indices: index of each frame among all decoded frames of the source, ``[N]``.
        source_fps: the stream's average frame rate.
        total_num_frames: frames in the source.
        duration: source duration in seconds (``total_num_frames / source_fps``).
    """

    frames: np.ndarray  # [N, H, W, 3] uint8
    timestamps: list[float]
    frame_indices: list[int]
    source_fps: float
    total_num_frames: int
    duration: float

    def metadata(self) -> dict[str, Any]:
        """Keyword arguments of transformers' ``VideoMetadata`` (pass as ``video_metadata``)."""
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.source_fps,
            "duration": self.duration,
            "frames_indices": list(self.frame_indices),
            "height": int(self.frames.shape[1]),
            "width": int(self.frames.shape[2]),
        }

    def to_pil(self) -> list[Image.Image]:
        return [Image.fromarray(frame) for frame in self.frames]


def select_frame_indices(
    times: np.ndarray, *, fps: float, max_frames: int | None, duration: float
) -> list[int]:
    """Indices of the frames to keep: for each target time ``k / fps`` in ``[0, duration)`` the
    frame whose time is nearest (duplicates dropped), then, above ``max_frames``, an even
    subsample that keeps the first and the last. ``times`` ``[T]`` must be sorted."""
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    targets = np.arange(0.0, duration - 1e-9, 1.0 / fps) + float(times[0])  # [K]
    right = np.clip(np.searchsorted(times, targets), 1, len(times) - 1)  # [K]
    left = right - 1
    nearest = np.where(targets - times[left] <= times[right] - targets, left, right)  # [K]
    picked = list(dict.fromkeys(int(i) for i in nearest)) if len(times) > 1 else [0]
    if max_frames is not None and len(picked) > max_frames:
        keep = np.linspace(0, len(picked) - 1, max_frames).round().astype(int)  # [max_frames]
        picked = [picked[i] for i in keep]
    return picked


def _output_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _frame_times(path: Path) -> tuple[np.ndarray, float]:
    """Presentation times (s, sorted, relative to the first frame) of every video packet, found by
    demuxing only — no decoding — and the stream's average fps."""
    with _av().open(str(path)) as container:
        stream = container.streams.video[0]
        base = stream.time_base or Fraction(1, 1)
        pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size)
        rate = stream.average_rate or stream.guessed_rate
    if not pts:
        raise ValueError(f"video has no frames: {path}")
    times = np.array([float((p - pts[0]) * base) for p in pts])  # [T]
    if rate:
        fps = float(rate)
    elif len(times) > 1:
        fps = (len(times) - 1) / times[-1]
    else:
        fps = 1.0
    return times, fps


def sample_video(
    path: str | Path,
    *,
    fps: float = 2.0,
    max_frames: int | None = 64,
    max_pixels: int | None = None,
    root: str | Path | None = None,
) -> VideoFrames:
    """Decode ``path`` and keep frames evenly spaced at ``fps`` (never more than the source has),
    at most ``max_frames`` of them (even subsample keeping first and last), each resized keeping
    the aspect ratio so that ``H * W <= max_pixels``.

    Two passes: demux (cheap) to learn every frame time, then decode and convert only the kept
    frames, so memory is ``N * H * W * 3`` bytes whatever the video length.
    """
    resolved = _resolve(path, root)
    if not resolved.is_file():
        raise FileNotFoundError(f"video not found: {resolved}")
    av = _av()
    try:
        times, source_fps = _frame_times(resolved)
        duration = len(times) / source_fps
        indices = select_frame_indices(times, fps=fps, max_frames=max_frames, duration=duration)
        frames = _decode_frames(resolved, indices, max_pixels)
    except av.FFmpegError as exc:
        raise ValueError(f"cannot decode video {resolved}: {exc}") from None
    if len(frames) != len(indices):
        raise ValueError(f"{resolved}: decoded {len(frames)} of the {len(indices)} frames selected")
    return VideoFrames(
        frames=np.stack(frames),  # [N, H, W, 3]
        timestamps=[float(times[i]) for i in indices],
        frame_indices=indices,
        source_fps=source_fps,
        total_num_frames=len(times),
        duration=duration,
    )


def _decode_frames(path: Path, indices: list[int], max_pixels: int | None) -> list[np.ndarray]:
    wanted = set(indices)
    last = max(indices)
    frames = []
    with _av().open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                width, height = _output_size(frame.width, frame.height, max_pixels)
                frames.append(frame.to_ndarray(width=width, height=height, format="rgb24"))
            if i >= last:
                break
    return frames


def load_pixels(source: str | Path | bytes | ImageSource, *, size: int, num_frames: int | None = None,
                root: str | Path | None = None) -> np.ndarray:
    """An image or a video as a square-frame model's input (a diffusion model's training pairs):
    the centre square of each frame resized to ``size`` x ``size``. An image gives ``[size, size, 3]``
    uint8 RGB; with ``num_frames`` the source is a video (an animated GIF through Pillow, anything
    else through PyAV) and gives ``[num_frames, size, size, 3]``, that many frames evenly spaced
    over the video, first and last kept. A video with fewer frames is a ValueError naming it."""
    def fit(image: Image.Image) -> np.ndarray:
        return np.asarray(ImageOps.fit(image.convert("RGB"), (size, size), Image.Resampling.BICUBIC))

    if num_frames is None:
        return fit(load_image(source, root=root))
    path = _resolve(str(source), root)
    if path.suffix.lower() == ".gif":
        with Image.open(path) as gif:
            frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    else:
        frames = sample_video(path, fps=1000.0, max_frames=None).to_pil()  # every frame
    if len(frames) < num_frames:
        raise ValueError(f"video {path} has {len(frames)} frames; {num_frames} are needed")
    keep = np.linspace(0, len(frames) - 1, num_frames).round().astype(int)  # [num_frames]
    return np.stack([fit(frames[i]) for i in keep])  # [F, size, size, 3]


def load_frames(source: str | Path, *, size: int, video_frames: int, root: str | Path | None = None) -> np.ndarray:
    """`load_pixels` as frames whatever the source: ``[1, size, size, 3]`` for an image, ``[video_frames,
    size, size, 3]`` spaced evenly over a video (a path with a video suffix: ``.mp4``, ``.gif``, ...)."""
    from rl_data.records import VIDEO_SUFFIXES

    if Path(str(source)).suffix.lower() in VIDEO_SUFFIXES:
        return load_pixels(source, size=size, num_frames=video_frames, root=root)
    return load_pixels(source, size=size, root=root)[None].copy()  # writable, as a stacked video is


def fit_image(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` scaled down (aspect kept, each side >= 28) to at most `max_pixels` pixels."""
    if image.width * image.height <= max_pixels:
        return image
    scale = (max_pixels / (image.width * image.height)) ** 0.5
    return image.resize((max(28, int(image.width * scale)), max(28, int(image.height * scale))))


def chat_messages(prompt: Sequence[ChatMessage], images: Sequence[ImageSource], videos: Sequence[str], *, fps: float,
                  max_frames: int, max_pixels: int) -> list[dict[str, Any]]:
    """A verl-style prompt whose text holds `<image>`/`<video>` markers -> chat messages whose
    content parts hold the decoded media in marker order (PIL images scaled to `max_pixels`,
    video frame arrays sampled at `fps`), as Qwen-VL processors and vLLM take them. Media without
    a marker go first in the first user turn. Raises ValueError for more markers than media or
    a prompt without a user turn (and what `load_image`/`sample_video` raise for bad media)."""
    decoded = {"image": iter([fit_image(load_image(src), max_pixels) for src in images]),
               "video": iter([sample_video(path, fps=fps, max_frames=max_frames, max_pixels=max_pixels).frames
                              for path in videos])}
    messages: list[dict[str, Any]] = []
    for message in prompt:
        if not isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(MEDIA_MARKER.split(message.content)):
            if i % 2:
                item = next(decoded[piece], None)
                if item is None:
                    raise ValueError(f"more <{piece}> markers than {piece}s in the record")
                parts.append({"type": piece, piece: item})
            elif piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": message.role, "content": parts})
    rest = [{"type": kind, kind: item} for kind in ("image", "video") for item in decoded[kind]]
    user = next((m for m in messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError("the prompt has no user turn")
    user["content"] = rest + user["content"]
    return messages
