"""A text recipe's `score` hook in one call: the reward's results for this process's generations
as the trainer loop's `rl_core.train.Scores`.

    def score(self, s, step, batch):
        results = s.reward.score(samples)          # one rl_rewards.ScoreResult per generation
        return group_scores(s.run.accelerator, results, batch.generations, prompts_per_rank=k,
                            estimator=cfg.algo.advantage, aggregation=cfg.algo.reward_aggregation,
                            weights=weights)

Every text recipe scores the same way: a sequence reward per generation, NaN where scoring
failed (`score is None`) or the recipe leaves the sample out (`exclude`: caption-rl's captions
that sampled a vision placeholder), which the loop's advantages then leave out of their group;
the generations of one prompt in one group, numbered apart across processes; the reward's
components per sample; the response lengths over every process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from rl_core.train import Scores
from rl_policy.training import response_metrics
from rl_rollout import Generation

__all__ = ["Scored", "group_scores"]


class Scored(Protocol):
    """What `group_scores` reads of one sample's result (`rl_rewards.ScoreResult` has it): this
    package does not need rl-rewards installed."""

    @property
    def score(self) -> float | None: ...  # None: failed (or abstained)

    @property
    def components(self) -> Mapping[str, float]: ...  # unweighted, by name


def group_scores(accelerator: Any, results: Sequence[Scored], generations: Sequence[Generation], *,
                 prompts_per_rank: int, estimator: str, aggregation: str = "sum_then_normalize",
                 weights: Mapping[str, float] | None = None, exclude: Sequence[bool] | None = None,
                 metrics: Mapping[str, float] | None = None) -> Scores:
    """This process's `Scores` from `results[i]`, generation i's reward (request-major, `n` a
    prompt). The group of generation i is `rank x prompts_per_rank + request_index`: give every
    process the same `prompts_per_rank` (the most prompts a process samples in a step) so the
    ids never collide across processes. `exclude[i]`: leave generation i out like a failed one
    (its reward NaN). `estimator`: an `rl_core.advantages` name; `aggregation`, `weights`: how
    several components combine (`weights` from `rl_core.train.component_weights`, needed by
    `normalize_then_sum`). `metrics`: the recipe's own, over every process, beside
    `response_metrics` (response lengths, truncation, tokens). Gathers: call it on every process."""
    left_out = [False] * len(generations) if exclude is None else list(exclude)
    if not len(results) == len(left_out) == len(generations):
        raise ValueError(f"group_scores: {len(results)} results and {len(left_out)} exclusion flags for "
                         f"{len(generations)} generations; give one of each per generation")
    rewards = torch.tensor([math.nan if x.score is None or out else x.score
                            for x, out in zip(results, left_out, strict=True)], dtype=torch.float32)  # [B] NaN: out
    rank = int(accelerator.process_index)
    groups = torch.tensor([rank * prompts_per_rank + g.request_index for g in generations], dtype=torch.long)  # [B]
    return Scores(rewards, groups, estimator, components=[dict(x.components) for x in results],
                  metrics={**response_metrics(accelerator, generations), **(metrics or {})},
                  aggregation=aggregation, weights=dict(weights or {}))
