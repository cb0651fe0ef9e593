"""A run's image artifacts, for apps that train image (or video frame) generators: tensors to PIL
images, a contact sheet of eval samples with their captions, and the statistics that show a
policy collapsing under reward hacking.

    images = to_pil(samples.images)                       # [B, 3, H, W] in [0, 1] -> PIL
    contact_sheet(images, [f"{p} | reward {r:.3f}" for p, r in ...], run_dir / "contact_sheet.png")
    metrics |= image_stats(images)                        # image/brightness, image/colour_entropy
    write_video(to_pil(video.frames[0]), run_dir / "sample.mp4", fps=8)   # [F, 3, H, W] -> MP4 (or GIF)
    paths = save_media(to_media(samples.images), run_dir / "rollouts")   # 000.png, 001.mp4, ...
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["Media", "all_frames", "contact_sheet", "image_stats", "save_media", "to_media", "to_pil", "write_video"]

Media = Image.Image | list[Image.Image]  # an image, or a video's frames


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """`[B, 3, H, W]` floats in [0, 1] -> RGB PIL images."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
    return [Image.fromarray(a.permute(1, 2, 0).cpu().numpy()) for a in arrays]


def to_media(images: torch.Tensor) -> list[Media]:
    """An engine's images `[B, 3, H, W]` as PIL images, or its videos `[B, F, 3, H, W]` as frame lists."""
    return [to_pil(video) for video in images] if images.dim() == 5 else list(to_pil(images))


def all_frames(media: Sequence[Media]) -> list[Image.Image]:
    """Every image, and every video's frames in order (for `image_stats` over videos)."""
    return [f for m in media for f in (m if isinstance(m, list) else [m])]


def image_stats(images: Sequence[Image.Image]) -> dict[str, float]:
    """Mean brightness (grey level in [0, 1]) and colour entropy (bits of the 8x8x8 RGB histogram)
    of `images`: either collapsing is reward hacking's signature (blank or single-colour images)."""
    brightness, entropy = [], []
    for image in images:
        rgb = np.asarray(image.convert("RGB"), dtype=np.int64)  # [H, W, 3]
        brightness.append(float(np.asarray(image.convert("L"), dtype=np.float64).mean() / 255))
        bins = (rgb // 32) @ np.array([64, 8, 1])  # [H, W] index into 512 colour bins
        p = np.bincount(bins.ravel(), minlength=512) / bins.size
        p = p[p > 0]
        entropy.append(float(-(p * np.log2(p)).sum()))
    return {"image/brightness": float(np.mean(brightness)), "image/colour_entropy": float(np.mean(entropy))}


def contact_sheet(images: Sequence[Image.Image], captions: Sequence[str], path: Path, *,
                  columns: int = 4, cell: int = 256) -> Path:
    """A grid of `images` (scaled to `cell` px), each with its caption (prompt, reward) under it."""
    rows = math.ceil(len(images) / columns)
    font, text_h = ImageFont.load_default(), 4 * 12  # 4 caption lines of 12 px
    sheet = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_h)
        sheet.paste(image.resize((cell, cell), Image.Resampling.NEAREST), (x, y))
        for line_no, line in enumerate(textwrap.wrap(caption, width=cell // 6)[:4]):
            draw.text((x + 2, y + cell + 1 + 12 * line_no), line, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path


def write_video(frames: Sequence[Image.Image], path: Path, *, fps: float = 8.0) -> Path:
    """A sampled video a person can watch: `frames` as H.264 MP4 through PyAV (`pip install av`)
    at `path`, or, where PyAV is missing, an animated GIF beside it (`path` with `.gif`, Pillow
    only). Odd sizes are padded to even ones (H.264's 4:2:0 needs them). Returns the file written."""
    if not frames:
        raise ValueError(f"{path}: no frames to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import av
    except ImportError:
        gif = path.with_suffix(".gif")
        frames[0].save(gif, save_all=True, append_images=list(frames[1:]), duration=round(1000 / fps), loop=0)
        return gif
    width, height = frames[0].width + frames[0].width % 2, frames[0].height + frames[0].height % 2
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            canvas = Image.new("RGB", (width, height))
            canvas.paste(frame.convert("RGB"))
            container.mux(stream.encode(av.VideoFrame.from_image(canvas)))
        container.mux(stream.encode())  # flush the encoder
    return path


def save_media(media: Sequence[Media], folder: Path) -> list[Path]:
    """Sample i of `media` in `folder` as `{i:03d}.png`, or a video's frames as `{i:03d}.mp4`
    (`write_video`: a GIF where PyAV is missing), for a person to look at or a reward server to
    read; returns the files written, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, sample in enumerate(media):
        if isinstance(sample, list):
            paths.append(write_video(sample, folder / f"{i:03d}.mp4"))
        else:
            sample.save(folder / f"{i:03d}.png")
            paths.append(folder / f"{i:03d}.png")
    return paths
