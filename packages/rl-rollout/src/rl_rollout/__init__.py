"""rl-rollout: generation engines behind one protocol (`hf`, `openai`, `vllm`)."""

from rl_rollout.protocol import (
    ColocatedEngine,
    Engine,
    FinishReason,
    Generation,
    Prompt,
    SamplingParams,
)
from rl_rollout.registry import build_engine, engine_names, register_engine, resolve_engine_kind

__version__ = "0.1.0"

__all__ = [
    "ColocatedEngine",
    "Engine",
    "FinishReason",
    "Generation",
    "Prompt",
    "SamplingParams",
    "build_engine",
    "engine_names",
    "register_engine",
    "resolve_engine_kind",
]
