"""The captioning-specific pieces: records -> messages, data loading, batches, reward backends
(in process and against a real `rl-rewards serve` process)."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from caption_parts import (
    LocalReward,
    RemoteReward,
    RewardUnavailable,
    load_records,
    make_sample,
    placeholder_ids,
    resolve_model,
    to_messages,
)
from conftest import DATA, RULE_SPEC, free_port
from PIL import Image

from rl_core.train import UserError
from rl_models import tiny
from rl_rollout.prompts import EncodedPrompt
from rl_rollout.training import Rollout, collate

IMAGES, VIDEOS = DATA / "caption_qa_images.jsonl", DATA / "caption_qa_videos.jsonl"


def test_to_messages_puts_decoded_media_where_the_placeholders_are():
    image = next(iter(load_records([str(IMAGES)], [], eval_size=0, task="auto", seed=0).train))
    video = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0).train[0]
    [user] = to_messages(image, fps=2.0, max_frames=4, max_pixels=56 * 56)
    assert [p["type"] for p in user["content"]] == ["image", "text"]
    assert isinstance(user["content"][0]["image"], Image.Image)
    assert user["content"][0]["image"].width * user["content"][0]["image"].height <= 56 * 56
    assert user["content"][1]["text"] == "Please describe this image in detail."
    [user] = to_messages(video, fps=2.0, max_frames=4, max_pixels=32 * 32)
    frames = user["content"][0]["video"]
    assert user["content"][0]["type"] == "video" and isinstance(frames, np.ndarray)
    assert frames.shape[0] == 4 and frames.shape[-1] == 3  # 5 s at 2 fps = 10 frames, capped at 4
    assert "[mm:ss]" in user["content"][1]["text"]


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
    with pytest.raises(UserError, match=r"data\.train is empty"):
        load_records([], [], eval_size=0, task="auto", seed=0)
    with pytest.raises(UserError, match=r"model not found: .*missing-model"):
        resolve_model(str(tmp_path / "missing-model"))
    assert resolve_model("Qwen/Qwen3-VL-4B-Instruct") == "Qwen/Qwen3-VL-4B-Instruct"  # a hub id


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
    reward = LocalReward(judge=None, spec=str(RULE_SPEC), qa_estimator="exact", qa_num=8, format_weight=0.2,
                         length_tokenizer="whitespace", length_l1=8, length_l2=24, length_weight=0.2, seed=0)
    good = make_sample(data.train[0], "[00:01] the background turns red [00:03] a square appears")
    bad = make_sample(data.train[0], "no timestamps at all")
    results = reward.score([good, bad])
    assert results[0].components["format"] == 1.0 and results[1].components["format"] == 0.0
    assert results[0].score == pytest.approx(1.0 + results[0].components["length"])


def _remote(url: str, retries: int = 2) -> RemoteReward:
    return RemoteReward(url, retries=retries, timeout=60, length_tokenizer="whitespace", length_l1=8, length_l2=24,
                        length_weight=0.2)


def test_remote_reward_against_a_real_server_then_the_server_dies(reward_server):
    url, proc = reward_server
    data = load_records([str(VIDEOS)], [], eval_size=0, task="auto", seed=0)
    remote = _remote(url)
    samples = [make_sample(data.train[0], "[00:01] the background turns red, [00:03] a green square appears"),
               make_sample(data.train[1], "nothing useful")]
    results = remote.score(samples)
    assert all(r.score is not None for r in results)
    for r in results:  # CapRL's server total (qa + 0.2 format) plus the locally added 0.2 length
        assert set(r.components) == {"qa", "format", "length"}
        assert r.score == pytest.approx(r.components["qa"] + 0.2 * r.components["format"] + 0.2 * r.components["length"])
    assert results[0].components["format"] == 1.0 and results[1].components["format"] == 0.0
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    started = time.monotonic()
    with pytest.raises(RewardUnavailable, match="gave up after 2 attempt"):
        remote.score(samples)  # retried, then the caller skips the step: never a silent zero
    assert time.monotonic() - started < 60


def test_a_reward_server_that_is_down_at_start_is_a_clear_error():
    with pytest.raises(UserError, match=r"reward server http://127\.0\.0\.1:.* is not reachable.*rl-rewards serve"):
        _remote(f"http://127.0.0.1:{free_port()}/get_reward")


def test_collate_media_rows_follow_their_prompts():
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny.build("qwen2_5_vl"))
    data = load_records([str(IMAGES)], [], eval_size=0, task="auto", seed=0)
    from caption_parts import encode_rollout_prompt

    prompts = [encode_rollout_prompt(to_messages(r, fps=2, max_frames=4, max_pixels=56 * 56), processor, i)
               for i, r in enumerate(data.train[:2])]
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
        reward = LocalReward(judge=str(tiny.build("qwen3")), spec=None, qa_estimator="sample", qa_num=2,
                             format_weight=0.2, length_tokenizer="whitespace", length_l1=8, length_l2=24,
                             length_weight=0.2, seed=0, format_variant=variant, answer_parser="caprl")
        [result] = reward.score([sample])
        scores[variant] = result.components["format"]
    assert scores == {"readme": 1.0, "caprl-server": pytest.approx(0.70)}
