# ruff: noqa: E402  (imports follow the importorskip of the optional extra)
"""vl_judge: the JSON parser by hand, and the tiny Qwen2.5-VL judge through HFEngine on real media."""

import pytest

pytest.importorskip("torch")  # the [hf] extra; skipped in the torch-free session
av = pytest.importorskip("av")

import numpy as np
from PIL import Image

from rl_rewards.samples import Sample
from rl_rewards.scorers.vl_judge import VLJudgeScorer, judgement_score, parse_judgement

FULL = {"factuality": 1.0, "temporal_alignment": 0.5, "coverage": 0.5, "hallucination_penalty": 1.0}


@pytest.mark.parametrize(
    ("text", "criteria", "failed"),
    [
        ('{"factuality": 1, "temporal_alignment": 0.5, "coverage": 0.5, "hallucination_penalty": 1, "reason": "ok"}', FULL, False),
        ('```json\n{"factuality": 1, "temporal_alignment": 0.5, "coverage": 0.5, "hallucination_penalty": 1}\n```', FULL, False),
        ('Sure! {"factuality": 1.7, "temporal_alignment": 0.5, "coverage": 0.5, "hallucination_penalty": 1} hope it helps',
         FULL, False),  # first { to last }, 1.7 clipped to 1
        ('{"factuality": -2, "temporal_alignment": 0.5, "coverage": 0.5}',
         {"factuality": 0.0, "temporal_alignment": 0.5, "coverage": 0.5, "hallucination_penalty": 0.0}, True),
        ("no json at all", dict.fromkeys(FULL, 0.0), True),
        ('{"factuality": "high"', dict.fromkeys(FULL, 0.0), True),
    ],
)
def test_parse_judgement(text, criteria, failed):
    assert parse_judgement(text) == (criteria, failed)


def test_weights_hand_worked():
    # 0.30*1 + 0.25*0.5 + 0.25*0.5 + 0.20*1 = 0.75
    assert judgement_score(FULL) == pytest.approx(0.75)


def _video(path, frames=6):
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            image = np.full((48, 64, 3), 40 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_tiny_vl_judge_scores_media_and_fails_missing_media(tmp_path):
    from rl_models.tiny import build
    from rl_rollout.hf import HFEngine

    engine = _Recording(HFEngine.from_pretrained(build("qwen2_5_vl"), device="cpu"))
    scorer = VLJudgeScorer(engine, max_frames=4, max_pixels=56 * 56, max_new_tokens=8)
    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), "red").save(image)
    video = _video(tmp_path / "clip.mp4")
    results = scorer.score([
        Sample(completion="A red square.", metadata={"image": str(image)}),
        Sample(completion="[00:00] dark [00:02] bright", metadata={"video": str(video)}),
        Sample(completion="x", metadata={"video": str(tmp_path / "missing.mp4")}),
        Sample(completion="no media at all", metadata={}),
        Sample(completion="an empty path", metadata={"video": ""}),  # CapRL++'s client: no video
    ])
    for r in [*results[:2], *results[3:]]:  # random weights do not write JSON: CapRL's 0, flagged
        assert r.error is None and r.score == 0.0 and r.components["parse_failed"] == 1.0
        assert set(r.components) == {*FULL, "parse_failed"}
    assert "missing.mp4" in results[2].error
    # the judge got the two media samples with their media, the two without as text alone
    kinds = [[part["type"] for part in request[0]["content"]] for request in engine.requests]
    assert kinds == [["image", "text"], ["video", "text"], ["text"], ["text"]]
    assert "Caption:\nno media at all" in engine.requests[2][0]["content"][0]["text"]


def test_a_trainers_frames_are_judged_against_its_prompt(tmp_path):
    """A video trainer's sample (diffusion-grpo's): the frames in memory, as PIL images or an array,
    no completion. The judge gets at most max_frames of them, first and last kept, fitted to
    max_pixels, and the prompt as the description to grade; an empty video fails its sample."""
    from rl_models.tiny import build
    from rl_rollout.hf import HFEngine

    engine = _Recording(HFEngine.from_pretrained(build("qwen2_5_vl"), device="cpu"))
    scorer = VLJudgeScorer(engine, max_frames=4, max_pixels=56 * 56, max_new_tokens=8)
    frames = [Image.new("RGB", (128, 96), (40 * i, 0, 0)) for i in range(7)]  # red rising
    results = scorer.score([
        Sample(completion="", prompt="a screen turning red", metadata={"video": frames}),
        Sample(completion="", prompt="the same as an array", metadata={"video": np.stack([np.asarray(f) for f in frames])}),
        Sample(completion="", prompt="nothing", metadata={"video": []}),
    ])
    assert [r.error is None and r.components["parse_failed"] == 1.0 for r in results[:2]] == [True, True]
    assert "the video has no frames" in results[2].error
    first, second = ([part for part in request[0]["content"]] for request in engine.requests)
    for request, prompt in ((first, "a screen turning red"), (second, "the same as an array")):
        video = request[0]["video"]  # [N, H, W, 3]
        assert video.shape[0] == 4 and video.shape[1] * video.shape[2] <= 56 * 56
        assert [int(frame[..., 0].mean()) for frame in video] == [0, 80, 160, 240]  # frames 0, 2, 4 and 6
        assert request[1]["text"].endswith(f"Caption:\n{prompt}")
    assert np.array_equal(first[0]["video"], second[0]["video"])


class _Recording:
    """The real engine, keeping the requests it was sent."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def generate(self, requests, params):
        self.requests += requests
        return self.engine.generate(requests, params)
