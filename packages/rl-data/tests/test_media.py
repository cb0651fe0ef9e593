import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from rl_data.media import load_image, load_pixels, sample_video, select_frame_indices
from rl_data.records import ImageSource

W, H, FPS, SECONDS = 64, 48, 10, 3  # 30 frames; frame i is filled with grey level 8 * i


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.time_base = Fraction(1, FPS)
        for i in range(FPS * SECONDS):
            frame = av.VideoFrame.from_ndarray(np.full((H, W, 3), 8 * i, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def _grey_index(frames):
    """Recover each frame's source index from its grey level (lossy codec: nearest multiple of 8)."""
    return [round(float(f.mean()) / 8) for f in frames]


def test_sample_video_at_target_fps(clip):
    video = sample_video(clip, fps=2.0, max_frames=None)
    assert video.frames.shape == (6, H, W, 3) and video.frames.dtype == np.uint8
    assert video.frame_indices == [0, 5, 10, 15, 20, 25]
    assert video.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert _grey_index(video.frames) == video.frame_indices  # the right frames were decoded
    assert (video.source_fps, video.total_num_frames, video.duration) == (10.0, 30, 3.0)


def test_sample_video_above_source_fps_keeps_every_frame(clip):
    video = sample_video(clip, fps=30.0, max_frames=None)
    assert video.frame_indices == list(range(30))


def test_sample_video_frame_cap_keeps_first_and_last(clip):
    video = sample_video(clip, fps=10.0, max_frames=4)
    # linspace(0, 29, 4) = 0, 9.67, 19.33, 29 -> rounded
    assert video.frame_indices == [0, 10, 19, 29]
    assert video.timestamps == pytest.approx([0.0, 1.0, 1.9, 2.9])
    assert _grey_index(video.frames) == [0, 10, 19, 29]


def test_sample_video_resize_keeps_aspect(clip):
    video = sample_video(clip, fps=1.0, max_pixels=768)
    n, h, w, _ = video.frames.shape
    assert n == 3 and h * w <= 768
    assert (w, h) == (32, 24)  # scale sqrt(768 / 3072) = 0.5, aspect 4:3 kept


def test_sample_video_relative_path_and_errors(clip, tmp_path):
    assert sample_video(clip.name, root=clip.parent, fps=1.0).frame_indices == [0, 10, 20]
    with pytest.raises(FileNotFoundError, match=r"missing\.mp4"):
        sample_video(tmp_path / "missing.mp4")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all")
    with pytest.raises(ValueError, match=r"cannot decode video .*bad\.mp4"):
        sample_video(bad)
    with pytest.raises(ValueError, match="fps must be > 0"):
        sample_video(clip, fps=0)


def test_select_frame_indices_hand_worked():
    times = np.arange(90) / 30.0  # 30 fps, 3 s
    assert select_frame_indices(times, fps=2.0, max_frames=None, duration=3.0) == [0, 15, 30, 45, 60, 75]
    # uneven source times: targets 0, 0.5, 1.0 -> nearest frames at 0.0, 0.45, 1.2
    uneven = np.array([0.0, 0.45, 1.2, 1.3])
    assert select_frame_indices(uneven, fps=2.0, max_frames=None, duration=1.5) == [0, 1, 2]
    assert select_frame_indices(np.array([0.0]), fps=2.0, max_frames=3, duration=0.5) == [0]


def test_metadata_feeds_transformers_video_metadata(clip):
    video_utils = pytest.importorskip("transformers.video_utils")
    meta = video_utils.VideoMetadata(**sample_video(clip, fps=2.0).metadata())
    assert meta.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])  # Qwen3-VL's <t seconds>
    assert meta.sampled_fps == pytest.approx(2.0)  # Qwen2.5-VL's second_per_grid_ts = 2 / 2.0


def test_qwen3_vl_video_processor_accepts_frames_and_metadata(clip):
    pytest.importorskip("torch")
    module = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    video = sample_video(clip, fps=2.0)
    out = module.Qwen3VLVideoProcessor()(
        videos=[video.frames], video_metadata=[video.metadata()], do_sample_frames=False,
        return_metadata=True, return_tensors="pt",
    )
    assert out["video_grid_thw"][0, 0].item() == 3  # 6 frames / temporal patch 2
    assert out["video_metadata"][0].timestamps == pytest.approx(video.timestamps)


def _png(colour=(1, 2, 3), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, (5, 4), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_from_every_source(tmp_path):
    data = _png()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    sources = [
        tmp_path / "sub" / "a.png",
        str(tmp_path / "sub" / "a.png"),
        data,
        {"bytes": data, "path": "ignored.png"},
        {"bytes": None, "path": str(tmp_path / "sub" / "a.png")},
        ImageSource(path="sub/a.png"),
        "sub/a.png",
    ]
    for source in sources:
        image = load_image(source, root=tmp_path)
        assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (5, 4), (1, 2, 3))


