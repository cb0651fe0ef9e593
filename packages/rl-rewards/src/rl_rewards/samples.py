"""The scorer contract: samples in, one result per sample out.

Imports no torch: `pip install rl-rewards` alone must be able to use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import msgspec


class Sample(msgspec.Struct, kw_only=True, frozen=True):
    """What a scorer sees of one rollout.

    `reference` is the task's ground truth in whatever form the scorer needs (a QA list for
    `caption_qa`, the target text for `ocr`, a reference answer for rules and judges).
    `metadata` carries free fields: `image`/`video` paths, `data_source`, `extra_info`.
    """

    completion: str
    prompt: str = ""
    reference: Any = None
    metadata: dict[str, Any] = {}


class ScoreResult(msgspec.Struct, kw_only=True):
    """One sample's outcome. `score=None` means abstain (TRL's convention) or failure; a failure
    always carries `error`, and never changes the results of the other samples."""

    score: float | None
    components: dict[str, float] = {}
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> ScoreResult:
        return cls(score=None, error=error)


@runtime_checkable
class Scorer(Protocol):
    """Scores a batch. Must return exactly one ScoreResult per sample, in order; an exception
    raised while scoring one sample becomes that sample's `error`."""

    name: str

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]: ...


@runtime_checkable
class AsyncScorer(Protocol):
    """Async variant (remote scorers). Same contract as `Scorer`."""

    name: str

    async def ascore(self, samples: Sequence[Sample]) -> list[ScoreResult]: ...


@runtime_checkable
class InlineScorer(Protocol):
    """A `Scorer` that may mark itself cheap enough to run where a request arrives.

    Set `inline = True` on pure rules (microseconds per sample, no model, no I/O, safe to call
    from any thread): the reward server then scores them on its event loop instead of queueing
    them for a batch thread or worker, since batching buys a rule nothing and the hand-off costs
    more than the scoring. Leave it off (or False) for anything that loads a model.
    """

    name: str
    inline: bool

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]: ...


def runs_inline(scorer: object) -> bool:
    """True when `scorer` declares `inline = True` (see `InlineScorer`)."""
    return isinstance(scorer, InlineScorer) and scorer.inline


class TimedScorer:
    """`inner` with every `score` call inside `timer(phase)`: a trainer's phase timer (such as
    `rl_core.train.PhaseTimer`, whose block adds `time/<phase>`), so one reward term's seconds
    show beside the step's other phases. `name` is the phase."""

    def __init__(self, inner: Scorer, timer: Callable[[str], AbstractContextManager[Any]], phase: str) -> None:
        self.inner, self.timer, self.name = inner, timer, phase

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with self.timer(self.name):
            return self.inner.score(samples)
