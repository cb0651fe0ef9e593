"""Advantage estimators behind one call: `compute_advantages(name, *, rewards, mask, group_ids, values=None, **options)`.

Every estimator takes the same inputs, so a trainer switches GRPO for REINFORCE++ or GAE by
changing a string:

- `rewards`: `[B]` (one score per sequence) or `[B, T]` (token-level rewards).
  Outcome estimators (`grpo`, `dr_grpo`, `rloo`, `reinforce_pp_baseline`) reduce `[B, T]`
  rewards to a sequence score by summing over the mask (verl's convention) and broadcast the
  advantage over the mask. Token-level estimators (`reinforce_pp`, `gae`) place a `[B]` reward
  on the last valid token of each row.
- `mask`: `[B, T]` response mask (bool or 0/1); the output is zero outside it.
- `group_ids`: `[B]` integer ids; samples of the same prompt share an id. Ids need not be
  contiguous or sorted and groups may have unequal sizes.
- `values`: `[B, T]` critic values, used by `gae` only (ignored by the others).

The output is a `[B, T]` float tensor (float32, or float64 for float64 rewards). Group
statistics are computed with `index_add_`, never a Python loop over groups; the tests compare
every estimator with a loop reference.

Two helpers reproduce Flow-GRPO's data handling around the estimator: `group_ids_from_keys`
(group by prompt text, as its per-prompt stat tracker does) and `nonzero_advantage_indices`
(its zero-advantage filter with the refill to equal batches).

Several reward components are combined by a `REWARD_AGGREGATIONS` entry: `sum_then_normalize`
(the weighted sum is the reward the estimator sees) or `normalize_then_sum` (GDPO: each
component normalised within its group, then summed; the result is the advantage).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rl_core.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "REWARD_AGGREGATIONS",
    "GAEOutput",
    "compute_advantages",
    "compute_gae",
    "group_ids_from_keys",
    "masked_whiten",
    "nonzero_advantage_indices",
    "normalize_then_sum",
    "sum_then_normalize",
    "uses_group_baseline",
]

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
"""Estimators by name. Trait `group_baseline=True`: the baseline is the sample's group (the other
samples of its prompt), so a group with fewer than 2 valid samples has none (`uses_group_baseline`)."""


def uses_group_baseline(name: str) -> bool:
    """Whether estimator `name` compares a sample with its group (`grpo`, `dr_grpo`, `rloo`,
    `reinforce_pp_baseline`): it needs `n >= 2` samples per prompt. Unknown names raise."""
    return bool(ADVANTAGE_ESTIMATORS.trait(name, "group_baseline"))


def compute_advantages(
    name: str,
    *,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    **options: object,
) -> Tensor:
    """Advantages `[B, T]` from the estimator registered as `name` (see `ADVANTAGE_ESTIMATORS`).

    `options` go to the estimator (`grpo`: `scale`, `eps`, `clip`, `std`, `eps_mode`;
    `reinforce_pp`: `gamma`;
    `gae`: `gamma`, `lam`); an option the estimator does not take raises `TypeError`.
    """
    estimator = ADVANTAGE_ESTIMATORS[name]
    _check_inputs(rewards, mask, group_ids, values)
    return estimator(rewards=rewards, mask=mask, group_ids=group_ids, values=values, **options)


# ----------------------------------------------------------------------------- helpers


def _check_inputs(
    rewards: Tensor, mask: Tensor, group_ids: Tensor | None, values: Tensor | None
) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    batch, length = mask.shape
    if rewards.shape not in ((batch,), (batch, length)):
        raise ValueError(
            f"rewards must be [B]={batch} or [B, T]={batch, length} to match mask, "
            f"got shape {tuple(rewards.shape)}"
        )
    if group_ids is not None:
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must be [B]={batch}, got shape {tuple(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if values is not None and values.shape != (batch, length):
        raise ValueError(f"values must be [B, T]={batch, length}, got shape {tuple(values.shape)}")
    bad = ~torch.isfinite(rewards.reshape(batch, -1)).all(dim=1)  # [B]
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"rewards are NaN or infinite in rows {rows}; fix or drop those samples")


def _float_dtype(rewards: Tensor) -> torch.dtype:
    return torch.promote_types(rewards.dtype, torch.float32)


def _sequence_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """One score per sequence `[B]`: `[B]` rewards as given, `[B, T]` summed over the mask."""
    dtype = _float_dtype(rewards)
    if rewards.dim() == 1:
        return rewards.to(dtype)  # [B]
    return (rewards.to(dtype) * mask.to(dtype)).sum(dim=-1)  # [B]


def _token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token-level rewards `[B, T]`: `[B]` rewards sit on the last valid token of each row."""
    dtype = _float_dtype(rewards)
    maskf = mask.to(dtype)  # [B, T]
    if rewards.dim() == 2:
        return rewards.to(dtype) * maskf  # [B, T]
    length = mask.shape[1]
    positions = torch.arange(length, device=mask.device)  # [T]
    last = torch.where(mask.bool(), positions, -1).amax(dim=1)  # [B], -1 for an empty row
    onehot = positions.unsqueeze(0) == last.unsqueeze(1)  # [B, T]
    return onehot.to(dtype) * rewards.to(dtype).unsqueeze(1)  # [B, T]


