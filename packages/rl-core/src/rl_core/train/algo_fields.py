"""The `algo.*` keys of a token policy-gradient update, named the same in every text app: an
app's `AlgoConfig` subclasses `TokenPolicyFields` (the estimator, the loss, its options and the
off-policy corrections), restating a field only to change its default, and
`rl_policy.training.LossOptions(**loss_fields(cfg.algo), ...)` reads them."""

from __future__ import annotations

import inspect

import msgspec

from rl_core.train.config import (
    AdvantageName,
    AggregationName,
    ConfigError,
    NonNegativeFloat,
    PolicyLossName,
    PositiveFloat,
    RewardAggregationName,
    RolloutCorrectionName,
    UnitInterval,
)

__all__ = ["PolicyLossFields", "TokenPolicyFields", "check_loss_options"]


class PolicyLossFields(msgspec.Struct, kw_only=True, frozen=True):
    """Loss options and corrections shared by the text apps' `algo` tables."""

    loss_options: dict[str, float] = {}
    """The policy loss's own options: `dual_clip` {c = 3.0}; `sapo` {tau_pos = 1.0, tau_neg =
    1.05} (TRL's sapo_temperature_pos/neg). `cispo` reads clip_low/clip_high as its weight
    bounds (clip_low = 1: no lower bound; TRL epsilon_high = 1 + clip_high)."""
    off_policy_mask: PositiveFloat | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage whose mean
    log-prob drop from the rollout engine to the trainer exceeds this is left out (TRL
    off_policy_mask_threshold; e.g. 0.5). None: off. For stale or mismatched rollouts."""
    rollout_correction: RolloutCorrectionName = "none"
    """Importance weights trainer / rollout engine on the loss (TRL vllm_importance_sampling_mode):
    token_truncate (TIS), token_mask (MIS; IcePop with clip 0.5..2), sequence_truncate,
    sequence_mask, or none. For a rollout engine whose numerics differ from the trainer's (vLLM,
    bf16 kernels)."""
    rollout_clip_min: NonNegativeFloat | None = None  # lower bound of the rollout correction (None: none)
    rollout_clip_max: PositiveFloat | None = 3.0  # upper bound of the rollout correction (None: none)
    reward_aggregation: RewardAggregationName = "sum_then_normalize"
    """Several reward components: `sum_then_normalize` (their weighted sum is the reward) or
    `normalize_then_sum` (GDPO; TRL multi_objective_aggregation): each component normalised in
    its group before the weighted sum, so a large-scale reward does not drown a small one."""


class TokenPolicyFields(PolicyLossFields, kw_only=True, frozen=True):
    """The estimator and the clipped loss, with `PolicyLossFields`' options and corrections."""

    advantage: AdvantageName = "grpo"
    """The advantage estimator (`rl_core.advantages`): grpo, dr_grpo and rloo compare a prompt's
    samples with each other; reinforce_pp normalises over the batch."""
    loss: PolicyLossName = "ppo_clip"  # ppo_clip | dual_clip | gspo | cispo | sapo
    agg: AggregationName = "token-mean"  # how token losses become one number (verl loss_agg_mode)
    clip_low: UnitInterval = 0.2
    clip_high: NonNegativeFloat = 0.2  # above clip_low: DAPO's clip-higher


def check_loss_options(loss: str, options: dict[str, float], *, key: str = "algo.loss_options") -> None:
    """`Recipe.check`'s rule: every option names a keyword of the loss function (before any model loads)."""
    # imported here: it imports torch, and app configs import this module before torch loads
    from rl_core.losses import POLICY_LOSSES

    params = inspect.signature(POLICY_LOSSES[loss]).parameters
    known = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY
                   and n not in ("logp", "old_logp", "advantages", "valid", "clip_low", "clip_high"))
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{key}: {', '.join(unknown)} is not an option of the {loss!r} loss; "
                          f"its options: {', '.join(known) or 'none'}")
