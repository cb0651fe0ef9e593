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


@dataclass
class Parts:
    """Everything the loop touches, built once in `main`."""

    cfg: Config
    accelerator: Accelerator
    model: Any
    ref: Any
    optimizer: Any
    engine: Any  # rollout.engine: HFEngine over the training model, or a colocated VLLMEngine
    judges: list[Judge]
    reward: Reward
    monitor: PhaseMonitor
    swap: PolicySwap
    ref_offload: PinnedOffload | None  # the reference's weights between uses (CUDA, model.ref_offload)
    run_dir: Path
    samples: SampleLog
    guard: NonFiniteGuard
    full: FullWeights | None = None  # the rollout's copy of a sharded policy (train.sharding = "fsdp2")
    engine_kind: str = "hf"  # rollout.engine resolved: "hf" | "vllm"
    weight_version: int = 0  # optimizer steps pushed into a vllm engine (hf: always 0, nothing to push)
    pad_id: int = 0  # padding of the replay batches (the policy tokenizer's pad token)
