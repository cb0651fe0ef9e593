"""Rollout on Ray actors (`rollout.workers=2`, a real local Ray cluster on 2 CPUs): the run trains
end to end, the workers' LoRA follows the trainer's by version, the first replay of every
epoch reproduces the workers' log-probs (ratio 1), and the run equals the in-process one."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from rl_core.train import load_config


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_workers_train_like_the_in_process_engine(app, ray_cluster, tmp_path: Path) -> None:
    runs = {}
    for workers in (2, 0):
        overrides = tiny_overrides(tmp_path / str(workers), "train.epochs=2", "train.save_freq=1",
                                   f"rollout.workers={workers}", "rollout.placement=colocated")
        runs[workers] = app.train(load_config(app.Config, app.DEFAULT_CONFIG, overrides))
    ray_rows, local_rows = _rows(runs[2]), _rows(runs[0])
    # 2 optimizer steps per epoch; epoch 2 samples with the weights after them (version 2)
    assert [r["optimizer_steps"] for r in ray_rows] == ["2", "4"]
    assert [r["rollout/weight_version"] for r in ray_rows] == ["0", "2"]
    for row in ray_rows:  # the trainer replays the workers' trajectories: ratio exactly 1
        assert float(row["diag/first_replay_max_abs_log_ratio"]) == 0.0
    for key in ("reward/mean", "image/brightness", "loss", "grad_norm"):  # same seeds, same trajectories
        assert [r[key] for r in ray_rows] == [r[key] for r in local_rows], key
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        a = torch.load(runs[2] / "checkpoints" / ckpt / "lora.pt", weights_only=True)
        b = torch.load(runs[0] / "checkpoints" / ckpt / "lora.pt", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), ckpt
