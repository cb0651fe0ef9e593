"""The shared failure rules in rider-grm: a non-finite rule score, a judge module that returns a
non-number, a data row without the rm_prompt a judge reads, refused values and unusable rule or
judge files before any model loads, and user errors as one line without a traceback."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import APP, REPO, TESTS, app, tiny_overrides
from rider_config import DEFAULT_CONFIG, Config, resolve_model

from rl_core.train import ConfigError, UserError, load_config, run_app
from rl_core.train.testing import run_cli


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples" / "train.jsonl").read_text().splitlines()]


def test_nan_rule_fails_the_sample_instead_of_passing_the_gate(tmp_path: Path) -> None:
    run = app.main(tiny_overrides(tmp_path, **{"reward.rule": f'"{TESTS}/rules/nan_rule.py"', "reward.judges": "[]",
                                                "train.max_steps": 2, "train.samples_to_log": 8}))
    logged = samples(run)
    failed = [s for s in logged if s["reward"] is None]
    assert failed and all("not a finite number" in s["error"] for s in failed), [s["error"] for s in failed]
    assert all(s["components"]["rule"] == 1.0 for s in logged if s["reward"] is not None)
    table = rows(run)
    assert sum(float(r["reward/failed"]) for r in table) >= len(failed)
    assert all(r["grad_norm"] not in ("", "nan") for r in table if "grad_norm" in r)


def test_judge_returning_none_is_a_counted_failure(tmp_path: Path) -> None:
    judges = f'[{{name = "none", module = "{TESTS}/judges/none_judge.py", model = "tiny:qwen3:1", max_new_tokens = 4, ' \
             'prompt = "prompt", fallback = 0.0}]'
    run = app.main(tiny_overrides(tmp_path, **{"reward.judges": judges, "train.max_steps": 1, "train.samples_to_log": 8}))
    [row] = rows(run)
    logged = samples(run)
    nones = [s for s in logged if s["judges"]["none"]["error"]]
    assert nones and all("not a number" in s["judges"]["none"]["error"] for s in nones)
    assert float(row["judge/none/parse_failures"]) == len(nones)  # counted, not a silent constant


def test_a_missing_judge_folder_is_named_by_its_key_and_path(tmp_path: Path) -> None:
    """A judge whose model folder does not exist: one user error naming the judge's key and the
    path tried (it read as a malformed hub id before: "Repo id must be in the form ...")."""
    judges = f'[{{name = "absent", module = "rl_rewards.judges.yes_no", model = "{tmp_path / "no-judge"}"}}]'
    with pytest.raises(UserError, match=rf"reward\.judges\[0\]\.model='{tmp_path / 'no-judge'}' is no local folder "
                       rf"\(no such path: {tmp_path / 'no-judge'}\)"):
        app.main(tiny_overrides(tmp_path, **{"reward.judges": judges, "train.max_steps": 1}))


def test_a_later_row_without_the_rm_prompt_is_named(tmp_path: Path) -> None:
    """Only row 0 used to be checked: 15 later rows without rm_prompt_1 silently got the fallback."""
    from rewarding import load_records
    from transformers import AutoTokenizer

    table = pq.read_table(REPO / "examples" / "data" / "rider" / "train.parquet")
    path = tmp_path / "holes.parquet"
    pq.write_table(table.slice(0, 3).drop_columns(["rm_prompt_1"]).slice(2, 1), tmp_path / "b.parquet")
    pq.write_table(table.slice(0, 2), tmp_path / "a.parquet")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny:qwen3"))
    cfg = load_config(Config, DEFAULT_CONFIG)
    with pytest.raises(UserError, match=r"b\.parquet: row 0: no rm_prompt_1 column, but 2 judges read"):
        load_records([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], tokenizer, cfg, 2)
    assert len(load_records([str(tmp_path / "a.parquet")], tokenizer, cfg, 2)) == 2
    del path


@pytest.mark.parametrize(("override", "message"), [
    ("train.max_steps=0", r"train\.max_steps: expected int >= 1, got 0 \(from override train\.max_steps=0\)"),
    ("reward.rule_weight=nan", r"reward\.rule_weight: must be a finite number"),
    ("rollout.temperature=0", r"rollout\.temperature: expected float > 0\.0, got 0 \(from override"),
    ("train.lr=-1", r"train\.lr: expected float > 0\.0, got -1"),
    ("rollout.n=1", r"rollout\.n=1: .* needs rollout\.n >= 2"),
    ("algo.advantage=nope", r"^algo\.advantage: unknown advantage estimator 'nope'; valid names: dr_grpo, gae, "),
    ("algo.loss=ppo", r"^algo\.loss: unknown policy loss 'ppo'; valid names: cispo, dual_clip, gspo, ppo_clip, sapo"),
    ("algo.kl=k4", r"^algo\.kl: unknown KL estimator 'k4'; valid names: k1, k2, k3, low_var_kl"),
])
def test_refused_values_fail_before_any_model_loads(tmp_path: Path, override: str, message: str) -> None:
    overrides = tiny_overrides(tmp_path)
    if override.startswith("rollout.n"):
        overrides += ["algo.advantage=grpo"]
    with pytest.raises(ConfigError, match=message):
        app.main([*overrides, override])
    assert not (tmp_path / "latest").exists()  # nothing was started


def test_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(APP / "__main__.py"), "data.train_files=[\"/nope.parquet\"]",
                           f"train.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "rider-grm: error: data file not found: /nope.parquet " \
                                                   "(data.train_files / data.val_files)"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("argv", "line"), [
    (["--help"], None),
    (["train.nope=1"], r"rider-grm: error: unknown config key 'train\.nope' \(override train\.nope=1\): no field"),
    (["algo.kl=k4"], r"rider-grm: error: algo\.kl: unknown KL estimator 'k4'; valid names: k1, "),
    (["--resume", "/nope"], r"rider-grm: error: --resume /nope: no complete checkpoint-<step> there$"),
    # one vocabulary: verl's names of the seed's launch line are refused with the shared key
    (["algo.kl_loss_coef=1e-3"], r"rider-grm: error: algo\.kl_loss_coef was renamed: use algo\.kl_coef$"),
    (["data.max_response_length=64"], r"rider-grm: error: data\.max_response_length was renamed: use "
     r"rollout\.max_new_tokens$"),
    (["model.dtype=float8", "model.path=/nope"], r"rider-grm: error: model\.dtype: unknown value 'float8'; "
     r"valid choices: auto, float32, fp32, bfloat16, bf16, float16, fp16 \(from override model\.dtype=float8\)$"),
])
def test_help_and_config_errors_answer_before_torch_is_imported(argv: list[str], line: str | None) -> None:
    """The command line, the config and the `--resume` path are read before the recipe (and
    torch) loads."""
    done = run_cli(APP, *argv, cwd=REPO)
    assert not done.imported_torch
    if line is None:
        assert done.returncode == 0 and "reward.judges[i].module" in done.stdout and "MODEL_PATH" in done.stdout
        assert max(map(len, done.stdout.splitlines())) < 100  # wrapped: off a terminal, to 100 columns
    else:
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and re.match(line, done.stderr), done.stderr


def test_resume_refuses_another_run_name(tmp_path: Path) -> None:
    run = app.main(tiny_overrides(tmp_path, **{"train.max_steps": 1, "train.run_name": "a"}))
    with pytest.raises(UserError, match=r"--resume continues run 'a', but train\.run_name='b'"):
        app.main([*tiny_overrides(tmp_path, **{"train.max_steps": 2, "train.run_name": "b"}), "--resume", str(run)])


HALF = "def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):\n    return text_prompts\n"
BAD_FILES = {"syntax.py": "def rm_preprocess(:\n", "imports.py": "import no_such_module_here\n", "half.py": HALF}


@pytest.mark.parametrize(("key", "value", "message"), [
    ("reward.judges", '[{module = "/nope/judge.py", model = "tiny:qwen3:1"}]',
     r"reward\.judges\[0\]\.module='/nope/judge\.py': FileNotFoundError: reward module file '/nope/judge\.py' does not exist"),
    ("reward.judges", '[{module = "TMP/syntax.py", model = "tiny:qwen3:1"}]',
     r"reward\.judges\[0\]\.module='.*syntax\.py': SyntaxError: "),
    ("reward.judges", '[{module = "TMP/imports.py", model = "tiny:qwen3:1"}]',
     r"reward\.judges\[0\]\.module='.*imports\.py': ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("reward.judges", '[{module = "TMP/half.py", model = "tiny:qwen3:1"}]',
     r"reward\.judges\[0\]\.module='.*half\.py': AttributeError: reward module '.*half\.py' does not define rm_postprocess"),
    ("reward.verl.reward_function", '["rl_rewards.judges.yes_no", "TMP/half.py"]',
     r"reward\.verl\.reward_function\[1\]='.*half\.py': AttributeError: .* does not define rm_postprocess"),
    ("reward.rule", '"/nope/rule.py"', r"reward\.rule='/nope/rule\.py': FileNotFoundError: reward function file not found"),
    ("reward.rule", '"TMP/syntax.py:compute_score"', r"reward\.rule='.*syntax\.py:compute_score': SyntaxError: "),
    ("reward.rule", '"no_such_rules:compute_score"',
     r"reward\.rule='no_such_rules:compute_score': ModuleNotFoundError: No module named 'no_such_rules'"),
    ("reward.rule", '"rider_rules:nope"', r"reward\.rule='rider_rules:nope': AttributeError: rider_rules defines no function 'nope'"),
    ("reward.spec", '"/nope/spec.toml"', r"reward\.spec='/nope/spec\.toml': \[Errno 2\] No such file"),
], ids=["judge-missing", "judge-syntax", "judge-import", "judge-half", "verl-list-half", "rule-missing", "rule-syntax",
        "rule-import", "rule-no-function", "spec-missing"])
def test_unusable_rule_judge_or_spec_is_one_line_before_any_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str, message: str) -> None:
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    extra = {key: value.replace("TMP", str(tmp_path))}
    if key == "reward.verl.reward_function":
        extra |= {"reward.judges": "[]", "reward.verl.model_path": '["tiny:qwen3:1", "tiny:qwen3:2"]'}
    out = tmp_path / "runs"
    code = run_app("rider-grm", app.main, tiny_overrides(out, **extra))
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2
    assert re.fullmatch(rf"rider-grm: error: {message}.*", line), line
    assert not out.exists()  # stopped before loading or writing anything


def test_batch_size_is_checked_against_the_process_count() -> None:
    """`Recipe.check` runs before any model loads (the loop calls it with the accelerator's count)."""
    cfg = load_config(Config, DEFAULT_CONFIG, ["train.batch_size=3", "train.mini_batch_size=3"])
    app.RECIPE.check(cfg, 1)
    with pytest.raises(ConfigError, match=r"^train\.batch_size=3 must divide by the 2 processes and by train\.mini_batch_size=3$"):
        app.RECIPE.check(cfg, 2)
