"""Loss aggregation, policy-gradient losses and rollout-vs-trainer corrections.

`aggregate(values, mask, mode, *, num_valid=None, norm_length=None)` turns a per-token loss
`[B, T]` into a scalar with verl's modes (registry `AGGREGATIONS`):

- `token-mean`: sum of valid-token losses / number of valid tokens. Every token weighs the same
  (DAPO's recommendation; verl's default).
- `seq-mean-token-sum`: per-sequence token sums, averaged over sequences. Long answers weigh more.
- `seq-mean-token-mean`: per-sequence token means, averaged over sequences (the original GRPO
  objective; every sequence weighs the same, so tokens of short answers weigh more).
- `seq-mean-token-sum-norm`: per-sequence token sums / `norm_length` (default `T`, the padded
  length; pass the max response length so it stays constant), averaged over sequences
  (Dr. GRPO's unbiased objective).

`num_valid` is the divisor: the number of valid tokens (`token-mean`) or of sequences with at
least one valid token (`seq-*` modes). Left as `None`, it is counted from this `mask`. Pass the
count of the *global* batch (summed over micro-batches and data-parallel ranks) and the sum of
the micro-batch losses equals the one-big-batch loss, so gradient accumulation and DP do not
change the gradient (NeMo-RL's loss contract). Note that DDP averages gradients over ranks:
multiply by the world size there, or all-reduce with SUM.

`compute_policy_loss(name, *, logp, old_logp, advantages, mask, agg="token-mean", clip_low=0.2,
clip_high=0.2, num_valid=None, norm_length=None, off_policy_mask=None, sampling_logp=None,
is_weights=None, **options) -> (loss, metrics)` with registry `POLICY_LOSSES`: `ppo_clip`,
`dual_clip`, `gspo`, `cispo`, `sapo`. Two corrections apply to any of them, in this order, to the
per-token loss before aggregation: `off_policy_mask` (DeepSeek-V3.2's off-policy sequence mask)
and `is_weights` (rollout-vs-trainer importance weights from `rollout_correction`). `metrics` is
a dict of detached scalar tensors computed over this call's valid tokens:

- `clip_fraction`: fraction of valid tokens where the clipped branch is active (gradient zero;
  for `cispo`, where the stop-gradient weight is clamped; always 0 for `sapo`).
- `approx_kl`: mean of the k3 estimator `exp(d) - 1 - d`, `d = logp - old_logp`: an estimate of
  KL(old || new) from samples of the old policy (non-negative, low variance).
- `ratio_mean`, `ratio_min`, `ratio_max`: the importance ratio over valid tokens (sequence-level
  ratio for `gspo`); 1 on the first on-policy replay.
- `dual_clip` adds `clip_fraction_lower`: fraction of valid tokens where the `c * A` bound is hit.
- with `off_policy_mask`: `off_policy_masked`, the fraction of valid tokens whose sequence was
  dropped.
- with `is_weights`: `is_ratio_mean`, `is_ratio_min`, `is_ratio_max` (the weights over valid
  tokens) and `is_masked` (fraction of valid tokens whose weight is 0).

`rollout_correction(mode, *, old_logp, sampling_logp, mask, clip_min=None, clip_max=3.0) -> [B, T]`
with registry `ROLLOUT_CORRECTIONS`: `none`, `token_truncate`, `token_mask`, `sequence_truncate`,
`sequence_mask`: detached importance weights `pi_trainer / pi_engine` that correct for the
rollout engine (vLLM) sampling from a slightly different distribution than the trainer computes
(TRL's `vllm_importance_sampling_mode`, the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rl_core.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "TokenLoss",
    "aggregate",
    "compute_policy_loss",
    "rollout_correction",
]

Count = int | float | Tensor

AGGREGATIONS: Registry[Callable[..., Tensor]] = Registry("loss aggregation mode")
POLICY_LOSSES: Registry[Callable[..., TokenLoss]] = Registry("policy loss")
ROLLOUT_CORRECTIONS: Registry[Callable[..., Tensor]] = Registry("rollout correction")


# -------------------------------------------------------------------------------- aggregation


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_valid: Count | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Scalar loss from per-token `values` `[B, T]` and the response `mask` `[B, T]`."""
    reducer = AGGREGATIONS[mode]
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both be [B, T], got {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    if norm_length is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_length is only used by 'seq-mean-token-sum-norm', not {mode!r}")
    if isinstance(num_valid, int | float) and num_valid <= 0:
        raise ValueError(f"num_valid must be positive, got {num_valid}")
    if norm_length is not None and norm_length <= 0:
        raise ValueError(f"norm_length must be positive, got {norm_length}")
    maskf = mask.to(values.dtype)  # [B, T]
    token_sums = (values * maskf).sum(dim=-1)  # [B]
    return reducer(token_sums=token_sums, maskf=maskf, num_valid=num_valid, norm_length=norm_length)


def _sequences(maskf: Tensor, num_valid: Count | None) -> Count:
    if num_valid is not None:
        return num_valid
    return (maskf.sum(dim=-1) > 0).sum().clamp(min=1)


@AGGREGATIONS.register("token-mean")
def _token_mean(
    *, token_sums: Tensor, maskf: Tensor, num_valid: Count | None, **_: object
) -> Tensor:
    denom = maskf.sum().clamp(min=1) if num_valid is None else num_valid
    return token_sums.sum() / denom


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    *, token_sums: Tensor, maskf: Tensor, num_valid: Count | None, **_: object
) -> Tensor:
    return token_sums.sum() / _sequences(maskf, num_valid)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    *, token_sums: Tensor, maskf: Tensor, num_valid: Count | None, **_: object
) -> Tensor:
    seq_means = token_sums / maskf.sum(dim=-1).clamp(min=1)  # [B], 0 for an empty row
    return seq_means.sum() / _sequences(maskf, num_valid)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    *, token_sums: Tensor, maskf: Tensor, num_valid: Count | None, norm_length: float | None
) -> Tensor:
    norm = maskf.shape[-1] if norm_length is None else norm_length
    return (token_sums / norm).sum() / _sequences(maskf, num_valid)


