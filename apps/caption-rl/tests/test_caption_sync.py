"""The `vllm` rollout path on a real vLLM (opt-in `-m vllm`, needs a GPU): a colocated engine
asleep during the update, the policy's weights pushed after every optimizer step (LoRA merged,
or full fine-tuning), images and videos; and `rollout.engine=auto` picking vLLM there. The
in-process QA judge on vLLM (`reward.judge_engine=auto` picks it there): beside a vLLM policy
engine in one run, and scoring as the hf judge does."""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch
from conftest import tiny_overrides

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]
# enforce_eager: a tiny model starts in seconds instead of compiling and capturing CUDA graphs
FAST = ["rollout.gpu_memory_utilization=0.2", "rollout.engine_options.enforce_eager=true",
        "rollout.engine_options.max_model_len=4096"]


def app_rows(run):
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("step")]


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_weight_sync_with_real_vllm(app, tmp_path, tuning):
    """3 steps at a high learning rate: each rollout after the first comes from the weights of the
    previous optimizer step (version = optimizer steps), so the engine's log-probs keep matching
    the trainer's; without the push they would drift apart as the policy moves."""
    tune = ["model.lora_rank=4", "train.lr=5e-2"] if tuning == "lora" else ["model.lora_rank=0", "train.lr=1e-3"]
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, *tune, "data.eval_size=0",
                                  "train.max_steps=3", "algo.old_logprobs=replay"))
    rows = app_rows(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 1.0, 2.0]
    for row in rows:
        assert float(row["replay/engine_diff_mean"]) < 1e-2, row  # trainer vs vLLM kernels (passed at this bound on an H100)


def test_auto_picks_vllm_and_says_so(app, tmp_path, capfd):
    app.main(tiny_overrides(tmp_path, *FAST, "data.eval_size=0", "train.max_steps=1"))
    assert "rollout.engine: vllm (auto: CUDA device and vLLM found)" in capfd.readouterr().out


