"""rl-rewards."""

__version__ = "0.1.0"
