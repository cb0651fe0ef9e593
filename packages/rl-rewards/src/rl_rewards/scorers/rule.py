"""A rule reward from your own code: a verl-style `compute_score` function in a file or module."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from rl_rewards.modules import load_function
from rl_rewards.samples import Sample, ScoreResult


class RuleScorer:
    """`function(data_source, solution_str, ground_truth, extra_info)` per sample, verl's
    `compute_score` signature, so a verl reward file serves unchanged: `solution_str` is the
    completion, `ground_truth` the reference, `data_source`/`extra_info` come from the sample's
    metadata (None when absent; `as_verl_compute_score` puts them there).

    `function` is `"path/to/file.py:fn"` or `"pkg.module:fn"` (`fn` defaults to `compute_score`),
    loaded by `rl_rewards.modules.load_function`, or the function itself (in Python: a trainer
    that loaded and checked it already, or a lambda in a test); a sample's error names the path,
    or the function's `__qualname__`.
    It returns a number, or verl's `{"score": number, **numeric extras}`: the extras become
    components; list them in `components` so every result carries them (see `register_scorer`).
    An exception, or a value that is not a finite number, fails that sample only. Not `inline`:
    your code may be slow or do I/O, so the server scores it off its event loop."""

    name = "rule"

    def __init__(self, function: str | Callable[..., Any], *, components: Sequence[str] = ()) -> None:
        # any callable will do: a functools.partial or an object with __call__ has no __qualname__
        self.function = function if isinstance(function, str) else getattr(function, "__qualname__", repr(function))
        self._fn = load_function(function) if isinstance(function, str) else function
        self.components = tuple(components)

    def _one(self, sample: Sample) -> ScoreResult:
        meta = sample.metadata
        try:
            value = self._fn(meta.get("data_source"), sample.completion, sample.reference, meta.get("extra_info"))
        except Exception as e:  # a bug on one sample fails that sample only
            return ScoreResult.failed(f"{self.function}: {type(e).__name__}: {e}")
        extras: dict[str, Any] = {}
        if isinstance(value, dict):
            extras = {k: float(v) for k, v in value.items() if k != "score" and _is_number(v)}
            value = value.get("score")
        if not _is_number(value) or not math.isfinite(value):  # NaN would pass every gate (NaN < t is false)
            return ScoreResult.failed(f"{self.function} returned {value!r}, not a finite number")
        return ScoreResult(score=float(value), components=extras)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return [self._one(s) for s in samples]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