def test_asynchronous_rollouts_with_real_vllm(app, tmp_path):
    """train.max_staleness=1: the engine stays awake, the rollout thread samples step j + 1 while
    step j trains, and each version of the weights reaches vLLM as a push between its requests: step
    j samples with the weights after step j - 2 (optimizer steps 0, 0, 1, 2), never newer, never
    older. Step 1 samples with the weights it trains, so its engine gap is kernels only."""
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, "model.lora_rank=0", "train.lr=1e-3",
                                  "data.eval_size=0", "train.max_steps=4", "train.max_staleness=1",
                                  "algo.rollout_correction=token_truncate"))
    rows = app_rows(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert [float(r["rollout/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert float(rows[0]["replay/engine_diff_mean"]) < 1e-2, rows[0]
    for row in rows:
        assert 0.0 <= float(row["replay/engine_kl"]) < 1.0, row  # finite, and the push landed (else it grows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for the engine")
@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="needs Ray for the actor"))])
def test_asynchronous_rollouts_on_a_vllm_gpu_of_its_own(app, tmp_path, workers):
    """rollout.placement=split with vLLM: one training process on GPU 0, its vLLM engine on GPU 1,
    never asleep. `workers=0`: its engine core in a process of its own, each version pushed there
    by CUDA IPC between requests. `workers=1`: the whole engine, vLLM's client included, in a Ray
    actor (a local Ray instance given every GPU but the trainer's), each version pushed whole.
    Both: the same versions and bounds as the colocated engine above, and none of vLLM's memory
    on the trainer's GPU (its fraction, 0.2 of the card, would show in the trainer's peaks)."""
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, "model.lora_rank=0", "train.lr=1e-3",
                                  "data.eval_size=0", "train.max_steps=4", "train.max_staleness=1",
                                  "rollout.placement=split", f"rollout.workers={workers}",
                                  "algo.rollout_correction=token_truncate"))
    rows = app_rows(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert [float(r["rollout/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert float(rows[0]["replay/engine_diff_mean"]) < 1e-2, rows[0]
    for row in rows:
        assert 0.0 <= float(row["replay/engine_kl"]) < 1.0, row
        peaks = {k: float(v) for k, v in row.items() if k.startswith("memory/") and v}
        assert peaks and max(peaks.values()) < 2.0, peaks  # GiB on GPU 0: the tiny policy, not vLLM's 0.2 of a card


JUDGE_FAST = ["reward.spec=null", "reward.judge=tiny:qwen3", "reward.judge_gpu_memory_utilization=0.2",
              "reward.judge_engine_options.enforce_eager=true"]


def test_in_process_judge_on_vllm_beside_a_vllm_policy_engine(app, tmp_path, capsys):
    """The judge's engine core runs in a process of its own, built before the policy's
    in-process one (two engine cores cannot share a process); it sleeps outside the reward
    phase, so both fit one GPU with the trainer."""
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, *JUDGE_FAST, "data.eval_size=0",
                                  "train.max_steps=2"))
    assert "caption_qa judge tiny:qwen3: engine vllm (auto: CUDA device and vLLM found)\n" in capsys.readouterr().out
    rows = app_rows(run)
    assert len(rows) == 2
    for row in rows:
        assert float(row["reward/failed"]) == 0 and 0 <= float(row["reward/qa"]) <= 1, row


def test_in_process_judge_on_vllm_scores_as_the_hf_judge():
    """The same QA rewards from the judge on vLLM as on hf (vLLM's scoring itself is compared
    with hf's in rl-rollout's test_vllm; here: the app's wiring), and the vLLM judge is asleep
    before and after each score call."""
    from caption_config import RewardConfig
    from caption_data import load_records, make_sample
    from conftest import DATA

    from rl_rewards.caprl import CaprlLocalReward as LocalReward

    data = load_records([str(DATA / "caption_qa_images.jsonl")], [], eval_size=0, task="auto", seed=0)
    samples = [make_sample(row, caption) for row, caption in zip(data.train[:4], [
        "a red circle on a white table", "a blue square", "nothing to see", "a green triangle and a red circle"], strict=True)]
    base = {"judge": "tiny:qwen3", "length_l1": 8, "length_l2": 24}
    hf = LocalReward(RewardConfig(**base, judge_engine="hf"), length_tokenizer="whitespace", seed=0)
    on_vllm = LocalReward(RewardConfig(**base, judge_gpu_memory_utilization=0.2,
                                       judge_engine_options={"enforce_eager": True}), length_tokenizer="whitespace", seed=0)
    assert on_vllm.swapped is not None and on_vllm.swapped.state == "asleep"
    expected, got = hf.score(samples), on_vllm.score(samples)
    assert on_vllm.swapped.state == "asleep"
    assert all(r.error is None for r in expected + got)
    # vLLM's kernels (and its dtype="auto" choice) differ from hf's float32 forward: rl-rollout's test_vllm's 2e-2 bound
    assert [r.components["qa"] for r in got] == pytest.approx([r.components["qa"] for r in expected], abs=2e-2)
    on_vllm.close()


def test_partial_rollouts_with_real_vllm(app, tmp_path):
    """train.partial_rollouts on vLLM: captions of image and video prompts continued chunk by chunk
    (token ids with the media, which vLLM expands again); the first step's engine gap stays at the
    kernels' and later steps train tokens of older versions."""
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, "model.lora_rank=0", "train.lr=1e-3",
                                  "data.eval_size=0", "train.max_steps=3",
                                  "train.partial_rollouts.steps=1", "train.partial_rollouts.chunk_tokens=3",
                                  "algo.rollout_correction=token_truncate"))
    rows = app_rows(run)
    assert float(rows[0]["replay/engine_diff_mean"]) < 1e-2, rows[0]
    assert max(float(r["rollout/token_staleness_max"]) for r in rows) >= 1