# ------------------------------------------------------------------------------ policy losses


class TokenLoss(NamedTuple):
    """What a policy loss returns before aggregation; all `[B, T]`."""

    loss: Tensor  # per-token loss
    ratio: Tensor  # importance ratio used (token or sequence level)
    clipped: Tensor  # bool: the clipped branch is active
    extra: dict[str, Tensor]  # loss-specific [B, T] bool indicators, reported as fractions


def compute_policy_loss(
    name: str,
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_valid: Count | None = None,
    norm_length: float | None = None,
    off_policy_mask: float | None = None,
    sampling_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
    **options: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss of `name` aggregated with `agg`, and detached metrics.

    All tensors are `[B, T]`; `logp` carries the gradient, `old_logp`, `advantages`,
    `sampling_logp` and `is_weights` are treated as constants. The ratio is clipped to
    `[1 - clip_low, 1 + clip_high]`; set `clip_high` above `clip_low` for DAPO's clip-higher
    (0.2 / 0.28); `clip_low=1` removes the lower bound (CISPO).

    `off_policy_mask=delta` (> 0) is DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556,
    eq. 9; TRL's `off_policy_mask_threshold`): a sequence with a negative advantage whose mean
    over valid tokens of `sampling_logp - logp` (a KL estimate between the policy that sampled
    it and the one being trained) exceeds `delta` is left out of the loss; the divisor is
    unchanged. `sampling_logp` is the sampling engine's log-probs (None: `old_logp`, so only the
    drift of earlier updates counts). Choose it for heavily off-policy training (many updates per
    batch, asynchronous rollouts, an engine that differs from the trainer): negative samples the
    current policy would hardly produce give noisy, destabilising gradients. TRL's docs give 0.5
    as an example `delta`.

    `is_weights` `[B, T]` multiplies the per-token loss after the mask: the rollout-vs-trainer
    importance weights of `rollout_correction`.
    """
    loss_fn = POLICY_LOSSES[name]
    _check_inputs(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, sampling_logp=sampling_logp,
                  is_weights=is_weights)
    if not (0 <= clip_low <= 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    if off_policy_mask is not None and not off_policy_mask > 0:
        raise ValueError(f"off_policy_mask must be > 0 (the KL threshold delta; None turns it off), "
                         f"got {off_policy_mask}")
    if sampling_logp is not None and off_policy_mask is None:
        raise ValueError("sampling_logp is only used by off_policy_mask; pass off_policy_mask=delta or drop it")
    valid = mask.bool()  # [B, T]
    adv = advantages.detach().to(logp.dtype)  # [B, T]
    token = loss_fn(logp=logp, old_logp=old_logp.detach(), advantages=adv, valid=valid, clip_low=clip_low,
                    clip_high=clip_high, **options)
    per_token = token.loss  # [B, T]
    extra: dict[str, Tensor] = {}
    if off_policy_mask is not None:
        sampled = old_logp if sampling_logp is None else sampling_logp
        keep = _off_policy_keep(logp, sampled.detach(), adv, valid, off_policy_mask)  # [B, T] bool
        per_token = per_token * keep.to(per_token.dtype)  # [B, T]
        extra["off_policy_masked"] = (~keep & valid).sum() / valid.sum().clamp(min=1)
    if is_weights is not None:
        weights = is_weights.detach().to(per_token.dtype)  # [B, T]
        per_token = per_token * weights  # [B, T]
        extra.update(_weight_metrics(weights, valid))
    loss = aggregate(per_token, mask, agg, num_valid=num_valid, norm_length=norm_length)
    metrics = _metrics(token, logp.detach() - old_logp.detach(), valid)
    return loss, {**metrics, **{k: v.detach().to(torch.float32) for k, v in extra.items()}}


def _check_inputs(**tensors: Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"{', '.join(shapes)} must all be [B, T], got {shapes}")


def _off_policy_keep(logp: Tensor, sampling_logp: Tensor, advantages: Tensor, valid: Tensor, delta: float) -> Tensor:
    """`[B, T]` bool: False on every token of a sequence that DeepSeek-V3.2's mask drops."""
    validf = valid.to(logp.dtype)  # [B, T]
    # NaN: a token the engine could not score is no evidence either way (as TRL)
    gap = torch.nan_to_num(sampling_logp.to(logp.dtype) - logp.detach(), nan=0.0) * validf  # [B, T]
    seq_gap = gap.sum(-1, keepdim=True) / validf.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return (advantages >= 0) | (seq_gap <= delta)  # [B, T]


