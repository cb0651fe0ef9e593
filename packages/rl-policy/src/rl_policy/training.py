"""From language-model rollouts to a policy update: the token-level RL update that caption-rl
(Qwen-VL captioners) and rider-grm (text policies) share.

    rollouts = [Rollout(EncodedPrompt(g.prompt_ids), g.completion_ids, g.logprobs, valid=True) ...]
    old = rollout_logprobs(model, rollouts, ...)      # or None on-policy (see `token_update`)
    metrics = token_update(acc, Policy(model) prepared, optimizer, rollouts, advantages, ...)

The accumulation rules (global valid-token count, data-parallel scaling, equal backward counts
on every process, the non-finite guard) are `rl_core.train.optimizer_step`'s; this module adds
what is specific to token sequences: collating prompts (with their media tensors) and
completions into a `TokenBatch`, the clipped policy loss with an optional KL term, and the
engine-vs-trainer log-prob check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec
import torch
from torch import Tensor

from rl_core.kl import compute_kl
from rl_core.losses import ROLLOUT_CORRECTIONS, aggregate, compute_policy_loss, rollout_correction
from rl_core.train import (
    NonFiniteGuard,
    ReplayCheck,
    TokenPolicyFields,
    UpdateStats,
    gather_rows,
    optimizer_step,
)
from rl_models.logprobs import TokenBatch, completion_logprobs, completion_logprobs_and_entropy
from rl_rollout.prompts import EncodedPrompt, pad_batch
from rl_rollout.protocol import Generation

B = TypeVar("B")

__all__ = [
    "LossOptions",
    "Policy",
    "Rollout",
    "by_length",
    "collate",
    "loss_fields",
    "pad_rows",
    "regroup",
    "replay_tolerance",
    "response_metrics",
    "rollout_logprobs",
    "to_device",
    "to_rollouts",
    "token_advantages",
    "token_rewards",
    "token_update",
]


@dataclass(frozen=True)
class Rollout:
    """One sampled completion and what the update needs about it."""

    prompt: EncodedPrompt  # prompt ids (+ processor media tensors for VL models)
    completion_ids: list[int]
    engine_logprobs: list[float]  # the rollout engine's sampling log-probs
    valid: bool  # False: failed to score (or unusable); stays in the batch with weight 0


def to_rollouts(generations: Sequence[Generation], valid: Sequence[bool] | Tensor | None = None,
                prompts: Sequence[EncodedPrompt] | None = None) -> list[Rollout]:
    """The `Rollout` of each generation: its prompt as the engine encoded it (`prompts[request_index]`
    where given, for a VL prompt's media tensors), its engine log-probs, `valid[i]` (None: all)."""
    flags = [True] * len(generations) if valid is None else [bool(v) for v in valid]
    return [Rollout(EncodedPrompt(g.prompt_ids) if prompts is None else prompts[g.request_index], g.completion_ids,
                    g.logprobs, valid=ok) for g, ok in zip(generations, flags, strict=True)]


def regroup(groups: Sequence[tuple[B, Sequence[int]]], generations: Callable[[B], Sequence[Generation]],
            ) -> tuple[list[tuple[B, int]], list[Generation]]:
    """Dynamic sampling's kept groups (`Recipe.merge`'s: a batch and the rows of one prompt's
    samples each) as one batch: each group's batch and the request index of its prompt there,
    and the groups' samples, in order, renumbered so that group j's have `request_index` j."""
    heads = [(batch, generations(batch)[rows[0]].request_index) for batch, rows in groups]
    gens = [msgspec.structs.replace(generations(batch)[i], request_index=j)
            for j, (batch, rows) in enumerate(groups) for i in rows]
    return heads, gens


def token_advantages(advantages: Tensor, rollouts: Sequence[Rollout]) -> list[Tensor]:
    """Each rollout's advantage per completion token `[C_i]`: a row of token advantages
    (`advantages` `[B, T]`) cut to its completion, or a sequence advantage (`[B]`) repeated."""
    if advantages.dim() == 2:
        return [advantages[i, : len(r.completion_ids)] for i, r in enumerate(rollouts)]
    return [advantages[i].expand(len(r.completion_ids)) for i, r in enumerate(rollouts)]


def token_rewards(generations: Sequence[Generation], scores: Sequence[float | None], *,
                  kl: Sequence[Tensor] | None = None, kl_coef: float = 0.0) -> tuple[Tensor, Tensor]:
    """Token rewards `[B, C]` (C: the longest completion) and their mask: each sample's score on
    its last token (None: NaN, a failed sample the advantages leave out), minus `kl_coef` x its
    per-token KL `kl[i]` `[C_i]` to a reference on every token (verl's `apply_kl_penalty`)."""
    width = max([1, *(len(g.completion_ids) for g in generations)])
    mask, rewards = torch.zeros(len(generations), width), torch.zeros(len(generations), width)  # [B, C] x2
    for i, (g, score) in enumerate(zip(generations, scores, strict=True)):
        n = len(g.completion_ids)
        mask[i, :n] = 1
        rewards[i, max(n - 1, 0)] = math.nan if score is None else score
        if kl is not None and n:
            rewards[i, :n] -= kl_coef * kl[i]
    return rewards, mask


def replay_tolerance(given: float | None, model: torch.nn.Module, precision: str = "bf16") -> float:
    """The largest mean |engine - trainer| log-prob gap the first replay accepts: `given`
    (`algo.replay_tolerance`), else 1e-3 for a float32 policy, 5e-2 for 16-bit kernels and 0.2
    for an FP8 rollout engine (`rollout.precision`: its gap is corrected, not checked to rounding)."""
    if given is not None:
        return given
    if precision == "fp8":
        return 0.2
    return 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2


def collate(rollouts: Sequence[Rollout], pad_id: int, placeholders: frozenset[int] = frozenset()) -> TokenBatch:
    """Prompts left-padded (with their processor tensors), completions right-padded, every
    completion starting at column P. Tokens in `placeholders` (a VL model's vision slots,
    which a drifted policy can sample) become `pad_id`; such rows must be marked invalid."""
    prompts = pad_batch([r.prompt for r in rollouts], pad_id)
    width = max(1, max(len(r.completion_ids) for r in rollouts))
    completion = torch.full((len(rollouts), width), pad_id, dtype=torch.long)  # [B, C]
    completion_mask = torch.zeros(len(rollouts), width, dtype=torch.long)  # [B, C]
    for i, r in enumerate(rollouts):
        completion[i, : len(r.completion_ids)] = torch.tensor(
            [pad_id if tok in placeholders else tok for tok in r.completion_ids], dtype=torch.long)
        completion_mask[i, : len(r.completion_ids)] = 1
    return TokenBatch.from_prompt_completion(prompts.input_ids, prompts.attention_mask, completion, completion_mask,
                                             **prompts.media)


def to_device(batch: TokenBatch, device: torch.device) -> TokenBatch:
    moved: dict[str, Any] = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, Tensor)}
    return replace(batch, **moved)


