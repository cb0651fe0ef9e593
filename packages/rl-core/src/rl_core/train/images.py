"""A run's image artifacts, for apps that train image (or video frame) generators: tensors to PIL
images, a contact sheet of eval samples with their captions, and the statistics that show a
policy collapsing under reward hacking.

    images = to_pil(samples.images)                       # [B, 3, H, W] in [0, 1] -> PIL
    contact_sheet(images, [f"{p} | reward {r:.3f}" for p, r in ...], run_dir / "contact_sheet.png")
    metrics |= image_stats(images)                        # image/brightness, image/colour_entropy
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["contact_sheet", "image_stats", "to_pil"]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """`[B, 3, H, W]` floats in [0, 1] -> RGB PIL images."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
    return [Image.fromarray(a.permute(1, 2, 0).cpu().numpy()) for a in arrays]


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