@torch.no_grad()
def _ratio_stats(ratio: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, min and max of `ratio` `[B, T]` over the valid tokens (1 when there are none)."""
    n = valid.sum().clamp(min=1)
    any_valid = valid.any()
    inf = torch.full_like(ratio, float("inf"))  # [B, T]
    return (
        torch.where(valid, ratio, 0.0).sum() / n,
        torch.where(any_valid, torch.where(valid, ratio, inf).min(), 1.0),
        torch.where(any_valid, torch.where(valid, ratio, -inf).max(), 1.0),
    )


@torch.no_grad()
def _weight_metrics(weights: Tensor, valid: Tensor) -> dict[str, Tensor]:
    mean, low, high = _ratio_stats(weights, valid)
    masked = ((weights == 0) & valid).sum() / valid.sum().clamp(min=1)
    return {"is_ratio_mean": mean, "is_ratio_min": low, "is_ratio_max": high, "is_masked": masked}


@torch.no_grad()
def _metrics(token: TokenLoss, log_ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    n = valid.sum().clamp(min=1)
    kl = torch.expm1(log_ratio) - log_ratio  # [B, T] k3 estimate of KL(old || new)
    mean, low, high = _ratio_stats(token.ratio.detach(), valid)
    metrics = {
        "clip_fraction": (token.clipped & valid).sum() / n,
        "approx_kl": torch.where(valid, kl, 0.0).sum() / n,
        "ratio_mean": mean,
        "ratio_min": low,
        "ratio_max": high,
    }
    for key, flags in token.extra.items():
        metrics[key] = (flags & valid).sum() / n
    return {k: v.detach().to(torch.float32) for k, v in metrics.items()}


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate `max(-A r, -A clip(r))` `[B, T]` and where the clip is active."""
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _token_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    # clamp as verl does, so one stale token cannot overflow exp()
    return torch.exp(torch.clamp(logp - old_logp, min=-20.0, max=20.0))  # [B, T]


@POLICY_LOSSES.register("ppo_clip")
def compute_ppo_clip(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    clip_low: float,
    clip_high: float,
) -> TokenLoss:
    """PPO's clipped surrogate (Schulman et al. 2017) with asymmetric bounds.

    `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025), which keeps low-probability
    tokens able to grow and delays entropy collapse. Flow-GRPO uses tiny symmetric clips (1e-4).
    """
    ratio = _token_ratio(logp, old_logp)  # [B, T]
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return TokenLoss(loss=loss, ratio=ratio, clipped=clipped, extra={})


@POLICY_LOSSES.register("dual_clip")
def compute_dual_clip(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    clip_low: float,
    clip_high: float,
    c: float = 3.0,
) -> TokenLoss:
    """Dual-clip PPO (Ye et al. 2020, "Mastering complex control in MOBA games"; verl's default).

    For negative advantages the loss is also bounded by `-c * A` (`c > 1`, default 3), so a token
    whose ratio exploded under a stale policy cannot dominate the batch. Positive advantages are
    treated as in `ppo_clip`.
    """
    if c <= 1.0:
        raise ValueError(f"dual_clip option c must be > 1, got {c}")
    ratio = _token_ratio(logp, old_logp)  # [B, T]
    loss1, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)  # [B, T]
    bound = -advantages * c  # [B, T]
    negative = advantages < 0  # [B, T]
    lower = negative & (loss1 > bound)  # [B, T] the c*A bound is active
    loss = torch.where(negative, torch.minimum(loss1, bound), loss1)  # [B, T]
    return TokenLoss(loss=loss, ratio=ratio, clipped=clipped, extra={"clip_fraction_lower": lower})


