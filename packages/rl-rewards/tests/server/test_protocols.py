"""Wire <-> sample translation of the server routes (pure functions, no server)."""

from __future__ import annotations

import pytest

from rl_rewards import wire
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server import protocols
from rl_rewards.server.limits import confine_sample

pytestmark = pytest.mark.no_torch


def test_empty_video_path_means_no_media(tmp_path):
    for path in ("", "  "):
        sample = protocols.vl_judge_sample(wire.VLJudgeSample(caption="a dog", video_path=path))
        assert sample == Sample(completion="a dog")
        assert confine_sample(sample, []) == sample  # nothing to confine, even with no media root
    named = protocols.vl_judge_sample(wire.VLJudgeSample(caption="a dog", video_path="clip.mp4"))
    assert named.metadata == {"video": "clip.mp4"}
    assert confine_sample(named, [str(tmp_path)]).metadata == {"video": str(tmp_path / "clip.mp4")}


def test_without_a_media_root_a_named_video_is_that_samples_error():
    named = protocols.vl_judge_sample(wire.VLJudgeSample(caption="a dog", video_path="clip.mp4"))
    with pytest.raises(ValueError, match=r"metadata.video: media path 'clip.mp4' refused: the server has no --media-root"):
        confine_sample(named, [])


def test_a_non_finite_score_is_that_samples_error_on_the_openrlhf_route():
    prepared = [Sample(completion="a"), "metadata.image: refused", Sample(completion="b")]
    scored = [ScoreResult(score=float("nan"), components={"fmt": 1.0}), ScoreResult(score=0.5, components={"fmt": 0.5})]
    merged = protocols.merge(prepared, scored)
    assert [r.score for r in merged] == [None, None, 0.5]
    assert "non-finite score nan" in merged[0].error and merged[0].components == {"fmt": 1.0}
    response = protocols.openrlhf_response(merged, ["fmt", "fmt.sub"])
    assert response.rewards == [0.0, 0.0, 0.5]  # never NaN (JSON null)
    assert response.extra_logs == {"failed": [1.0, 1.0, 0.0], "fmt": [1.0, 0.0, 0.5], "fmt.sub": [0.0, 0.0, 0.0]}
