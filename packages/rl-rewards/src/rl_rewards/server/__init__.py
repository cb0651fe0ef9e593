"""The reward server: `rl-rewards serve` (see `command`), the ASGI app (`app`), batching,
worker pools (processes or Ray actors), settings and metrics."""
