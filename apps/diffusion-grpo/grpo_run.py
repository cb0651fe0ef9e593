"""diffusion-grpo's state: the `Run` every phase takes, an epoch's `Batch` of trajectories, and
the prompt sources (a manifest file, a save_to_disk directory or a cached Hub id)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from grpo_config import Config, resolve_path
from grpo_parts import LoraEMA
from peft import PeftModel
from ray_rollout import RayRollout

from rl_core.train import FullWeights, MetricsLogger, NonFiniteGuard, PhaseTimer, UserError
from rl_data import GroupSampler, OCRPrompt, open_source
from rl_rollout.diffusion import DiffusionEngine, Trajectory


@dataclass
class Run:
    cfg: Config
    acc: Accelerator
    run_dir: Path
    engine: DiffusionEngine
    model: torch.nn.Module  # the peft transformer, prepared (DDP-wrapped with several processes, or sharded)
    peft: PeftModel
    optimizer: torch.optim.Optimizer
    ema: LoraEMA
    reward: Any  # a rl_rewards Scorer (composed in process, or RemoteScorer)
    prompts: list[OCRPrompt]
    eval_prompts: list[OCRPrompt]
    sampler: GroupSampler
    start_epoch: int
    optimizer_steps: int = 0
    first_ratio: float = math.nan  # max |log ratio| on this epoch's first replay (diagnostic)
    workers: RayRollout | None = None  # Ray rollout actors (rollout.workers > 0)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)
    eval_log: MetricsLogger | None = None  # eval_metrics.csv (main process)
    full: FullWeights | None = None  # a sharded transformer's whole copy, the engine's (train.sharding, grpo_sharding.py)


@dataclass(frozen=True)
class Batch:
    """One epoch's rollouts on this process: trajectories of `sample_batch_size` images each."""

    trajectories: list[Trajectory]
    records: list[OCRPrompt]  # one per image, in trajectory order
    group_ids: torch.Tensor  # [N] global group index


def read_prompts(source: str, key: str) -> list[OCRPrompt]:
    """The OCR prompts of a manifest file, a save_to_disk directory or a Hub id in the local cache
    (a `prompt` or `text` column)."""
    try:
        reader = open_source(resolve_path(source), kind="ocr")
    except (FileNotFoundError, ValueError) as e:  # missing; not a dataset dir; several splits
        raise UserError(f"{key}: {e}") from None
    return list(reader)
