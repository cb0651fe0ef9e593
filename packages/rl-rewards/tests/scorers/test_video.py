"""`per_frame` and `temporal_consistency`: video rewards over a sample's frames, through the registry."""

import pytest

pytest.importorskip("PIL")  # the [ocr] or [vision] extra; skipped in the torch-free session

import numpy as np
from PIL import Image

from rl_rewards.composition import build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample
from rl_rewards.scorers.video import lift_to_video
from rl_rewards.spec import Component, RewardSpec


def grey(level: int) -> Image.Image:
    return Image.new("RGB", (4, 4), (level, level, level))


VIDEO = [grey(51), grey(102), grey(153), grey(204)]  # brightness 0.2, 0.4, 0.6, 0.8


@pytest.mark.parametrize("aggregate, frames, expected", [
    ("mean", None, 0.5), ("min", None, 0.2), ("max", None, 0.8),
    ("mean", 2, 0.5),  # the first and the last frame
    ("min", 3, 0.2), ("mean", 1, 0.2),  # frames 0, 2 (rounded from 1.5), 3; the first alone
])
def test_per_frame_folds_an_image_scorer_over_the_kept_frames(aggregate, frames, expected):
    scorer = build_scorer("per_frame", scorer="brightness", aggregate=aggregate, frames=frames)
    [result] = scorer.score([Sample(completion="", metadata={"video": VIDEO})])
    assert result.score == pytest.approx(expected)


def test_per_frame_takes_arrays_and_fails_a_bad_sample_alone():
    array = np.stack([np.full((4, 4, 3), v, dtype=np.uint8) for v in (0, 255)])  # [F, H, W, 3]
    results = build_scorer("per_frame", scorer="brightness").score([
        Sample(completion="", metadata={"video": array}),
        Sample(completion="", metadata={}),
        Sample(completion="", metadata={"video": "missing/clip.mp4"}),
        Sample(completion="", metadata={"video": []}),
    ])
    assert results[0].score == pytest.approx(0.5)
    assert [r.score for r in results[1:]] == [None] * 3
    assert "no 'video'" in str(results[1].error) and "'missing/clip.mp4' does not exist" in str(results[2].error)
    assert "no frames" in str(results[3].error)
    with pytest.raises(ValueError, match="aggregate='median'"):
        build_scorer("per_frame", scorer="brightness", aggregate="median")
    with pytest.raises(KeyError, match="unknown scorer 'sharpness'"):
        build_scorer("per_frame", scorer="sharpness")


def test_temporal_consistency_is_one_minus_the_mean_frame_change():
    flicker = [grey(0), grey(255), grey(0)]
    results = build_scorer("temporal_consistency").score([
        Sample(completion="", metadata={"video": VIDEO}),
        Sample(completion="", metadata={"video": [grey(10)] * 3}),
        Sample(completion="", metadata={"video": flicker}),
        Sample(completion="", metadata={"video": VIDEO[:1]}),
    ])
    assert [r.score for r in results] == pytest.approx([0.8, 1.0, 0.0, 1.0])


def test_a_video_reward_spec_sums_a_per_frame_term_and_consistency():
    spec = RewardSpec(components={
        "bright": Component(scorer="per_frame", options={"scorer": "brightness", "aggregate": "min"}),
        "steady": Component(scorer="temporal_consistency", weight=0.5)})
    [result] = build_reward(spec).score([Sample(completion="", metadata={"video": VIDEO})])
    assert result.score == pytest.approx(0.2 + 0.5 * 0.8)
    assert result.components == pytest.approx({"bright": 0.2, "steady": 0.8})


def test_lift_to_video_scores_image_components_per_frame_and_keeps_the_rest():
    spec = lift_to_video(RewardSpec(components={
        "bright": Component(scorer="brightness", weight=2.0, fallback=0.0),
        "steady": Component(scorer="temporal_consistency", weight=0.5)}), aggregate="max", frames=2)
    bright = spec.components["bright"]
    assert (bright.scorer, bright.weight, bright.fallback) == ("per_frame", 2.0, 0.0)
    assert bright.options == {"scorer": "brightness", "options": {}, "aggregate": "max", "frames": 2}
    assert spec.components["steady"] == Component(scorer="temporal_consistency", weight=0.5)
    [result] = build_reward(spec).score([Sample(completion="", metadata={"video": VIDEO})])
    assert result.score == pytest.approx(2.0 * 0.8 + 0.5 * 0.8)  # the first and last frames' max; 1 - 0.2


def test_a_servers_request_names_a_video_file_gif_or_mp4(tmp_path):
    """A reward server gets the path of the video the trainer wrote: a GIF through Pillow (exact
    for flat colours), an MP4 through PyAV (H.264 rounds each flat frame by a grey level or two)."""
    greys = (0, 128, 255)
    frames = [Image.new("RGB", (16, 16), (g, g, g)) for g in greys]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=125, loop=0)
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    scorer = build_scorer("per_frame", scorer="brightness", aggregate="min")
    gif, broken = scorer.score([Sample(completion="", metadata={"video": str(tmp_path / "clip.gif")}),
                                Sample(completion="", metadata={"video": str(tmp_path / "broken.mp4")})])
    assert gif.score == 0.0 and broken.score is None and "broken.mp4" in str(broken.error)
    steady = build_scorer("temporal_consistency").score([Sample(completion="", metadata={"video": tmp_path / "clip.gif"})])
    assert steady[0].score == pytest.approx(1 - (128 + 127) / 255 / 2)
    av = pytest.importorskip("av")  # the MP4 half needs PyAV (not a dependency of rl-rewards)
    with av.open(str(tmp_path / "clip.mp4"), mode="w") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(frame)))
        out.mux(stream.encode())
    [mp4] = build_scorer("per_frame", scorer="brightness").score([Sample(completion="", metadata={
        "video": str(tmp_path / "clip.mp4")})])
    assert mp4.score == pytest.approx(sum(greys) / 3 / 255, abs=3 / 255)
