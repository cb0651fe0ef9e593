"""Video rewards over a sample's frames (`Sample.metadata["video"]`: a sequence of PIL images or an
array `[F, H, W, 3]`, the frames a video trainer sampled; or, in a request to a reward server, the
path of a video file the trainer wrote: MP4 and other containers decoded with PyAV, GIF with Pillow).

- `per_frame`: any registered image scorer (`ocr`, `aesthetic`, `clip_score`, `brightness`, ...)
  run on each frame (or on `frames` of them, evenly spaced, first and last included), its
  scores folded by `aggregate`: `mean` (the video on average), `min` (its worst frame: choose it
  when one bad frame spoils the video, e.g. text that must stay legible), `max`.
- `temporal_consistency`: 1 minus the mean absolute change of grey level between consecutive
  frames, in [0, 1]. A still video scores 1: add it to a content reward with a small weight to
  penalise flicker, never alone.
- `vl_judge` (rl_rewards.scorers.vl_judge) reads the whole video as well: a VLM grades the frames
  against the prompt; `lift_to_video` leaves it, like the two above, as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample, Scorer, ScoreResult
from rl_rewards.spec import Component, RewardSpec

try:
    import numpy as np
    from PIL import Image, ImageSequence
except ImportError as e:
    raise ImportError(f'video scorers need pillow and numpy: pip install "rl-rewards[ocr]" or "rl-rewards[vision]" ({e})') from e

Aggregate = Literal["mean", "min", "max"]
VIDEO_SCORERS = ("per_frame", "temporal_consistency", "vl_judge")  # the scorers that read a whole video
AGGREGATES: dict[str, Callable[[list[float]], float]] = {"mean": lambda xs: sum(xs) / len(xs), "min": min, "max": max}


def load_frames(metadata: dict[str, Any]) -> list[Image.Image]:
    """The sample's frames as RGB images; a missing key, a missing file or an empty video is a
    per-sample error."""
    if "video" not in metadata:
        raise ValueError(f"no video: Sample.metadata has no 'video' (keys: {sorted(metadata)})")
    video = metadata["video"]
    if isinstance(video, str | Path):
        video = read_video(Path(video))
    frames = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in video]
    if not frames:
        raise ValueError("the video has no frames")
    return [f.convert("RGB") for f in frames]


def read_video(path: Path) -> list[Image.Image]:
    """Every frame of the video file `path`: a GIF through Pillow, anything else through PyAV."""
    if not path.is_file():
        raise FileNotFoundError(f"video file {str(path)!r} does not exist")
    if path.suffix.lower() == ".gif":
        with Image.open(path) as gif:
            return [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    try:
        import av
    except ImportError as e:
        raise ValueError(f"reading {path.name} needs PyAV: pip install av ({e})") from None
    try:
        with av.open(str(path)) as container:
            return [frame.to_image() for frame in container.decode(video=0)]
    except av.error.FFmpegError as e:  # not a video PyAV can read: this sample fails, not the batch
        raise ValueError(f"{path.name}: {e}") from None


def spaced(count: int, keep: int | None) -> list[int]:
    """`keep` evenly spaced indices of `count` frames, the first and the last included (all: None)."""
    if keep is None or keep >= count:
        return list(range(count))
    if keep == 1:
        return [0]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


class PerFrameScorer:
    """`scorer` (a registered image scorer, built with `options`) on each kept frame of
    `metadata["video"]`, folded by `aggregate` (see the module doc). A frame that fails to score
    fails its sample."""

    def __init__(self, scorer: str, options: dict[str, Any] | None = None, aggregate: Aggregate = "mean",
                 frames: int | None = None) -> None:
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={aggregate!r} is not one of {', '.join(AGGREGATES)}")
        if frames is not None and frames < 1:
            raise ValueError(f"frames={frames}: keep at least 1 frame (None: every frame)")
        inner = build_scorer(scorer, **(options or {}))
        if not hasattr(inner, "score"):
            raise ValueError(f"per_frame: {scorer!r} scores asynchronously only; pick a scorer with a score method")
        self.inner: Scorer = inner  # type: ignore[assignment]
        self.name, self.aggregate, self.frames = f"per_frame({scorer})", aggregate, frames

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        spans: list[tuple[int, int] | str] = []  # each sample's frames in `batch`, or its error
        batch: list[Sample] = []
        for sample in samples:
            try:
                frames = load_frames(sample.metadata)
            except (ValueError, TypeError, OSError) as e:
                spans.append(f"{self.name}: {e}")
                continue
            kept = [frames[i] for i in spaced(len(frames), self.frames)]
            spans.append((len(batch), len(batch) + len(kept)))
            batch += [Sample(completion=sample.completion, prompt=sample.prompt, reference=sample.reference,
                             metadata={**sample.metadata, "image": frame}) for frame in kept]
        scored = self.inner.score(batch) if batch else []
        results = []
        for span in spans:
            if isinstance(span, str):
                results.append(ScoreResult.failed(span))
                continue
            part = scored[span[0]:span[1]]
            failed = next((r for r in part if r.score is None), None)
            if failed is not None:
                results.append(ScoreResult.failed(f"{self.name}: a frame failed: {failed.error}"))
                continue
            results.append(ScoreResult(score=AGGREGATES[self.aggregate]([float(r.score or 0.0) for r in part])))
        return results


class TemporalConsistencyScorer:
    """1 - the mean absolute grey-level change between consecutive frames, in [0, 1] (a single
    frame scores 1); see the module doc for when to use it."""

    name = "temporal_consistency"

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results = []
        for sample in samples:
            try:
                grey = np.stack([np.asarray(f.convert("L"), dtype=np.float64) / 255 for f in load_frames(sample.metadata)])
            except (ValueError, TypeError, OSError) as e:
                results.append(ScoreResult.failed(f"temporal_consistency: {e}"))
                continue
            change = float(np.abs(np.diff(grey, axis=0)).mean()) if len(grey) > 1 else 0.0  # [F - 1, H, W] mean
            results.append(ScoreResult(score=1.0 - change))
        return results


def lift_to_video(spec: RewardSpec, *, aggregate: Aggregate = "mean", frames: int | None = None) -> RewardSpec:
    """`spec` for videos: each image scorer's component scores every frame (`per_frame`, folded
    by `aggregate` over `frames` evenly spaced ones; its options, weight, gate and fallback kept),
    a video scorer's component is left as it is."""
    def lifted(c: Component) -> Component:
        options = {"scorer": c.scorer, "options": dict(c.options), "aggregate": aggregate, "frames": frames}
        return c if c.scorer in VIDEO_SCORERS else msgspec.structs.replace(c, scorer="per_frame", options=options)

    return msgspec.structs.replace(spec, components={name: lifted(c) for name, c in spec.components.items()})
