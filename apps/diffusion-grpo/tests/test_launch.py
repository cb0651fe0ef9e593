"""diffusion-grpo's update invariants, pinned for one full epoch: 2 processes x 1 prompt group = 1
process x 2 groups (under `accelerate launch --multi_gpu --num_processes 2` on CPU: two gloo
processes, `--cpu` alone would start one), and gradient accumulation over micro-batches = one
micro-batch. A sample's noise depends on its place in the epoch, not on the process count, so
the runs draw the same images."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import APP, tiny_overrides

from rl_core.train import load_config

REPO = APP.parents[1]
DEAD = "transformer_blocks.1.attn.add_q_proj.lora_B"  # reaches no output (see test_recipe.py)
# one process, 2 groups x 4 images, one optimizer step (pinned on the 2-core CPU)
PINNED = {"reward/mean": 0.5058244, "grad_norm": 0.0053476}


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def lora(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "checkpoint-1" / "lora.pt", weights_only=True)


def one_epoch(out: Path, *extra: str) -> list[str]:
    return tiny_overrides(out, "train.epochs=1", "train.save_freq=1", "train.kl_beta=0.04", *extra)


def test_two_processes_equal_one_process_with_twice_the_batch(app, tmp_path: Path) -> None:
    single = app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path / "one", "train.gradient_accumulation_steps=2")))  # both groups in one optimizer step
    launcher = Path(sys.executable).with_name("accelerate")
    result = subprocess.run(
        [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(APP / "__main__.py"), *one_epoch(tmp_path / "two")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(APP), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    two = (tmp_path / "two" / "latest").resolve()
    [a], [b] = rows(single), rows(two)
    assert (a["world_size"], b["world_size"]) == ("1", "2")
    assert a["optimizer_steps"] == b["optimizer_steps"] == "1"
    assert float(a["reward/mean"]) == pytest.approx(PINNED["reward/mean"], abs=2e-6)
    assert float(a["grad_norm"]) == pytest.approx(PINNED["grad_norm"], rel=1e-3)
    for key in ("reward/mean", "reward/std", "adv/std", "loss/total", "loss/kl", "grad_norm"):
        assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4, abs=1e-6), (key, a[key], b[key])
    assert float(b["diag/first_replay_max_abs_log_ratio"]) == 0.0  # replay bit-exact on each rank
    wa, wb = lora(single), lora(two)
    assert [DEAD in k for k in wa if torch.equal(wa[k], torch.zeros_like(wa[k]))].count(False) < len(wa)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=0, msg=k)


def test_gradient_accumulation_equals_one_micro_batch(app, tmp_path: Path) -> None:
    big = app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path / "big", "rollout.sample_batch_size=8", "train.micro_batch_size=8", "train.gradient_accumulation_steps=1")))
    small = app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path / "small", "rollout.sample_batch_size=8", "train.micro_batch_size=2", "train.gradient_accumulation_steps=4")))
    [a], [b] = rows(big), rows(small)
    assert a["optimizer_steps"] == b["optimizer_steps"] == "1"
    assert float(b["loss/total"]) == pytest.approx(float(a["loss/total"]), abs=1e-6)
    wa, wb = lora(big), lora(small)
    for k in wa:  # replays of 2 rows vs 8 rows round differently on the CPU: float tolerance
        torch.testing.assert_close(wb[k], wa[k], atol=2e-6, rtol=0, msg=k)
