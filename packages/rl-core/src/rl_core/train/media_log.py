"""An eval's pictures and videos to the run's trackers (`train.log_with`), beside the files the
eval writes in the run directory.

    run.log_media(step, run.run_dir / f"eval_epoch_{step}")   # in a recipe's `evaluate`

Every PNG directly in the folder (a contact sheet) goes as an image, every MP4 or GIF under it
(a sampled video) as a video, each named `eval/<file stem>`. Trackers take them as they can:
TensorBoard (an image; a video as a strip of its frames, TensorBoard's own video summary needing
moviepy), Weights & Biases (`wandb.Image`, `wandb.Video`), MLflow (the files as artifacts of the
step) and the other accelerate trackers through their `log_images` (Aim, ClearML, SwanLab).
A tracker that takes no media is skipped; a tracker that fails is logged as a warning and the
run goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["STRIP_FRAMES", "log_media", "media_files", "video_strip"]

log = logging.getLogger(__name__)

VIDEO_SUFFIXES = (".mp4", ".gif")
STRIP_FRAMES = 8  # frames of a video side by side where a tracker shows images only


def media_files(folder: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """The images (PNGs directly in `folder`) and videos (MP4s and GIFs anywhere under it) an eval
    wrote, each under its tracker name `eval/<stem>` (a video: `eval/video_<stem>`)."""
    images = {f"eval/{p.stem}": p for p in sorted(folder.glob("*.png"))}
    videos = {f"eval/video_{p.stem}": p for p in sorted(folder.rglob("*")) if p.suffix in VIDEO_SUFFIXES}
    return images, videos


def video_frames(path: Path) -> list[Image.Image]:
    """A video file's frames as RGB images (an MP4 through PyAV, a GIF through Pillow)."""
    if path.suffix == ".gif":
        with Image.open(path) as gif:
            frames = []
            for k in range(getattr(gif, "n_frames", 1)):
                gif.seek(k)
                frames.append(gif.convert("RGB"))
            return frames
    import av

    with av.open(str(path)) as container:
        return [frame.to_image().convert("RGB") for frame in container.decode(video=0)]


def picture(path: Path) -> np.ndarray:
    """An image file as `[H, W, 3]` uint8 RGB."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def video_strip(frames: Sequence[Image.Image], count: int = STRIP_FRAMES) -> np.ndarray:
    """Up to `count` frames, evenly spaced, side by side: `[H, W x k, 3]` uint8."""
    picked = [frames[round(i * (len(frames) - 1) / max(count - 1, 1))] for i in range(min(count, len(frames)))]
    return np.concatenate([np.asarray(f.convert("RGB")) for f in picked], axis=1)


def log_media(trackers: Sequence[Any], step: int, folder: Path) -> dict[str, int]:
    """Log `folder`'s images and videos (`media_files`) to each of `trackers` (an accelerate
    `Accelerator.trackers`; call on the main process, where they live). Returns how many files
    each tracker took, by tracker name."""
    images, videos = media_files(folder)
    taken: dict[str, int] = {}
    for tracker in trackers:
        name = getattr(tracker, "name", type(tracker).__name__)
        try:
            taken[name] = _log_one(tracker, name, step, images, videos)
        except Exception as e:  # a tracker's media failure must not end the run: its scalars went through
            log.warning("tracker %s could not take the media of step %d: %s: %s", name, step, type(e).__name__, e)
            taken[name] = 0
    return taken


def _log_one(tracker: Any, name: str, step: int, images: dict[str, Path], videos: dict[str, Path]) -> int:
    if name == "tensorboard":
        writer = tracker.writer
        for tag, path in images.items():
            writer.add_image(tag, picture(path), global_step=step, dataformats="HWC")
        for tag, path in videos.items():
            writer.add_image(tag, video_strip(video_frames(path)), global_step=step, dataformats="HWC")
        writer.flush()
        return len(images) + len(videos)
    if name == "wandb":
        import wandb

        tracker.run.log({**{tag: wandb.Image(str(path)) for tag, path in images.items()},
                         **{tag: wandb.Video(str(path)) for tag, path in videos.items()}}, step=step)
        return len(images) + len(videos)
    if name == "mlflow":
        import mlflow

        for path in [*images.values(), *videos.values()]:
            mlflow.log_artifact(str(path), artifact_path=f"eval/step_{step}")
        return len(images) + len(videos)
    if hasattr(tracker, "log_images"):  # Aim, ClearML, SwanLab: pictures only
        pictures = {tag: [picture(path)] for tag, path in images.items()}
        pictures |= {tag: [video_strip(video_frames(path))] for tag, path in videos.items()}
        tracker.log_images(pictures, step=step)
        return len(pictures)
    return 0
