"""`rl_core.train.images`: tensors to PIL, the collapse statistics by hand, the contact sheet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from rl_core.train import contact_sheet, image_stats, to_pil


def test_to_pil_rounds_and_clamps_into_rgb_bytes() -> None:
    images = torch.zeros(2, 3, 2, 2)  # [B, 3, H, W]
    images[0, 0] = 1.5  # clamped to 255
    images[1, 2] = 0.5  # 127.5 rounds to 128
    first, second = to_pil(images)
    assert first.mode == "RGB" and first.size == (2, 2)
    assert first.getpixel((0, 0)) == (255, 0, 0) and second.getpixel((1, 1)) == (0, 0, 128)


def test_brightness_and_colour_entropy_by_hand() -> None:
    """Black: brightness 0, 1 colour (0 bits); half black, half white: brightness 0.5, 2 colours
    equally often (1 bit); the means over both: 0.25 and 0.5 bits."""
    black = Image.new("RGB", (4, 4), "black")
    halves = Image.new("RGB", (4, 4), "black")
    halves.paste(Image.new("RGB", (2, 4), "white"), (0, 0))
    assert image_stats([halves]) == {"image/brightness": 0.5, "image/colour_entropy": 1.0}
    assert image_stats([black, halves]) == pytest.approx({"image/brightness": 0.25, "image/colour_entropy": 0.5})


def test_contact_sheet_is_a_grid_of_cells_with_captions(tmp_path: Path) -> None:
    images = [Image.new("RGB", (8, 8), colour) for colour in ("red", "green", "blue", "white", "black")]
    path = contact_sheet(images, [f"prompt {i} | reward 0.5" for i in range(5)], tmp_path / "eval" / "sheet.png",
                         columns=4, cell=32)
    with Image.open(path) as sheet:
        assert sheet.size == (4 * 32, 2 * (32 + 48))  # 2 rows of a cell and 4 caption lines of 12 px
        assert sheet.getpixel((16, 16)) == (255, 0, 0) and sheet.getpixel((16, 80 + 16)) == (0, 0, 0)
    with pytest.raises(ValueError, match="zip"):
        contact_sheet(images, ["one caption"], tmp_path / "short.png")
