"""DiffusionNFT's update for the SD3 family (`train.method = "nft"`; Zheng et al. 2025, NVlabs/
DiffusionNFT `scripts/train_nft_sd3.py`): the epoch's clean images (the last latents of any
sampler, drawn by the old policy, `families.OldPolicy`) are noised again on the forward process
at `int(sampling.num_steps x train.timestep_fraction)` of the sampler's noise levels each, and the
trained policy's velocity there is fitted with `rl_core.flow.compute_nft_loss` (implicit positive
and negative policies around the old one's velocity, weighted by the reward's advantage). After
the epoch the old policy moves towards the trained one (`rl_core.flow.compute_nft_decay`).

A unit is one (image, noise level) pair: every unit of an optimizer step weighs the same over
micro-batches and processes. Which noise levels an image gets and its noise depend only on
(train.seed, epoch, the image's place in the epoch), so 2 processes draw what 1 does and a
resumed run draws them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from families import SD3, OldPolicy
from grpo_config import Config

from rl_core.flow import compute_nft_decay, compute_nft_loss, flow_noise, host_randn
from rl_core.train import Micro, NonFiniteGuard, UpdateStats, optimizer_step, sample_seed
from rl_rollout.diffusion import Trajectory

NFTMicro = tuple[int, torch.Tensor, float, int]  # (sampled batch, its rows [b], loss weight, noise draw j)


def noise_levels(seed: int, epoch: int, index: int, num_steps: int, count: int) -> torch.Tensor:
    """The sampler steps `[count]` whose sigma image `index` of the epoch is trained at: the first
    `count` of a random permutation of the `num_steps` steps (upstream permutes the scheduler's
    timesteps per image and trains the first `int(num_steps x timestep_fraction)`)."""
    generator = torch.Generator().manual_seed(sample_seed(seed, epoch, index, 2))
    return torch.randperm(num_steps, generator=generator)[:count]


def nft_update(cfg: Config, acc: Any, guard: NonFiniteGuard, family: SD3, samples: Sequence[Trajectory],
               advantages: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], plan: list[list[Micro]], *,
               epoch: int) -> dict[str, float]:
    """One epoch's DiffusionNFT update along `plan` (optimizer steps of micro-batches of the
    scored images), then the old policy's move, scheduled by the optimizer steps taken so far
    (`family.weights.steps`, which the loop's guard counts). `advantages[k]`, `indices[k]`
    `[b_k]`: sampled batch k's advantages and its images' places in the epoch."""
    t, n = cfg.train, cfg.nft
    old = cast(OldPolicy, family.old)  # built by SD3 for train.method = "nft"
    count = int(cfg.sampling.num_steps * t.timestep_fraction)
    levels = [torch.stack([noise_levels(t.seed, epoch, int(i), traj.num_steps, count) for i in idx])
              for traj, idx in zip(samples, indices, strict=True)]  # [b_k, count] per sampled batch

    def loss_fn(micro: NFTMicro, num_valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        k, rows, weight, j = micro
        traj, engine, device = samples[k], family.engine, family.acc.device
        clean = traj.latents[rows.to(traj.latents.device), -1]  # [b, C, h, w] the sampler's last latents
        sigma = traj.sigmas[levels[k][rows, j]].to(device)  # [b]
        generators = [torch.Generator().manual_seed(sample_seed(t.seed, epoch, int(i), 3, j)) for i in indices[k][rows]]
        noisy = flow_noise(clean, host_randn(clean.shape, generators, device), sigma)  # [b, C, h, w]
        cond = traj.conditioning.index(rows)
        velocity = engine.velocity(noisy, sigma, cond, guidance_scale=1.0, model=family.model)  # [b, C, h, w]
        with torch.no_grad():
            old_velocity = old.engine.velocity(noisy, sigma, cond, guidance_scale=1.0)  # [b, C, h, w]
            ref = None
            if cfg.algo.kl_coef > 0:
                with family.peft.disable_adapter():
                    ref = engine.velocity(noisy, sigma, cond, guidance_scale=1.0, model=family.peft)  # [b, C, h, w]
        per_sample, m = compute_nft_loss(velocity=velocity, old_velocity=old_velocity, clean=clean, noisy=noisy,
                                         sigma=sigma, advantages=advantages[k][rows], beta=n.beta, adv_clip=t.adv_clip,
                                         ref_velocity=ref, kl_beta=cfg.algo.kl_coef)  # [b]
        share = len(rows) / float(num_valid) * weight  # this micro-batch's part of the optimizer step's mean
        loss = per_sample.sum() / num_valid * weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": m["policy"] * share,
                      "loss/kl": m["kl"] * share, "nft/positive_loss": m["positive"],
                      "nft/negative_loss": m["negative"], "nft/old_deviation": m["old_deviation"]}

    units = [[(k, rows, weight, j) for k, rows, weight in micro for j in range(count)] for micro in plan]
    stats = UpdateStats()
    family.model.train()
    for micro_batches in units:
        optimizer_step(acc, family.model, family.optimizer, micro_batches, loss_fn,
                       units=lambda m: float(len(m[1])) * m[2], grad_clip=t.grad_clip, guard=guard,
                       stats=stats, filler=(0, torch.tensor([0]), 0.0, 0))
    family.model.eval()
    decay = compute_nft_decay(family.weights.steps, start=n.old_decay_start, rate=n.old_decay_rate,
                              limit=n.old_decay_max)
    old.move_towards(decay)
    return {**stats.reduce(acc), "nft/old_decay": decay}