@POLICY_LOSSES.register("gspo")
def compute_gspo(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    clip_low: float,
    clip_high: float,
) -> TokenLoss:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form as in verl.

    The sequence ratio `s = exp(mean over valid tokens of (logp - old_logp))` is clipped once per
    sequence. Each token uses `s_t = sg[s] * pi_t / sg[pi_t]`: its value is `s` and its gradient
    is `s * grad log pi_t`, so with the paper's `agg="seq-mean-token-mean"` the gradient equals
    GSPO's. Use the paper's tiny clips (`clip_low=3e-4, clip_high=4e-4`); other `agg` modes
    re-weight sequences by length.
    """
    validf = valid.to(logp.dtype)  # [B, T]
    delta = (logp - old_logp).detach() * validf  # [B, T]
    seq_log_ratio = delta.sum(-1) / validf.sum(-1).clamp(min=1)  # [B]
    log_ratio = logp - logp.detach() + seq_log_ratio.unsqueeze(-1)  # [B, T]
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))  # [B, T]
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return TokenLoss(loss=loss, ratio=ratio, clipped=clipped, extra={})


@POLICY_LOSSES.register("cispo")
def compute_cispo(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    clip_low: float,
    clip_high: float,
) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585; the loss of ScaleRL, arXiv 2510.13786).

    REINFORCE with a clipped, stop-gradient importance weight: token loss `-w * A * logp` with
    `w = sg[clamp(r, 1 - clip_low, 1 + clip_high)]`, so its gradient is `-w * A` per token. Unlike
    PPO's clip, no token loses its gradient: a clipped token keeps the gradient at weight
    `1 + clip_high`, which keeps the rare "fork" tokens (low probability, large ratio) learning.
    Choose it for long reasoning rollouts reused over several updates. MiniMax-M1 sets no lower
    bound: pass `clip_low=1`. TRL's `loss_type="cispo", epsilon_high=E` equals this with
    `clip_high=E - 1, clip_low=1`; recommended `clip_high=4.0` (ScaleRL's epsilon_max = 5).
    The loss value is not a surrogate near 0 (it holds `logp`): compare gradients, not losses.
    """
    ratio = _token_ratio(logp.detach(), old_logp)  # [B, T]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T] constant
    loss = -weight * advantages * logp  # [B, T]
    clipped = (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)  # [B, T]
    return TokenLoss(loss=loss, ratio=ratio, clipped=clipped, extra={})