@dataclass(frozen=True, slots=True)
class _Groups:  # not a NamedTuple: `index` and `count` would shadow tuple's methods
    index: Tensor  # [B] contiguous group index 0..G-1
    count: Tensor  # [G] members per group (float)


def _groups(group_ids: Tensor, dtype: torch.dtype) -> _Groups:
    _, index = torch.unique(group_ids, return_inverse=True)  # [B]
    count = torch.bincount(index).to(dtype)  # [G]
    return _Groups(index, count)


def _group_min(scores: Tensor, groups: _Groups) -> Tensor:
    """Smallest score of each sample's group, `[B]`."""
    lowest = torch.zeros_like(groups.count).scatter_reduce_(
        0, groups.index, scores, reduce="amin", include_self=False
    )  # [G]
    return lowest[groups.index]  # [B]


def _group_mean(scores: Tensor, groups: _Groups) -> Tensor:
    """Mean of each sample's group, gathered back to `[B]`.

    Summed relative to the group minimum, so a group of equal rewards has a mean exactly equal
    to them: its advantages are exactly 0 instead of rounding noise divided by `std + eps`.
    """
    low = _group_min(scores, groups)  # [B]
    total = torch.zeros_like(groups.count).index_add_(0, groups.index, scores - low)  # [G]
    return low + (total / groups.count)[groups.index]  # [B]


def _group_std(scores: Tensor, mean: Tensor, groups: _Groups, kind: str = "unbiased") -> Tensor:
    """Std of each sample's group, `[B]`: `unbiased` (`torch.std` default, divides by n - 1) or
    `population` (`np.std` default, divides by n); 0 for a group of one either way."""
    sq = torch.zeros_like(groups.count).index_add_(0, groups.index, (scores - mean) ** 2)  # [G]
    dof = groups.count - 1 if kind == "unbiased" else groups.count  # [G]
    var = sq / dof.clamp(min=1)  # [G]
    return var.sqrt()[groups.index]  # [B]


STD_KINDS = ("unbiased", "population")
EPS_MODES = ("add", "clamp")


def _normalise(centered: Tensor, std: Tensor, eps: float, eps_mode: str) -> Tensor:
    """`centered / (std + eps)` (`add`) or `centered / max(std, eps)` (`clamp`); shapes broadcast."""
    if eps_mode == "add":
        return centered / (std + eps)
    return centered / std.clamp(min=eps)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """verl's `masked_whiten`: `(v - mean) / sqrt(var + eps)` over the valid tokens of the batch.

    Mean and unbiased variance are taken over all entries where `mask` is set; the result is
    zero outside the mask. One valid token gives zero (its value equals the mean).
    """
    maskf = mask.to(values.dtype)  # [B, T]
    n = maskf.sum()
    mean = (values * maskf).sum() / n.clamp(min=1)
    var = (((values - mean) * maskf) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * maskf  # [B, T]


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    return seq_adv.unsqueeze(1) * mask.to(seq_adv.dtype)  # [B, T]


def group_ids_from_keys(keys: Sequence[Hashable]) -> Tensor:
    """Group ids `[B]` (int64) for samples identified by any hashable key, e.g. the prompt text.

    Equal keys get equal ids, numbered in order of first appearance: `["a", "b", "a"]` ->
    `[0, 1, 0]`. Use it to group the way Flow-GRPO's per-prompt stat tracker does — by prompt
    text, so two groups sampled from the same prompt in one batch share one mean and std —
    instead of by the sampler's group id (one id per draw of a prompt, our default).
    """
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.int64)


