"""Diffusion-DPO (`train.method = "dpo"`) on the tiny SD3 and Wan: offline preference pairs
(examples/data/preference/brightness: a lighter and a darker copy of one picture, the lighter
preferred), the hand-worked first step, learning, the video family, and what DPO refuses. The
invariants (2 processes = 1, accumulation = one batch) are in test_launch.py."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import APP, checked, flat, setup_state, tiny_config, train

from rl_core.train import (
    ConfigError,
    UserError,
    group_advantages,
    trainable_parameters,
    unknown_metric_names,
)

PAIRS = APP.parents[1] / "examples" / "data" / "preference" / "brightness"
DPO = ("train.method=dpo", f"data.preferences={PAIRS / 'images.jsonl'}")


@pytest.fixture(scope="module", params=["lora", "full"])
def state(app, tmp_path_factory, request):
    """A LoRA policy, or (`full`, model.lora_rank=0) every weight trained against a frozen copy of the start."""
    full = ["model.lora_rank=0", "train.lr=1e-3"] if request.param == "full" else []  # every weight: a smaller step
    return setup_state(app, tiny_config(app, "sd3", tmp_path_factory.mktemp("dpo"), *DPO, "rollout.groups_per_epoch=4",
                                        "train.lr=0.1", "dpo.beta=10", *full))


def step(app, state, k: int) -> dict[str, float]:
    """Epoch `k` through the recipe's hooks and the loop's advantages."""
    recipe, acc = app.RECIPE, state.run.accelerator
    batch = recipe.rollout(state, k)
    scores = recipe.score(state, k, batch)
    adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=acc)
    return recipe.update(state, k, batch, adv)


def test_the_first_step_is_log_2_and_the_update_then_prefers_the_lighter_images(app, state) -> None:
    """Hand-worked: a fresh LoRA (B = 0) is the reference model (fully fine-tuned: the reference is
    a copy of the starting weights), so every pair's margin
    (error - reference error on the chosen minus the same on the rejected) is exactly 0 and its
    loss -log sigmoid(0) = log 2. The step: 4 pairs x int(4 steps x 0.99) = 3 noise levels, one
    optimizer step. Repeating epoch 1 (the same pairs at the same noise) after it, every pair's
    margin is negative: the policy's error fell on the lighter image against the darker one."""
    recipe = app.RECIPE
    batch = recipe.rollout(state, 1)
    [pairs] = batch.samples
    assert pairs.chosen.shape == pairs.rejected.shape == (4, 4, 16, 16)  # 32x32 pixels through the tiny VAE
    assert not torch.equal(pairs.chosen, pairs.rejected)
    scores = recipe.score(state, 1, batch)
    assert scores.rewards.tolist() == [1.0, 0.0] * 4 and scores.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    trained = trainable_parameters(state.family.peft)
    before = {k: p.detach().clone() for k, p in trained.items()}
    first = step(app, state, 1)
    assert unknown_metric_names(first) == []
    assert (first["optimizer_steps"], first["adv/trained_samples"]) == (1, 4)
    assert first["loss/total"] == pytest.approx(math.log(2), abs=1e-6)
    assert (first["dpo/margin"], first["dpo/accuracy"]) == (0.0, 0.0)
    assert first["dpo/rejected_error"] != first["dpo/chosen_error"]
    assert any(not torch.equal(p.detach(), before[k]) for k, p in trained.items())
    again = step(app, state, 1)
    assert again["dpo/margin"] < 0 and again["dpo/accuracy"] == 1.0, again
    assert again["loss/total"] < math.log(2)


def test_a_nan_loss_trains_nothing(app, state) -> None:
    """A pair whose pixels are NaN makes the step's loss NaN: the step is skipped, the LoRA kept."""
    recipe = app.RECIPE
    batch = recipe.rollout(state, 2)
    [pairs] = batch.samples
    pairs.chosen[1] = math.nan  # the tensors are the batch's own
    params = list(trainable_parameters(state.family.peft).values())
    before = [p.detach().clone() for p in params]
    scores = recipe.score(state, 2, batch)
    adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=state.run.accelerator)
    state.run.guard.consecutive = 0
    stats = recipe.update(state, 2, batch, adv)
    state.run.guard.consecutive = 0
    assert (stats["nonfinite/skipped_steps"], stats["optimizer_steps"]) == (1, 0)
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))


# The DPO preset's run (seed 42, 24 steps of 8 pairs, lr 0.1, beta 10), eval brightness (8 prompts,
# EMA weights) measured on the CPU: 0.4755 before, 0.5205 after; beta 2-50 and lr 0.05 rose 0.023-0.045.
DPO_MARGIN = 0.02


def test_dpo_preset_gets_brighter(app, tmp_path: Path) -> None:
    """`uv run apps/diffusion-grpo --config apps/diffusion-grpo/configs/dpo_tiny.toml`: the held-out
    prompts' images (never in a pair) get lighter, and the implicit reward prefers every chosen image."""
    run = app.main(["--config", str(APP / "configs" / "dpo_tiny.toml"),
                    f"train.output_dir={tmp_path}", "train.save_freq=100"])
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    evals = [float(r["eval/reward/mean"]) for r in rows if r.get("eval/reward/mean")]
    assert len(evals) == 3 and evals[-1] - evals[0] > DPO_MARGIN, evals
    assert float(rows[-1]["dpo/accuracy"]) == 1.0
    assert (run / "checkpoint-final" / "lora" / "adapter_model.safetensors").is_file()


