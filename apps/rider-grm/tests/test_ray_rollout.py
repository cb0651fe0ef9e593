"""rollout.workers: the policy's engine in a Ray actor (a real local Ray instance, hf engine on
CPU), synchronous and asynchronous, against the same run with the engine in the trainer's
process: the same samples, rewards and updates, step by step."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import app, read_metrics, tiny_overrides

from rl_core.train.testing import launch

SAMPLED = ("reward/mean", "reward/std", "response/length_mean", "rollout/weight_version")  # equal exactly
TRAINED = ("loss/policy", "grad_norm")  # equal to float32 rounding: the actor's engine scores its own
# copy of the weights, so its log-probs (the IS correction at staleness 1) differ in the last bits


@pytest.mark.parametrize("staleness", [pytest.param(0, marks=pytest.mark.slow), 1])  # 1 covers 0's first step;
# the synchronous path of the actors is also rl-policy's test_policy_pool
def test_ray_actor_rollouts_train_as_the_in_process_engine(tmp_path: Path, staleness: int) -> None:
    """Per-prompt seeds; staleness 1 samples from the weights one step older, in both runs."""
    extra: dict[str, object] = {"rollout.per_prompt_seeds": "true", "rollout.engine": '"hf"',
                                "train.max_staleness": staleness, "train.lr": "3e-2"}
    if staleness:
        extra["algo.rollout_correction"] = '"token_truncate"'
    here = [r for r in read_metrics(app.main(tiny_overrides(tmp_path / "here", **extra))) if r.get("step")]
    actors = [r for r in read_metrics(app.main(tiny_overrides(tmp_path / "actors", **extra, **{
        "rollout.workers": 1, "rollout.placement": '"split"'}))) if r.get("step")]
    assert len(here) == len(actors) == 3
    for mine, theirs in zip(here, actors, strict=True):
        assert {k: mine[k] for k in SAMPLED} == {k: theirs[k] for k in SAMPLED}, mine["step"]
        for key in TRAINED:
            assert float(theirs[key]) == pytest.approx(float(mine[key]), rel=1e-5, abs=1e-7), (key, mine, theirs)
    assert [float(r["rollout/weight_version"]) for r in actors] == ([0.0, 1.0, 2.0] if not staleness else [0.0, 0.0, 1.0])


@pytest.mark.slow  # the same placement as caption-rl's test of that name, which CI runs
def test_two_training_processes_each_drive_actors_of_their_own_on_a_cluster(tmp_path: Path) -> None:
    """`accelerate launch` with 2 processes on a running Ray cluster (started here, as `ray start
    --head` would be), one actor per process, 3 asynchronous steps = 1 process with twice the
    batch and the engine in process (step 3 samples from the weights pushed after step 1)."""
    import ray
    import torch
    from conftest import APP, REPO
    from test_invariants import one_step, rows, weights

    extra = {"train.max_staleness": 1, "train.max_steps": 3, "train.save_freq": 3, "rollout.engine": '"hf"',
             "algo.rollout_correction": '"token_truncate"'}
    single = app.main(one_step(tmp_path, "one", **extra))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        launch(APP / "__main__.py", one_step(tmp_path, "two", **extra, **{
            "rollout.workers": 1, "rollout.placement": '"split"', "rollout.ray_address": f'"{address}"'}), cwd=REPO)
    finally:
        ray.shutdown()
    one, two = rows(single), rows(tmp_path / "two")
    assert [r["world_size"] for r in two] == ["2"] * 3
    assert [r["rollout/weight_version"] for r in one] == [r["rollout/weight_version"] for r in two] == ["0.0", "0.0", "1.0"]
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "reward/std", "adv/std", "loss/policy", "grad_norm", "policy/entropy",
                    "replay/engine_diff_mean"):
            assert float(b[key]) == pytest.approx(float(a[key]), abs=2e-5), (key, a[key], b[key])
    wa, wb = weights(single, 3), weights(tmp_path / "two", 3)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=5e-6, rtol=0, msg=name)
