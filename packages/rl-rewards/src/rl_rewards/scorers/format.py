"""Format rule scorers (no model)."""

from __future__ import annotations

from collections.abc import Sequence

from rl_rewards.rules import TIMESTAMP_VARIANTS, timestamp_format
from rl_rewards.samples import Sample, ScoreResult


class TimestampFormatScorer:
    """CapRL++'s video format reward R_fmt of the completion (`rl_rewards.rules.timestamp_format`).
    Use with the video caption task, weight 0.2 as in CapRL++.

    `variant`: `"readme"` (default, the CapRL++ README formula) or `"caprl-server"` (what the
    CapRL++ reward server computes; `min_brackets` is its `FORMAT_MIN_BRACKETS`)."""

    name = "timestamp_format"
    inline = True  # a regex pass per caption: scored where the request arrives

    def __init__(self, *, max_minute: int = 599, variant: str = "readme", min_brackets: int = 3) -> None:
        if variant not in TIMESTAMP_VARIANTS:
            raise ValueError(f"timestamp_format: variant must be one of {TIMESTAMP_VARIANTS}, got {variant!r}")
        self.max_minute, self.variant, self.min_brackets = max_minute, variant, min_brackets

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        max_minute, variant, min_brackets = self.max_minute, self.variant, self.min_brackets
        return [
            ScoreResult(score=timestamp_format(s.completion, max_minute, variant=variant, min_brackets=min_brackets))
            for s in samples
        ]
