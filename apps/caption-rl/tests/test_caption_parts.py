"""The captioning-specific pieces: data loading, batches, reward backends (in process, as a
compiled or inline RewardSpec, and against a real `rl-rewards serve` process)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch
from caption_config import Config, RewardConfig
from caption_data import load_records, make_sample
from conftest import DATA, RULE_SPEC, free_port, tiny_overrides

from rl_core.train import UserError, load_config, run_app
from rl_data import chat_messages
from rl_models import tiny
from rl_models.vl import placeholder_ids
from rl_policy.training import Rollout, collate
from rl_rewards.caprl import CaprlLocalReward as LocalReward
from rl_rewards.caprl import CaprlServerReward as RemoteReward
from rl_rewards.caprl import RewardUnavailable, caprl_spec
from rl_rewards.spec import load_spec
from rl_rollout.prompts import EncodedPrompt, encode_prompt

IMAGES, VIDEOS = DATA / "caption_qa_images.jsonl", DATA / "caption_qa_videos.jsonl"


def test_records_without_qa_are_skipped_and_counted(tmp_path):
    rows = [json.loads(line) for line in IMAGES.read_text().splitlines()[:3]]
    rows[1]["reward_model"]["ground_truth"] = []
    for row in rows:
        row["image"] = str(DATA / (row["image"]["path"] if isinstance(row["image"], dict) else row["image"]))
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    data = load_records([str(path)], [], eval_size=1, task="auto", seed=0)
    assert data.skipped == 2  # the QA-less row and the broken line
    assert len(data.train) == 1 and len(data.eval) == 1


def test_task_filter_and_clear_errors_for_missing_inputs(tmp_path):
    data = load_records([str(IMAGES), str(VIDEOS)], [], eval_size=0, task="video", seed=0)
    assert len(data.train) == 3 and {r.kind for r in data.train} == {"video"}
    with pytest.raises(UserError, match=r"dataset file not found: .*nope\.jsonl"):
        load_records([str(tmp_path / "nope.jsonl")], [], eval_size=0, task="auto", seed=0)
    with pytest.raises(UserError, match=r"dataset file not found: nobody/no-such-dataset .*offline mode"):
        load_records(["nobody/no-such-dataset"], [], eval_size=0, task="auto", seed=0)  # a Hub id not in the cache
    with pytest.raises(UserError, match=r"data\.train_files is empty"):
        load_records([], [], eval_size=0, task="auto", seed=0)
    with pytest.raises(UserError, match=r"model not found: .*missing-model"):
        tiny.resolve(str(tmp_path / "missing-model"), key="model.path")


def test_collate_aligns_completions_and_blanks_sampled_placeholders():
    vl = tiny.build("qwen2_5_vl")
    from transformers import AutoConfig

    holes = placeholder_ids(AutoConfig.from_pretrained(vl))
    image_pad = min(holes)
    rollouts = [
        Rollout(EncodedPrompt([5, 6, 7]), [8, 9], [0.0, 0.0], valid=True),
        Rollout(EncodedPrompt([5]), [10, image_pad, 11], [0.0] * 3, valid=False),
    ]
    batch = collate(rollouts, pad_id=0, placeholders=holes)
    assert batch.prompt_length == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 10, 0, 11]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_local_rule_reward_scores_every_sample():
    data = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0)
    reward = LocalReward(RewardConfig(spec=str(RULE_SPEC)), length_tokenizer="whitespace", seed=0)
    good = make_sample(data.train[0], "[00:01] the background turns red [00:03] a square appears")
    bad = make_sample(data.train[0], "no timestamps at all")
    results = reward.score([good, bad])
    assert results[0].components["format"] == 1.0 and results[1].components["format"] == 0.0
    assert results[0].score == pytest.approx(1.0 + results[0].components["length"])


def _remote(url: str, retries: int = 2) -> RemoteReward:
    config = RewardConfig(retries=retries, timeout=60, length_l1=8, length_l2=24, length_weight=0.2, variety_weight=0.5)
    return RemoteReward(config, url, length_tokenizer="whitespace")


def test_remote_reward_against_a_real_server_then_the_server_dies(reward_server):
    url, proc = reward_server
    data = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0)
    remote = _remote(url)
    samples = [make_sample(data.train[0], "[00:01] the background turns red, [00:03] a green square appears"),
               make_sample(data.train[1], "nothing useful")]
    results = remote.score(samples)
    assert all(r.score is not None for r in results)
    for r in results:  # CapRL's server total (qa + 0.2 format) plus the locally added 0.2 length and 0.5 variety
        assert set(r.components) == {"qa", "format", "length", "variety"}
        assert r.score == pytest.approx(r.components["qa"] + 0.2 * r.components["format"] + 0.2 * r.components["length"]
                                        + 0.5 * r.components["variety"])
    assert results[0].components["format"] == 1.0 and results[1].components["format"] == 0.0
    # "nothing useful": 2 distinct words of the target 8, every piece a word
    assert results[1].components["variety"] == pytest.approx(2 / 8)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    started = time.monotonic()
    with pytest.raises(RewardUnavailable, match="gave up after 2 attempt"):
        remote.score(samples)  # retried, then the caller skips the step: never a silent zero
    assert time.monotonic() - started < 60


def test_a_reward_server_that_is_down_at_start_is_a_clear_error(app, tmp_path, capsys):
    """The run stops at setup with one line naming the URL and what to do, exit 2."""
    url = f"http://127.0.0.1:{free_port()}/get_reward"
    assert run_app(app.NAME, app.main, [*tiny_overrides(tmp_path), f"reward.url={url}"]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"caption-rl: error: reward server http://127\.0\.0\.1:\d+ is not reachable \(.*\); start "
                        r"it with `rl-rewards serve` or fix reward\.url / REWARD_REMOTE_URL", line), line


def test_collate_media_rows_follow_their_prompts():
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny.build("qwen2_5_vl"))
    data = load_records([str(IMAGES)], [], eval_size=0, task="auto", seed=0)
    prompts = [encode_prompt(chat_messages(r.prompt, r.images, r.videos, fps=2, max_frames=4, max_pixels=56 * 56),
                             processor.tokenizer, processor, i) for i, r in enumerate(data.train[:2])]
    batch = collate([Rollout(p, [1, 2], [0.0, 0.0], valid=True) for p in prompts], pad_id=0)
    assert batch.image_grid_thw.shape == (2, 3)
    assert batch.pixel_values.shape[0] == int(torch.prod(batch.image_grid_thw, dim=1).sum())


def test_caprl_server_format_formula_in_process():
    """`reward.format_variant = "caprl-server"`: the formula CapRL++'s server computes ("[00:01] x":
    0.45 * 1/3 + 0.25 + 0.30 = 0.70) instead of the README's (1.0)."""
    data = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0)
    sample = make_sample(data.train[0], "[00:01] x")
    scores = {}
    for variant in ("readme", "caprl-server"):
        config = RewardConfig(judge="tiny:qwen3", qa_estimator="sample", qa_num=2, length_l1=8, length_l2=24,
                              format_variant=variant, answer_parser="caprl")
        reward = LocalReward(config, length_tokenizer="whitespace", seed=0)
        [result] = reward.score([sample])
        scores[variant] = result.components["format"]
    assert scores == {"readme": 1.0, "caprl-server": pytest.approx(0.70)}


