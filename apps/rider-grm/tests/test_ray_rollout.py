"""rollout.workers: the policy's engine in a Ray actor (a real local Ray instance, hf engine on
CPU), synchronous and asynchronous, against the same run with the engine in the trainer's
process: the same samples, rewards and updates, step by step."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import app, read_metrics, tiny_overrides

COMPARED = ("reward/mean", "reward/std", "loss/policy", "grad_norm", "response/length_mean", "rollout/weight_version")


@pytest.mark.parametrize("staleness", [0, 1])
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
        assert {k: mine[k] for k in COMPARED} == {k: theirs[k] for k in COMPARED}, mine["step"]
    assert [float(r["rollout/weight_version"]) for r in actors] == ([0.0, 1.0, 2.0] if not staleness else [0.0, 0.0, 1.0])
