"""rl-core: RL post-training algorithms as pure tensor functions.

Submodules: `advantages`, `kl`, `losses`, `logprobs`, `flow` (and `train`, the shared training
plumbing, behind the `train` extra). The main entry points are re-exported here, imported on
first use (PEP 562): `import rl_core.registry` or `rl_core.names` does not import torch, so an
app reads its command line before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae
    from rl_core.flow import SDEStep, flow_kl, sde_step
    from rl_core.kl import KL_ESTIMATORS, compute_kl
    from rl_core.logprobs import entropy, token_logprobs, token_logprobs_from_hidden
    from rl_core.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, compute_policy_loss
    from rl_core.registry import Registry

__version__ = "0.1.0"

# module -> the names it gives this package (the imports above, for type checkers, say the same;
# tests/test_registry.py checks that they agree)
_EXPORTS = {
    "advantages": ["ADVANTAGE_ESTIMATORS", "compute_advantages", "compute_gae"],
    "flow": ["SDEStep", "flow_kl", "sde_step"],
    "kl": ["KL_ESTIMATORS", "compute_kl"],
    "logprobs": ["entropy", "token_logprobs", "token_logprobs_from_hidden"],
    "losses": ["AGGREGATIONS", "POLICY_LOSSES", "aggregate", "compute_policy_loss"],
    "registry": ["Registry"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_core.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
