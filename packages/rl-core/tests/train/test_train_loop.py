"""The trainer loop (`rl_core.train.loop`) on its own test recipe (bandit_recipe.py): the
invariants every app inherits, pinned with numbers (2 processes = 1 process with twice the batch,
accumulation = one batch, resume = uninterrupted, bit for bit), the schedule (eval cadence,
log before checkpoint), the failure rules (skipped steps, a run that trains nothing, refused
config values before setup) and what a run prints and writes."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bandit_recipe as bandit

from rl_core.train import ConfigError, UserError, unknown_metric_names
from rl_core.train.testing import assert_resume_is_bit_identical, assert_two_processes_equal_one

SCRIPT = Path(bandit.__file__)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def go(tmp_path: Path, name: str, *extra: str, resume: str | None = None) -> Path:
    argv = [f"train.output_dir={tmp_path}", f"train.run_name={name}", *extra]
    out = bandit.main([*argv, "--resume", resume] if resume else argv)
    assert out == tmp_path / name  # the run directory, named as asked (a resume keeps its own)
    return out


# one process, batch 4 x 4, 3 steps, seed 0 (pinned on the 2-core CPU)
PINNED = {1: {"reward/mean": 0.1875, "loss/policy": 0.0, "grad_norm": 0.1875},
          3: {"reward/mean": 0.125, "grad_norm": 0.165359}}


def test_a_run_logs_known_metrics_and_pinned_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = go(tmp_path, "plain")
    table = rows(run_dir)
    assert [r["step"] for r in table] == ["1", "2", "3"]
    for step, values in PINNED.items():
        for key, value in values.items():
            assert float(table[step - 1][key]) == pytest.approx(value, abs=1e-5), (step, key)
    assert not unknown_metric_names(table[0])  # every column is in the one table of names
    assert (run_dir / "checkpoints" / "checkpoint-3" / "meta.json").is_file()
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "step 2/3  reward/mean=0.125" in out  # one line per step off a terminal
    assert "bandit finished: 3 steps (3 run now, 0 skipped)" in out
    assert "train reward    first 0.1875 (step 1)" in out and f"weights         {run_dir / 'weights.pt'}" in out


def test_accumulated_micro_batches_equal_one_batch(tmp_path: Path) -> None:
    one = go(tmp_path, "one", "train.micro_batch_size=16")
    many = go(tmp_path, "many", "train.micro_batch_size=3")
    torch.testing.assert_close(bandit.weights(many), bandit.weights(one), atol=1e-7, rtol=0)
    for a, b in zip(rows(one), rows(many), strict=True):
        assert float(a["loss/policy"]) == pytest.approx(float(b["loss/policy"]), abs=1e-7)
        assert a["reward/mean"] == b["reward/mean"]


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    assert_resume_is_bit_identical(bandit.main, [], tmp_path, steps=4,
                                   keys=("reward/mean", "loss/policy", "grad_norm", "adv/std"))


def test_a_resumed_runs_summary_covers_the_whole_run_and_lists_only_what_it_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def summary(out: str) -> list[str]:
        return out[out.index("bandit finished"):].splitlines()

    whole = go(tmp_path, "whole")
    uninterrupted = summary(capsys.readouterr().out)
    part = go(tmp_path, "part", "train.max_steps=2")
    capsys.readouterr()
    go(tmp_path, "part", resume=str(part))
    resumed = summary(capsys.readouterr().out)
    assert resumed[0].startswith("bandit finished: 3 steps (1 run now, 0 skipped)")
    reward_lines = [line for line in uninterrupted if line.startswith(("  train reward", "  failed rewards"))]
    assert len(reward_lines) == 2 and all(line in resumed for line in reward_lines)  # first reward: step 1's
    assert "first 0.1875 (step 1)" in reward_lines[0]
    listed = [word for line in uninterrupted for word in line.split() if word.startswith(str(whole))]
    assert len(listed) >= 5 and all(Path(path).exists() for path in listed)  # what the run wrote, and nothing else


def test_resume_of_another_run_name_and_a_missing_path_are_user_errors(tmp_path: Path) -> None:
    first = go(tmp_path, "a", "train.max_steps=1")
    with pytest.raises(UserError, match=r"--resume continues run 'a', but train.run_name='b' names another run"):
        go(tmp_path, "b", resume=str(first))
    with pytest.raises(UserError, match="no complete checkpoint"):
        go(tmp_path, "c", resume=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"--config .*nope\.toml: no such file"):
        bandit.main(["--config", str(tmp_path / "nope.toml")])


def test_a_failed_start_leaves_latest_and_resume_never_quietly_starts_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A start that fails after the config check (a model path that does not exist) leaves
    `latest` on the run before it, and `--resume` continues that run; with no run to resume,
    `--resume` stops with one line instead of training from step 1."""
    with pytest.raises(UserError, match=r"nothing to resume: no run under .*empty has a checkpoint"):
        bandit.main([f"train.output_dir={tmp_path / 'empty'}", "--resume"])
    assert not (tmp_path / "empty").exists()
    first = bandit.main([f"train.output_dir={tmp_path}", "train.max_steps=2"])

    def setup_fails(self: bandit.Bandit, cfg: bandit.Config, run: object) -> bandit.State:
        raise UserError("model not found: model.path='nowhere'")

    monkeypatch.setattr(bandit.Bandit, "setup", setup_fails)
    with pytest.raises(UserError, match="model not found"):
        bandit.main([f"train.output_dir={tmp_path}", "train.max_steps=3"])
    monkeypatch.undo()
    assert (tmp_path / "latest").resolve() == first
    capsys.readouterr()
    resumed = bandit.main([f"train.output_dir={tmp_path}", "train.max_steps=3", "--resume"])
    assert resumed == first and [r["step"] for r in rows(first)] == ["1", "2", "3"]
    assert f"resumed from {first / 'checkpoints' / 'checkpoint-2'} at step 2" in capsys.readouterr().out


