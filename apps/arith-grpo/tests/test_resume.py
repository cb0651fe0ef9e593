"""Resume is exactly-once: the resumed run logs the weight version its rollouts were sampled with
and trains the prompts of the uninterrupted run (`samples/prompts.jsonl`)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import app

from rl_core.train.testing import assert_resume_is_bit_identical, metric_rows

SMALL = ["rollout.n=4", "rollout.max_new_tokens=4", "train.batch_size=4", "train.micro_batch_size=3", "train.eval_freq=0"]


def prompts(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "samples" / "prompts.jsonl").read_text().splitlines()]


def test_a_resumed_run_logs_the_weight_version_and_prompts_of_the_uninterrupted_one(tmp_path: Path) -> None:
    """3 steps straight against 2, then `--resume` to 3: step 3 samples from the weights of 2
    optimizer steps. The weight version was the engine's count of its pushes, which restarted at
    0 on resume (fixed: it is checkpointed, `engine.pt`)."""
    assert_resume_is_bit_identical(app.main, SMALL, tmp_path, steps=3, keys=("rollout/weight_version", "loss/policy"))
    assert [r["rollout/weight_version"] for r in metric_rows(tmp_path / "cut")] == ["0.0", "1.0", "2.0"]
    assert prompts(tmp_path / "cut") == prompts(tmp_path / "straight")
    assert [len(row["prompts"]) for row in prompts(tmp_path / "straight")] == [4, 4, 4]
