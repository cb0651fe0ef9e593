"""The tiny run under `accelerate launch --multi_gpu --num_processes 2` on CPU: two gloo processes
(`--cpu` alone would start one), each sampling its share of the prompt groups, rewards gathered
for the advantages, gradients synchronized by DDP."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import APP, tiny_overrides

REPO = APP.parents[1]
DEAD = "transformer_blocks.1.attn.add_q_proj.lora_B"  # reaches no output (see test_recipe.py)


def test_two_processes_with_accelerate_launch(tmp_path: Path) -> None:
    launcher = Path(sys.executable).with_name("accelerate")
    result = subprocess.run(
        [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(APP / "__main__.py"),
         *tiny_overrides(tmp_path, "train.epochs=2", "train.save_freq=1")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(APP)}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run = (tmp_path / "latest").resolve()
    with (run / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    assert [r["world_size"] for r in rows] == ["2", "2"]  # two processes really ran
    assert all(float(r["diag/first_replay_max_abs_log_ratio"]) <= 1e-5 for r in rows)
    first, last = (torch.load(run / "checkpoints" / c / "lora.pt", weights_only=True) for c in ("checkpoint-1", "checkpoint-2"))
    unchanged = [name for name in last if torch.equal(first[name], last[name])]
    assert len(last) > 0 and [DEAD in name for name in unchanged] == [True], unchanged[:5]
