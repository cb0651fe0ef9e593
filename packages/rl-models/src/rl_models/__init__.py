"""rl-models."""

__version__ = "0.1.0"
