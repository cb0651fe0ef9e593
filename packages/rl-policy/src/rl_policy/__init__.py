"""The trained policy between a trainer and its rollout engines.

- `rl_policy.engine`: the policy's rollout engine in every placement and its weight versions
  (`build_policy_engine`, `PolicyEngine`, `rollout_device`).
- `rl_policy.training`: the token-level policy update (`token_update`, `Policy`, `Rollout`, ...).
- `rl_policy.flow_update`: a flow model's DiffusionNFT and Diffusion-DPO updates (`nft_update`, `dpo_update`).
- `rl_policy.placement`: the `rollout.workers` keys and the placement rules an app checks with
  its config, before torch is imported.
"""
