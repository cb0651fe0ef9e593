"""DAPO's dynamic sampling in the trainer loop: groups whose samples all scored the same are
dropped and the batch is refilled from further rollout rounds.

A group whose rewards are all equal has advantage 0 under every group baseline (GRPO, RLOO,
Dr. GRPO): it costs a forward and backward and only dilutes the loss of the informative groups.
DAPO (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale") keeps sampling until the
batch holds `batch_size` prompts whose groups disagree. Peers: verl `algorithm.filter_groups`
(`metric`, `max_num_gen_batches`), OpenRLHF `--dynamic_filtering`, NeMo-RL
`use_dynamic_sampling`.

How the loop runs it (`train.dynamic_sampling.enable = true`):

- round 1 is the step's ordinary rollout and scoring; each process keeps its informative groups
  (at least 2 distinct finite values of `metric` among the group's samples);
- while some process holds fewer informative groups than it rolled out in round 1, and fewer than
  `max_rounds` rounds ran, every process runs `Recipe.rollout` + `Recipe.score` again (the
  recipe's sampler draws the next prompts) and keeps informative groups up to its round-1 count;
- after `max_rounds`, a process still short fills its batch with uniform groups (advantage 0;
  logged as `dynamic_sampling/filled_groups`), so the batch keeps its shape and its optimizer
  step count (verl raises instead);
- the recipe merges the kept samples of the rounds into one batch (`Recipe.merge`), and the loop
  merges the scores the same way.

`metric` is `reward` (the total) or the name of one reward component (its unweighted value, e.g.
an exact-answer `acc`). Filter on the raw task metric when the total includes shaping terms (an
overlong penalty, a KL penalty): a group whose answers are all right but of different lengths is
uniform in accuracy and carries no accuracy signal (NeMo-RL fixed this bug in its filter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from rl_core.train.fields import DynamicSampling

__all__ = ["DynamicSampling", "GroupFilter", "merge_scores"]


def metric_values(scores: Any, metric: str) -> Tensor:
    """`[B_r]` value of `metric` per sample (NaN where absent or failed): the total reward (the
    sum over the response for token rewards) or one component."""
    if metric == "reward":
        rewards = scores.rewards.float()
        if rewards.dim() == 2:  # token rewards: the sequence total
            return torch.where(torch.isfinite(rewards).all(1), (torch.nan_to_num(rewards) * scores.mask).sum(1),
                               math.nan)
        return rewards
    values = [row.get(metric, math.nan) for row in scores.components] if scores.components else []
    if len(values) != scores.rewards.shape[0]:
        values = [math.nan] * scores.rewards.shape[0]
    out = torch.tensor(values, dtype=torch.float32)  # [B_r]
    return torch.where(torch.isfinite(scores.rewards.float().reshape(len(out), -1)).all(1), out, math.nan)


def informative_groups(values: Tensor, group_ids: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """The sample indices of each group, in order of first appearance, split into informative
    groups (>= 2 distinct finite values) and uniform ones."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        members.setdefault(int(g), []).append(i)
    keep: list[list[int]] = []
    uniform: list[list[int]] = []
    for rows in members.values():
        finite = {float(values[i]) for i in rows if math.isfinite(float(values[i]))}
        (keep if len(finite) >= 2 else uniform).append(rows)
    return keep, uniform


@dataclass
class GroupFilter:
    """One step's rounds on this process: which groups of which round are kept."""

    metric: str
    target: int = 0  # groups of round 1 on this process: the batch's size in groups
    kept: list[tuple[int, list[int]]] = field(default_factory=list)  # (round, sample rows) per kept group
    spare: list[tuple[int, list[int]]] = field(default_factory=list)  # uniform groups, for a short batch
    dropped: int = 0  # groups discarded (uniform, or informative beyond the target)
    values: list[Tensor] = field(default_factory=list)  # each round's metric values [B_r]

    def add(self, round_index: int, scores: Any) -> None:
        values = metric_values(scores, self.metric)  # [B_r]
        keep, uniform = informative_groups(values, scores.group_ids)
        if round_index == 0:
            self.target = len(keep) + len(uniform)
        room = self.target - len(self.kept)
        self.kept += [(round_index, rows) for rows in keep[:room]]
        self.spare += [(round_index, rows) for rows in uniform]
        self.dropped += len(uniform) + max(0, len(keep) - room)
        self.values.append(values)

    @property
    def short(self) -> int:
        return self.target - len(self.kept)

    def selection(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Kept groups (round, rows) in order, filled with uniform ones when short; and the
        number of fillers (which are then not counted as dropped)."""
        fill = self.spare[: self.short]
        return self.kept + fill, len(fill)

    def metrics(self, rounds: int, accelerator: Any) -> dict[str, float]:
        """dynamic_sampling/* over every process."""
        values = torch.cat(self.values)  # [sum B_r]
        finite = values[torch.isfinite(values)]
        _, filled = self.selection()
        local = torch.tensor([float(len(self.kept)), float(self.dropped - filled), float(filled),
                              float(finite.sum()), float(finite.numel())], dtype=torch.float64,
                             device=accelerator.device)
        kept, dropped, filled_all, total, count = accelerator.reduce(local, "sum").tolist()
        return {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": kept,
                "dynamic_sampling/dropped_groups": dropped, "dynamic_sampling/filled_groups": filled_all,
                "dynamic_sampling/metric_mean": total / count if count else math.nan}


def merge_scores(groups: Sequence[tuple[Any, list[int]]], rounds: Sequence[Any], group_offset: int) -> Any:
    """One `Scores` from the kept groups, each `(that round's Scores, its sample rows)`, in
    order: group j gets id `group_offset + j`. Estimator, options, aggregation and metrics come
    from round 1 (`rounds[0]`), except `tokens`, summed over every round (the throughput counts
    every generated token)."""
    first = rounds[0]
    token_level = first.rewards.dim() == 2
    width = max(s.rewards.shape[1] for s in rounds) if token_level else 0
    rewards, masks, ids, components = [], [], [], []
    for j, (scores, rows) in enumerate(groups):
        index = torch.tensor(rows, dtype=torch.long)
        ids += [group_offset + j] * len(rows)
        if token_level:
            rewards.append(_pad(scores.rewards[index], width))
            masks.append(_pad(scores.mask[index], width))
        else:
            rewards.append(scores.rewards[index])
        components += [scores.components[i] for i in rows] if scores.components else [{} for _ in rows]
    metrics = dict(first.metrics)
    if "tokens" in metrics:
        metrics["tokens"] = float(sum(s.metrics.get("tokens", 0.0) for s in rounds))
    return replace(first, rewards=torch.cat(rewards), group_ids=torch.tensor(ids, dtype=torch.long),
                   mask=torch.cat(masks) if token_level else None, components=components, metrics=metrics)


def _pad(rows: Tensor, width: int) -> Tensor:
    out = torch.zeros(rows.shape[0], width, dtype=rows.dtype)  # [b, width]
    out[:, : rows.shape[1]] = rows
    return out
