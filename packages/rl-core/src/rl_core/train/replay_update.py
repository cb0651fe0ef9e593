"""The update over stored samples replayed through a callback: one clipped policy-gradient step
per optimizer step over micro-batches, the image update that SD3 (Flow-GRPO: one unit per
denoising step) and Janus (one unit per image token) share.

    def replay(micro) -> Replay:                 # the app's: a forward with gradients
        out = engine.replay(trajectory, step, rows=rows, model=model)
        return Replay(out.log_prob[:, None], old[:, None], adv[rows], weight, kl=flow_kl(...)[:, None])

    metrics = replay_update(acc, model, optimizer, plan, replay, units=lambda m: len(m.rows) * m.weight,
                            clip_range=1e-4, kl_beta=0.04, grad_clip=1.0, guard=guard, tolerance=1e-5,
                            what="epoch 3: first replay", after_step=ema_step, filler=plan_filler)

`plan` lists the optimizer steps, each this process's micro-batches; every process plans the
same number of optimizer steps (`rl_core.train.optimizer_step` pairs the micro-batch counts).
The loss of a micro-batch is `weight x (ppo_clip over its units + kl_beta x sum of its per-unit
KL)`, both divided by the optimizer step's unit count over every process, so how the samples
are split into micro-batches or processes does not change the update. A weight of 0 trains
nothing (a zero-advantage sample refilled for an equal batch still counts with weight 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from rl_core.losses import compute_policy_loss
from rl_core.train.update import NonFiniteGuard, ReplayCheck, UpdateStats, optimizer_step

__all__ = ["Replay", "replay_update"]

M = TypeVar("M")


@dataclass(frozen=True)
class Replay:
    """One micro-batch replayed under the current weights. U = trained units per sample."""

    logp: Tensor  # [b, U] log-probs with gradients
    old_logp: Tensor  # [b, U] the rollout engine's log-probs of the same units
    advantages: Tensor  # [b] one advantage per sample, broadcast over its units
    weight: float = 1.0  # 0: a filler micro-batch that trains nothing
    kl: Tensor | None = None  # [b, U] per-unit KL to the reference, with gradients
    log_ratio: Tensor | None = None
    """[b, U] with gradients: the clipped objective's log ratio in place of `logp - old_logp`
    (GRPO-Guard's RatioNorm, `rl_core.flow.compute_ratio_guard`); `logp` and `old_logp` still
    feed the first-replay check."""
    policy_scale: float = 1.0  # multiplies the micro-batch's policy loss, not its KL (GRPO-Guard: 1 / |dt|)


def replay_update(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Sequence[Sequence[M]],
    replay: Callable[[M], Replay],
    *,
    units: Callable[[M], float],
    clip_range: float,
    kl_beta: float,
    grad_clip: float | None,
    guard: NonFiniteGuard,
    filler: M,
    tolerance: float | None = None,
    what: str = "first replay",
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run `plan` (optimizer steps of micro-batches) through `replay`; returns the metrics over
    every process (`loss/*`, `policy/*`, `grad_norm`, `optimizer_steps`, ...).

    `units(m)` is micro-batch m's trained unit count times its weight, known before its forward.
    `tolerance`: before the first optimizer step (weights still those that sampled), the mean
    |replayed - rollout| log-prob must be within it, else `RuntimeError` naming `what`; its
    `replay/engine_diff_mean|max` are returned. None: no check (old log-probs not the engine's).
    `after_step` runs after each optimizer step that was taken (an EMA update)."""
    stats, check = UpdateStats(), ReplayCheck()
    extra: dict[str, float] = {}

    def loss_fn(micro: M, num_valid: Tensor) -> tuple[Tensor, dict[str, float]]:
        r = replay(micro)
        if tolerance is not None and stats.steps == 0 and r.weight:
            check.add(r.logp.detach(), r.old_logp)
        adv = r.advantages.to(r.logp.device, r.logp.dtype)[:, None].expand_as(r.logp)  # [b, U]
        logp, old = ((r.logp, r.old_logp.to(r.logp.device)) if r.log_ratio is None
                     else (r.log_ratio, torch.zeros_like(r.log_ratio)))  # [b, U] each: ratio = exp(logp - old)
        policy, metrics = compute_policy_loss("ppo_clip", logp=logp, old_logp=old, advantages=adv,
                                              mask=torch.ones_like(r.logp), clip_low=clip_range,
                                              clip_high=clip_range, num_valid=num_valid)
        policy = policy * r.policy_scale
        # summed per sample, then over samples: the order of `rl_core.losses.aggregate("token-mean")`, so the KL
        # term is bit-identical to the policy loss's own reduction of per-unit values
        kl = r.kl.sum(dim=-1).sum() / num_valid if r.kl is not None and kl_beta > 0 else torch.zeros((), device=r.logp.device)
        loss = (policy + kl_beta * kl) * r.weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": float(policy.detach()),
                      "loss/kl": float(kl.detach()), **{f"policy/{n}": float(v) for n, v in metrics.items()}}

    def first_check() -> None:
        if tolerance is not None and stats.steps == 0:
            extra.update(check.verify(accelerator, tolerance, what))

    model.train()
    for micro_batches in plan:
        stepped = optimizer_step(accelerator, model, optimizer, micro_batches, loss_fn, units=units,
                                 grad_clip=grad_clip, guard=guard, stats=stats,
                                 before_step=first_check, filler=filler).stepped
        if stepped and after_step is not None:
            after_step()
    model.eval()
    return {**stats.reduce(accelerator), **extra}
