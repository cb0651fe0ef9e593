"""diffusion-grpo's `janus` family: token-level GRPO on Janus / Janus-Pro image tokens (VRL's
autoregressive trainer, on the recipe skeleton of the SD3 path).

setup: `JanusEngine` over the checkpoint, LoRA on the language model, the `JanusImagePolicy`
the accelerator prepares. rollout: groups of n images per prompt sampled with CFG
(`sampling.guidance_scale`, `janus.temperature`), one seed per sample (the SD3 path's seeds),
per-token log-probs kept. update: every image token of a sample carries the sample's GRPO
advantage; `ppo_clip` on the per-token ratio (`train.clip_range`) plus `train.kl_beta` x the
per-token `janus.kl` estimator against the LoRA-disabled model, both token-mean over the
optimizer step's tokens (all processes), so accumulation and process count do not change it.
Reward, advantages, EMA, checkpoints, resume and eval are the SD3 path's.
"""

from __future__ import annotations

from typing import Any

import torch
from grpo_config import Config
from grpo_plan import plan_micro_batches
from grpo_run import Batch, Run, epoch_samples
from peft import PeftModel

from rl_core.kl import compute_kl
from rl_core.losses import aggregate, compute_policy_loss
from rl_core.train import ReplayCheck, UpdateStats, UserError, optimizer_step
from rl_models.janus import JanusImagePolicy, image_size, reference_image_token_logprobs
from rl_models.lora import add_lora
from rl_rollout.janus import ImageRollout, JanusEngine

Micro = tuple[int, torch.Tensor, float]  # (rollout index, its rows [b], loss weight)


def build(cfg: Config, path: str, device: torch.device) -> tuple[JanusEngine, PeftModel, torch.nn.Module]:
    """The engine (sampling with the live LoRA weights), the peft model and the policy module."""
    m, j = cfg.model, cfg.janus
    engine = JanusEngine.from_pretrained(path, dtype=m.dtype, device=device, compile=j.compile,
                                         logprobs=j.logprobs, max_batch_size=cfg.rollout.sample_batch_size)
    side = image_size(engine.model)
    if cfg.sampling.resolution != side:
        raise UserError(f"sampling.resolution={cfg.sampling.resolution}: this Janus checkpoint draws {side}x{side} "
                        f"images; set sampling.resolution={side}")
    if j.gradient_checkpointing:
        engine.model.model.language_model.gradient_checkpointing_enable()
    engine.model.requires_grad_(False)
    peft = add_lora(engine.model, family="janus", r=m.lora_rank, alpha=m.lora_alpha, target_modules=m.lora_targets)
    return engine, peft, JanusImagePolicy(peft)


def collect(run: Run, epoch: int) -> Batch:
    """n images per prompt, `rollout.sample_batch_size` per sampled batch."""
    cfg, size = run.cfg, run.cfg.rollout.sample_batch_size
    records, seeds, group_ids = epoch_samples(run, epoch)
    rollouts = [run.engine.sample([r.prompt for r in records[start:start + size]],
                                  guidance_scale=cfg.sampling.guidance_scale, temperature=cfg.janus.temperature,
                                  seeds=seeds[start:start + size])
                for start in range(0, len(records), size)]
    return Batch(rollouts, records, group_ids)


def sample_images(run: Any, prompts: list[str], seeds: list[int]) -> torch.Tensor:
    """Eval images `[B, 3, H, W]`: the current (or EMA) weights at fixed seeds."""
    return run.engine.sample(prompts, guidance_scale=run.cfg.eval.guidance_scale,
                             temperature=run.cfg.janus.temperature, seeds=seeds).images