def test_resume_equals_uninterrupted_run(app, tmp_path: Path) -> None:
    """3 steps = 1 step, then --resume for the other 2, bit for bit: the pairs' sampler (16 pairs, 4 a
    step), the LoRA, the optimizer and the EMA are checkpoint state, and a pair's noise depends on
    the step and its place only."""
    def config(out: Path, steps: int):
        return tiny_config(app, "sd3", out, *DPO, f"train.epochs={steps}", "train.save_freq=1",
                           "rollout.groups_per_epoch=4", "train.lr=0.1", "dpo.beta=10")

    whole = train(app, config(tmp_path / "whole", 3))
    train(app, config(tmp_path / "parts", 1))
    resumed = train(app, config(tmp_path / "parts", 3), resume="latest")
    a, b = whole / "checkpoints" / "checkpoint-3", resumed / "checkpoints" / "checkpoint-3"
    for name in ("lora.pt", "ema.pt", "optimizer.pt", "sampler.pt"):
        sa, sb = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        assert json.dumps(flat(sa)) == json.dumps(flat(sb)), name


@pytest.mark.parametrize("family", ["wan", "cosmos"])
def test_video_families_train_on_video_pairs(app, tmp_path: Path, family: str) -> None:
    """The tiny Wan and Cosmos on 5-frame GIF pairs (sampling.num_frames = 5, 32x32): the videos are
    VAE-encoded to [C, 2, 4, 4] latents, the LoRA moves and the margin falls step by step. (The tiny
    Wan VAE, Cosmos's too, decodes nearly every latent to one brightness, 0.5455 +- 0.0009 over 64
    random ones, so its eval brightness cannot show the pairs' preference: the tiny SD3 test above does.)"""
    run = app.main(["--config", str(APP / "configs" / f"{family}_tiny.toml"), "train.method=dpo",
                    f"data.preferences={PAIRS / 'videos.jsonl'}", "rollout.groups_per_epoch=8", "train.epochs=4",
                    "rollout.sample_batch_size=8", "train.micro_batch_size=8",
                    "train.lr=0.01", "dpo.beta=10", "train.eval_freq=0", f"train.output_dir={tmp_path}"])
    with (run / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("dpo/margin")]
    assert len(rows) == 4 and float(rows[0]["loss/total"]) == pytest.approx(math.log(2), abs=1e-6)
    margins = [float(r["dpo/margin"]) for r in rows]  # measured (wan): 0, -0.0050, -0.0143, -0.0188 (lr 0.1 oscillates)
    assert margins[0] == 0 > margins[1] > margins[2] > margins[3] and float(rows[-1]["dpo/accuracy"]) == 1.0, margins
    from safetensors.torch import load_file

    weights = load_file(run / "checkpoint-final" / "lora" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())


@pytest.mark.parametrize(("extra", "message"), [
    (("data.preferences=",), r"train\.method='dpo' \(Diffusion-DPO\) trains on preference pairs: set data\.preferences"),
    (("model.family=janus", "model.path=tiny:janus"), r"train\.method='dpo' .* model\.family='janus' samples tokens"),
    (("rollout.workers=2",), r"rollout\.workers=2: train\.method='dpo'"),
    (("train.sharding=fsdp2",), r"train\.sharding='fsdp2': train\.method='dpo'"),
    (("train.max_staleness=1",), r"train\.max_staleness=1: train\.method='dpo'"),
])
def test_what_dpo_does_not_support_is_refused_naming_the_key(app, extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(app, *DPO, *extra)


def test_bad_pairs_are_refused_naming_the_row(app, tmp_path: Path) -> None:
    """Video pairs for an image family, a missing file and a clip with too few frames: one line
    each, naming the key, the row or the file, before (or, for the frames, without) any update."""
    from grpo_config import read_pairs

    with pytest.raises(UserError, match=r"data\.preferences=.*videos\.jsonl.*, row 1: a pair of videos, but this "
                                        r"family trains on images"):
        read_pairs(str(PAIRS / "videos.jsonl"), video=False)
    with pytest.raises(UserError, match=r"data\.preferences: .*no-such\.jsonl"):
        read_pairs(str(tmp_path / "no-such.jsonl"), video=False)
    row = json.loads((PAIRS / "videos.jsonl").read_text().splitlines()[0])
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({**row, "chosen": str(PAIRS / row["chosen"]), "rejected": str(PAIRS / row["rejected"])}))
    with pytest.raises(UserError, match=r"data\.preferences: video .*00_chosen\.gif has 5 frames; 9 are needed"):
        app.main(["--config", str(APP / "configs" / "wan_tiny.toml"), "train.method=dpo", f"data.preferences={short}",
                  "sampling.num_frames=9", "train.epochs=1", "train.eval_freq=0", f"train.output_dir={tmp_path / 'o'}"])
