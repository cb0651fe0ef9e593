"""`Parts`: everything rider-grm's loop touches, built once by `setup`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from judging import Judge, PhaseMonitor
from rider_config import Config
from swapping import PinnedOffload, PolicySwap

from rl_core.train import FullWeights, NonFiniteGuard, SampleLog
from rl_rewards.composition import Reward
from rl_rollout.hf import HFEngine


@dataclass
class Parts:
    """Everything the loop touches, built once in `main`."""

    cfg: Config
    accelerator: Accelerator
    model: Any
    ref: Any
    optimizer: Any
    engine: HFEngine
    judges: list[Judge]
    reward: Reward
    monitor: PhaseMonitor
    swap: PolicySwap
    ref_offload: PinnedOffload | None  # the reference's weights between uses (CUDA, model.ref_offload)
    run_dir: Path
    samples: SampleLog
    guard: NonFiniteGuard
    full: FullWeights | None = None  # the rollout's copy of a sharded policy (train.sharding = "fsdp2")