def test_load_image_converts_to_rgb():
    assert load_image(_png((9, 9, 9, 128), mode="RGBA")).mode == "RGB"
    assert load_image(_png(200, mode="L")).getpixel((1, 1)) == (200, 200, 200)


def test_load_image_errors_name_the_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"image not found: .*nope\.png"):
        load_image("nope.png", root=tmp_path)
    with pytest.raises(ValueError, match=r"cannot decode image from image bytes \(path x.png\)"):
        load_image({"bytes": b"garbage", "path": "x.png"})
    with pytest.raises(ValueError, match="neither bytes nor path"):
        load_image({"bytes": None, "path": None})


def test_sample_video_h264_with_b_frames(tmp_path):
    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV build has no libx264 encoder")
    path = tmp_path / "b.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)  # B-frames: decode order != display
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(50):
            frame = av.VideoFrame.from_ndarray(np.full((H, W, 3), 5 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    video = sample_video(path, fps=5.0)
    assert video.frame_indices == list(range(0, 50, 5))
    assert video.timestamps == pytest.approx([i / 5 for i in range(10)])
    assert [round(float(f.mean()) / 5) for f in video.frames] == video.frame_indices


def test_chat_messages_put_decoded_media_where_the_markers_are():
    from rl_data import chat_messages, read_caption_qa

    root = Path(__file__).resolve().parents[3] / "examples" / "data"
    image = next(iter(read_caption_qa(root / "caption_qa_images.jsonl")))
    video = next(iter(read_caption_qa(root / "caption_qa_videos.jsonl")))
    [user] = chat_messages(image.prompt, image.images, image.videos, fps=2.0, max_frames=4, max_pixels=56 * 56)
    assert [p["type"] for p in user["content"]] == ["image", "text"]
    assert isinstance(user["content"][0]["image"], Image.Image)
    assert user["content"][0]["image"].width * user["content"][0]["image"].height <= 56 * 56
    assert user["content"][1]["text"] == "Please describe this image in detail."
    [user] = chat_messages(video.prompt, video.images, video.videos, fps=2.0, max_frames=4, max_pixels=32 * 32)
    frames = user["content"][0]["video"]
    assert user["content"][0]["type"] == "video" and isinstance(frames, np.ndarray)
    assert frames.shape[0] == 4 and frames.shape[-1] == 3  # 5 s at 2 fps = 10 frames, capped at 4
    assert "[mm:ss]" in user["content"][1]["text"]


def test_chat_messages_refuse_extra_markers_and_a_prompt_without_a_user_turn():
    from rl_data import ChatMessage, ImageSource, chat_messages

    one = [ImageSource(path=str(Path(__file__).resolve().parents[3] / "examples/data/images/img_00.png"))]
    with pytest.raises(ValueError, match="more <image> markers than images"):
        chat_messages([ChatMessage("user", "<image>\n<image>\nBoth?")], one, [], fps=2, max_frames=2, max_pixels=64)
    with pytest.raises(ValueError, match="no user turn"):
        chat_messages([ChatMessage("system", "<image> Describe.")], one, [], fps=2, max_frames=2, max_pixels=64)


def test_load_pixels_fits_the_centre_square_and_spaces_video_frames(tmp_path, clip):
    """An image: its centre square resized (a 40x20 picture whose left and right 10 columns are
    red, the middle blue, gives a blue 8x8, only its edge columns tinted by the filter); a video: `num_frames` evenly spaced frames,
    first and last kept, from an MP4 (PyAV) or a GIF (Pillow); too few frames are refused."""
    wide = Image.new("RGB", (40, 20), (255, 0, 0))
    wide.paste((0, 0, 255), (10, 0, 30, 20))
    wide.save(tmp_path / "wide.png")
    square = load_pixels(tmp_path / "wide.png", size=8).astype(int)  # [8, 8, 3]
    assert square.shape == (8, 8, 3) and (square[:, 2:6] == (0, 0, 255)).all() and square[..., 0].mean() < 40
    picked = load_pixels(clip, size=16, num_frames=3)  # of the clip's 30 frames: 0, round(14.5) = 14, 29
    assert picked.shape == (3, 16, 16, 3)  # the codec shifts a grey level by up to 8 (frame 14 decodes as 13.4)
    assert np.abs(np.array(_grey_index(picked)) - [0, 14, 29]).max() <= 1
    frames = [Image.new("RGB", (6, 6), (v, v, v)) for v in (0, 50, 100, 150, 200)]
    frames[0].save(tmp_path / "grey.gif", save_all=True, append_images=frames[1:], duration=100)
    assert load_pixels(tmp_path / "grey.gif", size=4, num_frames=3)[:, 0, 0, 0].tolist() == [0, 100, 200]
    with pytest.raises(ValueError, match=r"grey\.gif has 5 frames; 6 are needed"):
        load_pixels(tmp_path / "grey.gif", size=4, num_frames=6)
