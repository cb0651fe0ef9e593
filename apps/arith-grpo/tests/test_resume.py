"""Resume is exactly-once: the resumed run logs the weight version its rollouts were sampled with
and trains the prompts of the uninterrupted run (`samples/prompts.jsonl`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import APP, REPO, app

from rl_core.train.testing import assert_resume_is_bit_identical, launch, metric_rows

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


PARTIAL = [*SMALL, "rollout.max_new_tokens=6", "train.partial_rollouts.steps=1", "train.partial_rollouts.chunk_tokens=2",
           "algo.rollout_correction=token_truncate"]
KEYS = ("loss/policy", "grad_norm", "rollout/weight_version", "rollout/staleness", "rollout/token_staleness_max",
        "rollout/token_staleness_mean", "response/length_mean")


def check_token_staleness(run: Path, staleness: int) -> None:
    table = metric_rows(run)
    oldest = [float(r["rollout/token_staleness_max"]) for r in table]
    assert oldest[0] == 0.0 and max(oldest) >= 1.0 + staleness  # tokens sampled by older weights were trained
    assert all(m <= 1.0 + staleness for m in oldest)  # at most K + max_staleness optimizer steps old
    assert all(float(r["rollout/token_staleness_mean"]) <= o for r, o in zip(table, oldest, strict=True))
    assert [len(row["prompts"]) for row in prompts(run)] == [4] * len(table)


def test_partial_rollouts_resume_bit_identical_with_the_groups_in_flight(tmp_path: Path) -> None:
    """train.partial_rollouts.steps=1, 2 tokens a round: each step trains the 4 groups of its 8 in
    flight that finish first; the others carry their tokens into the next step, sampled on by
    the next weights. A resume restores the groups in flight and logs the uninterrupted run's
    numbers."""
    assert_resume_is_bit_identical(app.main, PARTIAL, tmp_path, steps=4, keys=[k for k in KEYS if k != "rollout/staleness"])
    check_token_staleness(tmp_path / "straight", 0)


def test_asynchronous_partial_rollouts_resumed_mid_run_are_the_uninterrupted_run(tmp_path: Path) -> None:
    """The same with train.max_staleness=1, cut after step 2 of 4: the checkpoint holds the
    rollouts sampled ahead for step 3 and the groups still in flight after them."""
    args = [*PARTIAL, "train.max_staleness=1", f"train.output_dir={tmp_path}", "train.save_freq=2", "train.max_steps=4"]
    straight = app.main([*args, "train.run_name=straight"])
    assert straight is not None
    shutil.copytree(straight, tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "checkpoint-4")
    resumed = app.main([*args, "--resume", str(tmp_path / "cut" / "checkpoints" / "checkpoint-2")])
    assert resumed == tmp_path / "cut"
    a, b = metric_rows(straight), metric_rows(resumed)
    assert [r["step"] for r in b] == ["1", "2", "3", "4"]
    for key in KEYS:
        assert [r[key] for r in a] == [r[key] for r in b], key
    check_token_staleness(straight, 1)


def test_two_processes_keep_their_own_groups_in_flight_and_resume_them(tmp_path: Path) -> None:
    """2 processes (accelerate launch), each 2 of the step's 4 groups: each keeps its own groups in
    flight and checkpoints them (`partial_rollouts/rank<r>.pt`); a 2-process resume from step 2
    logs the uninterrupted run's step 3."""
    args = [*PARTIAL, "train.max_steps=3", "train.save_freq=1", f"train.output_dir={tmp_path}"]
    launch(APP / "__main__.py", [*args, "train.run_name=straight"], cwd=REPO)
    straight = tmp_path / "straight"
    assert sorted(p.name for p in (straight / "checkpoints" / "checkpoint-2" / "partial_rollouts").iterdir()) == [
        "rank0.pt", "rank1.pt"]
    shutil.copytree(straight, tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "checkpoint-3")
    launch(APP / "__main__.py", [*args, "--resume", str(tmp_path / "cut" / "checkpoints" / "checkpoint-2")], cwd=REPO)
    a, b = metric_rows(straight), metric_rows(tmp_path / "cut")
    assert [r["world_size"] for r in b] == ["2", "2", "2"]
    for key in KEYS[:3] + KEYS[4:]:  # a synchronous run logs no rollout/staleness
        assert [r[key] for r in a] == [r[key] for r in b], key
    check_token_staleness(straight, 0)


def test_dynamic_sampling_over_partial_rollouts_keeps_the_batch_exact(tmp_path: Path) -> None:
    """Dynamic sampling's further rounds draw from the groups in flight too: every step still
    trains exactly its 4 groups, informative ones first, then uniform fillers."""
    run = app.main([*PARTIAL, f"train.output_dir={tmp_path}", "train.max_steps=3", "train.dynamic_sampling.enable=true",
                    "train.dynamic_sampling.metric=answer", "train.dynamic_sampling.max_rounds=3"])
    table = metric_rows(run)
    assert max(float(r["dynamic_sampling/rounds"]) for r in table) >= 2
    for r in table:
        assert float(r["dynamic_sampling/kept_groups"]) + float(r["dynamic_sampling/filled_groups"]) == 4
    assert max(float(r["rollout/token_staleness_max"]) for r in table) >= 1
