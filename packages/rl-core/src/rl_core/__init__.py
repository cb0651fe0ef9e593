"""rl-core: RL post-training algorithms as pure tensor functions.

Submodules: `advantages`, `kl`, `losses`, `logprobs`, `flow` (and `train`, the shared training
plumbing, behind the `train` extra). The main entry points are re-exported here.
"""

from rl_core.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae
from rl_core.flow import SDEStep, flow_kl, sde_step
from rl_core.kl import KL_ESTIMATORS, compute_kl
from rl_core.logprobs import entropy, token_logprobs, token_logprobs_from_hidden
from rl_core.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, compute_policy_loss
from rl_core.registry import Registry

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Registry",
    "SDEStep",
    "aggregate",
    "compute_advantages",
    "compute_gae",
    "compute_kl",
    "compute_policy_loss",
    "entropy",
    "flow_kl",
    "sde_step",
    "token_logprobs",
    "token_logprobs_from_hidden",
]
