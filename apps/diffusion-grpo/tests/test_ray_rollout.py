"""Rollout on Ray actors (`rollout.workers=2`, a real local Ray cluster on 2 CPUs): the run trains
end to end, the workers' LoRA follows the trainer's by version, the first replay of every
epoch reproduces the workers' log-probs (ratio 1), and the run equals the in-process one (to
float32 rounding), for SD3 images and Wan videos; with an FSDP2-sharded trainer the workers get its
gathered LoRA."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import APP, in_process_group, tiny_overrides, train, world_rows

from rl_core.train import load_config


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def test_ray_workers_train_like_the_in_process_engine(app, ray_cluster, tmp_path: Path) -> None:
    runs = {}
    for workers in (2, 0):
        overrides = tiny_overrides(tmp_path / str(workers), "train.epochs=2", "train.save_freq=1",
                                   f"rollout.workers={workers}", "rollout.placement=colocated")
        runs[workers] = train(app, load_config(app.Config, app.DEFAULT_CONFIG, overrides))
    ray_rows, local_rows = _rows(runs[2]), _rows(runs[0])
    # 2 optimizer steps per epoch; epoch 2 samples with the weights after them (version 2)
    assert [float(r["optimizer_steps"]) for r in ray_rows] == [2, 2]
    assert [r["rollout/weight_version"] for r in ray_rows] == ["0.0", "2.0"]
    for row in ray_rows:  # the trainer replays the workers' trajectories: ratio exactly 1
        assert float(row["replay/engine_diff_max"]) == 0.0
    # Same seeds, same trajectories. Not bitwise: a worker denoises half the prompts, so its
    # forwards have other shapes than the in-process batch, and CPU kernels (AVX-512 ones, seen:
    # reward 0.5073372 vs 0.5073376) round per shape. Different trajectories would differ at 1e-2.
    # The loss is a near-cancelling sum of +-advantage terms (~1e-6 here): compared absolutely.
    for key, tolerance in (("reward/mean", {"rel": 1e-4}), ("image/brightness", {"rel": 1e-4}),
                           ("loss/total", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-3})):
        assert [float(r[key]) for r in ray_rows] == pytest.approx([float(r[key]) for r in local_rows], **tolerance), key
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        a = torch.load(runs[2] / "checkpoints" / ckpt / "lora.pt", weights_only=True)
        b = torch.load(runs[0] / "checkpoints" / ckpt / "lora.pt", weights_only=True)
        assert a.keys() == b.keys(), ckpt
        for k in a:  # seen up to 6.6e-6; one Adam step of a different trajectory moves an element ~lr = 3e-4
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=3e-5, msg=lambda m, ckpt=ckpt, k=k: f"{ckpt} {k}: {m}")


def test_ray_workers_sample_with_a_sharded_trainers_lora(app, ray_cluster, tmp_path: Path) -> None:
    """train.sharding=fsdp2 (one process): the workers are sent the LoRA gathered from the shards,
    so each epoch's first replay through the sharded model reproduces their log-probs exactly."""
    overrides = tiny_overrides(tmp_path, "train.epochs=2", "train.save_freq=1", "rollout.workers=2",
                               "rollout.placement=colocated", 'train.sharding="fsdp2"')
    rows = _rows(in_process_group(app, load_config(app.Config, app.DEFAULT_CONFIG, overrides)))
    assert [float(r["optimizer_steps"]) for r in rows] == [2, 2]
    assert [r["rollout/weight_version"] for r in rows] == ["0.0", "2.0"]
    assert all(float(r["replay/engine_diff_max"]) == 0.0 for r in rows)
    assert all(float(r["time/weight_gather"]) > 0 for r in rows)


# cosmos shares wan's worker engine and adds the trainer's encoded frames: slow, to keep CI in budget
@pytest.mark.parametrize("family", ["wan", "wan-full", pytest.param("cosmos", marks=pytest.mark.slow), "janus"])
def test_ray_workers_sample_each_family_like_the_in_process_engine(app, ray_cluster, tmp_path: Path, family) -> None:
    """model.family=wan (cosmos: each sample starting from its row's image, the trainer's encoded
    frames sent to the workers; janus: image tokens): each worker builds the family's engine with
    the trainer's LoRA layout and engine options, so the trainer's replay reproduces the workers'
    log-probs and the run equals the in-process one. wan-full: fully fine-tuned (model.lora_rank=0),
    the workers are pushed every weight."""
    family, full = family.removesuffix("-full"), family.endswith("-full")
    given = ["model.lora_rank=0"] if full else []
    given += [f"data.manifest={world_rows(tmp_path, ['image'] * 4)}"] if family == "cosmos" else []
    given += ["reward.components={brightness = 1.0}"] if family == "janus" else []
    runs = {}
    for workers in (2, 0):
        overrides = ["train.epochs=2", "train.eval_freq=0", "train.save_freq=100", f"train.output_dir={tmp_path / str(workers)}",
                     f"rollout.workers={workers}", "rollout.placement=colocated", *given]
        runs[workers] = train(app, load_config(app.Config, APP / "configs" / f"{family}_tiny.toml", overrides))
    ray_rows, local_rows = _rows(runs[2]), _rows(runs[0])
    assert [r["rollout/weight_version"] for r in ray_rows] == ["0.0", "2.0"]
    # a diffusion replay repeats the rollout's kernels (gap 0); janus rescores its decode: the in-process gap
    gaps = [float(r["replay/engine_diff_max"]) for r in ray_rows]
    assert gaps == ([0.0, 0.0] if family != "janus" else pytest.approx(
        [float(r["replay/engine_diff_max"]) for r in local_rows], abs=1e-6))
    for key, tolerance in (("reward/mean", {"rel": 1e-4}), ("loss/total", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-3})):
        assert [float(r[key]) for r in ray_rows] == pytest.approx([float(r[key]) for r in local_rows], **tolerance), key
