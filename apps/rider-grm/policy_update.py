"""The policy side of a rider-grm step on the shared phases: generations -> `rl_rollout.training`
rollouts, the old and reference log-probs, token rewards (the outcome reward on each completion's
last token, minus `kl_coef` x KL per token with `algo.kl_in_reward`, verl's `apply_kl_penalty`)
for the loop's advantages over every process (`rl_core.train.group_advantages`: REINFORCE++
whitens over the global batch, a failed reward is left out and gets advantage 0), and the update
(`rl_rollout.training.token_update`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rider_config import Config

from rl_core.kl import compute_kl
from rl_core.train import NonFiniteGuard
from rl_rollout import Generation
from rl_rollout.prompts import EncodedPrompt
from rl_rollout.training import LossOptions, Rollout, engine_check, rollout_logprobs, token_update


def to_rollouts(gens: Sequence[Generation], valid: torch.Tensor) -> list[Rollout]:
    return [Rollout(EncodedPrompt(g.prompt_ids), g.completion_ids, g.logprobs, valid=bool(ok))
            for g, ok in zip(gens, valid, strict=True)]


def logprobs(model: Any, gens: Sequence[Generation], cfg: Config, pad_id: int, device: torch.device) -> list[torch.Tensor]:
    """No-grad log-probs `[C_i]` of each completion under `model` (the policy or the reference)."""
    return rollout_logprobs(model, to_rollouts(gens, torch.ones(len(gens), dtype=torch.bool)),
                            micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
                            pad_id=pad_id, device=device)


def token_rewards(cfg: Config, gens: Sequence[Generation], scores: torch.Tensor, old: Sequence[torch.Tensor],
                  ref: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards and the response mask, both `[B, C]`: each sequence's score `[B]` on its last
    token (NaN there marks a failed sample), minus `kl_coef` x KL(old || ref) per token with
    `algo.kl_in_reward`."""
    width = max(1, max(len(g.completion_ids) for g in gens))
    mask = torch.zeros(len(gens), width)  # [B, C]
    rewards = torch.zeros(len(gens), width)  # [B, C]
    for i, g in enumerate(gens):
        n = len(g.completion_ids)
        mask[i, :n] = 1
        rewards[i, max(n - 1, 0)] = scores[i]
        if cfg.algo.kl_in_reward and ref is not None and n:
            rewards[i, :n] -= cfg.algo.kl_coef * compute_kl(cfg.algo.kl_reward_type, old[i][None], ref[i][None])[0]
    return rewards, mask


def update(cfg: Config, acc: Any, policy: Any, optimizer: Any, rollouts: list[Rollout], adv: torch.Tensor,
           old: list[torch.Tensor], ref: list[torch.Tensor] | None, guard: NonFiniteGuard, pad_id: int, *,
           first: bool, model_dtype: torch.dtype, after_step: Callable[[], None] | None = None) -> dict[str, float]:
    """Clipped PG + KL-loss minibatch updates (`train.mini_batch_size` prompts each), after the
    engine-vs-trainer check of the old log-probs: the rollout engine's sampling log-probs (hf or
    vLLM) against the trainer's replay, within `algo.replay_tolerance` (default 1e-3 for a
    float32 policy, 5e-2 for 16-bit kernels); the first step raises on a mismatch, every step
    reports it (`replay/engine_diff_mean`). `after_step` runs after each optimizer step (the
    engine's weight sync)."""
    a, t = cfg.algo, cfg.train
    tolerance = a.replay_tolerance if a.replay_tolerance is not None else (
        1e-3 if model_dtype == torch.float32 else 5e-2)
    replay = engine_check(rollouts, old).verify(acc, tolerance if first else math.inf, "first replay")
    out = token_update(
        acc, policy, optimizer, rollouts, [adv[i, : len(r.completion_ids)] for i, r in enumerate(rollouts)],
        options=LossOptions(a.loss, a.agg, a.clip_low, a.clip_high, a.kl_loss_type,
                            a.kl_loss_coef if a.use_kl_loss else 0.0, cfg.rollout.temperature,
                            norm_length=cfg.data.max_response_length),
        old=old, ref=ref if a.use_kl_loss else None, num_minibatches=max(1, t.batch_size // t.mini_batch_size),
        micro_batch_size=t.micro_batch_size, ppo_epochs=1, grad_clip=t.grad_clip, guard=guard, pad_id=pad_id,
        after_step=after_step)
    return {**replay, **out}
