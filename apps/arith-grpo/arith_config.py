"""arith-grpo's config, one Struct per TOML table, read (and refused) before torch loads."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import msgspec

from rl_core import train
from rl_rewards import RewardSpec


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "Qwen/Qwen3-0.6B"  # `tiny:qwen3` builds a tiny random checkpoint
    dtype: train.DType = "bfloat16"


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    engine: Literal["auto", "hf", "vllm"] = "auto"  # auto: vllm on a CUDA machine where it imports, else hf
    n: train.Positive = 8  # answers sampled per prompt
    temperature: train.PositiveFloat = 1.0
    max_new_tokens: train.Positive = 16


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    partial: float = 0.1  # reward of a wrong number: a format bonus a random policy finds (0 = exact only)
    near: train.NonNegativeFloat = 0.0  # > 0: a wrong number within `near` of the sum earns up to 0.5 (exact_answer's)
    spec: str | RewardSpec | None = None  # a RewardSpec replacing the exact-answer rule (file or inline table)


class TrainConfig(train.RunFields, kw_only=True, frozen=True):
    output_dir: str = "runs/arith-grpo"
    batch_size: train.Positive = 8  # prompts per step, all processes
    micro_batch_size: train.Positive = 8  # answers per forward/backward
    max_steps: train.Positive = 100
    lr: train.PositiveFloat = 1e-5
    eval_freq: train.NonNegative = 0  # greedy answers to every problem every N steps, before the first and after the last (0 = never)


class Config(train.AppConfig, kw_only=True, frozen=True):
    # Keys renamed to the other apps' names for the same idea (old -> new; the old is refused).
    RENAMED: ClassVar[dict[str, str]] = {"policy.path": "model.path", "policy.dtype": "model.dtype", **{
        f"policy.{key}": f"rollout.{key}" for key in ("engine", "n", "temperature", "max_new_tokens")}}
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: train.TokenPolicyFields = train.TokenPolicyFields()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()


ENTRY = train.AppEntry("arith-grpo", Config, Path(__file__).resolve().parent / "configs" / "default.toml", recipe="arith_recipe")