def pad_rows(rows: Sequence[Tensor], width: int) -> Tensor:
    """Right-pad 1-D per-token tensors into `[B, width]` (zeros)."""
    out = torch.zeros(len(rows), width)  # [B, C]
    for i, row in enumerate(rows):
        out[i, : len(row)] = row[:width]
    return out


class Policy(torch.nn.Module):
    """The trained model behind one forward returning completion log-probs and entropies
    `[B, C]` (`rl_models.completion_logprobs_and_entropy`: hidden states, then the LM head in
    chunks; the entropy carries no gradient). Hand this module to `accelerator.prepare` (or
    `rl_core.train.prepare_policy`), so DDP wraps the whole log-prob computation and synchronizes
    its gradients, or FSDP2 shards it with this module as the root unit: the LM head weight read
    outside the model's own forward is then gathered by the root's forward. `entropy=False`
    computes log-probs only (`rollout_logprobs`; the entropy comes back as None)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, temperature: float, entropy: bool = True) -> tuple[Tensor, Tensor | None]:
        if not entropy:
            return completion_logprobs(self.model, batch, temperature=temperature), None  # [B, C]
        return completion_logprobs_and_entropy(self.model, batch, temperature=temperature)  # [B, C] x2


@torch.no_grad()
def rollout_logprobs(model: torch.nn.Module, rollouts: Sequence[Rollout], *, micro_batch_size: int,
                     temperature: float, pad_id: int, device: torch.device,
                     placeholders: frozenset[int] = frozenset()) -> list[Tensor]:
    """No-grad log-probs of each rollout's completion under `model` (a list of `[C_i]`, CPU):
    PPO's old log-probs, or the KL reference's. `model` is a transformers model, or the trained
    `Policy` (required when it is sharded: its forward gathers the weights). Micro-batches take the
    rollouts in order of length (`by_length`); the list keeps the rollouts' order."""
    out: dict[int, Tensor] = {}
    order = by_length(rollouts, range(len(rollouts)))
    for start in range(0, len(order), micro_batch_size):
        rows = order[start : start + micro_batch_size]
        batch = to_device(collate([rollouts[i] for i in rows], pad_id, placeholders), device)
        if isinstance(model, Policy):
            logp = model(batch, temperature, entropy=False)[0]  # [b, C]
        else:
            logp = completion_logprobs(model, batch, temperature=temperature)  # [b, C]
        out |= {i: logp[k, : len(rollouts[i].completion_ids)].float().cpu() for k, i in enumerate(rows)}
    return [out[i] for i in range(len(rollouts))]


