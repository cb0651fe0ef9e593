"""Group advantages over every process, with the one failed-reward rule of all apps.

Each process holds its own rollouts (`[B_r]` rows, `B_r` may differ between processes: prompts
dropped as too long, records skipped as bad). Group statistics must see whole groups and the
global batch, so rewards are gathered first (padded to the longest process, then unpadded),
the estimator runs on the global batch, and each process keeps its own rows.

The failed-reward rule, the same in every app:
- a sample whose reward is not finite (NaN: scoring failed or was refused) is left out of its
  group's statistics and gets advantage 0; it is counted in `reward/failed`;
- for the group estimators (`rl_core.advantages.uses_group_baseline`), a group with fewer than 2 valid samples has no
  baseline: its samples get advantage 0 and it is counted in `adv/small_groups`.

    result = group_advantages("grpo", scores, group_ids, accelerator=acc)   # scores [B_r]
    result.advantages                                                        # [B_r]
    result.metrics["reward/failed"]

Several reward components can instead be normalised one by one (GDPO, TRL's
`multi_objective_aggregation="normalize_then_sum"`): pass `aggregation="normalize_then_sum"`,
their unweighted values `objectives` `[B_r, K]` and `weights` `[K]`; the same rows are valid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rl_core.advantages import (
    REWARD_AGGREGATIONS,
    compute_advantages,
    group_ids_from_keys,
    uses_group_baseline,
)

__all__ = ["GroupAdvantages", "component_means", "component_weights", "gather_rows", "gathered_means",
           "group_advantages"]


def component_weights(reward: Any, aggregation: str) -> dict[str, float]:
    """The reward components' weights that `Scores(weights=...)` needs under
    `normalize_then_sum` (the reward's `sum_weights()`), else `{}`. A reward that cannot give
    them (a fold, a remote scorer) is a `ConfigError` naming `algo.reward_aggregation`."""
    if aggregation != "normalize_then_sum":
        return {}
    from rl_core.train.config import ConfigError

    if not hasattr(reward, "sum_weights"):
        raise ConfigError(f"algo.reward_aggregation=normalize_then_sum: {type(reward).__name__} reports no "
                          "component weights; use sum_then_normalize")
    try:
        return dict(reward.sum_weights())
    except ValueError as e:
        raise ConfigError(f"algo.reward_aggregation=normalize_then_sum: {e}") from None


def gather_rows(tensor: Tensor, accelerator: Any = None) -> tuple[Tensor, slice]:
    """Rows of `tensor` (`[B_r, ...]`, `B_r` may differ per process; later dims may differ too
    and are right-padded with zeros to the widest) from every process in rank order,
    `[sum_r B_r, ...]`, and the slice of this process's rows in it.

    Pads to the longest process before the collective, so gloo/NCCL see equal sizes (an unequal
    `gather` aborts on gloo and hangs or returns wrong data on NCCL).
    """
    if accelerator is None or accelerator.num_processes == 1:
        return tensor, slice(0, tensor.shape[0])
    device = accelerator.device
    local = tensor.to(device)
    counts = accelerator.gather(torch.tensor([local.shape[0]], device=device)).tolist()  # [W]
    for dim in range(local.dim()):  # pad_across_processes pads one dim per call
        local = accelerator.pad_across_processes(local, dim=dim)
    longest = local.shape[0]
    everything = accelerator.gather(local)  # [W * longest, ...]
    pieces = [everything[r * longest : r * longest + n] for r, n in enumerate(counts)]
    start = sum(counts[: accelerator.process_index])
    return torch.cat(pieces), slice(start, start + counts[accelerator.process_index])


@dataclass(frozen=True)
class GroupAdvantages:
    """This process's advantages (`[B_r]` for `[B_r]` scores, `[B_r, T]` for token rewards)
    and metrics over the global batch (the same on every process)."""

    advantages: Tensor
    valid: Tensor  # [B_r] bool: the sample entered the statistics (finite reward, group of >= 2)
    metrics: dict[str, float]


def group_advantages(
    estimator: str,
    scores: Tensor,
    group_ids: Tensor,
    *,
    accelerator: Any = None,
    mask: Tensor | None = None,
    options: Mapping[str, Any] | None = None,
    aggregation: str = "sum_then_normalize",
    objectives: Tensor | None = None,
    weights: Sequence[float] | Tensor | None = None,
) -> GroupAdvantages:
    """Advantages of this process's samples under `estimator`, statistics over every process.

    Args:
        estimator: an `rl_core.advantages` name (`grpo`, `rloo`, `reinforce_pp`, ...).
        scores: `[B_r]` sequence rewards, or `[B_r, T]` token rewards with `mask`; a row with a
            non-finite value failed to score.
        group_ids: `[B_r]` ids unique across processes (the same prompt's samples share one).
        mask: `[B_r, T]` response mask for token rewards (None for sequence rewards).
        options: extra keyword arguments of the estimator (gamma, scale, eps, clip, ...).
        aggregation: an `rl_core.advantages.REWARD_AGGREGATIONS` name. `sum_then_normalize`
            (default): `scores` are the reward the estimator normalises. `normalize_then_sum`
            (GDPO): the advantages of the valid rows are `normalize_then_sum(objectives, weights,
            group ids)` over every process, in place of the estimator's (which must be a group
            one: it decides which rows are valid; its `options` do not apply). Sequence
            `scores` only; `reward/*` metrics still come from `scores`.
        objectives: `[B_r, K]` unweighted reward components (NaN where missing), for
            `normalize_then_sum`.
        weights: `[K]` component weights, for `normalize_then_sum`.
    """
    token_level = scores.dim() == 2
    if token_level != (mask is not None):
        raise ValueError("token rewards [B, T] need a mask [B, T]; sequence rewards [B] take none")
    aggregate = REWARD_AGGREGATIONS[aggregation]
    replaces = REWARD_AGGREGATIONS.trait(aggregation, "replaces_estimator")
    if replaces:
        _check_objectives(aggregation, estimator, scores, objectives, weights)
    rewards, own = gather_rows(scores.float(), accelerator)  # [B] or [B, T]
    groups, _ = gather_rows(group_ids.long(), accelerator)  # [B]
    masks = gather_rows(mask.float(), accelerator)[0] if mask is not None else None  # [B, T]
    objs = objectives if replaces else None  # checked above: given when it replaces the estimator
    components = gather_rows(objs.float(), accelerator)[0] if objs is not None else None  # [B, K]
    finite = torch.isfinite(rewards) if not token_level else torch.isfinite(rewards).all(dim=1)  # [B]
    valid, small = _valid_rows(estimator, finite, groups)
    adv = torch.zeros_like(rewards)  # [B] or [B, T]
    if valid.any() and components is not None:
        adv[valid] = aggregate(components[valid].to(rewards.device), weights, groups[valid]).to(adv.dtype)  # [V]
    elif valid.any():
        if token_level:
            assert masks is not None
            adv[valid] = compute_advantages(estimator, rewards=rewards[valid], mask=masks[valid],
                                            group_ids=groups[valid], **(options or {}))  # [V, T]
        else:
            ones = torch.ones(int(valid.sum()), 1, dtype=rewards.dtype, device=rewards.device)  # [V, 1]
            adv[valid] = compute_advantages(estimator, rewards=rewards[valid][:, None], mask=ones,
                                            group_ids=groups[valid], **(options or {}))[:, 0]  # [V]
    metrics = _metrics(rewards, masks, finite, valid, adv, small)
    local = adv[own][:, : scores.shape[1]] if token_level else adv[own]  # this process's width
    return GroupAdvantages(local.to(scores.device), valid[own].to(scores.device), metrics)


def _check_objectives(aggregation: str, estimator: str, scores: Tensor, objectives: Tensor | None,
                      weights: Sequence[float] | Tensor | None) -> None:
    """Arguments of an aggregation that replaces the estimator: a group estimator, sequence
    scores, `objectives` `[B_r, K]` and `weights` `[K]`."""
    if not uses_group_baseline(estimator):
        raise ValueError(f"reward aggregation {aggregation!r} normalises within groups: it needs a group "
                         f"advantage estimator (grpo, dr_grpo, rloo, ...), got estimator {estimator!r}")
    if scores.dim() != 1:
        raise ValueError(f"reward aggregation {aggregation!r} takes sequence scores [B_r], got token rewards "
                         f"of shape {tuple(scores.shape)}")
    if objectives is None or weights is None:
        raise ValueError(f"reward aggregation {aggregation!r} needs objectives [B_r, K] (the unweighted reward "
                         "components) and weights [K]")
    w = torch.as_tensor(weights)
    if w.dim() != 1:
        raise ValueError(f"weights must be [K] (one per reward component), got shape {tuple(w.shape)}")
    k = w.shape[0]
    if objectives.shape != (scores.shape[0], k):
        raise ValueError(f"objectives must be [B_r, K]={scores.shape[0], k} (one row per score, one column per "
                         f"weight), got shape {tuple(objectives.shape)}")


def _valid_rows(estimator: str, finite: Tensor, groups: Tensor) -> tuple[Tensor, int]:
    """Rows that enter the estimator `[B]`, and the number of groups left out for having fewer
    than 2 valid samples (group estimators only)."""
    if not uses_group_baseline(estimator):
        return finite, 0
    ids, index = torch.unique(groups, return_inverse=True)  # [G], [B]
    per_group = torch.zeros(len(ids), dtype=torch.long, device=groups.device).index_add_(
        0, index, finite.long())  # [G] valid samples per group
    big_enough = per_group >= 2  # [G]
    return finite & big_enough[index], int(((per_group > 0) & ~big_enough).sum())


def _metrics(rewards: Tensor, masks: Tensor | None, finite: Tensor, valid: Tensor, adv: Tensor,
             small: int) -> dict[str, float]:
    """reward/* over the finite samples (sequence total for token rewards), adv/* over the
    samples that entered the statistics."""
    totals = (rewards * masks).sum(dim=1) if masks is not None else rewards  # [B]
    ok = totals[finite]
    seq_adv = adv[valid] if masks is None else (adv * masks).sum(1)[valid] / masks.sum(1)[valid].clamp(min=1)
    out = {
        "reward/mean": ok.mean().item() if ok.numel() else float("nan"),
        "reward/std": ok.std().item() if ok.numel() > 1 else 0.0,
        "reward/failed": float((~finite).sum()),
        "adv/small_groups": float(small),
        "adv/kept_fraction": float(valid.float().mean()) if valid.numel() else 0.0,
    }
    if seq_adv.numel():
        out.update({"adv/mean": seq_adv.mean().item(), "adv/std": seq_adv.std().item() if seq_adv.numel() > 1 else 0.0,
                    "adv/min": seq_adv.min().item(), "adv/max": seq_adv.max().item()})
    return out


def component_means(components: Sequence[Mapping[str, float]], accelerator: Any = None,
                    prefix: str = "reward/") -> dict[str, float]:
    """`{prefix + name: mean}` of each reward component over the samples of every process that
    report it (`components[i]` holds sample i's unweighted component values; a failed sample
    may report none)."""
    rows: list[Mapping[str, float]] = list(components)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        rows = gather_object([dict(c) for c in components])
    out = {}
    for name in sorted({k for row in rows for k in row}):
        values = [row[name] for row in rows if name in row]
        out[prefix + name] = sum(values) / len(values)
    return out


def gathered_means(columns: Mapping[str, Sequence[float]], accelerator: Any = None) -> dict[str, float]:
    """`{name: mean}` of each column's values over every process: the sums and counts are
    reduced, so processes may hold different numbers of values (an eval set that does not divide
    by the process count) and each value weighs the same; NaN for a column empty everywhere."""
    local = torch.tensor([[sum(v), len(v)] for v in columns.values()], dtype=torch.float64).reshape(-1, 2)  # [K, 2]
    if accelerator is not None and accelerator.num_processes > 1:
        local = accelerator.reduce(local.to(accelerator.device), reduction="sum").cpu()  # [K, 2] over every process
    return {name: total / count if count else math.nan
            for name, (total, count) in zip(columns, local.tolist(), strict=True)}


def gathered_group_ids(keys: Sequence[str], accelerator: Any = None) -> Tensor:
    """This process's group ids `[N]` for samples grouped by a key over every process (Flow-GRPO's
    per-prompt stat tracker: the prompt text), numbered together in rank order
    (`group_ids_from_keys` over the gathered keys)."""
    if accelerator is None or accelerator.num_processes == 1:
        return group_ids_from_keys(list(keys))
    from accelerate.utils import gather_object

    parts = gather_object([list(keys)])  # one list per process, in rank order
    start = sum(len(part) for part in parts[: accelerator.process_index])
    return group_ids_from_keys([k for part in parts for k in part])[start:start + len(keys)]  # [N]


def zero_std_fraction(rewards: Tensor, group_ids: Tensor, accelerator: Any = None) -> float:
    """The share of groups (over every process; those with >= 2 finite rewards) whose rewards are
    all equal: groups that give GRPO no signal."""
    everything, _ = gather_rows(rewards, accelerator)  # [N * world]
    groups, _ = gather_rows(group_ids, accelerator)  # [N * world]
    stds = [everything[(groups == g) & torch.isfinite(everything)].std().item() for g in groups.unique()
            if ((groups == g) & torch.isfinite(everything)).sum() > 1]
    return sum(s == 0 for s in stds) / max(len(stds), 1)
