"""rl-rollout: generation engines behind one protocol (`hf`, `openai`, `vllm`), the policy
engine layer a trainer drives them through (`policy`), and image engines (`diffusion`, `janus`)."""

from rl_rollout.images import ImageEngine, ImageSamples, build_image_engine
from rl_rollout.partial import Drawn, PartialRollouts
from rl_rollout.protocol import (
    Continuation,
    Engine,
    FinishReason,
    Generation,
    Prompt,
    SamplingParams,
    generate_seeded,
)
from rl_rollout.recording import RecordingEngine
from rl_rollout.registry import (
    build_engine,
    engine_names,
    load_engine,
    register_engine,
    resolve_engine,
    resolve_judge_engine,
)

__version__ = "0.1.0"

__all__ = [
    "Continuation",
    "Drawn",
    "Engine",
    "FinishReason",
    "Generation",
    "ImageEngine",
    "ImageSamples",
    "PartialRollouts",
    "Prompt",
    "RecordingEngine",
    "SamplingParams",
    "build_engine",
    "build_image_engine",
    "engine_names",
    "generate_seeded",
    "load_engine",
    "register_engine",
    "resolve_engine",
    "resolve_judge_engine",
]
