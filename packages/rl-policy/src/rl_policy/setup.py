"""What a text policy's recipe does with its config's shared tables in `check` and `setup`: the
`algo.*` keys (`rl_core.train.TokenPolicyFields`), `rollout.*` (`PolicyRolloutFields`) and
`train.*` (`rl_core.train.TokenTrainFields`), one call each, so that every text app checks its
keys, builds its optimizer and its engine the same way.

    def check(self, cfg, world_size):
        check_token_config(cfg.algo, cfg.rollout, cfg.train, world_size)

    def setup(self, cfg, run):
        trained = prepare_token_policy(run, model, cfg.train)
        engine = engine_for(cfg.rollout, run, model=model, processor=processor, path=path,
                            dtype=cfg.model.dtype, full=trained.full, optimizer=trained.optimizer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_core.train import (
    ConfigError,
    FullWeights,
    RunContext,
    TokenPolicyFields,
    TokenTrainFields,
    check_token_step,
    prepare_policy,
    resolve_sharding,
)
from rl_policy.engine import PolicyEngine, build_policy_engine, rollout_device
from rl_policy.placement import PolicyRolloutFields, check_placement, check_ray
from rl_policy.training import Policy
from rl_rollout.registry import resolve_engine

__all__ = ["TrainedPolicy", "check_token_config", "engine_for", "prepare_token_policy"]


def check_token_config(algo: TokenPolicyFields, rollout: PolicyRolloutFields, train: TokenTrainFields,
                       world_size: int) -> str:
    """The rules between the shared keys, before any model loads: whole prompts per process and
    per optimizer step, `rollout.n >= 2` for a group baseline, the loss's options, and the
    rollout's engine and placement (a vLLM engine where it cannot run, a split placement without
    asynchronous rollouts, Ray workers without Ray). Returns the engine `rollout.engine` resolves
    to here."""
    check_token_step(algo, n=rollout.n, batch_size=train.batch_size, world_size=world_size,
                     mini_batch_size=train.mini_batch_size)
    engine, _ = resolve_engine(rollout.engine, key="rollout.engine")
    check_placement(rollout.placement, engine, train.max_staleness, world_size=world_size, workers=rollout.workers,
                    ray_address=rollout.cluster_address())
    check_ray(rollout.workers)
    if rollout.weight_push == "adapter" and not rollout.workers and (
            engine != "vllm" or train.max_staleness or rollout.placement != "colocated"):
        raise ConfigError(f"rollout.weight_push='adapter' pushes a LoRA adapter to Ray actors (rollout.workers) or to a "
                          f"colocated, synchronous vLLM engine; "
                          f"here rollout.engine resolves to {engine!r}, train.max_staleness={train.max_staleness}, "
                          f"rollout.placement={rollout.placement!r}: set rollout.weight_push='merged'")
    if rollout.precision == "fp8" and engine != "vllm":
        raise ConfigError(f"rollout.precision='fp8' quantizes a vLLM engine's weights; rollout.engine resolves to "
                          f"{engine!r} here: set rollout.precision='bf16' (or rollout.engine='vllm' on a GPU)")
    return engine


@dataclass(frozen=True)
class TrainedPolicy:
    """The trained side of a text policy, prepared for the run's processes."""

    policy: torch.nn.Module  # `Policy(model)`, DDP-wrapped or FSDP2-sharded
    optimizer: torch.optim.Optimizer  # AdamW over the trainable parameters
    scheduler: torch.optim.lr_scheduler.LRScheduler  # linear warm-up over train.warmup_steps, then constant
    full: FullWeights | None  # a sharded policy's full weights: what its engine decodes and its export writes


def prepare_token_policy(run: RunContext, model: torch.nn.Module, train: TokenTrainFields) -> TrainedPolicy:
    """`model` (a transformers model, a PeftModel with LoRA) ready to train: sharded as
    `train.sharding` and an `accelerate launch` FSDP config say (`rl_core.train.resolve_sharding`),
    AdamW with `train.lr` and `train.weight_decay` over the parameters that require grad, and
    the warm-up schedule (pass it to `token_update` as `scheduler`)."""
    acc = run.accelerator
    plan = resolve_sharding(acc, train.sharding, mixed_precision=train.fsdp_mixed_precision,
                            cpu_offload=train.fsdp_cpu_offload, activation_checkpointing=train.fsdp_activation_checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=train.lr,
                                  weight_decay=train.weight_decay)
    warmup = train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    full = FullWeights(model, device=acc.device) if plan.sharded else None
    policy, optimizer, scheduler = prepare_policy(acc, Policy(model), optimizer, scheduler, plan)
    return TrainedPolicy(policy, optimizer, scheduler, full)


def engine_for(rollout: PolicyRolloutFields, run: RunContext, *, model: torch.nn.Module, processor: Any, path: str,
               dtype: str, engine_options: dict[str, Any] | None = None, **build: Any) -> PolicyEngine:
    """`build_policy_engine` for an app's `rollout.*` table: the engine kind, its batch size,
    vLLM's memory share and options, the placement and the Ray workers come from `rollout`; the
    device, seed (the process's rank), process count and phase timer from `run`. `engine_options`:
    the app's defaults, under `rollout.engine_options`; `build`: the rest of `build_policy_engine`'s
    keywords (`full`, `optimizer`, `compile`, `seed`, ...)."""
    acc = run.accelerator
    kwargs: dict[str, Any] = dict(
        device=acc.device, seed=run.rank, world_size=run.world_size, max_batch_size=rollout.max_batch_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization, timer=run.timer,
        rollout_device=rollout_device(rollout.placement, acc, workers=rollout.workers), workers=rollout.workers,
        gpus_per_worker=rollout.gpus_per_worker, ray_address=rollout.ray_address, weight_push=rollout.weight_push)
    fp8 = {"quantization": "fp8"} if rollout.precision == "fp8" else {}
    return build_policy_engine(rollout.engine, model=model, processor=processor, path=path, dtype=dtype,
                               engine_options={**(engine_options or {}), **fp8, **rollout.engine_options}, **(kwargs | build))
