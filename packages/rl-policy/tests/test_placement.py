"""The placement rules an app checks with its config (`rl_policy.placement`), before torch."""

from __future__ import annotations

import pytest

from rl_core.train import ConfigError
from rl_policy.placement import RolloutWorkerFields, check_placement, check_ray


def test_split_placement_rules() -> None:
    """A rollout GPU of its own: asynchronous only; vLLM there serves one training process."""
    check_placement("colocated", "vllm", 0, world_size=4)  # no rule for the colocated placement
    check_placement("split", "vllm", 1)  # one process, its vLLM engine on GPU 1
    check_placement("split", "hf", 2, world_size=2)
    with pytest.raises(ConfigError, match=r"rollout.placement=split samples on its own GPU .* train.max_staleness >= 1"):
        check_placement("split", "hf", 0)
    with pytest.raises(ConfigError, match=r"rollout.placement=split with rollout.engine=vllm runs one training "
                                          r"process .* this launch has 2: launch one process, or use rollout.engine=hf"):
        check_placement("split", "vllm", 1, world_size=2)
    # as Ray actors (rollout.workers): synchronous too, split only; several processes on a running cluster
    check_placement("split", "vllm", 0, workers=2)
    check_placement("split", "hf", 1, workers=1)
    with pytest.raises(ConfigError, match=r"rollout.workers=1 samples in Ray actors on GPUs of their own: it needs "
                                          r"rollout.placement=split"):
        check_placement("colocated", "hf", 0, workers=1)
    with pytest.raises(ConfigError, match=r"rollout.workers=2 with 2 training processes needs a running Ray cluster, "
                                          r"where each process drives its own actors: `ray start --head` .*, then set "
                                          r"RAY_ADDRESS or rollout.ray_address; or launch one process"):
        check_placement("split", "hf", 1, world_size=2, workers=2)
    check_placement("split", "hf", 1, world_size=2, workers=2, ray_address="10.0.0.1:6379")


def test_ray_actors_need_ray_installed_and_a_cluster_address(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    check_ray(0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray" else object())
    with pytest.raises(ConfigError, match=r'rollout.workers=2 runs the rollout engine in Ray actors: pip install "rl-policy\[ray\]"'):
        check_ray(2)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert RolloutWorkerFields().cluster_address() == "10.0.0.1:6379"
    assert RolloutWorkerFields(ray_address="10.0.0.2:6379").cluster_address() == "10.0.0.2:6379"