def nonzero_advantage_indices(
    advantages: Tensor, *, num_batches: int, generator: torch.Generator | None = None
) -> Tensor:
    """Indices `[K]` (ascending) of the samples Flow-GRPO trains on after its zero-advantage filter.

    `advantages` is `[N]` (one per sample) or `[N, ...]` (e.g. per denoising step; a sample is
    zero when all its entries are). Flow-GRPO (`scripts/train_sd3.py`) keeps the samples with a
    non-zero advantage; when their count is not a multiple of `num_batches` (its
    `sample.num_batches_per_epoch`), it marks `num_batches - count % num_batches` zero-advantage
    samples as kept again, chosen by `torch.randperm` over the zero ones, so the kept samples
    reshape into `num_batches` equal training batches. Same generator state, same choice.

    Edge cases, as there: when too few zero-advantage samples exist to reach the next multiple,
    none are put back and K stays a non-multiple (Flow-GRPO then reshapes into uneven batches
    or fails); when every advantage is zero, K = 0 (nothing to train this epoch). Check
    `len(kept) % num_batches` before batching.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    if advantages.dim() == 0:
        raise ValueError("advantages must be [N] or [N, ...], got a scalar")
    flat = advantages.detach().abs().reshape(advantages.shape[0], -1)  # [N, M]
    keep = flat.sum(dim=1) != 0  # [N]
    remainder = int(keep.sum()) % num_batches
    if remainder:
        zeros = torch.where(~keep)[0]  # [Z]
        missing = num_batches - remainder
        if len(zeros) >= missing:
            chosen = torch.randperm(len(zeros), generator=generator)[:missing]  # [missing]
            keep[zeros[chosen]] = True
    return torch.where(keep)[0]  # [K]


# -------------------------------------------------------------------------- outcome estimators


@ADVANTAGE_ESTIMATORS.register("grpo", group_baseline=True)
def compute_grpo(
    *,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    clip: float | None = None,
    std: Literal["unbiased", "population"] = "unbiased",
    eps_mode: Literal["add", "clamp"] = "add",
) -> Tensor:
    """GRPO (DeepSeekMath, Shao et al. 2024): `(r - group mean) / (std + eps)`.

    `scale` picks the std: `"group"` (per prompt, the GRPO paper and verl), `"batch"` (one std
    over the whole batch: Flow-GRPO's "global std", steadier when groups are small or nearly
    constant) or `"none"` (no division, same as `dr_grpo`). A group of one gets advantage 0.
    `clip` clamps advantages to `[-clip, clip]` (Flow-GRPO and VRL use 5.0).

    How the std is taken and guarded, to reproduce a given system exactly:

    - `std="unbiased"` (default; `torch.std`, verl) divides the squared deviations by n - 1;
      `std="population"` divides by n (`np.std`: Flow-GRPO's stat tracker, VRL).
    - `eps_mode="add"` (default) divides by `std + eps`; `eps_mode="clamp"` by `max(std, eps)`.

    | system   | std          | eps    | eps_mode |
    |----------|--------------|--------|----------|
    | ours     | `unbiased`   | 1e-6   | `add`    |
    | Flow-GRPO| `population` | 1e-4   | `add`    |
    | VRL      | `population` | 1e-8   | `clamp`  |

    With n samples per group, population/unbiased = sqrt((n - 1) / n) (0.935 for n = 8), so
    advantages differ by that factor; pick the system's own settings when reproducing its
    curves. Flow-GRPO groups by prompt *text*: pass `group_ids_from_keys(prompts)`.
    """
    if std not in STD_KINDS:
        raise ValueError(f"grpo option std must be 'unbiased' or 'population', got {std!r}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"grpo option eps_mode must be 'add' or 'clamp', got {eps_mode!r}")
    scores = _sequence_scores(rewards, mask)  # [B]
    groups = _groups(group_ids, scores.dtype)
    mean = _group_mean(scores, groups)  # [B]
    centered = scores - mean  # [B]
    if scale == "group":
        adv = _normalise(centered, _group_std(scores, mean, groups, std), eps, eps_mode)  # [B]
    elif scale == "batch":
        correction = 1 if std == "unbiased" else 0
        spread = scores.std(correction=correction) if scores.numel() > 1 else scores.new_zeros(())
        adv = _normalise(centered, spread, eps, eps_mode)  # [B]
    elif scale == "none":
        adv = centered  # [B]
    else:
        raise ValueError(f"grpo option scale must be 'group', 'batch' or 'none', got {scale!r}")
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return _broadcast(adv, mask)


@ADVANTAGE_ESTIMATORS.register("dr_grpo", group_baseline=True)
def compute_dr_grpo(
    *, rewards: Tensor, mask: Tensor, group_ids: Tensor, values: Tensor | None = None
) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): `r - group mean`.

    Drops GRPO's std division, which up-weights prompts whose rewards barely vary. Pair it with
    the `seq-mean-token-sum-norm` aggregation to drop the length bias as well.
    """
    scores = _sequence_scores(rewards, mask)  # [B]
    groups = _groups(group_ids, scores.dtype)
    return _broadcast(scores - _group_mean(scores, groups), mask)


@ADVANTAGE_ESTIMATORS.register("rloo", group_baseline=True)
def compute_rloo(
    *, rewards: Tensor, mask: Tensor, group_ids: Tensor, values: Tensor | None = None
) -> Tensor:
    """RLOO (Ahmadian et al. 2024): `r_i - mean of the other members of its group`.

    An unbiased leave-one-out baseline (CapRL's choice). A group of one has no others: 0.
    """
    scores = _sequence_scores(rewards, mask)  # [B]
    groups = _groups(group_ids, scores.dtype)
    low = _group_min(scores, groups)  # [B] shift: equal rewards give exactly 0
    shifted = scores - low  # [B]
    total = torch.zeros_like(groups.count).index_add_(0, groups.index, shifted)[groups.index]
    count = groups.count[groups.index]  # [B]
    others_mean = low + (total - shifted) / (count - 1).clamp(min=1)  # [B]
    adv = torch.where(count > 1, scores - others_mean, torch.zeros_like(scores))  # [B]
    return _broadcast(adv, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline", group_baseline=True)
def compute_reinforce_pp_baseline(
    *, rewards: Tensor, mask: Tensor, group_ids: Tensor, values: Tensor | None = None
) -> Tensor:
    """REINFORCE++ with a group baseline (verl `reinforce_plus_plus_baseline`).

    Subtract the group mean of sequence scores, broadcast over the response, then whiten over all
    valid tokens of the batch. A group of one is its own mean, so it gets 0 before whitening
    (verl keeps the raw score there; a lone sample carries no relative signal).
    """
    scores = _sequence_scores(rewards, mask)  # [B]
    groups = _groups(group_ids, scores.dtype)
    centered = _broadcast(scores - _group_mean(scores, groups), mask)  # [B, T]
    return masked_whiten(centered, mask)


# ------------------------------------------------------------------------ token-level estimators


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """`G_t = r_t + gamma * G_{t+1}` inside each run of valid tokens; a masked position resets it.

    This is verl's REINFORCE++ recursion (`running_return *= mask[t]`: no reward leaks across
    EOS or across a masked hole such as a tool output). gamma == 1 uses a reverse cumulative sum
    with resets (no loop); other gammas use a loop over T, vectorised over the batch.
    """
    maskf = mask.to(token_rewards.dtype)  # [B, T]
    r = token_rewards * maskf  # [B, T]
    batch, length = r.shape
    if gamma == 1.0:
        rev = r.double().flip(1).cumsum(1).flip(1)  # [B, T] sum_{k>=t} r_k
        rev = torch.cat([rev, rev.new_zeros(batch, 1)], dim=1)  # [B, T+1]
        positions = torch.arange(length + 1, device=r.device)  # [T+1]
        holes = torch.cat([~mask.bool(), mask.new_ones(batch, 1, dtype=torch.bool)], dim=1)
        hole_at = torch.where(holes, positions, length)  # [B, T+1]
        next_hole = hole_at.flip(1).cummin(1).values.flip(1)[:, :length]  # [B, T] first hole >= t
        returns = rev[:, :length] - rev.gather(1, next_hole)  # [B, T]
        return returns.to(r.dtype) * maskf
    returns = torch.zeros_like(r)  # [B, T]
    running = r.new_zeros(batch)  # [B]
    for t in range(length - 1, -1, -1):
        running = r[:, t] + gamma * running  # [B]
        returns[:, t] = running
        running = running * maskf[:, t]
    return returns * maskf


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def compute_reinforce_pp(
    *,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ (Hu 2025; verl `reinforce_plus_plus`, VeRL-with-RMs' estimator).

    Token returns `G_t = r_t + gamma * G_{t+1}` (reset after EOS), then whitened over all valid
    tokens of the batch; no per-prompt baseline, so it works with one sample per prompt. Use
    `reinforce_pp_baseline` when there are several samples per prompt.
    """
    token_rewards = _token_rewards(rewards, mask)  # [B, T]
    returns = _discounted_returns(token_rewards, mask, gamma)  # [B, T]
    return masked_whiten(returns, mask)


class GAEOutput(NamedTuple):
    """`advantages` `[B, T]` (whitened over the batch's valid tokens) and `returns` `[B, T]`
    (raw GAE advantages + values: the critic's regression target). Both zero outside the mask."""

    advantages: Tensor
    returns: Tensor


def compute_gae(
    *, rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> GAEOutput:
    """Generalized advantage estimation (Schulman et al. 2016) exactly as verl computes it.

    `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lam * A_{t+1}`, going
    backwards; masked positions inside the response (e.g. tool output) are skipped: they carry
    the next valid value and advantage through unchanged. `returns = A + V` before whitening;
    `advantages` are whitened over the valid tokens. Use with a critic (PPO); `gamma=lam=1`
    are verl's defaults for LLM RL.
    """
    _check_inputs(rewards, mask, None, values)
    token_rewards = _token_rewards(rewards, mask)  # [B, T]
    vals = values.to(token_rewards.dtype)  # [B, T]
    maskf = mask.to(token_rewards.dtype)  # [B, T]
    batch, length = token_rewards.shape
    next_value = vals.new_zeros(batch)  # [B]
    last_gae = vals.new_zeros(batch)  # [B]
    advantages = torch.zeros_like(vals)  # [B, T]
    for t in range(length - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - vals[:, t]  # [B]
        gae_t = delta + gamma * lam * last_gae  # [B]
        m = maskf[:, t]  # [B]
        next_value = vals[:, t] * m + (1 - m) * next_value
        last_gae = gae_t * m + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + vals) * maskf  # [B, T]
    return GAEOutput(advantages=masked_whiten(advantages, mask), returns=returns)


@ADVANTAGE_ESTIMATORS.register("gae")
def compute_gae_advantages(
    *,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Tensor:
    """GAE advantages through the uniform interface; `compute_gae` also returns the returns."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values=[B, T] critic values")
    return compute_gae(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam).advantages


# ----------------------------------------------------------------------- reward aggregations

REWARD_AGGREGATIONS: Registry = Registry("reward aggregation")
"""How several reward components (objectives) become advantages, by name; each entry takes
`(objectives [B, K], weights [K], group_ids [B], eps)`. `sum_then_normalize` returns None: the
weighted sum is the reward and the advantage estimator runs on it. `normalize_then_sum` (trait
`replaces_estimator=True`) returns the advantages `[B]` itself, in place of the estimator's."""


@REWARD_AGGREGATIONS.register("sum_then_normalize")
def sum_then_normalize(objectives: Tensor | None, weights: Tensor | None, group_ids: Tensor,
                       eps: float = 1e-4) -> None:
    """The default: the reward is the weighted sum of the components (computed by the reward
    itself), and the advantage estimator normalises it (GRPO; TRL's `multi_objective_aggregation`
    default of the same name). Returns None: nothing replaces the estimator's advantages.

    Choose it for one reward, or several whose scales are meant to trade off as weighted.
    """
    return None


@REWARD_AGGREGATIONS.register("normalize_then_sum", replaces_estimator=True)
def normalize_then_sum(objectives: Tensor, weights: Sequence[float] | Tensor, group_ids: Tensor,
                       eps: float = 1e-4) -> Tensor:
    """GDPO (arXiv 2601.05242), exactly as TRL 1.16's `multi_objective_aggregation="normalize_then_sum"`.

    Args:
        objectives: `[B, K]` unweighted per-component rewards; NaN where a component is missing.
        weights: `[K]` component weights.
        group_ids: `[B]` integer ids; samples of one prompt share one (any ids, any order).
        eps: added to every std (TRL: 1e-4).

    Returns the advantages `[B]`:
      1. per group and component, `z = (x - nanmean) / (nanstd + eps)`, with TRL's `nanstd`
         (Bessel-corrected over the non-NaN values; NaN for fewer than 2, so such a component
         adds nothing to its group's rows);
      2. `s = nansum_k(w_k * z_k)`, NaN for a row with every component missing;
      3. `(s - nanmean(s)) / (nanstd(s) + eps)` over the batch; NaN (a row with no component,
         or a batch of one) becomes 0.

    Choose it over `sum_then_normalize` when the rewards have different scales or spreads
    (format + accuracy): summed first, the widest one decides the ranking within a group and
    the others drown; normalised first, each moves the advantage by its weight.
    """
    if objectives.dim() != 2:
        raise ValueError(f"normalize_then_sum: objectives must be [B, K], got shape {tuple(objectives.shape)}")
    batch, k = objectives.shape
    dtype = _float_dtype(objectives)
    w = torch.as_tensor(weights, dtype=dtype, device=objectives.device)  # [K]
    if w.shape != (k,):
        raise ValueError(f"normalize_then_sum: weights must be [K]={k} (one per objectives column), "
                         f"got shape {tuple(w.shape)}")
    if group_ids.shape != (batch,):
        raise ValueError(f"normalize_then_sum: group_ids must be [B]={batch}, got shape {tuple(group_ids.shape)}")
    x = objectives.to(dtype)  # [B, K]
    _, index = torch.unique(group_ids, return_inverse=True)  # [B]
    present = ~torch.isnan(x)  # [B, K]
    groups = int(index.max()) + 1 if batch else 0
    count = torch.zeros(groups, k, dtype=dtype, device=x.device).index_add_(0, index, present.to(dtype))  # [G, K]
    total = torch.zeros_like(count).index_add_(0, index, torch.where(present, x, 0.0))  # [G, K]
    mean = (total / count)[index]  # [B, K], NaN where the group has no value
    sq = torch.zeros_like(count).index_add_(0, index, torch.where(present, (x - mean) ** 2, 0.0))  # [G, K]
    std = _bessel_std(sq / count, count)[index]  # [B, K]
    z = (x - mean) / (std + eps)  # [B, K]
    s = (z * w).nansum(dim=1)  # [B]
    s[~present.any(dim=1)] = torch.nan  # a row without any component stays out of the batch statistics
    finite = ~torch.isnan(s)  # [B]
    n = finite.sum().to(dtype)
    batch_mean = torch.nanmean(s)
    batch_var = torch.where(finite, (s - batch_mean) ** 2, 0.0).sum() / n  # TRL's nanmean of the squares
    return torch.nan_to_num((s - batch_mean) / (_bessel_std(batch_var, n) + eps), nan=0.0)  # [B]


def _bessel_std(variance: Tensor, count: Tensor) -> Tensor:
    """TRL's `nanstd` from the population variance: `sqrt(var * n / (n - 1))`, NaN for n < 2."""
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, torch.nan))
    return (variance * correction).sqrt()

