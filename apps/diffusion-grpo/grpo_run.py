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

from rl_core.train import (
    FullWeights,
    MetricsLogger,
    NonFiniteGuard,
    PhaseTimer,
    UserError,
    sample_seed,
)
from rl_data import GroupSampler, OCRPrompt, open_source


@dataclass
class Run:
    cfg: Config
    acc: Accelerator
    run_dir: Path
    engine: Any  # DiffusionEngine (model.family "sd3") or rl_rollout.janus.JanusEngine ("janus")
    model: torch.nn.Module  # prepared: the peft transformer (sd3; DDP-wrapped with several processes, or sharded), a JanusImagePolicy (janus)
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
    """One epoch's rollouts on this process: trajectories of `sample_batch_size` images each
    (`Trajectory` for sd3, `rl_rollout.janus.ImageRollout` for janus)."""

    trajectories: list[Any]
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


def epoch_samples(run: Run, epoch: int) -> tuple[list[OCRPrompt], list[int], torch.Tensor]:
    """This process's records for the epoch (n copies of each of its prompts), one seed per
    sample and the global group ids `[N]`. A sample's seed depends on its group's place in the
    epoch's prompt order (group g of rank r is the (g * world + r)-th prompt) and its index in the
    group: not on the process count."""
    cfg, acc = run.cfg, run.acc
    n, groups = cfg.rollout.n, cfg.rollout.groups_per_epoch // acc.num_processes
    records = [run.prompts[next(iter(run.sampler))] for _ in range(groups * n)]
    world, rank = acc.num_processes, acc.process_index
    seeds = [sample_seed(cfg.train.seed, epoch, ((i // n) * world + rank) * n + i % n) for i in range(len(records))]
    return records, seeds, torch.arange(len(records)) // n + rank * groups
