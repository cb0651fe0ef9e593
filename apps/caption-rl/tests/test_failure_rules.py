"""caption-rl's failure rules (the shared ones, `rl_core.train`): refused values name the key and
its source before anything loads, records that fail only when turned into model input are
skipped and counted with file and line, a failed reward is left out and counted, a crash before
the first checkpoint leaves no stray metrics or samples, and user errors end without a traceback."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from conftest import APP, DATA, REPO, tiny_overrides

from rl_core.train import ConfigError, UserError, load_config, run_app
from rl_core.train.testing import run_cli
from rl_rewards import ScoreResult, register_scorer
from rl_rewards.registry import SCORERS


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.temperature=nan", r"rollout\.temperature: expected float > 0\.0, got nan|rollout\.temperature: must be a finite"),
    ("train.warmup_steps=-3", r"train\.warmup_steps: expected int >= 0, got -3 \(from override train\.warmup_steps=-3\)"),
    ("rollout.n=1", r"rollout\.n=1: algo\.advantage='grpo' compares the samples of one prompt .* needs rollout\.n >= 2"),
    ("train.mini_batch_size=-1", r"train\.mini_batch_size: expected int >= 1, got -1"),
    ("train.max_steps=-1", r"train\.max_steps: expected int >= 1, got -1"),
    ("data.eval_size=-1", r"data\.eval_size: expected int >= 0, got -1"),
    ("reward.length_l1=900", r"reward\.length_l1=900 must be below reward\.length_l2="),
    ("train.lr=inf", r"train\.lr: must be a finite number, got inf \(from override train\.lr=inf\)"),
    ("algo.advantage=nope", r"^algo\.advantage: unknown advantage estimator 'nope'; valid names: dr_grpo, gae, grpo, "),
    ("algo.loss=ppo", r"^algo\.loss: unknown policy loss 'ppo'; valid names: cispo, dual_clip, gspo, ppo_clip, sapo \(from override"),
    ("algo.agg=mean", r"^algo\.agg: unknown loss aggregation mode 'mean'; valid names: seq-mean-token-mean, "),
])
def test_refused_values_name_the_key_and_the_source(app, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        app.main([*tiny_overrides(tmp_path), override])
    assert not (tmp_path / "latest").exists()  # refused before anything started


def test_eval_hold_out_of_every_record_names_the_knob(app, tmp_path):
    with pytest.raises(UserError, match=r"data\.eval_size=64 would hold out all 3 training records"):
        app.main([*tiny_overrides(tmp_path), f"data.train_files=[\"{DATA / 'caption_qa_videos.jsonl'}\"]",
                  "data.eval_size=64"])


def bad_records(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """The example image rows (absolute paths) with three records that parse but cannot become
    model input: an image that is not there, two <image> markers for one image, no user turn."""
    lines = (DATA / "caption_qa_images.jsonl").read_text().splitlines()
    rows_ = [json.loads(line) for line in lines]
    for row in rows_:
        path = row["image"]["path"] if isinstance(row["image"], dict) else row["image"]
        row["image"] = str(DATA / path)
    rows_[0]["image"] = str(tmp_path / "gone.png")
    rows_[1]["prompt"] = "<image>\n<image>\nDescribe both."
    rows_[2]["prompt"] = [{"role": "system", "content": "<image> Describe the image."}]
    out = tmp_path / "bad.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return out, {1: "gone.png", 2: "more <image> markers than images", 3: "no user turn"}


def test_records_that_fail_as_model_input_are_skipped_with_file_and_line(app, tmp_path, caplog):
    from caption_data import encode_records, load_records
    from transformers import AutoProcessor

    from rl_data import ReadStats
    from rl_models import tiny

    data, reasons = bad_records(tmp_path)
    cfg = load_config(app.Config, app.DEFAULT_CONFIG, [*tiny_overrides(tmp_path), f"data.train_files=[\"{data}\"]"])
    records = load_records([str(data)], [], eval_size=0, task="auto", seed=0)
    bad = ReadStats()
    with caplog.at_level("WARNING", logger="rl_data"):
        encoded = encode_records(records.train[:6], records.train_where[:6],
                                 AutoProcessor.from_pretrained(tiny.build("qwen2_5_vl")), cfg.data, 13000, bad)
    assert encoded.positions == [3, 4, 5] and len(encoded.records) == len(encoded.prompts) == 3
    assert bad.skipped == 3
    for line, reason in reasons.items():
        assert any(f"bad.jsonl: line {line}:" in r.getMessage() and reason in r.getMessage() for r in caplog.records), \
            (line, [r.getMessage() for r in caplog.records])


class FailsEveryThird:
    """A reward that fails every third sample (a judge that times out, say)."""

    name = "fails_every_third"

    def score(self, samples):
        return [ScoreResult.failed("judge timed out") if i % 3 == 0 else ScoreResult(score=float(len(s.completion) % 5))
                for i, s in enumerate(samples)]


if "fails_every_third" not in SCORERS:
    register_scorer("fails_every_third", FailsEveryThird)


def test_a_failed_reward_is_left_out_and_counted(app, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[components.r]\nscorer = "fails_every_third"\n')
    run = app.main([*tiny_overrides(tmp_path, f"reward.spec={spec}"), "train.max_steps=1"])
    [row] = rows(run)
    assert float(row["reward/failed"]) == 3.0  # 8 samples: 0, 3, 6 fail
    logged = [json.loads(line) for line in (run / "samples" / "train.jsonl").read_text().splitlines()]
    assert logged[0]["reward"] is None and "judge timed out" in logged[0]["error"]
    assert float(row["nonfinite/skipped_steps"]) == 0.0 and row["grad_norm"] not in ("", "nan")


class CrashOnStep:
    """A reward that kills the run on its second call (a crash after step 1 was logged, before
    any checkpoint)."""

    name = "crash_on_second_call"
    calls = 0

    def score(self, samples):
        type(self).calls += 1
        if type(self).calls == 2:
            raise KeyboardInterrupt
        return [ScoreResult(score=float(len(s.completion) % 3)) for s in samples]


if "crash_on_second_call" not in SCORERS:
    register_scorer("crash_on_second_call", CrashOnStep)


def test_a_restart_after_a_crash_before_the_first_checkpoint_logs_each_step_once(app, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[components.r]\nscorer = "crash_on_second_call"\n')
    overrides = [*tiny_overrides(tmp_path, f"reward.spec={spec}"), "train.max_steps=2", "train.run_name=same"]
    with pytest.raises(KeyboardInterrupt):
        app.main(overrides)
    assert [r["step"] for r in rows(tmp_path / "same")] == ["1"]
    app.main(overrides)  # the same run name again, no checkpoint to resume: starts over
    assert [r["step"] for r in rows(tmp_path / "same")] == ["1", "2"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "same" / "samples" / "train.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(1) == 2  # samples_to_log=2 per step, not 4 for step 1


def test_user_errors_are_one_line_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(APP / "__main__.py"), *tiny_overrides(tmp_path),
                           "data.train_files=[\"/nope.jsonl\"]"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("caption-rl: error: dataset file not found: /nope.jsonl "
                                                    "(data.train_files / data.val_files / DATASET)")


@pytest.mark.parametrize(("argv", "line"), [
    (["--help"], None),
    (["train.nope=1"], r"caption-rl: error: unknown config key 'train\.nope' \(override train\.nope=1\): no field"),
    (["algo.loss=ppo"], r"caption-rl: error: algo\.loss: unknown policy loss 'ppo'; valid names: cispo, "),
    (["--config", "/nope.toml"], r"caption-rl: error: --config /nope\.toml: no such file$"),
    (["data.train=[]"], r"caption-rl: error: data\.train was renamed: use data\.train_files$"),  # one vocabulary
    # a value outside its key's choices stops before the model loads (model.path: a fast failure if it did not)
    (["model.dtype=float8", "model.path=/nope"], r"caption-rl: error: model\.dtype: unknown value 'float8'; valid "
     r"choices: auto, float32, fp32, bfloat16, bf16, float16, fp16 \(from override model\.dtype=float8\)$"),
    (["rollout.compile_mode=max_autotune", "model.path=/nope"], r"caption-rl: error: rollout\.compile_mode: unknown value "
     r"'max_autotune'; valid choices: auto, default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, lite \("),
])
def test_help_and_config_errors_answer_before_torch_is_imported(argv, line):
    """The command line and the config are read before the recipe (and torch) loads."""
    done = run_cli(APP, *argv, cwd=REPO)
    assert not done.imported_torch
    if line is None:
        assert done.returncode == 0 and "algo.loss" in done.stdout and "CAPTION_MODEL" in done.stdout
        assert max(map(len, done.stdout.splitlines())) < 100  # wrapped: off a terminal, to 100 columns
    else:
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and re.match(line, done.stderr), done.stderr


def test_the_dtype_choices_are_the_model_loaders():
    """`model.dtype`'s choices, checked before torch loads, are what `rl_models` loads."""
    from rl_core.train import DType
    from rl_models.loading import DTYPES

    assert set(get_args(DType)) == {"auto", *DTYPES}


def test_a_run_where_no_record_can_become_model_input_ends_with_the_reason(app, tmp_path, capsys):
    """Every record names a missing image: each is skipped (file and line in the log), every step
    has no rollout, and the run ends with a user error instead of reporting a finished run."""
    rows_ = [json.loads(line) for line in (DATA / "caption_qa_images.jsonl").read_text().splitlines()]
    for row in rows_:
        row["image"] = str(tmp_path / "gone.png")
    data = tmp_path / "all-bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    assert run_app(app.NAME, app.main, [*tiny_overrides(tmp_path), f"data.train_files=[\"{data}\"]", "data.eval_size=0"]) == 2
    why = "no rollouts on some process (every prompt over rollout.max_prompt_length or a bad record?)"
    assert capsys.readouterr().err.splitlines()[-1] == (  # the app's name once, as in every user error
        f"caption-rl: error: no step trained; every step was skipped (step 1: {why}; step 2: {why})")
