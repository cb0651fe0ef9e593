"""From a flow model's clean samples to a policy update on the forward process: DiffusionNFT (the
policy's own samples, weighted by their reward) and Diffusion-DPO (preference pairs, offline), the
two updates diffusion-grpo runs besides Flow-GRPO (`train.method = "nft" | "dpo"`).

    plan = chunked_steps(acc, sizes, rows, micro_batch_size=8, accumulation=1)   # rl_core.train
    metrics = nft_update(acc, guard, policy, old.engine, trajectories, advantages, places, plan,
                         count=9, beta=1.0, adv_clip=5.0, kl_beta=0.0, grad_clip=1.0, seed=42, epoch=e)
    pairs = encode_pairs(engine, prompts, chosen, rejected, places)   # pixels in [0, 1]
    metrics = dpo_update(acc, guard, policy, [pairs], plan, num_steps=10, count=9, beta=500.0, ...)

Both noise a clean latent again at `count` of the sampler's `num_steps` noise levels, the first
`count` of a permutation drawn from (seed, epoch, the sample's place in the epoch), with noise
drawn from the same, so 2 processes draw what 1 does and a resumed run draws them again. A unit
is one (sample or pair, noise level): every unit of an optimizer step weighs the same over
micro-batches and processes. `policy` is anything with the trainer's `engine` (a
`rl_rollout.diffusion.DiffusionEngine`), the `model` the optimizer steps through (DDP-wrapped or
not), the LoRA `peft` model (LoRA disabled: the reference; `rl_models.lora.reference_of`) and the `optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rl_core.flow import (
    compute_flow_dpo_loss,
    compute_nft_loss,
    flow_noise,
    host_randn,
    velocity_errors,
)
from rl_core.train import Micro, NonFiniteGuard, UpdateStats, optimizer_step, sample_seed
from rl_models.lora import reference_of
from rl_rollout.diffusion import DiffusionEngine, PromptEmbeddings, Trajectory

__all__ = ["FlowPolicy", "PreferenceBatch", "dpo_update", "encode_pairs", "nft_update", "noise_levels"]

FlowMicro = tuple[int, Tensor, float, int]  # (sampled batch, its rows [b], loss weight, noise draw j)


class FlowPolicy(Protocol):
    @property
    def engine(self) -> DiffusionEngine: ...  # the trainer's pipeline: `velocity(..., model=)` runs the model through it

    @property
    def model(self) -> torch.nn.Module: ...  # what the optimizer steps through

    @property
    def peft(self) -> Any: ...  # the LoRA model (or a fully fine-tuned one): `reference_of` gives the reference

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


@dataclass(frozen=True)
class PreferenceBatch:
    """Preference pairs encoded for a flow model: each pair's prompt, the clean latents of its
    preferred and its rejected image or video, and its place in the step (seeds its noise)."""

    conditioning: PromptEmbeddings  # [B]
    chosen: Tensor  # [B, C, h, w] or [B, C, F', h, w]
    rejected: Tensor  # like chosen
    places: Tensor  # [B]

    def __len__(self) -> int:
        return len(self.places)


def noise_levels(seed: int, epoch: int, index: int, num_steps: int, count: int) -> Tensor:
    """The sampler steps `[count]` whose sigma sample `index` of the epoch is trained at: the first
    `count` of a random permutation of the `num_steps` steps (DiffusionNFT permutes the scheduler's
    timesteps per image and trains the first `int(num_steps x timestep_fraction)`)."""
    generator = torch.Generator().manual_seed(sample_seed(seed, epoch, index, 2))
    return torch.randperm(num_steps, generator=generator)[:count]


def _noise(clean: Tensor, places: Tensor, seed: int, epoch: int, j: int) -> Tensor:
    """The noise `[b, ...]` of draw `j` of the samples at `places` `[b]`, on the host's generators."""
    generators = [torch.Generator().manual_seed(sample_seed(seed, epoch, int(i), 3, j)) for i in places]
    return host_randn(clean.shape, generators, clean.device)


