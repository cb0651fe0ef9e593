"""DiffusionNFT (`train.method = "nft"`) on the tiny SD3: the old policy samples (the Euler ODE,
CFG-free) and moves towards the trained LoRA after the epoch by the stated decay, every LoRA
weight trains, a failed reward trains nothing, and what NFT does not support is refused in one
line naming the key. The invariants (2 processes = 1, accumulation = one batch) are in
test_launch.py, the preset in test_presets.py, the learning check in test_learning.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, advantages, checked, flat, setup_state, tiny_config, train

from rl_core.flow import compute_nft_decay
from rl_core.train import ConfigError, trainable_parameters, unknown_metric_names

# tiny NFT: the ODE sampler without CFG; the old policy lags half-way after the first step
NFT = ("train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1", "nft.old_decay_rate=0.5",
       "nft.old_decay_max=0.9")


@pytest.fixture(scope="module")
def state(app, tmp_path_factory):
    return setup_state(app, tiny_config(app, "sd3", tmp_path_factory.mktemp("nft"), *NFT, "algo.kl_coef=0.04"))


def test_old_policy_samples_and_moves_towards_the_trained_lora(app, state) -> None:
    """Epoch 1: 8 images, 2 optimizer steps of 4 images x 3 noise levels. The rollout is the old
    policy's ODE sample (equal to its engine's, not the trained engine's once they differ); after
    the update every LoRA weight but the dead one has moved, and the old LoRA is
    decay x old + (1 - decay) x trained with decay = min(2 steps x 0.5, 0.9) = 0.9."""
    f, recipe = state.family, app.RECIPE
    old_before = {k: v.clone() for k, v in f.old.state_dict().items()}
    trained = trainable_parameters(f.peft)
    before = {k: p.detach().clone() for k, p in trained.items()}
    batch = recipe.rollout(state, 1)
    assert all(traj.kind == "ode" and not traj.sde_steps.any() for traj in batch.samples)
    stats = recipe.update(state, 1, batch, advantages(app, state, batch, torch.arange(8, dtype=torch.float32)))
    assert unknown_metric_names(stats) == []
    assert (stats["optimizer_steps"], stats["adv/trained_samples"]) == (2, 8)
    assert stats["nft/old_decay"] == compute_nft_decay(2, start=0, rate=0.5, limit=0.9) == 0.9
    assert math.isfinite(stats["loss/total"]) and stats["loss/kl"] > 0 and stats["nft/old_deviation"] > 0
    unchanged = [k for k, p in trained.items() if torch.equal(p.detach(), before[k])]
    assert unchanged == ["base_model.model.transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"], unchanged
    old_after = f.old.state_dict()
    for name, p in trained.items():  # `OldPolicy` names are the trained LoRA's (peft prefix included)
        torch.testing.assert_close(old_after[name], old_before[name] * 0.9 + p.detach() * 0.1, atol=0, rtol=0)
    # the next rollout is the old policy's: its own engine reproduces it, the trained engine does not
    second = recipe.rollout(state, 2)
    chunk = second.samples[0]
    kwargs = {"num_steps": 4, "guidance_scale": 1.0, "height": 32, "width": 32, "kind": "ode",
              "max_sequence_length": 8, "conditioning": chunk.conditioning}
    seeds = [app.sample_seed(state.cfg.train.seed, 1, i) for i in range(4)]
    by_old = f.old.engine.sample(list(chunk.prompts), seeds=seeds, **kwargs)
    by_trained = f.engine.sample(list(chunk.prompts), seeds=seeds, **kwargs)
    assert torch.equal(chunk.latents[:, -1], by_old.latents[:, -1])
    assert not torch.allclose(chunk.latents[:, -1], by_trained.latents[:, -1], atol=1e-6)


def test_failed_rewards_are_not_trained_and_nan_advantages_skip_the_step(app, state) -> None:
    recipe = app.RECIPE
    batch = recipe.rollout(state, 3)
    rewards = torch.tensor([0.1, math.nan, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])  # image 1's scorer failed
    stats = recipe.update(state, 3, batch, advantages(app, state, batch, rewards))
    assert stats["adv/trained_samples"] == 7 and stats["optimizer_steps"] == 2
    params = list(trainable_parameters(state.family.peft).values())
    before = [p.detach().clone() for p in params]
    nan = app.GroupAdvantages(torch.full((8,), math.nan), torch.ones(8, dtype=torch.bool), {})
    state.run.guard.consecutive = 0
    stats = recipe.update(state, 3, batch, nan)  # NaN loss: both optimizer steps skipped
    state.run.guard.consecutive = 0
    assert stats["nonfinite/skipped_steps"] == 2 and stats["optimizer_steps"] == 0
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))


@pytest.mark.parametrize(("extra", "message"), [
    (("train.max_staleness=1",), r"train\.max_staleness=1: train\.method='nft' .* set train\.max_staleness=0"),
    (("--config", str(CONFIGS["janus"])), r"train\.method='nft' .* model\.family='janus' samples tokens"),
    (("rollout.workers=2",), r"rollout\.workers=2: train\.method='nft'"),
    (("train.sharding=fsdp2",), r"train\.sharding='fsdp2': train\.method='nft'"),
    (("sampling.guidance_scale=4.5",), r"sampling\.guidance_scale=4\.5: .* CFG-free"),
    (("train.zero_adv=flow_grpo",), r"train\.zero_adv='flow_grpo' picks GRPO's images"),
])
def test_what_nft_does_not_support_is_refused_naming_the_key(app, extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(app, *NFT, *extra)


def test_grpo_refuses_the_ode_sampler(app) -> None:
    with pytest.raises(ConfigError, match=r"sampling\.kind='ode' samples no log-probability: train\.method='grpo'"):
        checked(app, "sampling.kind=ode")
    assert checked(app, *NFT).train.method == "nft"



def test_resume_equals_uninterrupted_run(app, tmp_path: Path) -> None:
    """2 epochs = 1 epoch, then --resume for the second, bit for bit: the old policy (which
    samples epoch 2) is checkpoint state (`nft_old.pt`) next to the LoRA, optimizer and EMA; after
    2 optimizer steps it keeps decay min(2 x 0.5, 0.9) = 0.9 of itself, so it is not the LoRA."""
    def config(out: Path, epochs: int):
        return tiny_config(app, "sd3", out, *NFT, f"train.epochs={epochs}", "train.save_freq=1", "algo.kl_coef=0",
                           "rollout.groups_per_epoch=1")  # 4 images an epoch, one optimizer step

    whole = train(app, config(tmp_path / "whole", 2))
    train(app, config(tmp_path / "parts", 1))
    resumed = train(app, config(tmp_path / "parts", 2), resume="latest")
    a, b = whole / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2"
    for name in ("lora.pt", "nft_old.pt", "ema.pt", "optimizer.pt"):
        sa, sb = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        assert json.dumps(flat(sa)) == json.dumps(flat(sb)), name
    old, lora = torch.load(a / "nft_old.pt", weights_only=True), torch.load(a / "lora.pt", weights_only=True)
    assert old.keys() == lora.keys() and any(not torch.equal(old[k], lora[k]) for k in old)  # it lags (decay 0.9)
