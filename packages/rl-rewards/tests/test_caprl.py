"""CapRL++'s training-side reward (`rl_rewards.caprl`) without torch: the shorthand compiled to a
RewardSpec, a spec of one's own scored per task, where the server's URL comes from, and a server
that is down at start. The judge-backed reward and a live server run in caption-rl's tests."""

from __future__ import annotations

import socket

import pytest

from rl_rewards import Sample
from rl_rewards.caprl import (
    CaprlLocalReward,
    CaprlRewardConfig,
    CaprlServerReward,
    build_caprl_reward,
    caprl_spec,
)
from rl_rewards.client import RewardClientError
from rl_rewards.spec import Component, RewardSpec

pytestmark = pytest.mark.no_torch


def test_the_shorthand_is_qa_plus_length_and_format_on_video_rows() -> None:
    config = CaprlRewardConfig(format_weight=0.3, length_weight=0.1, length_l1=4, length_l2=9, format_variant="caprl-server")
    video = caprl_spec(config, "video", "whitespace")
    assert list(video.components) == ["qa", "length", "format"]
    assert (video.components["format"].weight, video.components["format"].options["variant"]) == (0.3, "caprl-server")
    assert video.components["length"].weight == 0.1 and video.components["length"].options["l2"] == 9
    assert list(caprl_spec(config, "image", "whitespace").components) == ["qa", "length"]
    varied = caprl_spec(CaprlRewardConfig(variety_weight=0.5, variety_target=3), "image", "whitespace")
    assert list(varied.components) == ["qa", "length", "variety"]
    assert (varied.components["variety"].weight, varied.components["variety"].options) == (0.5, {"target": 3})


def test_a_spec_of_ones_own_scores_image_and_video_rows_in_their_order() -> None:
    spec = RewardSpec(components={
        "format": Component(scorer="timestamp_format"),
        "length": Component(scorer="length", weight=0.5, options={"tokenizer": "whitespace", "l1": 1, "l2": 3})})
    reward = build_caprl_reward(CaprlRewardConfig(spec=spec), policy_path="unused", seed=0)
    assert isinstance(reward, CaprlLocalReward) and reward.weights == {"format": 1.0, "length": 0.5}
    samples = [Sample(completion="[00:01] a b c d", metadata={"task": "video"}),
               Sample(completion="a", metadata={"task": "image"}),
               Sample(completion="[00:02] x", metadata={"task": "video"})]
    results = reward.score(samples)
    assert [r.components["format"] for r in results] == [1.0, 0.0, 1.0]
    # length: 1 up to l1 = 1 word, falling linearly to 0 at l2 = 3 words (5 words: 0; 2 words: 0.5)
    assert [r.score for r in results] == pytest.approx([1.0 + 0.5 * 0.0, 0.0 + 0.5 * 1.0, 1.0 + 0.5 * 0.5])


def test_the_server_url_and_a_server_down_at_start() -> None:
    assert CaprlRewardConfig().server_url() is None
    assert CaprlRewardConfig(host="10.0.0.2", port=9).server_url() == "http://10.0.0.2:9/get_reward"
    assert CaprlRewardConfig(url="http://a/get_reward", host="b").server_url() == "http://a/get_reward"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(RewardClientError, match=rf"reward server http://127\.0\.0\.1:{port} is not reachable .*"
                                                     r"start it with `rl-rewards serve`"):
            CaprlServerReward(CaprlRewardConfig(retries=1, timeout=5), f"http://127.0.0.1:{port}/get_reward",
                              length_tokenizer="whitespace")