def test_the_caprl_shorthand_compiles_to_a_reward_spec_and_an_inline_spec_replaces_it(tmp_path):
    """reward.format_weight / length_* are CapRL++'s reward written as a RewardSpec (video rows get
    the format term); `reward.spec` as an inline table scores like the same spec in a file."""
    video = caprl_spec(RewardConfig(format_weight=0.3, length_l1=4, length_l2=9), "video", "whitespace")
    assert list(video.components) == ["qa", "length", "format"]
    assert video.components["format"].weight == 0.3 and video.components["length"].options["l2"] == 9
    assert "format" not in caprl_spec(RewardConfig(), "image", "whitespace").components
    inline = tmp_path / "inline.toml"
    inline.write_text("[reward.spec.components.format]\nscorer = \"timestamp_format\"\n"
                      "[reward.spec.components.length]\nscorer = \"length\"\n"
                      "options = { tokenizer = \"whitespace\", l1 = 1, l2 = 6 }\n")
    config = load_config(Config, inline)
    assert config.reward.spec == load_spec(RULE_SPEC)
    data = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0)
    samples = [make_sample(data.train[0], "[00:01] red [00:03] a square"), make_sample(data.train[1], "no stamps")]
    from_table = LocalReward(config.reward, length_tokenizer="whitespace", seed=0).score(samples)
    from_file = LocalReward(RewardConfig(spec=str(RULE_SPEC)), length_tokenizer="whitespace", seed=0).score(samples)
    assert [r.score for r in from_table] == [r.score for r in from_file] and from_table[0].score != from_table[1].score
