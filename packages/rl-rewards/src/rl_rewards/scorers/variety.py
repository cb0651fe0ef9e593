"""A word-variety rule: distinct words, which repeating one word cannot raise (no model, no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from rl_rewards.rules import word_variety
from rl_rewards.samples import Sample, ScoreResult


class WordVarietyScorer:
    """min(distinct words, `target`) / `target` x the share of whitespace pieces that are words
    (`rl_rewards.rules.word_variety`: two or more letters, case-blind). Choose it as a shaping
    term where a policy games a length or format rule by repeating one token, or as the signal a
    tiny random policy can learn (caption-rl's embedded default). Components: `words` (distinct),
    `clean` (the share)."""

    name = "word_variety"
    inline = True

    def __init__(self, *, target: int = 8) -> None:
        word_variety("", target)  # validates target at build time
        self.target = target

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results = []
        for s in samples:
            value, distinct, clean = word_variety(s.completion, self.target)
            results.append(ScoreResult(score=value, components={"words": float(distinct), "clean": clean}))
        return results
