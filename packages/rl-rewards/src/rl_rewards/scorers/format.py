"""Format rule scorers (no model)."""

from __future__ import annotations

from collections.abc import Sequence

from rl_rewards.rules import timestamp_format
from rl_rewards.samples import Sample, ScoreResult


class TimestampFormatScorer:
    """CapRL++'s video format reward R_fmt of the completion (`rl_rewards.rules.timestamp_format`).
    Use with the video caption task, weight 0.2 as in CapRL++."""

    name = "timestamp_format"
    inline = True  # a regex pass per caption: scored where the request arrives

    def __init__(self, *, max_minute: int = 599) -> None:
        self.max_minute = max_minute

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return [ScoreResult(score=timestamp_format(s.completion, self.max_minute)) for s in samples]
