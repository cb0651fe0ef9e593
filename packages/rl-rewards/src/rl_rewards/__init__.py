"""rl-rewards: reward scorers, their composition, and adapters for TRL, verl and OpenRLHF.

Importing this package imports no torch; model-backed scorers load their extras when built.
"""

from rl_rewards.adapters import as_openrlhf_reward_func, as_trl_reward, as_verl_compute_score
from rl_rewards.composition import Reward, build_reward
from rl_rewards.registry import SCORERS, build_scorer, register_scorer
from rl_rewards.samples import AsyncScorer, Sample, Scorer, ScoreResult
from rl_rewards.spec import Component, Gate, RewardSpec, load_spec

__version__ = "0.1.0"

__all__ = [
    "SCORERS",
    "AsyncScorer",
    "Component",
    "Gate",
    "Reward",
    "RewardSpec",
    "Sample",
    "ScoreResult",
    "Scorer",
    "as_openrlhf_reward_func",
    "as_trl_reward",
    "as_verl_compute_score",
    "build_reward",
    "build_scorer",
    "load_spec",
    "register_scorer",
]
