"""GRPO-Guard (`train.ratio_norm = true`) on the tiny SD3: the rollout keeps each step's mean, the
replay's ratio is RatioNorm's (checked against a loop over the elements, not against
`compute_ratio_guard`), the step's policy loss is scaled by 1 / |dt|, and where it does not apply
it is refused in one line naming the key. The learning check is in test_learning.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, advantages, checked, setup_state, tiny_config

from rl_core.train import ConfigError, trainable_parameters

GUARD = ("train.ratio_norm=true",)


@pytest.fixture(scope="module")
def state(app, tmp_path_factory):
    return setup_state(app, tiny_config(app, "sd3", tmp_path_factory.mktemp("guard"), *GUARD, "algo.kl_coef=0",
                                         "rollout.groups_per_epoch=1"))


def test_ratio_norm_reaches_the_replayed_ratio_and_the_loss_scale(app, state) -> None:
    """One sampled batch of 4 images (one prompt), 4 steps, the first 3 trained. At the sampling weights the
    replay reproduces the kept means, so RatioNorm's log ratio is exactly 0; after the LoRA moves,
    it is mean_i eps_i (mean_i - old_mean_i), eps = (x' - old_mean) / s, not the raw log ratio
    (which carries the bias -|mean - old_mean|^2 / (2 s^2)). The policy loss of step k is scaled by
    1 / (sigma_k - sigma_k+1): the tiny scheduler (shift 3) spaces 4 timesteps from 1 to its
    shifted floor 3 x 0.001 / 1.002 = 0.002994 (1, 0.66766, 0.33533, 0.002994) and shifts them
    again, s = 3t / (1 + 2t): sigmas 1, 0.85769, 0.60215, 0.008929, 0; steps 0, 1, 2 weigh
    1 / 0.14231 = 7.027, 1 / 0.25554 = 3.913, 1 / 0.59322 = 1.686."""
    f, recipe = state.family, app.RECIPE
    batch = recipe.rollout(state, 1)
    traj = batch.samples[0]
    assert traj.means.shape == (4, 4, *traj.latents.shape[2:])
    torch.testing.assert_close(traj.sigmas, torch.tensor([1.0, 0.85769, 0.60215, 0.008929, 0.0]), atol=1e-5, rtol=0)
    adv = advantages(app, state, batch, torch.arange(4, dtype=torch.float32)).advantages
    sizes = [len(s.prompts) for s in batch.samples]
    job = f.replays(batch.samples, adv.split(sizes), app.plan_micro_batches(state.cfg.train, state.run.accelerator,
                                                                            sizes, adv, 0))
    micros = [m for step in job.plan for m in step]  # the one batch's (k, rows, weight, step)
    assert [m[3] for m in micros] == [0, 1, 2]
    for micro, scale in zip(micros, (7.027, 3.913, 1.686), strict=True):
        r = job.replay(micro)
        assert torch.equal(r.log_ratio, torch.zeros(4, 1)) and r.policy_scale == pytest.approx(scale, abs=1e-3)
    with torch.no_grad():  # move the policy: every LoRA B by 0.05
        for name, p in trainable_parameters(f.peft).items():
            if "lora_B" in name:
                p.add_(0.05)
    _, rows, _, step = micros[2]  # step 2: sigma 0.60215 -> 0.008929
    r, out = job.replay(micros[2]), f.engine.replay(traj, step, rows=rows)
    s = float(out.std[0]) * math.sqrt(0.60215 - 0.008929)  # the step's per-element std sigma_t sqrt(|dt|)
    for b in range(4):
        old_mean, x_next = traj.means[b, step], traj.latents[b, step + 1]
        eps = (x_next - old_mean) / s
        torch.testing.assert_close(r.log_ratio[b, 0], (eps * (out.mean[b].detach() - old_mean)).mean(),
                                   atol=1e-6, rtol=1e-4)
    raw = r.logp.detach() - r.old_logp  # [4, 1]
    assert (raw < r.log_ratio.detach()).all() and r.log_ratio.abs().max() > 1e-4  # the bias removed, the ratio moved


@pytest.mark.parametrize(("extra", "message"), [
    (("--config", str(CONFIGS["janus"])), r"train\.ratio_norm=true \(GRPO-Guard\) .* model\.family='janus'"),
    (("train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1"),
     r"train\.ratio_norm=true \(GRPO-Guard\) .* train\.method='nft' has no ratio"),
    (("sampling.kind=cps",), r"sampling\.kind='cps' is not done .* set sampling\.kind='sde'"),
])
def test_ratio_norm_is_refused_where_it_does_not_apply(app, extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(app, *extra, *GUARD)
