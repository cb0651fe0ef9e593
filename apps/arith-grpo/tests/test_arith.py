"""arith-grpo: the loop's invariants through the shared checks (rl_core.train.testing), pinned
numbers, learning, and the one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import APP, REPO, app

from rl_core.train import unknown_metric_names
from rl_core.train.testing import (
    assert_resume_is_bit_identical,
    assert_two_processes_equal_one,
    metric_rows,
)

SMALL = ["policy.n=4", "policy.max_new_tokens=4", "train.batch_size=4", "train.micro_batch_size=3", "train.max_steps=2"]
KEYS = ("reward/mean", "reward/std", "adv/std", "loss/policy", "grad_norm", "policy/entropy", "response/length_mean")


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path: Path) -> None:
    """One full RL step. Adam's first step moves a weight by about lr x sign(g), so where |g| is
    near Adam's eps, float noise between the two gradient reductions moves it by up to 2 x lr
    (seen: 1 element of 32 by 5.1e-6 at lr 1e-5); a wrong update moves every element by ~lr."""
    assert_two_processes_equal_one(app.main, APP / "__main__.py", [*SMALL, "train.max_steps=1"], tmp_path, keys=KEYS,
                                   atol=2e-5, cwd=REPO)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    assert_resume_is_bit_identical(app.main, SMALL, tmp_path, steps=3, keys=KEYS)


# one process, SMALL, seed 0 (pinned on the 2-core CPU)
PINNED = {"reward/mean": 0.0125, "grad_norm": 0.662628, "policy/entropy": 6.454642}


def test_one_run_logs_the_table_names_and_pinned_numbers(tmp_path: Path) -> None:
    run = app.main([*SMALL, f"train.output_dir={tmp_path}"])
    table = metric_rows(run)
    assert not unknown_metric_names(table[0])
    for key, value in PINNED.items():
        assert float(table[0][key]) == pytest.approx(value, abs=1e-4), (key, table[0][key])
    assert float(table[0]["reward/answer.has_number"]) >= 0 and float(table[0]["replay/engine_diff_mean"]) < 1e-4


def test_the_embedded_default_learns_to_answer_with_a_number(tmp_path: Path) -> None:
    """The default (12 steps, lr 3e-2): the answers turn into numbers (the 0.1 format bonus), as a
    random tiny policy can learn; exact sums are beyond it."""
    rewards = [float(r["reward/mean"]) for r in metric_rows(app.main([f"train.output_dir={tmp_path}"]))]
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 > 0.04, rewards


def test_a_registry_typo_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(APP / "__main__.py"), "algo.loss=ppo", f"train.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "arith-grpo: error: algo.loss: unknown policy loss 'ppo'; valid names: dual_clip, gspo, ppo_clip "
        "(from override algo.loss=ppo)"]
    assert not list(tmp_path.iterdir())