def train_epoch(run: Run, batch: Batch, adv: torch.Tensor, epoch: int) -> dict[str, float]:
    """The epoch's optimizer steps (`grpo_plan.plan_micro_batches`: `train.zero_adv`, micro-batches
    of at most `micro_batch_size` images of one sampled batch); each micro-batch is one forward
    and backward over its images' N tokens."""
    acc, t, j = run.acc, run.cfg.train, run.cfg.janus
    rollouts: list[ImageRollout] = batch.trajectories
    run.engine.release_cache()  # the KV cache is not needed until the next rollout
    sizes = [len(r) for r in rollouts]
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    plan = plan_micro_batches(run, sizes, adv, epoch)
    scale = run.cfg.sampling.guidance_scale
    use_cfg = j.loss_logits == "cfg" and scale > 1
    old = [r.log_probs for r in rollouts] if use_cfg else conditional_logprobs(run, rollouts)
    tokens = rollouts[0].tokens.image_ids.shape[1]
    stats, check = UpdateStats(), ReplayCheck()

    def loss_fn(micro: Micro, num_valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        k, rows, weight = micro
        inputs = rollouts[k].tokens.index(rows).to(acc.device)
        logp = run.model(inputs, guidance_scale=scale, temperature=j.temperature, use_cfg=use_cfg)  # [b, N]
        old_logp = old[k][rows].to(acc.device)  # [b, N]
        if stats.steps == 0 and weight and use_cfg:  # on-policy: nothing was updated since the rollout
            check.add(logp.detach(), old_logp)
        row_adv = adv[offsets[k] + rows].to(acc.device, logp.dtype)[:, None].expand_as(logp)  # [b, N]
        mask = torch.ones_like(logp)  # [b, N] every image has N tokens
        policy, metrics = compute_policy_loss("ppo_clip", logp=logp, old_logp=old_logp, advantages=row_adv,
                                              mask=mask, clip_low=t.clip_range, clip_high=t.clip_range,
                                              num_valid=num_valid)
        kl = torch.zeros((), device=acc.device)
        if t.kl_beta > 0:
            ref = reference_image_token_logprobs(run.peft, inputs, guidance_scale=scale, temperature=j.temperature,
                                                 use_cfg=use_cfg)  # [b, N]
            kl = aggregate(compute_kl(j.kl, logp, ref), mask, "token-mean", num_valid=num_valid)
        loss = (policy + t.kl_beta * kl) * weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": float(policy.detach()),
                      "loss/kl": float(kl.detach()), **{f"policy/{n}": float(v) for n, v in metrics.items()}}

    def first_check() -> None:
        if stats.steps == 0 and use_cfg:
            metrics = check.verify(acc, t.ratio_tolerance, f"epoch {epoch}: first replay, |log ratio| vs "
                                   "train.ratio_tolerance (janus.logprobs='decode'? bf16 with micro_batch_size != "
                                   "sample_batch_size needs a looser tolerance)")
            run.first_ratio = metrics["replay/engine_diff_max"]

    run.model.train()
    filler: Micro = (0, torch.tensor([0]), 0.0)  # for a process with no image in a step
    for micro_batches in plan:
        stepped = optimizer_step(acc, run.model, run.optimizer, micro_batches, loss_fn,
                                 units=lambda m: float(len(m[1]) * tokens) * m[2], grad_clip=t.max_grad_norm,
                                 guard=run.guard, stats=stats, before_step=first_check, filler=filler).stepped
        if stepped:
            run.optimizer_steps += 1
            run.ema.step(run.optimizer_steps)
    run.model.eval()
    trained = sum(len(rows) * weight for micro_batches in plan for _, rows, weight in micro_batches)
    total = acc.reduce(torch.tensor(float(trained), device=acc.device), reduction="sum").item()
    return {**stats.reduce(acc), "adv/trained_samples": total}


@torch.no_grad()
def conditional_logprobs(run: Run, rollouts: list[ImageRollout]) -> list[torch.Tensor]:
    """Old log-probs `[B, N]` per rollout under the conditional logits (`janus.loss_logits =
    "cond"`), computed before the update in the batches they were sampled in."""
    t = run.cfg.janus.temperature
    return [run.engine.replay(r.tokens, guidance_scale=r.guidance_scale, temperature=t, use_cfg=False)
            for r in rollouts]
