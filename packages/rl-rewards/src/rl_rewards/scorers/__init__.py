"""Scorer implementations. Rule scorers (`format`, `length` with the whitespace counter, `overlong`) import no
torch; model-backed ones import their extra's dependencies when their module is imported and
say which extra to install when they are missing. Build them by name with
`rl_rewards.registry.build_scorer`."""
