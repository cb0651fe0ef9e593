"""rl-rollout."""

__version__ = "0.1.0"
