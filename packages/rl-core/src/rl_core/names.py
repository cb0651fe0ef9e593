"""The names of rl-core's algorithm registries, readable without importing torch.

An app reads its command line and config before it imports torch, so `--help` and a config
error answer at once instead of after torch and transformers have imported.
The config types that name a registry entry (`rl_core.train.AdvantageName`, ...) therefore hold
a `RegistryRef` (the registry's module and attribute, its kind, and the names rl-core registers
there), not the registry, which lives in a torch module. A value is checked against the registry
itself when its module is already imported (a user's own registered loss is then known), else
against the built-in names here.

This table is a second list of the registries' names, which `rl_core.registry` promises cannot
drift: `tests/test_registry.py::test_builtin_names_match_the_registries` compares each entry
with its registry (names and kind), so a name registered or renamed in a torch module without
its entry here fails rl-core's tests.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

from rl_core.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "REGISTRIES",
           "REWARD_AGGREGATIONS", "ROLLOUT_CORRECTIONS", "RegistryRef"]


@dataclass(frozen=True)
class RegistryRef:
    """A registry named by its module and attribute, with the names rl-core registers in it: what
    a config type holds to check a value without importing the registry's module (and torch)."""

    module: str  # "rl_core.losses"
    attribute: str  # "POLICY_LOSSES"
    kind: str  # the registry's kind, for messages ("policy loss")
    builtin: tuple[str, ...]  # the names rl-core registers there, sorted

    def loaded(self) -> Registry[Any] | None:
        """The registry itself when its module is imported already, else None."""
        module = sys.modules.get(self.module)
        return None if module is None else getattr(module, self.attribute)

    def resolve(self) -> Registry[Any]:
        """The registry itself (imports its module, and torch with it)."""
        return getattr(importlib.import_module(self.module), self.attribute)

    def names(self) -> list[str]:
        """The valid names, sorted: the registry's own once its module is imported (names a user
        registered included), else the built-in ones."""
        registry = self.loaded()
        return registry.names() if registry is not None else list(self.builtin)

    def __contains__(self, name: object) -> bool:
        return name in self.names()


ADVANTAGE_ESTIMATORS = RegistryRef("rl_core.advantages", "ADVANTAGE_ESTIMATORS", "advantage estimator",
                                   ("dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"))
REWARD_AGGREGATIONS = RegistryRef("rl_core.advantages", "REWARD_AGGREGATIONS", "reward aggregation",
                                  ("normalize_then_sum", "sum_then_normalize"))
KL_ESTIMATORS = RegistryRef("rl_core.kl", "KL_ESTIMATORS", "KL estimator", ("k1", "k2", "k3", "low_var_kl"))
AGGREGATIONS = RegistryRef("rl_core.losses", "AGGREGATIONS", "loss aggregation mode",
                           ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"))
POLICY_LOSSES = RegistryRef("rl_core.losses", "POLICY_LOSSES", "policy loss",
                            ("cispo", "dual_clip", "gspo", "ppo_clip", "sapo"))
ROLLOUT_CORRECTIONS = RegistryRef("rl_core.losses", "ROLLOUT_CORRECTIONS", "rollout correction",
                                  ("none", "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"))

# every entry above, for the test that keeps them equal to their registries
REGISTRIES = (ADVANTAGE_ESTIMATORS, REWARD_AGGREGATIONS, KL_ESTIMATORS, AGGREGATIONS, POLICY_LOSSES,
              ROLLOUT_CORRECTIONS)