def by_length(rollouts: Sequence[Rollout], rows: Iterable[int]) -> list[int]:
    """`rows` by completion length (stable), so that each micro-batch pads to lengths alike: with a
    long tail of lengths, a micro-batch of random rows pads most of its rows to the tail's length.
    The losses sum over micro-batches, so the order changes no gradient."""
    return sorted(rows, key=lambda i: len(rollouts[i].completion_ids))


def engine_check(rollouts: Sequence[Rollout], trainer: Sequence[Tensor]) -> ReplayCheck:
    """|engine - trainer| log-probs over the valid rollouts' tokens."""
    check = ReplayCheck()
    for r, logp in zip(rollouts, trainer, strict=True):
        if r.valid:
            check.add(logp[: len(r.completion_ids)], torch.tensor(r.engine_logprobs))
    return check


@dataclass(frozen=True)
class LossOptions:
    """The token policy loss: `rl_core.losses.compute_policy_loss(loss, agg, clip_low,
    clip_high, **loss_options)` plus `kl_coef` x `rl_core.kl.compute_kl(kl)` to the reference,
    aggregated the same way. `norm_length` is `seq-mean-token-sum-norm`'s constant (the response
    length cap). `loss_options` are the loss's own keywords (`dual_clip`'s `c`, `sapo`'s
    `tau_pos` / `tau_neg`).

    Both corrections read each rollout's `engine_logprobs`: `off_policy_mask` is DeepSeek-V3.2's
    off-policy sequence mask threshold (`compute_policy_loss(off_policy_mask=)`, None: off);
    `rollout_correction` names an `rl_core.losses.ROLLOUT_CORRECTIONS` mode (`token_mask`,
    `sequence_truncate`, ...; "none": off) whose importance weights trainer / engine, bounded by
    `rollout_clip_min` / `rollout_clip_max`, multiply the token loss."""

    loss: str = "ppo_clip"
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl: str = "k3"
    kl_coef: float = 0.0
    temperature: float = 1.0
    norm_length: float | None = None
    loss_options: Mapping[str, float] = field(default_factory=dict)
    off_policy_mask: float | None = None
    rollout_correction: str = "none"
    rollout_clip_min: float | None = None
    rollout_clip_max: float | None = 3.0



