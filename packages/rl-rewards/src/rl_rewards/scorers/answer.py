"""Outcome rule for tasks with one right answer (GSM8K/MATH-style arithmetic): no model."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rl_rewards.samples import Sample, ScoreResult

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ExactAnswerScorer:
    """1.0 when the completion's number equals `Sample.reference`, compared as numbers ("4.0"
    is 4), else `partial` if the completion states a number at all, else 0.0. `answer` picks
    which number is the answer: `first` (the answer comes first, e.g. "Answer with the number
    only") or `last` (after a chain of thought, as GSM8K's "#### 42"). `partial` > 0 is a format
    bonus a random policy can find (DeepSeek-R1's format reward, in spirit); keep 0 to train on
    correctness alone. `near` > 0 grades a wrong number by its distance d to the reference:
    `partial + max(0, 0.5 - partial) * max(0, 1 - d / near)`, so a group whose samples all miss
    still ranks the closer ones higher; choose it where being close means something (a numeric
    estimate), keep 0 where only the exact answer may count. A reference that is not a number
    fails the sample. Component: `has_number` (1.0 when the completion holds a number)."""

    name = "exact_answer"
    inline = True  # a regex per completion

    def __init__(self, *, answer: str = "last", partial: float = 0.0, near: float = 0.0) -> None:
        if answer not in ("first", "last"):
            raise ValueError(f"exact_answer: answer must be 'first' or 'last', got {answer!r}")
        if near < 0:
            raise ValueError(f"exact_answer: near must be >= 0 (0 = no credit for closeness), got {near!r}")
        self.answer, self.partial, self.near = answer, partial, near

    def _one(self, sample: Sample) -> ScoreResult:
        try:
            target = float(str(sample.reference).strip())
        except ValueError:
            return ScoreResult.failed(f"exact_answer: the reference {sample.reference!r} is not a number")
        numbers = _NUMBER.findall(sample.completion)
        if not numbers:
            return ScoreResult(score=0.0, components={"has_number": 0.0})
        given = float(numbers[0] if self.answer == "first" else numbers[-1])
        if given == target:
            return ScoreResult(score=1.0, components={"has_number": 1.0})
        closeness = max(0.0, 1.0 - abs(given - target) / self.near) if self.near else 0.0
        return ScoreResult(score=self.partial + max(0.0, 0.5 - self.partial) * closeness, components={"has_number": 1.0})

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return [self._one(s) for s in samples]
