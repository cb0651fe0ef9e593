"""The policy side of a rider-grm step: the rollout as right-padded tensors, log-prob replay,
advantages over the global batch, and the clipped policy-gradient + KL-loss update."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from rider_config import Config

from rl_core.advantages import compute_advantages
from rl_core.kl import compute_kl
from rl_core.logprobs import token_logprobs
from rl_core.losses import aggregate, compute_policy_loss
from rl_rollout import Generation


@dataclass(frozen=True)
class Rollout:
    """A step's sequences, right-padded. Label layout: position t predicts token t + 1."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] 1 on completion tokens
    engine_logp: torch.Tensor  # [B, L-1] the engine's sampling log-probs, 0 elsewhere
    group_ids: torch.Tensor  # [B]


def collate(gens: list[Generation], n: int, pad_id: int, device: torch.device) -> Rollout:
    width = max(len(g.prompt_ids) + len(g.completion_ids) for g in gens)
    bsz = len(gens)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros(bsz, width, dtype=torch.long)  # [B, L]
    resp = torch.zeros(bsz, width - 1)  # [B, L-1]
    elp = torch.zeros(bsz, width - 1)  # [B, L-1]
    for i, g in enumerate(gens):
        p, c = len(g.prompt_ids), len(g.completion_ids)
        ids[i, : p + c] = torch.tensor(g.prompt_ids + g.completion_ids)
        attn[i, : p + c] = 1
        resp[i, p - 1 : p + c - 1] = 1
        elp[i, p - 1 : p + c - 1] = torch.tensor(g.logprobs)
    groups = torch.arange(bsz) // n  # [B]
    return Rollout(*(t.to(device) for t in (ids, attn, resp, elp, groups)))


def sequence_logprobs(model: Any, roll: Rollout, rows: slice, temperature: float) -> torch.Tensor:
    """Per-token log-probs `[b, L-1]` of the rollout's tokens under `model` at `temperature`."""
    ids = roll.input_ids[rows]  # [b, L]
    logits = model(input_ids=ids, attention_mask=roll.attention_mask[rows]).logits[:, :-1]  # [b, L-1, V]
    return token_logprobs(logits, ids[:, 1:], temperature)  # [b, L-1]


@torch.no_grad()
def replay_logprobs(model: Any, roll: Rollout, micro: int, temperature: float) -> torch.Tensor:
    rows = [sequence_logprobs(model, roll, slice(s, s + micro), temperature)
            for s in range(0, roll.input_ids.shape[0], micro)]
    return torch.cat(rows) * roll.response_mask  # [B, L-1]


def advantages(cfg: Config, accelerator: Accelerator, roll: Rollout, scores: torch.Tensor,
               old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
    """Advantages `[B, L-1]`, computed over the global batch (REINFORCE++ whitens over all ranks)."""
    mask = roll.response_mask  # [B, L-1]
    rewards = torch.zeros_like(mask)  # [B, L-1]
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # [B] last completion position
    rewards[torch.arange(mask.shape[0]), last] = scores.to(rewards)
    if cfg.algo.kl_in_reward and ref_logp is not None:
        rewards -= cfg.algo.kl_coef * compute_kl(cfg.algo.kl_reward_type, old_logp, ref_logp) * mask
    groups = roll.group_ids + accelerator.process_index * mask.shape[0]  # [B] unique across ranks
    padded = [accelerator.pad_across_processes(t, dim=1) for t in (rewards, mask)]
    all_rewards, all_mask = (accelerator.gather(t) for t in padded)  # [W*B, L']
    adv = compute_advantages(cfg.algo.adv_estimator, rewards=all_rewards, mask=all_mask,
                             group_ids=accelerator.gather(groups),
                             **({"gamma": cfg.algo.gamma} if cfg.algo.adv_estimator == "reinforce_pp" else {}))
    rank = accelerator.process_index
    return adv[rank * mask.shape[0] : (rank + 1) * mask.shape[0], : mask.shape[1]]  # [B, L-1]


def update(cfg: Config, accelerator: Accelerator, model: Any, optimizer: Any, roll: Rollout,
           old_logp: torch.Tensor, ref_logp: torch.Tensor | None, adv: torch.Tensor,
           first: bool) -> dict[str, float]:
    """One pass of clipped PG + KL-loss minibatch updates; micro-batches accumulate gradients
    with the global count of valid tokens, so the loss does not depend on micro/DP splits."""
    bsz, world = roll.input_ids.shape[0], accelerator.num_processes
    mb_rows = max(1, cfg.train.mini_batch_size * cfg.rollout.n // world)
    micro, algo = cfg.train.micro_batch_size, cfg.algo
    sums: dict[str, float] = {}
    count = 0
    model.train()
    for mb in range(0, bsz, mb_rows):
        mask = roll.response_mask[mb : mb + mb_rows]  # [m, L-1]
        local = mask.sum() if algo.agg == "token-mean" else (mask.sum(-1) > 0).sum().to(mask)
        num_valid = accelerator.reduce(local.clone(), reduction="sum").clamp(min=1)
        starts = list(range(mb, min(mb + mb_rows, bsz), micro))
        for start in starts:
            rows = slice(start, min(start + micro, mb + mb_rows, bsz))
            ctx = accelerator.no_sync(model) if start != starts[-1] else nullcontext()
            with ctx:
                logp = sequence_logprobs(model, roll, rows, cfg.rollout.temperature)  # [b, L-1]
                pg, metrics = compute_policy_loss(algo.loss, logp=logp, old_logp=old_logp[rows],
                                                  advantages=adv[rows], mask=roll.response_mask[rows], agg=algo.agg,
                                                  clip_low=algo.clip_low, clip_high=algo.clip_high, num_valid=num_valid)
                loss = pg
                if algo.use_kl_loss and ref_logp is not None:
                    kl = compute_kl(algo.kl_loss_type, logp, ref_logp[rows])  # [b, L-1]
                    kl_loss = aggregate(kl, roll.response_mask[rows], algo.agg, num_valid=num_valid)
                    loss = loss + algo.kl_loss_coef * kl_loss
                    metrics["kl_loss"] = kl_loss.detach()
                accelerator.backward(loss * world)  # DDP averages gradients over ranks
            ratio_tol = 1e-4 if model_dtype(model) == torch.float32 else 1e-2  # 16-bit kernels vary
            if first and mb == 0 and abs(metrics["ratio_max"].item() - 1) + abs(metrics["ratio_min"].item() - 1) > ratio_tol:
                raise RuntimeError(f"first on-policy replay: importance ratio in [{metrics['ratio_min']:.6f}, "
                                   f"{metrics['ratio_max']:.6f}], expected exactly 1: the update forward differs "
                                   "from the replay forward (dropout? non-deterministic kernels?)")
            metrics["pg_loss"] = pg.detach()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            count += 1
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(
            accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    n_mb = -(-bsz // mb_rows)
    return {f"actor/{k}": v / (n_mb if k == "grad_norm" else count) for k, v in sums.items()}


def model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype

