"""A text recipe's `evaluate`: the held-out prompts shared out over the processes, each answered
once, greedily, by the process whose share it is.

    picked, gens = greedy_answers(s.engine, prompts, max_new_tokens=64, rank=run.rank,
                                  world_size=run.world_size)
    scores = ...                                   # the recipe's reward of each answer
    return gathered_means({"reward/mean": scores}, run.accelerator)   # rl_core.train: over all
"""

from __future__ import annotations

from collections.abc import Sequence

from rl_policy.engine import PolicyEngine
from rl_rollout import Generation, Prompt, SamplingParams

__all__ = ["greedy_answers"]


def greedy_answers(engine: PolicyEngine, prompts: Sequence[Prompt], *, max_new_tokens: int, rank: int = 0,
                   world_size: int = 1) -> tuple[list[int], list[Generation]]:
    """One greedy answer (temperature 0) to each prompt of this process's share of `prompts`:
    every `world_size`-th from its `rank`, so the processes together answer each prompt once
    however many there are (a share may be one shorter than another). Returns the share's
    indices in `prompts` and their answers, in that order, sampled in one engine session and
    batch: greedy decoding needs no per-prompt seed."""
    picked = list(range(rank, len(prompts), world_size))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    gens, _ = engine.sample([prompts[i] for i in picked], params)
    return picked, gens
