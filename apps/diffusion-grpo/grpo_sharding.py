"""FSDP2 in diffusion-grpo (`train.sharding = "fsdp2"`, or an `accelerate launch` FSDP config):
the SD3 transformer with its LoRA sharded over the processes by `rl_core.train.sharding` (one
`fully_shard` unit per `JointTransformerBlock`, diffusers' `_no_split_modules`, + the root), and
where each phase of the recipe gets whole weights from.

- update: the replay and the KL reference (adapter disabled) run through the sharded PeftModel;
  each forward all-gathers one block at a time, each backward reduce-scatters its LoRA
  gradients. Every process runs the same number of micro-batches (a zero-weight filler where it
  has none, as under DDP), so the collectives line up.
- rollout, eval, export: the engine's pipeline samples from an unsharded copy of the transformer
  (`FullWeights`), filled by all-gathering the current weights on every process at the start of
  the phase and emptied after it (`time/weight_gather`). A rollout runs tens of transformer
  forwards per image, and the eval runs on the main process alone: gathering once per phase
  costs one all-gather of the weights and needs no lockstep between the processes.
- Ray rollout workers (`rollout.workers`) are sent the gathered copy's LoRA weights, as from an
  unsharded trainer.
- EMA: whole on every process (`grpo_parts.LoraEMA`), applied to the gathered copy for the eval
  and the `lora_ema/` export.
- checkpoints: the LoRA weights and the optimizer state as DCP shards (`sharded/`, every process
  its own; the frozen base is left out), the EMA and the sampler by the main process, and the
  PEFT `lora/` and `lora_ema/` exports from the gathered copy: all inside the atomic
  `save_checkpoint` (grpo_phases.save).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import torch
from accelerate import Accelerator
from grpo_config import TrainConfig
from peft import PeftModel

from rl_core.train import FullWeights, gathered, prepare_policy, resolve_sharding
from rl_rollout.diffusion import DiffusionEngine

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)


def prepare_transformer(acc: Accelerator, t: TrainConfig, engine: DiffusionEngine, peft: PeftModel,
                        optimizer: Opt) -> tuple[torch.nn.Module, Opt, FullWeights | None]:
    """`acc.prepare(peft, optimizer)` (DDP) for `train.sharding = "none"`; for FSDP2 the sharded
    `peft` (in place), its optimizer, and the unsharded copy the engine now samples from (its
    weights are there only inside `whole_weights`)."""
    plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision, cpu_offload=t.fsdp_cpu_offload,
                            activation_checkpointing=t.fsdp_activation_checkpointing)
    full = FullWeights(peft, device=acc.device) if plan.sharded else None  # before sharding: a copy of the unsharded structure
    model, optimizer, _ = prepare_policy(acc, peft, optimizer, None, plan)
    if full is not None:
        engine.pipeline.transformer = cast(PeftModel, full.model).get_base_model()  # the copy's LoRA-injected transformer
    return model, optimizer, full


def whole_weights(run: Any) -> AbstractContextManager[PeftModel]:
    """The PeftModel with whole weights, which the engine samples from: the trained one, or a
    sharded policy's copy gathered for the block. Enter it on every process (the gather is a
    collective), also where only the main process uses it."""
    return gathered(run.full, run.peft)


def gather_metrics(run: Any) -> dict[str, float]:
    """`time/weight_gather` since the last call, for a sharded policy."""
    return run.full.pop_metrics() if run.full is not None else {}