def loss_fields(algo: TokenPolicyFields) -> dict[str, Any]:
    """`LossOptions`' loss, aggregation, clip range, loss options and corrections from an app's
    `algo` table (the keys of `rl_core.train.TokenPolicyFields`):
    `LossOptions(**loss_fields(cfg.algo), kl=..., temperature=...)`."""
    return {"loss": algo.loss, "agg": algo.agg, "clip_low": algo.clip_low, "clip_high": algo.clip_high,
            "loss_options": dict(algo.loss_options), "off_policy_mask": algo.off_policy_mask,
            "rollout_correction": algo.rollout_correction, "rollout_clip_min": algo.rollout_clip_min,
            "rollout_clip_max": algo.rollout_clip_max}

@dataclass(frozen=True)
class _Micro:
    rows: list[int]
    units: float


def _units(rollouts: Sequence[Rollout], rows: Sequence[int], agg: str) -> float:
    valid = [rollouts[i] for i in rows if rollouts[i].valid]
    return float(sum(len(r.completion_ids) for r in valid) if agg == "token-mean" else len(valid))


def token_update(
    accelerator: Any,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    advantages: Sequence[Tensor] | Tensor,
    *,
    options: LossOptions,
    micro_batch_size: int,
    guard: NonFiniteGuard,
    pad_id: int,
    old: Sequence[Tensor] | None = None,
    ref: Sequence[Tensor] | None = None,
    num_minibatches: int = 1,
    ppo_epochs: int = 1,
    grad_clip: float = 1.0,
    placeholders: frozenset[int] = frozenset(),
    scheduler: Any = None,
    check_tolerance: float | None = None,
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes over `num_minibatches` minibatches of this process's rollouts; each
    minibatch is one `optimizer_step` over micro-batches of `micro_batch_size` rollouts.

    `policy` is the prepared `Policy`. `advantages[i]` is rollout i's per-token advantage `[C_i]`,
    or a tensor of sequence (`[B]`) or token (`[B, T]`) advantages (`token_advantages`). `old=None` means on-policy (one optimizer
    step per batch): each micro-batch's own detached log-probs are its old ones, as TRL and verl
    do, and the engine's sampling log-probs are compared with them before the first optimizer
    step; `check_tolerance` (the run's first step) raises when they disagree. `ref` holds the
    KL reference's log-probs when `options.kl_coef > 0`. `after_step` runs after each optimizer
    step that was taken (a vLLM weight push, say)."""
    if isinstance(advantages, Tensor):
        advantages = token_advantages(advantages, rollouts)
    parts = [by_length(rollouts, p.tolist()) for p in torch.arange(len(rollouts)).tensor_split(num_minibatches)]
    stats, check = UpdateStats(), ReplayCheck()
    device = accelerator.device

    norm_length = options.norm_length if options.agg == "seq-mean-token-sum-norm" else None
    ROLLOUT_CORRECTIONS.get(options.rollout_correction)  # an unknown mode fails before any forward
    correct = options.rollout_correction != "none"

    def loss_fn(micro: _Micro, num_valid: Tensor) -> tuple[Tensor, dict[str, float]]:
        rows = [rollouts[i] for i in micro.rows]
        batch = to_device(collate(rows, pad_id, placeholders), device)
        valid = torch.tensor([r.valid for r in rows], device=device)[:, None]  # [B, 1]
        mask = batch.completion_mask * valid  # [B, C] failed samples contribute nothing
        logp, ent = policy(batch, options.temperature)  # [B, C], [B, C]
        width = logp.shape[1]
        old_logp = logp.detach() if old is None else pad_rows([old[i] for i in micro.rows], width).to(device)
        adv = pad_rows([advantages[i] for i in micro.rows], width).to(device, logp.dtype) * mask  # [B, C]
        if old is None and stats.steps == 0:
            for row, r in enumerate(rows):
                if r.valid:
                    check.add(logp[row, : len(r.completion_ids)], torch.tensor(r.engine_logprobs))
        sampling: Tensor | None = None
        weights: Tensor | None = None
        if correct or options.off_policy_mask is not None:
            sampling = _engine_logprobs(rows, width).to(device)  # [B, C]
            if correct:
                weights = rollout_correction(options.rollout_correction, old_logp=old_logp, sampling_logp=sampling,
                                             mask=mask, clip_min=options.rollout_clip_min,
                                             clip_max=options.rollout_clip_max)  # [B, C]
        loss, metrics = compute_policy_loss(
            options.loss, logp=logp, old_logp=old_logp, advantages=adv, mask=mask, agg=options.agg,
            clip_low=options.clip_low, clip_high=options.clip_high, num_valid=num_valid, norm_length=norm_length,
            off_policy_mask=options.off_policy_mask,
            sampling_logp=sampling if options.off_policy_mask is not None else None, is_weights=weights,
            **options.loss_options)
        keep = ("clip_fraction", "approx_kl", "ratio_mean", "off_policy_masked", "is_ratio_mean", "is_masked")
        out = {"loss/policy": float(loss.detach()), "policy/entropy": _mean(ent, mask),
               **{f"policy/{k}": float(v) for k, v in metrics.items() if k in keep},
               "policy/ratio_max": float(metrics["ratio_max"]) if mask.any() else 1.0}
        if ref is not None and options.kl_coef > 0:
            kl = compute_kl(options.kl, logp, pad_rows([ref[i] for i in micro.rows], width).to(device))  # [B, C]
            kl_loss = aggregate(kl, mask, options.agg, num_valid=num_valid, norm_length=norm_length)
            loss = loss + options.kl_coef * kl_loss
            out["loss/kl"] = float(kl_loss.detach())
        return loss, out

    def before_step() -> None:
        if old is None and stats.steps == 0:  # first optimizer step of this batch: weights unchanged so far
            extra.update(check.verify(accelerator, check_tolerance if check_tolerance is not None else float("inf"),
                                      "first replay"))

    extra: dict[str, float] = {}
    policy.train()
    for _ in range(ppo_epochs):
        for part in parts:
            micro = [_Micro(part[i : i + micro_batch_size], _units(rollouts, part[i : i + micro_batch_size], options.agg))
                     for i in range(0, len(part), micro_batch_size)]
            step = optimizer_step(accelerator, policy, optimizer, micro, loss_fn, units=lambda m: m.units,
                                  grad_clip=grad_clip, guard=guard, stats=stats, scheduler=scheduler,
                                  before_step=before_step, filler=_Micro([0], 0.0))
            if step.stepped and after_step is not None:
                after_step()
    policy.eval()
    return {**stats.reduce(accelerator), **extra}


def _engine_logprobs(rows: Sequence[Rollout], width: int) -> Tensor:
    """The rollout engine's sampling log-probs `[B, width]`, one per completion token."""
    for r in rows:
        if len(r.engine_logprobs) != len(r.completion_ids):
            raise ValueError(f"a rollout has {len(r.engine_logprobs)} engine log-probs for {len(r.completion_ids)} "
                             "completion tokens; off_policy_mask and rollout_correction need one per token "
                             "(turn them off for an engine that does not return log-probs)")
    return pad_rows([torch.tensor(r.engine_logprobs, dtype=torch.float32) for r in rows], width)  # [B, C]


def _mean(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` over the mask's tokens (0 when empty)."""
    count = float(mask.sum())
    return float((values * mask).sum()) / count if count else 0.0


def response_metrics(accelerator: Any, generations: Sequence[Generation]) -> dict[str, float]:
    """`response/length_mean|length_max|truncation_rate` over the generations of every process,
    and `tokens` (prompt + completion tokens of every process, which the trainer loop turns into
    `throughput/tokens_per_s`)."""
    local = [[float(len(g.completion_ids)), float(len(g.prompt_ids)), float(g.finish_reason == "length")]
             for g in generations]
    rows, _ = gather_rows(torch.tensor(local, dtype=torch.float64).reshape(-1, 3), accelerator)  # [B, 3]
    if not len(rows):
        return {}
    return {"response/length_mean": rows[:, 0].mean().item(), "response/length_max": rows[:, 0].max().item(),
            "response/truncation_rate": rows[:, 2].mean().item(), "tokens": rows[:, :2].sum().item()}
