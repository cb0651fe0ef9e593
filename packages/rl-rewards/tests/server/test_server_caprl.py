"""CapRL drop-in: `/get_reward` qa requests (video task) against a real server whose judge is
the tiny random-weight Qwen3 checkpoint of `rl_models.tiny`, loaded through from_pretrained.
Needs rl-rewards[hf] (torch); the no-torch paths are in test_server_http.py."""

from __future__ import annotations

import httpx
import pytest
from conftest import assert_healthy, server_process

from rl_rewards.rules import timestamp_format

pytestmark = pytest.mark.slow  # the server process imports torch and loads the judge: ~1-2 min on 2 cores
tiny = pytest.importorskip("rl_models.tiny")
pytest.importorskip("rl_rewards.scorers.caption_qa")

QUESTION = "What colour is the circle?\n   - A) red\n   - B) blue\n   - C) green"
CAPTIONS = ["[00:01] a red circle [00:04] it fades", "[00:09] a dog [00:02] runs", "no stamps at all"]


@pytest.fixture(scope="module")
def judge_path():
    return str(tiny.build("qwen3"))


@pytest.fixture(scope="module")
def caprl_server(tmp_path_factory, judge_path):
    tmp = tmp_path_factory.mktemp("caprl")
    env = {"REWARD_MODEL": judge_path, "REWARD_TASK": "video", "REWARD_QA_NUM": "4", "FORMAT_REWARD_WEIGHT": "0.2"}
    args = ["--judge-option", "estimator=exact", "--judge-option", 'engine_options={"device": "cpu"}']
    with server_process(tmp, "caprl", args, env=env, ready_timeout=300) as proc:
        yield proc


def test_qa_video_request_matches_in_process_scorer(caprl_server, judge_path):
    from rl_rewards.registry import build_scorer
    from rl_rewards.samples import Sample

    qa = [[QUESTION, "A"], ["Is it moving?\n   - A) yes\n   - B) no", "B"]]
    body = {"prompts": [[c, qa] for c in CAPTIONS], "query": [], "labels": []}
    r = httpx.post(f"{caprl_server.url}/get_reward", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"rewards", "qa_rewards", "format_rewards"}
    assert out["format_rewards"] == [timestamp_format(c) for c in CAPTIONS]
    scorer = build_scorer("caption_qa", model=judge_path, task="video", estimator="exact",
                          engine_options={"device": "cpu"})
    expected = [res.score for res in scorer.score([Sample(completion=c, reference=qa) for c in CAPTIONS])]
    assert out["qa_rewards"] == pytest.approx(expected, abs=1e-4)
    assert out["rewards"] == pytest.approx([q + 0.2 * f for q, f in zip(expected, out["format_rewards"], strict=True)], abs=1e-4)


def test_bad_sample_is_its_own_error(caprl_server):
    body = {"prompts": [["[00:01] ok", [[QUESTION, "A"]]], ["[00:01] empty", []], ["[00:02] x", [[QUESTION, "A"]]]]}
    out = httpx.post(f"{caprl_server.url}/get_reward", json=body, timeout=120).json()
    assert out["errors"][0] is None and out["errors"][2] is None
    assert "empty QA list" in out["errors"][1]
    assert out["rewards"][1] == 0.0 and 0.0 <= out["qa_rewards"][0] <= 1.0
    assert out["rewards"][0] == pytest.approx(out["qa_rewards"][0] + 0.2 * 1.0, abs=1e-6)
    assert_healthy(caprl_server.url)
