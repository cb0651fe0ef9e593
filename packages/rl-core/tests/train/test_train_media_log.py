"""`rl_core.train.media_log`: an eval folder's contact sheet and videos through accelerate's real
TensorBoard and W&B (offline) trackers, read back from what they wrote."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from accelerate import Accelerator
from PIL import Image

from rl_core.train import contact_sheet, log_media, write_video

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]


def eval_folder(folder: Path) -> Path:
    """What an eval writes: a contact sheet, one MP4 of 5 frames and one GIF of 3 (16 x 12)."""
    frames = [Image.new("RGB", (16, 12), c) for c in COLOURS]
    contact_sheet(frames[:2], ["a | reward 0.1", "b | reward 0.2"], folder / "contact_sheet.png")
    write_video(frames, folder / "images" / "000.mp4")
    frames[0].save(folder / "images" / "001.gif", save_all=True, append_images=frames[1:3], duration=100, loop=0)
    return folder


def test_tensorboard_shows_the_sheet_and_each_video_as_a_strip_of_its_frames(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = eval_folder(tmp_path / "eval_epoch_3")
    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "run"))
    acc.init_trackers("app")
    assert log_media(acc.trackers, 3, folder) == {"tensorboard": 3}
    acc.end_training()
    logged = EventAccumulator(str(tmp_path / "run" / "app"), size_guidance={"images": 0}).Reload()
    assert sorted(logged.Tags()["images"]) == ["eval/contact_sheet", "eval/video_000", "eval/video_001"]
    [sheet] = logged.Images("eval/contact_sheet")
    with Image.open(folder / "contact_sheet.png") as written:
        assert sheet.step == 3 and (sheet.width, sheet.height) == written.size
    [mp4], [gif] = logged.Images("eval/video_000"), logged.Images("eval/video_001")
    assert (mp4.width, mp4.height) == (5 * 16, 12) and (gif.width, gif.height) == (3 * 16, 12)


def test_a_video_the_tracker_cannot_read_is_a_warning_and_the_rest_goes_on(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    folder = eval_folder(tmp_path / "eval")
    (folder / "images" / "002.mp4").write_bytes(b"not a video")
    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "run"))
    acc.init_trackers("app")
    with caplog.at_level(logging.WARNING, logger="rl_core.train.media_log"):
        assert log_media(acc.trackers, 1, folder) == {"tensorboard": 0}
    acc.end_training()
    assert "tracker tensorboard could not take the media of step 1" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb installed (pip install wandb)")
def test_wandb_offline_keeps_the_sheet_as_an_image_and_the_videos_as_videos(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    folder = eval_folder(tmp_path / "eval")
    acc = Accelerator(cpu=True, log_with="wandb")
    acc.init_trackers("app", init_kwargs={"wandb": {"dir": str(tmp_path)}})
    assert log_media(acc.trackers, 2, folder) == {"wandb": 3}
    acc.end_training()
    [media] = list(tmp_path.glob("wandb/offline-run-*/files/media"))
    images = [p.name for p in (media / "images" / "eval").iterdir()]
    videos = sorted(p.name for p in (media / "videos" / "eval").iterdir())
    assert len(images) == 1 and images[0].startswith("contact_sheet_") and images[0].endswith(".png")
    assert len(videos) == 2 and videos[0].startswith("video_000_") and videos[1].startswith("video_001_")