def test_a_registry_typo_stops_before_setup(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algo.advantage: unknown advantage estimator 'nope'; valid names: dr_grpo"):
        go(tmp_path, "typo", "algo.advantage=nope")
    with pytest.raises(ConfigError, match=r"train\.n=1: algo\.advantage='grpo' compares the samples of one prompt .* needs train\.n >= 2"):  # Recipe.check
        go(tmp_path, "lone", "train.n=1")
    assert not (tmp_path / "typo").exists() and not (tmp_path / "lone").exists()


def test_eval_cadence_and_log_before_checkpoint(tmp_path: Path) -> None:
    run_dir = go(tmp_path, "evals", "train.max_steps=5", "train.eval_every=2", "train.eval_at_start=true",
                 "train.save_freq=2")
    table = rows(run_dir)
    assert [(r["step"], r["eval/reward/mean"] != "") for r in table] == [
        ("0", True), ("1", False), ("2", True), ("3", False), ("4", True), ("5", True)]
    assert table[0]["reward/mean"] == "" and float(table[0]["time/eval"]) > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-5"]
    # a resume from checkpoint 4 of a run that logged step 5 cuts step 5 back, and logs no new step-0 eval
    resumed = go(tmp_path, "evals", "train.max_steps=5", "train.eval_every=2", "train.eval_at_start=true",
                 resume=str(run_dir / "checkpoints" / "checkpoint-4"))
    assert [r["step"] for r in rows(resumed)] == ["0", "1", "2", "3", "4", "5"]


def test_a_skipped_step_is_logged_with_its_reason(tmp_path: Path) -> None:
    run_dir = go(tmp_path, "skip", "train.skip_steps=[2]")
    table = rows(run_dir)
    assert [r["skipped"] for r in table] == ["0", "1", "0"]
    assert table[1]["error"] == "reward service unavailable at step 2" and table[1]["reward/mean"] == ""


def test_a_run_that_trains_no_step_ends_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no step trained; every step was skipped \(step 1: reward service"):
        go(tmp_path, "none", "train.skip_steps=[1, 2, 3]")


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert_two_processes_equal_one(bandit.main, SCRIPT, ["train.micro_batch_size=3"], tmp_path, atol=1e-7,
                                   keys=("reward/mean", "reward/std", "adv/std", "loss/policy", "grad_norm",
                                         "replay/engine_diff_mean"))
    torch.testing.assert_close(bandit.weights(tmp_path / "two"), bandit.weights(tmp_path / "one"), atol=1e-7, rtol=0)
    # the slowest process's phases beside rank 0's: never faster, and only with several processes
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert not [k for k in one[0] if k.startswith("time_max/")]
    profiled = sorted(k.removeprefix("time_max/") for k in two[0] if k.startswith("time_max/"))
    assert {"rollout", "rank_wait", "update"} <= set(profiled) and not unknown_metric_names(two[0])
    assert "time/rank_wait" not in one[0]  # one process waits for no other
    assert all(float(r[f"time_max/{p}"]) >= float(r[f"time/{p}"]) for r in two for p in profiled)


def test_tensorboard_gets_the_scalars_of_metrics_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train.log_with=[tensorboard]` (the README's form): Accelerate's tracker writes into the run
    directory, and its event file holds the same scalars as metrics.csv."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = go(tmp_path, "tb", "train.log_with=[tensorboard]")
    assert f"  tensorboard     {run_dir / 'bandit'}\n" in capsys.readouterr().out  # named in the summary
    [events] = list((run_dir / "bandit").glob("events.out.tfevents.*"))  # run_dir/<app>/: the scalars
    logged = EventAccumulator(str(events.parent)).Reload()
    table = rows(run_dir)
    for key in ("reward/mean", "loss/policy", "grad_norm"):
        assert [(e.step, round(e.value, 5)) for e in logged.Scalars(key)] == [
            (int(r["step"]), round(float(r[key]), 5)) for r in table], key
    texts = EventAccumulator(str(events.parent), size_guidance={"tensors": 0}).Reload().Tensors("samples/train/text_summary")
    assert [t.step for t in texts] == [1, 2, 3]  # the step's sample rows as a table in the text tab
    first = texts[0].tensor_proto.string_val[0].decode()
    assert first.splitlines()[0] == "| prompt | answer | reward |" and len(first.splitlines()) == 4


def test_a_tracker_that_is_not_installed_or_unknown_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused with the config, before any directory, with the command that installs it where the
    user is: `uv run --with` under uv (which sets UV), `pip install` elsewhere."""
    monkeypatch.setenv("UV", "/usr/bin/uv")
    with pytest.raises(UserError, match=r"^train\.log_with=\['aim', 'dvclive'\]: aim, dvclive are not installed; run "
                                        r"the same command as uv run --with aim --with dvclive \.\.\.$"):
        go(tmp_path, "aim", "train.log_with=[aim, dvclive]")
    monkeypatch.delenv("UV")
    with pytest.raises(UserError, match=r"^train\.log_with=\['aim'\]: aim is not installed; pip install aim$"):
        go(tmp_path, "aim", "train.log_with=[aim]")
    assert not (tmp_path / "aim").exists()
    with pytest.raises(UserError, match=r"train\.log_with\[0\]: unknown value 'nope'; valid choices: all, aim, "
                                        r"tensorboard, .* \(from override train\.log_with=\[nope\]\)"):
        go(tmp_path, "nope", "train.log_with=[nope]")  # refused with the config, before any run directory
    assert not (tmp_path / "nope").exists()


def test_mlflows_store_is_each_runs_own_and_a_users_store_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs in one process (a notebook): each run's MLflow store is its own run directory's
    `mlruns` (it was the first run's for both: the variable outlived the run); a store the user
    names stays; without mlflow asked for, nothing is set."""
    from rl_core.train.trackers import mlflow_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for run in ("run-1", "run-2"):
        with mlflow_store(tmp_path / run, ["tensorboard", "mlflow"]):
            assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path / run / "mlruns").as_uri()
        assert "MLFLOW_TRACKING_URI" not in os.environ
    with mlflow_store(tmp_path / "run-3", ["tensorboard"]):
        assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    with mlflow_store(tmp_path / "run-4", ["all"]):
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
