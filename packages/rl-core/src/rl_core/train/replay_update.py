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

A rollout engine whose numerics differ from the trainer's on purpose (FP8 sampling) passes
`rescore`: before the first optimizer step every micro-batch's log-probs are recomputed without
gradients under the weights that start the update, and they become the ratio's old log-probs
(verl's `old_log_prob`), while the engine's become the sampling log-probs. Their gap over every
trained unit is logged under the text apps' names (`replay/engine_diff_mean|max`,
`replay/engine_kl`), and `correction` re-weights it (TIS, MIS, IcePop:
`rl_core.losses.rollout_correction`). The first replay is then checked against the rescore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from rl_core.losses import ROLLOUT_CORRECTIONS, compute_policy_loss, rollout_correction
from rl_core.train.update import NonFiniteGuard, ReplayCheck, UpdateStats, optimizer_step

__all__ = ["Replay", "RolloutCorrection", "replay_update"]

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


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance weights trainer / engine on a rescored update's loss: `mode` is one of
    `rl_core.losses.ROLLOUT_CORRECTIONS` (`token_truncate` = TIS, `token_mask` = MIS, IcePop with
    both bounds), the weight kept within [clip_min, clip_max] (None: unbounded). The text apps'
    `algo.rollout_correction`, `algo.rollout_clip_min|max`. A unit's log-prob here may be a mean
    over many elements (a diffusion step's): its ratio stays near 1, so choose bounds near 1."""

    mode: str = "none"
    clip_min: float | None = None
    clip_max: float | None = 3.0


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
    rescore: Callable[[M], Tensor] | None = None,
    correction: RolloutCorrection = RolloutCorrection(),
) -> dict[str, float]:
    """Run `plan` (optimizer steps of micro-batches) through `replay`; returns the metrics over
    every process (`loss/*`, `policy/*`, `grad_norm`, `optimizer_steps`, ...).

    `units(m)` is micro-batch m's trained unit count times its weight, known before its forward.
    `tolerance`: before the first optimizer step (weights still those that sampled), the mean
    |replayed - rollout| log-prob must be within it, else `RuntimeError` naming `what`; its
    `replay/engine_diff_mean|max` are returned. None: no check (old log-probs not the engine's).
    `after_step` runs after each optimizer step that was taken (an EMA update).
    `rescore(m)`: micro-batch m's log-probs `[b, U]` under the current weights (the module
    docstring); the first-replay check then compares the replay with them. `correction` applies
    to a rescored update only."""
    ROLLOUT_CORRECTIONS.get(correction.mode)  # an unknown mode fails before any forward
    stats, check, gap = UpdateStats(), ReplayCheck(), ReplayCheck()
    extra: dict[str, float] = {}
    rescored: dict[int, Tensor] = {}  # id(micro-batch) -> the trainer's old log-probs [b, U]

    def loss_fn(micro: M, num_valid: Tensor) -> tuple[Tensor, dict[str, float]]:
        r = replay(micro)
        old, sampling = r.old_logp.to(r.logp.device), None  # [b, U] each
        if id(micro) in rescored:
            old, sampling = rescored[id(micro)], old
        if tolerance is not None and stats.steps == 0 and r.weight:
            check.add(r.logp.detach(), old)
        weights = None
        if sampling is not None:
            if r.log_ratio is not None:
                raise ValueError("replay_update: a rescored update has no RatioNorm log ratio (rescore=None with it)")
            if r.weight:
                gap.add(old, sampling)
            if correction.mode != "none":
                weights = rollout_correction(correction.mode, old_logp=old, sampling_logp=sampling,
                                             mask=torch.ones_like(old), clip_min=correction.clip_min,
                                             clip_max=correction.clip_max)  # [b, U]
        adv = r.advantages.to(r.logp.device, r.logp.dtype)[:, None].expand_as(r.logp)  # [b, U]
        logp, old = ((r.logp, old) if r.log_ratio is None
                     else (r.log_ratio, torch.zeros_like(r.log_ratio)))  # [b, U] each: ratio = exp(logp - old)
        policy, metrics = compute_policy_loss("ppo_clip", logp=logp, old_logp=old, advantages=adv,
                                              mask=torch.ones_like(r.logp), clip_low=clip_range,
                                              clip_high=clip_range, num_valid=num_valid, is_weights=weights)
        policy = policy * r.policy_scale
        # summed per sample, then over samples: the order of `rl_core.losses.aggregate("token-mean")`, so the KL
        # term is bit-identical to the policy loss's own reduction of per-unit values
        kl = r.kl.sum(dim=-1).sum() / num_valid if r.kl is not None and kl_beta > 0 else torch.zeros((), device=r.logp.device)
        loss = (policy + kl_beta * kl) * r.weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": float(policy.detach()),
                      "loss/kl": float(kl.detach()), **{f"policy/{n}": float(v) for n, v in metrics.items()}}

    def first_check() -> None:
        if tolerance is not None and stats.steps == 0:
            checked = check.verify(accelerator, tolerance, what)
            if rescore is None:  # rescored: the engine's gap is `gap`'s, below
                extra.update(checked)

    model.train()
    if rescore is not None:
        with torch.no_grad():
            rescored.update((id(m), rescore(m).detach()) for micro_batches in plan for m in micro_batches)
    for micro_batches in plan:
        stepped = optimizer_step(accelerator, model, optimizer, micro_batches, loss_fn, units=units,
                                 grad_clip=grad_clip, guard=guard, stats=stats,
                                 before_step=first_check, filler=filler).stepped
        if stepped and after_step is not None:
            after_step()
    model.eval()
    if rescore is not None:
        mean, peak = gap.reduce(accelerator)
        extra |= {"replay/engine_diff_mean": mean, "replay/engine_diff_max": peak, "replay/engine_kl": gap.kl_mean(accelerator)}
    return {**stats.reduce(accelerator), **extra}
