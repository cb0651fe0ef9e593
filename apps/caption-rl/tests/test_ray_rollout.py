"""rollout.workers: the policy's engine in Ray actors (a real local Ray instance, hf engines on
CPU), synchronous and asynchronous, against the same run with the engine in the trainer's
process: the same samples and the same training, step by step."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import tiny_overrides

SAMPLED = ("reward/mean", "response/length_mean", "rollout/weight_version")  # equal exactly
TRAINED = ("loss/policy", "policy/approx_kl")  # equal to float32 rounding: the actor's engine scores
# its own copy of the weights, so its log-probs (the IS correction at staleness 1) differ in the
# last bits from the in-process engine's


def rows(run) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("step")]


@pytest.mark.parametrize("staleness", [pytest.param(0, marks=pytest.mark.slow), 1])  # 1 covers 0's first step;
# the synchronous path of the actors is also rl-policy's test_policy_pool
def test_ray_actor_rollouts_train_as_the_in_process_engine(app, tmp_path, staleness):
    """Full fine-tuning (the actors get the weights merged; a LoRA's unmerged decode would differ
    in the last bits), per-prompt seeds: each step's samples, rewards, loss and weight version
    equal the in-process run's (staleness 1: from the weights one step older, in both)."""
    common = ["model.lora_rank=0", "train.lr=1e-2", "train.max_steps=3", "data.eval_size=0", "rollout.engine=hf",
              "rollout.per_prompt_seeds=true", f"train.max_staleness={staleness}"]
    if staleness:
        common.append("algo.rollout_correction=token_truncate")
    here = rows(app.main(tiny_overrides(tmp_path / "here", *common)))
    actors = rows(app.main(tiny_overrides(tmp_path / "actors", *common, "rollout.workers=1", "rollout.placement=split")))
    assert len(here) == len(actors) == 3
    for mine, theirs in zip(here, actors, strict=True):
        assert {k: mine[k] for k in SAMPLED} == {k: theirs[k] for k in SAMPLED}, (mine, theirs)
        for key in TRAINED:
            assert float(theirs[key]) == pytest.approx(float(mine[key]), rel=1e-5, abs=1e-7), (key, mine, theirs)
    assert [float(r["rollout/weight_version"]) for r in actors] == ([0.0, 1.0, 2.0] if not staleness else [0.0, 0.0, 1.0])


def test_ray_actors_need_split_placement_and_ray(app, tmp_path, monkeypatch):
    import sys

    from rl_core.errors import UserError

    with pytest.raises(UserError, match=r"rollout.workers=1 samples in Ray actors on GPUs of their own: it needs "
                                        r"rollout.placement=split"):
        app.main(tiny_overrides(tmp_path, "rollout.workers=1"))
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(UserError, match=r'rollout.workers=2 runs the rollout engine in Ray actors: .*pip install "rl-policy\[ray\]"'):
        app.main(tiny_overrides(tmp_path, "rollout.workers=2", "rollout.placement=split"))
    assert not list(tmp_path.iterdir())  # refused before any model loads


def test_two_training_processes_each_drive_actors_of_their_own_on_a_cluster(app, tmp_path):
    """`accelerate launch` with 2 processes on a running Ray cluster (started here, as `ray start
    --head` would be), each process with one actor of its own, over 2 asynchronous steps = 1
    process with twice the batch and the engine in process: the same rollouts, rewards, loss and
    final weights (step 3 samples from the weights each process pushed to its actor after step 1)."""
    import ray
    from test_main import image_rows, launch_two, one_step, weights
    from test_main import rows as all_rows

    data = image_rows(tmp_path)
    extra = ["model.lora_rank=0", "rollout.engine=hf", "train.max_steps=3", "train.max_staleness=1",
             "algo.rollout_correction=token_truncate"]
    single = app.main([*one_step(tmp_path, data, "one"), *extra])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        launch_two(tmp_path, *one_step(tmp_path, data, "two"), *extra, "rollout.workers=1", "rollout.placement=split",
                   f"rollout.ray_address={address}")
    finally:
        ray.shutdown()
    one, two = all_rows(single), all_rows(tmp_path / "two")
    assert [r["world_size"] for r in two] == ["2"] * 3
    assert [r["rollout/weight_version"] for r in one] == [r["rollout/weight_version"] for r in two] == ["0.0", "0.0", "1.0"]
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "adv/std", "loss/policy", "grad_norm", "policy/entropy", "response/length_mean",
                    "replay/engine_diff_mean"):
            assert float(b[key]) == pytest.approx(float(a[key]), abs=2e-5), (key, a[key], b[key])
    wa, wb = weights(single / "export"), weights(tmp_path / "two" / "export")
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=5e-6, rtol=0, msg=name)


def test_ray_actors_merging_the_pushed_adapter_sample_as_with_merged_pushes(app, tmp_path):
    """rollout.weight_push=adapter with Ray actors, asynchronous: each version carries the LoRA
    alone and the actor merges it over the checkpoint's weights; the run equals the one whose
    versions carry the merged weights, step by step (the merge is the trainer's, bit for bit)."""
    common = ["model.lora_rank=8", "train.lr=1e-2", "train.max_steps=3", "data.eval_size=0", "rollout.engine=hf",
              "rollout.per_prompt_seeds=true", "train.max_staleness=1", "algo.rollout_correction=token_truncate", "rollout.workers=1",
              "rollout.placement=split"]
    merged = rows(app.main(tiny_overrides(tmp_path / "merged", *common)))
    adapter = rows(app.main(tiny_overrides(tmp_path / "adapter", *common, "rollout.weight_push=adapter")))
    assert [r["rollout/weight_version"] for r in adapter] == ["0.0", "0.0", "1.0"]
    for mine, theirs in zip(merged, adapter, strict=True):
        assert {k: mine[k] for k in (*SAMPLED, *TRAINED)} == {k: theirs[k] for k in (*SAMPLED, *TRAINED)}, (mine, theirs)
