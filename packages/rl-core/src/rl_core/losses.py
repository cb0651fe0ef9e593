"""Loss aggregation and clipped policy-gradient losses.

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
clip_high=0.2, num_valid=None, norm_length=None, **options) -> (loss, metrics)` with registry
`POLICY_LOSSES`: `ppo_clip`, `dual_clip`, `gspo`. `metrics` is a dict of detached scalar tensors
computed over this call's valid tokens:

- `clip_fraction`: fraction of valid tokens where the clipped branch is active (gradient zero).
- `approx_kl`: mean of the k3 estimator `exp(d) - 1 - d`, `d = logp - old_logp`: an estimate of
  KL(old || new) from samples of the old policy (non-negative, low variance).
- `ratio_mean`, `ratio_min`, `ratio_max`: the importance ratio over valid tokens (sequence-level
  ratio for `gspo`); 1 on the first on-policy replay.
- `dual_clip` adds `clip_fraction_lower`: fraction of valid tokens where the `c * A` bound is hit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rl_core.registry import Registry

__all__ = ["AGGREGATIONS", "POLICY_LOSSES", "TokenLoss", "aggregate", "compute_policy_loss"]

Count = int | float | Tensor

AGGREGATIONS: Registry[Callable[..., Tensor]] = Registry("loss aggregation mode")
POLICY_LOSSES: Registry[Callable[..., TokenLoss]] = Registry("policy loss")


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
    **options: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss of `name` aggregated with `agg`, and detached metrics.

    All tensors are `[B, T]`; `logp` carries the gradient, `old_logp` and `advantages` are
    treated as constants. The ratio is clipped to `[1 - clip_low, 1 + clip_high]`; set
    `clip_high` above `clip_low` for DAPO's clip-higher (0.2 / 0.28).
    """
    loss_fn = POLICY_LOSSES[name]
    shapes = {
        k: tuple(v.shape)
        for k, v in {
            "logp": logp,
            "old_logp": old_logp,
            "advantages": advantages,
            "mask": mask,
        }.items()
    }
    if len(set(shapes.values())) != 1 or logp.dim() != 2:
        raise ValueError(f"logp, old_logp, advantages and mask must all be [B, T], got {shapes}")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    valid = mask.bool()  # [B, T]
    token = loss_fn(
        logp=logp,
        old_logp=old_logp.detach(),
        advantages=advantages.detach().to(logp.dtype),
        valid=valid,
        clip_low=clip_low,
        clip_high=clip_high,
        **options,
    )
    loss = aggregate(token.loss, mask, agg, num_valid=num_valid, norm_length=norm_length)
    return loss, _metrics(token, logp.detach() - old_logp.detach(), valid)


@torch.no_grad()
def _metrics(token: TokenLoss, log_ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    n = valid.sum().clamp(min=1)
    ratio = token.ratio.detach()  # [B, T]
    kl = torch.expm1(log_ratio) - log_ratio  # [B, T] k3 estimate of KL(old || new)
    any_valid = valid.any()
    inf = torch.full_like(ratio, float("inf"))
    metrics = {
        "clip_fraction": (token.clipped & valid).sum() / n,
        "approx_kl": torch.where(valid, kl, 0.0).sum() / n,
        "ratio_mean": torch.where(valid, ratio, 0.0).sum() / n,
        "ratio_min": torch.where(any_valid, torch.where(valid, ratio, inf).min(), 1.0),
        "ratio_max": torch.where(any_valid, torch.where(valid, ratio, -inf).max(), 1.0),
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
