"""Scorer name registry: `name -> factory(**options) -> Scorer`.

Built-in model-backed scorers are registered as lazy import paths, so listing or building a rule
scorer never imports torch; building a model-backed one imports its module, which raises an
ImportError naming the extra to install when its dependencies are missing.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_rewards.samples import AsyncScorer, Scorer

ScorerFactory = Callable[..., Scorer | AsyncScorer]


@dataclass(frozen=True)
class LazyFactory:
    """A factory named by `"module:attribute"`, imported on first call."""

    path: str

    def load(self) -> ScorerFactory:
        module_name, _, attr = self.path.partition(":")
        return getattr(importlib.import_module(module_name), attr)

    def __call__(self, **options: Any) -> Scorer | AsyncScorer:
        return self.load()(**options)


SCORERS: dict[str, ScorerFactory] = {}


def register_scorer(name: str, factory: ScorerFactory | str) -> None:
    """Register `factory` (a callable, or a lazy `"module:attribute"` path) under `name`.

    Registering a name twice raises: pick a new name rather than silently replacing a scorer.
    """
    if name in SCORERS:
        raise ValueError(f"scorer {name!r} is already registered ({SCORERS[name]!r})")
    SCORERS[name] = LazyFactory(factory) if isinstance(factory, str) else factory


def build_scorer(name: str, **options: Any) -> Scorer | AsyncScorer:
    """Build the scorer registered as `name` with keyword `options` (checked against the factory's
    signature first, so a typo in a config names the scorer and the valid options)."""
    if name not in SCORERS:
        raise KeyError(f"unknown scorer {name!r}; valid scorers: {', '.join(sorted(SCORERS))}")
    factory = SCORERS[name]
    target = factory.load() if isinstance(factory, LazyFactory) else factory
    try:
        inspect.signature(target).bind(**options)
    except TypeError as e:
        params = [p for p in inspect.signature(target).parameters if p not in ("self", "args", "kwargs")]
        raise TypeError(f"scorer {name!r}: {e}; valid options: {', '.join(params) or '(none)'}") from None
    return target(**options)


_BUILTIN = {
    "timestamp_format": "rl_rewards.scorers.format:TimestampFormatScorer",
    "length": "rl_rewards.scorers.length:LengthScorer",
    "ocr": "rl_rewards.scorers.ocr:OcrScorer",
    "clip_score": "rl_rewards.scorers.vision:ClipScorer",
    "aesthetic": "rl_rewards.scorers.vision:AestheticScorer",
    "embedding_similarity": "rl_rewards.scorers.embedding:EmbeddingSimilarityScorer",
    "caption_qa": "rl_rewards.scorers.caption_qa:build_caption_qa",
    "vl_judge": "rl_rewards.scorers.vl_judge:build_vl_judge",
    "judge": "rl_rewards.scorers.judge:build_judge",
}
for _name, _path in _BUILTIN.items():
    register_scorer(_name, _path)
