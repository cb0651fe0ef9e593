"""Loading a judge model behind the rl-rollout `Engine` protocol (the `[hf]` extra).

Model-backed judges (`caption_qa`, `vl_judge`, `judge`) take any `Engine` in Python; from a
config they name a checkpoint and an engine kind (`hf` in-process, `vllm`, or `openai` for a
judge served elsewhere), built by rl-rollout's one builder, `rl_rollout.load_engine`.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from transformers import AutoTokenizer

    from rl_models.tiny import resolve
    from rl_rollout import Engine, SamplingParams, load_engine
    from rl_rollout.protocol import BatchScoringEngine
except ImportError as e:
    raise ImportError(f'model-backed judges need rl-rollout and transformers: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e

log = logging.getLogger("rl_rewards.judges")

__all__ = ["BatchScoringEngine", "Engine", "SamplingParams", "judge_engine", "load_tokenizer"]


def judge_engine(engine: str, model: str, engine_options: dict[str, Any] | None = None, *, key: str = "engine",
                 who: str = "judge") -> Engine:
    """`rl_rollout.load_engine(engine, model, ...)` for a judge: its vLLM engine core in a process
    of its own, and the pick of `auto` logged with its reason (`caption_qa judge M: engine hf
    (auto: no CUDA device, ...)`). `auto` is vllm on a CUDA machine where vLLM imports, else hf;
    `vllm` asked for where it cannot run is a `rl_core.errors.UserError` naming `key` (the
    setting that chose it), before anything loads. `engine_options` go to the engine (`device=`;
    an OpenAI-compatible server's `base_url`, `model` then being its served model name)."""
    return load_engine(engine, model, key=key, in_process=False,
                       report=lambda why: log.info("%s %s: engine %s", who, model, why), **(engine_options or {}))


def load_tokenizer(path: str) -> Any:
    """The judge's tokenizer (prompts are built from its own chat template)."""
    return AutoTokenizer.from_pretrained(resolve(path, key="tokenizer"))