def _run(acc: Any, guard: NonFiniteGuard, policy: FlowPolicy, plan: list[list[Micro]], count: int,
         loss_fn: Callable[[FlowMicro, Tensor], tuple[Tensor, dict[str, float]]], grad_clip: float) -> dict[str, float]:
    """Every (micro-batch, noise draw) pair of `plan`'s optimizer steps, through `optimizer_step`."""
    units = [[(k, rows, weight, j) for k, rows, weight in micro for j in range(count)] for micro in plan]
    stats = UpdateStats()
    policy.model.train()
    for micro_batches in units:
        optimizer_step(acc, policy.model, policy.optimizer, micro_batches, loss_fn,
                       units=lambda m: float(len(m[1])) * m[2], grad_clip=grad_clip, guard=guard,
                       stats=stats, filler=(0, torch.tensor([0]), 0.0, 0))
    policy.model.eval()
    return stats.reduce(acc)


def nft_update(acc: Any, guard: NonFiniteGuard, policy: FlowPolicy, old: DiffusionEngine, samples: Sequence[Trajectory],
               advantages: Sequence[Tensor], places: Sequence[Tensor], plan: list[list[Micro]], *, count: int,
               beta: float, adv_clip: float, kl_beta: float, grad_clip: float, seed: int, epoch: int) -> dict[str, float]:
    """One epoch's DiffusionNFT update (Zheng et al. 2025, NVlabs/DiffusionNFT
    `scripts/train_nft_sd3.py`) along `plan`: each image's clean latents (the sampler's last, drawn
    by the old policy whose engine `old` is) noised at `count` noise levels, the trained velocity
    fitted with `rl_core.flow.compute_nft_loss` around the old one's. `advantages[k]`, `places[k]`
    `[b_k]`: sampled batch k's advantages and its images' places in the epoch. The old policy's
    move after the epoch is the caller's (`rl_core.flow.compute_nft_decay`)."""
    levels = [torch.stack([noise_levels(seed, epoch, int(i), traj.num_steps, count) for i in idx])
              for traj, idx in zip(samples, places, strict=True)]  # [b_k, count] per sampled batch

    def loss_fn(micro: FlowMicro, num_valid: Tensor) -> tuple[Tensor, dict[str, float]]:
        k, rows, weight, j = micro
        traj, engine = samples[k], policy.engine
        clean = traj.latents[rows.to(traj.latents.device), -1].to(engine.device)  # [b, C, h, w] the sampler's last latents
        sigma = traj.sigmas[levels[k][rows, j]].to(engine.device)  # [b]
        noisy = flow_noise(clean, _noise(clean, places[k][rows], seed, epoch, j), sigma)  # [b, C, h, w]
        cond = traj.conditioning.index(rows)
        velocity = engine.velocity(noisy, sigma, cond, guidance_scale=1.0, model=policy.model)  # [b, C, h, w]
        with torch.no_grad():
            old_velocity = old.velocity(noisy, sigma, cond, guidance_scale=1.0)  # [b, C, h, w]
            ref = None
            if kl_beta > 0:
                with reference_of(policy.peft) as reference:
                    ref = engine.velocity(noisy, sigma, cond, guidance_scale=1.0, model=reference)  # [b, C, h, w]
        per_sample, m = compute_nft_loss(velocity=velocity, old_velocity=old_velocity, clean=clean, noisy=noisy,
                                         sigma=sigma, advantages=advantages[k][rows], beta=beta, adv_clip=adv_clip,
                                         ref_velocity=ref, kl_beta=kl_beta)  # [b]
        share = len(rows) / float(num_valid) * weight  # this micro-batch's part of the optimizer step's mean
        loss = per_sample.sum() / num_valid * weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": m["policy"] * share,
                      "loss/kl": m["kl"] * share, "nft/positive_loss": m["positive"],
                      "nft/negative_loss": m["negative"], "nft/old_deviation": m["old_deviation"]}

    return _run(acc, guard, policy, plan, count, loss_fn, grad_clip)


