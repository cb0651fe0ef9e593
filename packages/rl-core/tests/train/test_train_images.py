"""`rl_core.train.images`: tensors to PIL, the collapse statistics by hand, the contact sheet, the
videos and a batch's media as files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from rl_core.train import (
    all_frames,
    contact_sheet,
    image_stats,
    save_media,
    to_media,
    to_pil,
    write_video,
)


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


FRAMES = [Image.new("RGB", (7, 5), (40 * k, 0, 255 - 40 * k)) for k in range(5)]  # odd sizes, changing colour


def test_write_video_writes_an_mp4_a_player_decodes(tmp_path: Path) -> None:
    av = pytest.importorskip("av")  # rl-core's test group installs it
    out = write_video(FRAMES, tmp_path / "videos" / "sample.mp4", fps=4)
    assert out == tmp_path / "videos" / "sample.mp4"
    with av.open(str(out)) as container:
        decoded = [f.to_image() for f in container.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].size == (8, 6)  # padded to even sizes for 4:2:0
    first, last = (d.getpixel((2, 2)) for d in (decoded[0], decoded[-1]))
    assert first[2] > 200 and last[0] > 120  # blue first, then red, through the codec's rounding


def test_write_video_falls_back_to_a_gif_without_pyav(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    out = write_video(FRAMES, tmp_path / "sample.mp4", fps=4)
    assert out == tmp_path / "sample.gif" and not (tmp_path / "sample.mp4").exists()
    with Image.open(out) as gif:
        assert gif.n_frames == 5 and gif.info["duration"] == 250
    with pytest.raises(ValueError, match="no frames"):
        write_video([], tmp_path / "empty.mp4")


def test_to_media_keeps_images_flat_and_videos_as_frame_lists() -> None:
    images = torch.zeros(2, 3, 4, 4)  # [B, 3, H, W]
    videos = torch.ones(2, 3, 3, 4, 4)  # [B, F, 3, H, W]
    flat, clips = to_media(images), to_media(videos)
    assert [type(m) for m in flat] == [Image.Image, Image.Image]
    assert [len(m) for m in clips] == [3, 3] and clips[0][2].getpixel((0, 0)) == (255, 255, 255)
    assert len(all_frames([*flat, *clips])) == 2 + 6


def test_save_media_writes_each_sample_by_its_place(tmp_path: Path) -> None:
    """An image as `NNN.png`, a video as `NNN.mp4` (a GIF without PyAV), numbered by place in the batch."""
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    paths = save_media([red, FRAMES, red], tmp_path / "step_3")
    assert [p.name for p in paths[::2]] == ["000.png", "002.png"] and paths[1].stem == "001"
    assert sorted(p.name for p in (tmp_path / "step_3").iterdir()) == sorted(p.name for p in paths)
    with Image.open(paths[2]) as png:
        assert png.getpixel((1, 1)) == (255, 0, 0)