@POLICY_LOSSES.register("sapo")
def compute_sapo(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    clip_low: float,
    clip_high: float,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> TokenLoss:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347; Qwen3-VL).

    A smooth gate in place of the hard clip: token loss `-(4 / tau) * sigmoid(tau * (r - 1)) * A`,
    `tau = tau_pos` where `A > 0`, else `tau_neg`. At `r = 1` the gradient is `-A` (as PPO's); it
    fades smoothly as `r` leaves 1, so off-policy tokens are damped rather than cut. `tau_neg >
    tau_pos` (1.05 / 1.0, the paper's) damps negative tokens faster, since pushing probability
    down spreads it over the whole vocabulary. Choose it where hard clipping zeroes too many
    gradients (MoE models, large ratios). `clip_low` / `clip_high` are ignored; `clip_fraction`
    is 0. Equals TRL's `loss_type="sapo"` (`sapo_temperature_pos` / `_neg`) with
    `agg="seq-mean-token-mean"`.
    """
    for key, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not tau > 0:
            raise ValueError(f"sapo option {key} must be > 0, got {tau}")
    ratio = _token_ratio(logp, old_logp)  # [B, T]
    temp = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))  # [B, T]
    loss = -(4.0 / temp) * torch.sigmoid(temp * (ratio - 1.0)) * advantages  # [B, T]
    return TokenLoss(loss=loss, ratio=ratio, clipped=torch.zeros_like(valid), extra={})


# ------------------------------------------------------------------------- rollout correction


def rollout_correction(
    mode: str,
    *,
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """Detached importance weights `[B, T]` that correct for the rollout engine's sampling policy.

    vLLM (or any fast engine) samples from a distribution slightly off the trainer's (kernels,
    precision, MoE routing), so the rollouts are off-policy even on the first replay. The ratio
    `pi_trainer / pi_engine = exp(old_logp - sampling_logp)` re-weights them: truncated IS (TIS,
    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training")
    caps it, masked IS (MIS, Liu et al. 2025, "When speed kills stability") zeroes the units
    outside the bounds. Pass the result as `compute_policy_loss(..., is_weights=)`. Exactly TRL
    1.16's `importance_sampling_ratio` (`vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`):

    - `none`: all ones (no correction).
    - `token_truncate`: per-token ratio clamped to `[clip_min, clip_max]` (TIS).
    - `token_mask`: per-token ratio, 0 outside `[clip_min, clip_max]`. With both bounds, e.g.
      `clip_min=0.5, clip_max=2.0`, it is IcePop's two-sided token masking (Ling team, Ring-1T,
      arXiv 2510.18855: tokens whose trainer/engine ratio leaves `[alpha, beta]` do not train).
    - `sequence_truncate`: one ratio per row, `exp(sum of the token log differences)`, clamped;
      broadcast over the row.
    - `sequence_mask`: that row ratio, the whole row 0 outside the bounds (TRL's default; the
      sequence ratio is the unbiased one for a sequence reward, but it grows with length).

    The log difference is taken on `mask`ed tokens; a NaN (a token the engine did not score)
    counts as 0, i.e. ratio 1 (as TRL). `clip_min=None` means no lower bound, `clip_max=None`
    no upper bound. Choose a token mode for long responses (a sequence ratio over thousands of
    tokens is almost always out of bounds), a `*_mask` mode when mismatched tokens should not
    train at all, and `none` when engine and trainer agree (the first-replay check passes).
    """
    correct = ROLLOUT_CORRECTIONS[mode]
    _check_inputs(old_logp=old_logp, sampling_logp=sampling_logp, mask=mask)
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"rollout_correction needs clip_min <= clip_max, got clip_min={clip_min}, clip_max={clip_max}")
    with torch.no_grad():
        diff = (old_logp.detach() - sampling_logp.detach()) * mask  # [B, T]
        diff = torch.nan_to_num(diff, nan=0.0)  # [B, T]
        return correct(diff=diff, clip_min=clip_min, clip_max=clip_max).expand_as(diff).clone()


def _truncate(ratio: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    if clip_min is None and clip_max is None:
        return ratio
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def _mask_out(ratio: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@ROLLOUT_CORRECTIONS.register("none")
def _no_correction(*, diff: Tensor, **_: object) -> Tensor:
    return torch.ones_like(diff)  # [B, T]


@ROLLOUT_CORRECTIONS.register("token_truncate")
def _token_truncate(*, diff: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    return _truncate(torch.exp(diff), clip_min, clip_max)  # [B, T]


@ROLLOUT_CORRECTIONS.register("token_mask")
def _token_mask(*, diff: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    return _mask_out(torch.exp(diff), clip_min, clip_max)  # [B, T]


@ROLLOUT_CORRECTIONS.register("sequence_truncate")
def _sequence_truncate(*, diff: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    return _truncate(torch.exp(diff.sum(-1, keepdim=True)), clip_min, clip_max)  # [B, 1]


@ROLLOUT_CORRECTIONS.register("sequence_mask")
def _sequence_mask(*, diff: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    return _mask_out(torch.exp(diff.sum(-1, keepdim=True)), clip_min, clip_max)  # [B, 1]
