"""Loading a judge model behind the rl-rollout `Engine` protocol (the `[hf]` extra).

Model-backed judges (`caption_qa`, `vl_judge`, `judge`) take any `Engine` in Python; from a
config they name a checkpoint and an engine kind (`hf` in-process, `vllm`, or `openai` for a
judge served elsewhere), built through `rl_rollout.build_engine`.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from transformers import AutoTokenizer

    from rl_models.tiny import resolve
    from rl_rollout import Engine, SamplingParams, build_engine, resolve_engine
    from rl_rollout.protocol import BatchScoringEngine
except ImportError as e:
    raise ImportError(f'model-backed judges need rl-rollout and transformers: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e

log = logging.getLogger("rl_rewards.judges")

__all__ = ["BatchScoringEngine", "Engine", "SamplingParams", "load_engine", "load_tokenizer"]


def load_engine(
    model: str, engine: str = "auto", engine_options: dict[str, Any] | None = None, *, key: str = "engine",
    who: str = "judge",
) -> Engine:
    """`rl_rollout.build_engine(engine, ...)` for checkpoint `model`.

    `auto` (the default) is vllm on a CUDA machine where vLLM imports, else hf, and the pick is
    logged with its reason (`caption_qa judge M: engine hf (auto: no CUDA device, ...)`): exact
    caption QA is faster on vLLM than on hf (benchmarks/RESULTS.md, "caption_qa on an H200 at
    vLLM's defaults"; rl-rollout's README, "hf or vLLM?"). `vllm` asked for where it
    cannot run is a `rl_core.errors.UserError` naming `key` (the setting that chose it) and the reason, before anything loads.

    `hf` loads the checkpoint in-process (`path=model`); other engines get `model=model` (the
    vLLM checkpoint, or the served model name of an OpenAI-compatible server, whose `base_url`
    goes in `engine_options`). A checkpoint is a local folder, a hub id or `tiny:<family>`
    (`rl_models.tiny.resolve`: a missing folder is an error naming it, not a hub lookup).
    """
    options = dict(engine_options or {})
    if engine in ("auto", "vllm"):
        engine, why = resolve_engine(engine, key=key)
        log.info("%s %s: engine %s", who, model, why)
    if engine == "hf":
        return build_engine("hf", path=resolve(model, key="model"), **options)
    if engine == "vllm":
        return build_engine(engine, model=resolve(model, key="model"), **options)
    return build_engine(engine, model=model, **options)


def load_tokenizer(path: str) -> Any:
    """The judge's tokenizer (prompts are built from its own chat template)."""
    return AutoTokenizer.from_pretrained(resolve(path, key="tokenizer"))
