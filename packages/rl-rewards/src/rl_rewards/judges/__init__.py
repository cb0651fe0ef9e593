"""Example VeRL-with-RMs reward modules (`rm_preprocess` / `rm_postprocess`), loadable by the
`judge` scorer as `rl_rewards.judges.rubric` and `rl_rewards.judges.yes_no`."""
