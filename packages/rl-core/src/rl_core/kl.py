"""Per-token KL estimators between the policy and a reference: `compute_kl(name, logp, ref_logp)`.

With `delta = logp - ref_logp` on tokens sampled from the policy (Schulman, "Approximating KL
divergence", 2020; names as in verl):

- `k1` (verl `kl`): `delta`. Unbiased for KL(policy || ref) but high variance and can be negative.
- `k2` (verl `mse`): `delta**2 / 2`. Biased, low variance; its gradient is the true KL gradient
  for on-policy samples.
- `k3` = `low_var_kl`: `exp(-delta) + delta - 1`, always >= 0, unbiased, low variance. As in
  verl, `delta` is clamped to [-20, 20] before the exponential and the result to [-10, 10], so a
  single outlier token cannot produce inf/NaN gradients. The default for GRPO/REINFORCE++ KL
  losses (VeRL-with-RMs uses it with coefficient 1e-4).

Inputs are any matching shape (usually `[B, T]`); the output has that shape, in the promoted
float dtype of the inputs. Mask and aggregate it with `rl_core.losses.aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rl_core.registry import Registry

__all__ = ["KL_ESTIMATORS", "compute_kl"]

KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")


def compute_kl(name: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Elementwise KL estimate of the estimator `name` (`k1`, `k2`, `k3`/`low_var_kl`)."""
    estimator = KL_ESTIMATORS[name]
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape, got {tuple(logp.shape)} "
            f"and {tuple(ref_logp.shape)}"
        )
    return estimator(logp, ref_logp)


@KL_ESTIMATORS.register("k1")
def compute_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """`logp - ref_logp`."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def compute_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """`(logp - ref_logp)**2 / 2`."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def compute_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """`exp(-d) + d - 1` with `d = logp - ref_logp` clamped to [-20, 20], result clamped to [-10, 10]."""
    neg_delta = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(neg_delta) - neg_delta - 1.0, min=-10.0, max=10.0)