@torch.no_grad()
def encode_pairs(engine: DiffusionEngine, prompts: Sequence[str], chosen: Tensor, rejected: Tensor, places: Tensor, *,
                 max_sequence_length: int = 128) -> PreferenceBatch:
    """Pairs for `dpo_update`: the prompts encoded once, the pixels `[B, 3, H, W]` (a video family:
    `[B, F, 3, H, W]`) in [0, 1] VAE-encoded to clean latents (`engine.encode_pixels`)."""
    if chosen.shape != rejected.shape or chosen.shape[0] != len(prompts):
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must be one shape with "
                         f"a row per prompt ({len(prompts)})")
    return PreferenceBatch(engine.encode(list(prompts), max_sequence_length=max_sequence_length),
                           engine.encode_pixels(chosen), engine.encode_pixels(rejected), places)


def dpo_update(acc: Any, guard: NonFiniteGuard, policy: FlowPolicy, batches: Sequence[PreferenceBatch],
               plan: list[list[Micro]], *, num_steps: int, count: int, beta: float, grad_clip: float, seed: int,
               epoch: int) -> dict[str, float]:
    """One step of Diffusion-DPO (Wallace et al. 2023) in its flow-matching form along `plan`
    (micro-batches of pairs): both members of a pair are noised at one sigma (`count` of the
    sampler's `num_steps` levels a pair) with one noise, and `rl_core.flow.compute_flow_dpo_loss`
    compares the trained and the reference model's (LoRA disabled) velocity errors on them. One
    forward runs the chosen and the rejected rows together, CFG-free (the conditional velocity)."""
    first = batches[0].chosen
    sigmas = policy.engine.noise_schedule(num_steps, first[:1])  # [S + 1]
    levels = [torch.stack([noise_levels(seed, epoch, int(i), num_steps, count) for i in b.places]) for b in batches]

    def errors(model: torch.nn.Module, noisy: Tensor, sigma: Tensor, cond: PromptEmbeddings, clean: Tensor,
               noise: Tensor) -> Tensor:  # [2b]: the chosen rows' errors, then the rejected rows'
        return velocity_errors(policy.engine.velocity(noisy, sigma, cond, guidance_scale=1.0, model=model), clean, noise)

    def loss_fn(micro: FlowMicro, num_valid: Tensor) -> tuple[Tensor, dict[str, float]]:
        k, rows, weight, j = micro
        pairs, device = batches[k], policy.engine.device
        clean = torch.cat([pairs.chosen[rows.to(pairs.chosen.device)], pairs.rejected[rows.to(pairs.chosen.device)]])
        clean = clean.to(device)  # [2b, C, ...]
        b = len(rows)
        noise = _noise(clean[:b], pairs.places[rows], seed, epoch, j).repeat(2, *[1] * (clean.dim() - 1))  # [2b, ...]
        sigma = sigmas[levels[k][rows, j]].to(device).repeat(2)  # [2b]
        noisy = flow_noise(clean, noise, sigma)  # [2b, C, ...]
        cond = pairs.conditioning.index(torch.cat([rows, rows]))
        trained = errors(policy.model, noisy, sigma, cond, clean, noise)  # [2b]
        with torch.no_grad(), reference_of(policy.peft) as reference:
            ref = errors(reference, noisy, sigma, cond, clean, noise)  # [2b]
        per_pair, m = compute_flow_dpo_loss(chosen=trained[:b], rejected=trained[b:], ref_chosen=ref[:b],
                                            ref_rejected=ref[b:], beta=beta)  # [b]
        loss = per_pair.sum() / num_valid * weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": float(loss.detach()),
                      **{f"dpo/{name}": value for name, value in m.items()}}

    return _run(acc, guard, policy, plan, count, loss_fn, grad_clip)
