"""Turn a `RewardSpec` into one scorer: components scored in order, gated, combined.

`build_reward(spec).score(samples)` returns one `ScoreResult` per sample whose `components` hold
every component's unweighted value (a scorer's own sub-components appear as `"name.sub"`), and
whose `score` is the combined total. Every result, failed or gated-out ones included, carries
every key of `Reward.keys` (0.0 where nothing was computed): trainers that log per-sample
extras by key need the same keys on every sample. A non-finite score or component (NaN, inf)
from a scorer, or a non-finite total, is that sample's error, never a reward. A component failing for one sample fails only that sample
(or uses the component's `fallback`); a scorer that raises for a whole batch is retried one
sample at a time, so one bad sample never takes the others down.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rl_rewards.registry import build_scorer, scorer_component_keys
from rl_rewards.samples import AsyncScorer, Sample, Scorer, ScoreResult, runs_inline
from rl_rewards.spec import Component, RewardSpec, load_spec, spec_from_dict


@functools.cache
def _has_method(cls: type, method: str) -> bool:
    """Whether scorer class `cls` defines `method` (`score`: a `Scorer`; `ascore`: an
    `AsyncScorer`). Cached per class: a runtime `Protocol` isinstance check costs ~20 µs, and
    paid per batch it showed in the reward server's latency for rule rewards. Being no
    isinstance, it narrows nothing for the type checker: callers cast on its answer."""
    return callable(getattr(cls, method, None))


def score_isolated(scorer: Scorer | AsyncScorer, samples: Sequence[Sample]) -> list[ScoreResult]:
    """`scorer.score(samples)`, with an exception for the batch retried sample by sample."""
    if not samples:
        return []
    try:
        if _has_method(type(scorer), "score"):
            results = cast(Scorer, scorer).score(samples)
        else:
            results = asyncio.run(cast(AsyncScorer, scorer).ascore(samples))
        return _checked(scorer, samples, results)
    except Exception as e:  # any scorer failure becomes per-sample errors
        if len(samples) == 1:
            return [ScoreResult.failed(f"{type(e).__name__}: {e}")]
        return [score_isolated(scorer, [sample])[0] for sample in samples]


async def ascore_isolated(scorer: Scorer | AsyncScorer, samples: Sequence[Sample]) -> list[ScoreResult]:
    """Async `score_isolated`: awaits `ascore`, or runs a sync scorer in a worker thread."""
    if not samples:
        return []
    try:
        if _has_method(type(scorer), "ascore"):
            results = await cast(AsyncScorer, scorer).ascore(samples)
        else:
            results = await asyncio.to_thread(cast(Scorer, scorer).score, samples)
        return _checked(scorer, samples, results)
    except Exception as e:  # any scorer failure becomes per-sample errors
        if len(samples) == 1:
            return [ScoreResult.failed(f"{type(e).__name__}: {e}")]
        return [(await ascore_isolated(scorer, [sample]))[0] for sample in samples]


def _checked(scorer: Any, samples: Sequence[Sample], results: list[ScoreResult]) -> list[ScoreResult]:
    if len(results) != len(samples):
        raise RuntimeError(f"scorer {scorer.name!r} returned {len(results)} results for {len(samples)} samples")
    return reject_non_finite(results, f"scorer {scorer.name!r}")


def reject_non_finite(results: list[ScoreResult], source: str) -> list[ScoreResult]:
    """`results` with every sample whose score or any component is NaN/infinite turned into that
    sample's error: a non-finite value poisons group statistics and trainers' logs, and JSON has
    no form for it (it would go out as `null`). Its components are kept, a non-finite one as 0.0
    (the value every failed sample reports)."""
    isfinite = math.isfinite
    if all((r.score is None or isfinite(r.score)) and all(map(isfinite, r.components.values())) for r in results):
        return results
    return [_finite(r, source) for r in results]


def _finite(result: ScoreResult, source: str) -> ScoreResult:
    isfinite = math.isfinite
    bad = {key: value for key, value in result.components.items() if not isfinite(value)}
    if (result.score is None or isfinite(result.score)) and not bad:
        return result
    components = {key: 0.0 if key in bad else value for key, value in result.components.items()}
    if result.score is not None and not isfinite(result.score):
        error = f"{source} returned a non-finite score {result.score}"
    else:
        key, value = next(iter(bad.items()))
        error = f"{source} returned a non-finite component {key!r} = {value}"
    if result.error is not None:  # already failed: keep its reason
        error = result.error
    return ScoreResult(score=None, components=components, error=error)


@dataclass
class _Batch:
    """Per-sample state while components are scored in order."""

    n: int
    values: list[dict[str, float]] = field(init=False)
    scored: list[list[str]] = field(init=False)  # components that count in the total, in order
    errors: list[str | None] = field(init=False)
    abstained: list[bool] = field(init=False)
    out: int = field(init=False, default=0)  # samples failed or abstained so far

    def __post_init__(self) -> None:
        self.values = [{} for _ in range(self.n)]
        self.scored = [[] for _ in range(self.n)]
        self.errors = [None] * self.n
        self.abstained = [False] * self.n


@dataclass(frozen=True)
class _Part:
    name: str
    component: Component
    scorer: Scorer | AsyncScorer


class Reward:
    """A composed reward; itself a `Scorer` and an `AsyncScorer` (name "reward").

    The bookkeeping below runs per sample for every request a reward server scores, so it keeps
    to local names and plain loops (rule rewards score in microseconds: the composition was a
    fifth of their cost)."""

    name = "reward"

    def __init__(self, spec: RewardSpec, scorers: Mapping[str, Scorer | AsyncScorer]) -> None:
        self.spec = spec
        self.parts = [_Part(name, c, scorers[name]) for name, c in spec.components.items()]
        self.inline = all(runs_inline(part.scorer) for part in self.parts)  # rules only
        self._weights = {name: c.weight for name, c in spec.components.items()}
        self.keys: tuple[str, ...] = spec_keys(spec)
        """Every component and declared sub-component key, in spec order: present in every result."""

    def sum_weights(self) -> dict[str, float]:
        """`{component: weight}` of a `combine = "sum"` reward: what a trainer needs to normalise
        each component on its own before the weighted sum (GDPO, TRL's normalize_then_sum). A
        `fold` reward (products, gates folded in order) has no such weights: ValueError."""
        if self.spec.combine != "sum":
            raise ValueError(f"a reward with combine = {self.spec.combine!r} is not a weighted sum of its components; "
                             "normalising them one by one needs combine = \"sum\"")
        return dict(self._weights)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        batch = _Batch(len(samples))
        for part in self.parts:
            todo = self._todo(part, batch)
            results = score_isolated(part.scorer, samples if len(todo) == batch.n else [samples[i] for i in todo])
            self._absorb(part, batch, todo, results)
        return self._results(batch)

    async def ascore(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        batch = _Batch(len(samples))
        for part in self.parts:
            todo = self._todo(part, batch)
            todo_samples = samples if len(todo) == batch.n else [samples[i] for i in todo]
            results = await ascore_isolated(part.scorer, todo_samples)
            self._absorb(part, batch, todo, results)
        return self._results(batch)

    @staticmethod
    def _todo(part: _Part, batch: _Batch) -> Sequence[int]:
        """Samples this component must score: not already failed/abstained, and past its gate.
        Gated-out samples are reported as 0.0 here and never reach the scorer."""
        gate = part.component.gate
        if gate is None and batch.out == 0:
            return range(batch.n)
        todo = []
        for i in range(batch.n):
            if batch.errors[i] is not None or batch.abstained[i]:
                continue
            if gate is not None and batch.values[i][gate.component] < gate.threshold:
                batch.values[i][part.name] = 0.0
                if gate.gated_out == "zero":
                    batch.scored[i].append(part.name)  # counts as 0.0: a `mul` zeroes the total
                continue
            todo.append(i)
        return todo

    @staticmethod
    def _absorb(part: _Part, batch: _Batch, todo: Sequence[int], results: list[ScoreResult]) -> None:
        name, fallback = part.name, part.component.fallback
        keys: dict[str, str] = {}  # sub-component -> "name.sub", built once per batch
        values, scored = batch.values, batch.scored
        for i, result in zip(todo, results, strict=True):
            sample_values = values[i]
            for key, value in result.components.items():
                full = keys.get(key)
                if full is None:
                    full = keys[key] = f"{name}.{key}"
                sample_values[full] = value
            if result.score is not None:
                sample_values[name] = result.score
            elif result.error is not None and fallback is None:
                batch.errors[i] = f"component {name!r} (scorer {part.component.scorer!r}): {result.error}"
                batch.out += 1
                continue
            elif fallback is not None:
                sample_values[name] = fallback
            else:
                batch.abstained[i] = True
                batch.out += 1
                continue
            scored[i].append(name)

    def _results(self, batch: _Batch) -> list[ScoreResult]:
        combine, keys, isfinite = self._combine, self.keys, math.isfinite
        results = []
        for values, scored, error, abstained in zip(batch.values, batch.scored, batch.errors, batch.abstained, strict=True):
            if len(values) != len(keys):  # a key not scored (failed, gated out, skipped): report 0.0
                for key in keys:
                    values.setdefault(key, 0.0)
            if error is not None or abstained:
                results.append(ScoreResult(score=None, components=values, error=error))
                continue
            total = combine(values, scored)
            if not isfinite(total):
                error = f"the combined reward is {total} (components {values}); check the weights and scorers"
                results.append(ScoreResult(score=None, components=values, error=error))
                continue
            results.append(ScoreResult(score=total, components=values))
        return results

    def _combine(self, values: dict[str, float], scored: list[str]) -> float:
        if self.spec.combine == "sum":
            weights = self._weights
            return sum([weights[name] * values[name] for name in scored])
        components = self.spec.components
        total = components[scored[0]].weight * values[scored[0]]
        for name in scored[1:]:
            term = components[name].weight * values[name]
            total = total + term if components[name].op == "add" else total * term
        return total


def spec_keys(spec: RewardSpec) -> tuple[str, ...]:
    """The keys every result of `build_reward(spec)` carries: each component's name and its
    scorer's declared sub-components (`"name.sub"`), in spec order; known without building."""
    return tuple(
        key
        for name, c in spec.components.items()
        for key in (name, *(f"{name}.{sub}" for sub in scorer_component_keys(c.scorer, c.options)))
    )


def build_reward(
    spec: RewardSpec | Mapping[str, Any] | str | Path,
    scorers: Mapping[str, Scorer | AsyncScorer] | None = None,
) -> Reward:
    """Build every component's scorer and return the composed `Reward`.

    `spec` is a RewardSpec, a dict, or a TOML path. `scorers` supplies ready-made scorers by
    component name (e.g. several judges sharing one engine); the others are built from the
    registry with their `options`.
    """
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif not isinstance(spec, RewardSpec):
        spec = spec_from_dict(dict(spec))
    given = dict(scorers or {})
    unknown = set(given) - set(spec.components)
    if unknown:
        raise KeyError(f"scorers given for unknown components {sorted(unknown)}; components: {list(spec.components)}")
    built = {
        name: given[name] if name in given else build_scorer(component.scorer, **component.options)
        for name, component in spec.components.items()
    }
    return Reward(spec, built)
