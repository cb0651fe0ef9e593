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
ComponentKeys = tuple[str, ...] | Callable[..., tuple[str, ...]]
"""The keys a scorer reports in `ScoreResult.components`: fixed, or a function of its options."""


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
COMPONENT_KEYS: dict[str, ComponentKeys] = {}


def register_scorer(name: str, factory: ScorerFactory | str, *, component_keys: ComponentKeys = ()) -> None:
    """Register `factory` (a callable, or a lazy `"module:attribute"` path) under `name`.

    `component_keys` names the sub-components the scorer reports on every scored sample (a tuple,
    or a function of the scorer's options returning one). They are declared here, not read from
    a built scorer, so a reward's full key list is known before anything is scored or loaded:
    trainers that take their log keys from the first sample (verl, OpenRLHF, TRL across ranks)
    then see the same keys for every sample, failed and gated-out ones included.

    Registering a name twice raises: pick a new name rather than silently replacing a scorer.
    """
    if name in SCORERS:
        raise ValueError(f"scorer {name!r} is already registered ({SCORERS[name]!r})")
    SCORERS[name] = LazyFactory(factory) if isinstance(factory, str) else factory
    COMPONENT_KEYS[name] = component_keys


def scorer_component_keys(name: str, options: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The sub-component keys scorer `name` reports when built with `options` (() when it
    declares none or is not registered: a scorer handed to `build_reward` directly)."""
    keys = COMPONENT_KEYS.get(name, ())
    return keys(**(options or {})) if callable(keys) else keys


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


def _caption_qa_keys(*, estimator: str = "exact", **_: Any) -> tuple[str, ...]:
    return ("letter_mass",) if estimator == "exact" else ("parsed",)


def _judge_keys(*, completion_field: str | None = None, **_: Any) -> tuple[str, ...]:
    return ("malformed",) if completion_field is not None else ()


def _embedding_keys(*, completion_field: str | None = None, reference_field: str | None = None, **_: Any) -> tuple[str, ...]:
    fields = completion_field is not None or reference_field is not None
    return ("cosine", "malformed") if fields else ("cosine",)


def _rule_keys(*, components: tuple[str, ...] | list[str] = (), **_: Any) -> tuple[str, ...]:
    return tuple(components)


_VL_JUDGE_KEYS = ("factuality", "temporal_alignment", "coverage", "hallucination_penalty", "parse_failed")

_BUILTIN: dict[str, tuple[str, ComponentKeys]] = {
    "timestamp_format": ("rl_rewards.scorers.format:TimestampFormatScorer", ()),
    "exact_answer": ("rl_rewards.scorers.answer:ExactAnswerScorer", ("has_number",)),
    "length": ("rl_rewards.scorers.length:LengthScorer", ("n_tokens",)),
    "overlong": ("rl_rewards.scorers.overlong:OverlongScorer", ("n_tokens",)),
    "word_variety": ("rl_rewards.scorers.variety:WordVarietyScorer", ("words", "clean")),
    "rule": ("rl_rewards.scorers.rule:RuleScorer", _rule_keys),
    "ocr": ("rl_rewards.scorers.ocr:OcrScorer", ()),
    "clip_score": ("rl_rewards.scorers.vision:ClipScorer", ()),
    "aesthetic": ("rl_rewards.scorers.vision:AestheticScorer", ()),
    "brightness": ("rl_rewards.scorers.media:BrightnessScorer", ()),
    "per_frame": ("rl_rewards.scorers.video:PerFrameScorer", ()),
    "temporal_consistency": ("rl_rewards.scorers.video:TemporalConsistencyScorer", ()),
    "embedding_similarity": ("rl_rewards.scorers.embedding:EmbeddingSimilarityScorer", _embedding_keys),
    "caption_qa": ("rl_rewards.scorers.caption_qa:build_caption_qa", _caption_qa_keys),
    "vl_judge": ("rl_rewards.scorers.vl_judge:build_vl_judge", _VL_JUDGE_KEYS),
    "judge": ("rl_rewards.scorers.judge:build_judge", _judge_keys),
}
for _name, (_path, _keys) in _BUILTIN.items():
    register_scorer(_name, _path, component_keys=_keys)
