"""End-to-end runs of the recipe on tiny models (CPU)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import APP, REPO, TESTS, app, read_metrics, tiny_overrides
from rider_config import DEFAULT_CONFIG, Config, judge_configs, judge_name
from safetensors.torch import load_file

from rl_core.train import ConfigError, UserError, load_config, unknown_metric_names
from rl_core.train.testing import launch
from rl_rewards.rules import embedding_similarity_map, length_reward

JUDGES = (
    f'[{{name = "score", module = "{REPO}/examples/rider-grm/reward_function/rating_judge.py", model = "tiny:qwen3:1", weight = 0.3, '
    f'combine = "add", gate = 1.0, max_new_tokens = 4, fallback = 0.25}}, '
    f'{{name = "consistency", module = "{REPO}/examples/rider-grm/reward_function/no_contradiction_judge.py", model = "tiny:qwen3:2", '
    f'weight = 0.5, combine = "mul", max_new_tokens = 4, fallback = 0.5}}]'
)



def read_samples(run: Path) -> list[dict]:
    """Both sample logs (`samples/train.jsonl`, `samples/eval.jsonl`), each row tagged with its split."""
    return [{**json.loads(line), "split": split} for split in ("train", "eval")
            for line in (run / "samples" / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two judges (add, gated on the rule; mul), a parity rule, the similarity reward, 2 steps."""
    out = tmp_path_factory.mktemp("e2e")
    return app.main(tiny_overrides(out, **{
        "reward.judges": JUDGES, "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.rule_weight": 2.0,
        "reward.embedding.weight": 0.4, "train.max_steps": 2, "train.samples_to_log": 100, "train.save_freq": 1,
    }))


def hand_total(c: dict[str, float]) -> float:
    """VeRL-with-RMs' fold written out: rule, + 0.3 * score (gated), * 0.5 * consistency, + 0.4 * sim."""
    total = 2.0 * c["rule"]
    if c["rule"] >= 1.0:
        total += 0.3 * c["score"]
    total *= 0.5 * c["consistency"]
    return total + 0.4 * c["similarity"]


def test_combined_reward_equals_hand_computation_from_logged_components(e2e_run: Path) -> None:
    samples = [s for s in read_samples(e2e_run) if s["split"] == "train"]
    assert len(samples) == 2 * 4  # 2 steps x (2 prompts x n=2)
    for s in samples:
        c = s["components"]
        assert math.isclose(s["reward"], hand_total(c), rel_tol=1e-9, abs_tol=1e-12)
        assert c["similarity"] == pytest.approx(0.7 * embedding_similarity_map(c["similarity.cosine"]) + 0.3)
    rows = read_metrics(e2e_run)
    for row in rows:
        step = [s["reward"] for s in samples if s["step"] == int(row["step"])]
        assert float(row["reward/mean"]) == pytest.approx(sum(step) / len(step))
        assert float(row["reward/std"]) == pytest.approx(torch.tensor(step).std().item())  # n - 1


def test_gate_keeps_rule_failures_away_from_the_judge(e2e_run: Path) -> None:
    samples = [s for s in read_samples(e2e_run) if s["split"] == "train"]
    gated = [s for s in samples if s["components"]["rule"] < 1.0]
    passed = [s for s in samples if s["components"]["rule"] >= 1.0]
    assert gated and passed, "the parity rule should split the samples (pick another seed if not)"
    assert all(s["judges"]["score"]["raw"] is None for s in gated)  # never sent to the judge
    assert not any(s["judges"]["score"]["judged"] for s in gated)
    assert all(s["judges"]["score"]["raw"] is not None and s["judges"]["score"]["judged"] for s in passed)
    assert all(s["judges"]["consistency"]["raw"] is not None for s in samples)  # ungated judge saw all
    rows = read_metrics(e2e_run)
    assert sum(int(r["judge/score/scored"]) for r in rows) == len(passed)
    assert all(int(r["judge/consistency/scored"]) == 4 for r in rows)


def test_unparseable_judge_output_is_counted_and_scored_by_the_fallback(e2e_run: Path) -> None:
    samples = [s for s in read_samples(e2e_run) if s["split"] == "train"]
    failed = [s for s in samples if s["judges"]["consistency"]["error"] is not None]
    assert failed, "random tiny judges should write something that is not Yes/No"
    assert all(s["components"]["consistency"] == 0.5 for s in failed)
    rows = read_metrics(e2e_run)
    assert sum(int(r["judge/consistency/parse_failures"]) for r in rows) == len(failed)
    assert all("rm_postprocess" in s["judges"]["consistency"]["error"] for s in failed)


def test_samples_carry_each_judges_raw_output(e2e_run: Path) -> None:
    """The raw text logged for a judge is the text its module was given: a parse error quotes
    the output it failed on, and that is the logged raw output."""
    samples = [s for s in read_samples(e2e_run) if s["split"] == "train"]
    failed = [s["judges"]["consistency"] for s in samples if s["judges"]["consistency"]["error"] is not None]
    assert failed
    for judge in failed:
        assert isinstance(judge["raw"], str) and f"failed on {judge['raw'][:80]!r}" in judge["error"]
    assert {s["judges"]["consistency"]["raw"] for s in samples} - {None}, "raw outputs are logged"
    assert all(isinstance(s["judges"]["score"]["score"], float) for s in samples)


def test_judges_asleep_while_the_policy_generates_and_vice_versa(e2e_run: Path) -> None:
    for row in read_metrics(e2e_run):
        assert row["check/judges_awake_during_rollout"] == "0"
        assert row["check/policy_awake_during_score"] == "0"
        assert row["check/policy_awake_during_consistency"] == "0"


def test_metrics_have_each_phase_and_judge_swap(e2e_run: Path) -> None:
    rows = read_metrics(e2e_run)
    row = rows[0]
    assert unknown_metric_names(row) == []  # every column is in rl_core.train's table of names
    assert not [k for k in row if k.startswith("memory/")]  # CPU: no accelerator memory
    for name in ("score", "consistency"):
        for part in ("wake", "score", "sleep"):
            assert float(row[f"time/judge_{name}_{part}"]) >= 0
    for phase in ("rollout", "logprob", "ref_logprob", "offload_policy", "reward", "rule", "similarity",
                  "wake_policy", "update_actor", "update", "eval/rollout", "eval/reward"):
        assert float(rows[-1][f"time/{phase}"]) > 0, phase
    for key in ("reward/rule", "reward/score", "reward/consistency", "reward/similarity", "reward/std", "loss/kl",
                "replay/engine_diff_mean", "eval/reward/mean", "eval/judge/consistency/scored",
                "throughput/tokens_per_s", "response/length_mean"):
        assert key in row, key
    assert float(row["replay/engine_diff_mean"]) < 1e-3
    assert float(row["policy/ratio_mean"]) == pytest.approx(1.0, abs=0.05)


def test_swap_never_keeps_judges_resident_and_changes_no_number(tmp_path: Path, e2e_run: Path) -> None:
    """`reward.swap = "never"`: nothing sleeps (judges awake while the policy generates, the
    policy awake while they score) and the run is number for number the swapped one."""
    run = app.main(tiny_overrides(tmp_path, **{
        "reward.judges": JUDGES, "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.rule_weight": 2.0,
        "reward.embedding.weight": 0.4, "train.max_steps": 2, "train.samples_to_log": 100, "train.save_freq": 1,
        "reward.swap": '"never"',
    }))
    never, always = read_metrics(run), read_metrics(e2e_run)
    assert [r["swap/offload_policy"] for r in always] == ["1.0", "1.0"]  # auto on CPU = always
    assert [r["swap/offload_policy"] for r in never] == ["0.0", "0.0"]
    assert never[1]["check/judges_awake_during_rollout"] == "2"
    assert never[0]["check/policy_awake_during_consistency"] == "1"
    assert "time/offload_policy" not in never[0] or never[0]["time/offload_policy"] == ""
    for key in ("reward/mean", "reward/consistency", "loss/policy", "eval/reward/mean"):
        assert [r[key] for r in never] == [r[key] for r in always], key


def test_run_config_is_written_as_toml_and_reads_back(e2e_run: Path) -> None:
    """config.toml (rl_core's dump_config) holds the judges, with unset (None) fields left out."""
    cfg = load_config(Config, e2e_run / "config.toml")
    assert [j.name for j in cfg.reward.judges] == ["score", "consistency"]
    assert cfg.reward.judges[0].gate == 1.0 and cfg.reward.judges[1].gate is None


def test_resume_continues_exactly(tmp_path: Path, e2e_run: Path) -> None:
    """Stop after step 1, resume to step 2: same metrics and same weights as the straight run."""
    overrides = tiny_overrides(tmp_path, **{
        "reward.judges": JUDGES, "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.rule_weight": 2.0,
        "reward.embedding.weight": 0.4, "train.samples_to_log": 100, "train.save_freq": 1,
    })
    first = app.main([*overrides, "train.max_steps=1", "train.run_name=resumed", "train.eval_freq=0"])
    assert (first / "checkpoints" / "checkpoint-1").is_dir()
    # the first leg evaluates at its last step (1), on an isolated RNG state: the run goes on as if it had not
    resumed = app.main([*overrides, "train.max_steps=2", "--resume", str(first)])
    assert resumed == first
    straight, again = read_metrics(e2e_run), read_metrics(resumed)
    assert [r["step"] for r in again] == ["1", "2"]
    for key in ("reward/mean", "reward/consistency", "loss/policy", "loss/kl", "eval/reward/mean"):
        assert again[1][key] == straight[1][key], key
    a = load_file(e2e_run / "checkpoints" / "checkpoint-2" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "checkpoint-2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The embedded default's train reward/mean, measured (1 and 2 CPU threads alike): 0.169 0.192 0.185
# 0.181 0.175 0.230 0.190 0.259 0.259 0.326 0.321 0.348 0.393 0.400 0.407 0.449; the mean of the
# last 3 steps is 0.419 against 0.182 for the first 3 (+0.237; the similarity term moves the mean
# by up to ~0.04 from step to step, the rule carries the rise).
DEFAULT_MARGIN = 0.15


def test_the_embedded_default_learns_its_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`uv run apps/rider-grm` as a user runs it (only the output folder moved): REINFORCE++ raises
    the rule's share of "e" over the 16 steps, the gated rubric judge sees more replies as it
    does, and the closing summary quotes the first and the last step. The val rows are evaluated
    before the first step (logged as step 0) and after the last."""
    run = app.main([f'train.output_dir="{tmp_path}"'])
    before, *rows = read_metrics(run)
    assert before["step"] == "0" and before["eval/reward/mean"] and rows[-1]["eval/reward/mean"], before
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 16, rewards
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 > DEFAULT_MARGIN, rewards
    assert float(rows[-1]["reward/rule"]) > 2 * float(rows[0]["reward/rule"]), rows
    assert float(rows[0]["judge/rubric/scored"]) < float(rows[-1]["judge/rubric/scored"])
    assert re.search(r"train reward +first [0-9.]+ \(step 1\) +last [0-9.]+ \(step 16\)", capsys.readouterr().out)


def test_unequal_judge_lists_are_rejected_at_config_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward.verl.reward_weight': 1"):
        app.main(tiny_overrides(tmp_path, **{
            "reward.judges": "[]", "reward.verl.reward_function": '["a", "b"]',
            "reward.verl.model_path": '["tiny:qwen3", "tiny:qwen3"]', "reward.verl.reward_weight": "[0.3]",
        }))
    assert not list(tmp_path.iterdir())  # failed before creating anything


def test_seed_parallel_lists_expand_to_judge_tables() -> None:
    cfg = load_config(Config, None, [
        'reward.verl.reward_function=["rider_reward.py","consistency_reward.py"]',
        "reward.verl.model_path=/m/rm1,/m/rm2", "reward.verl.reward_weight=[0.3,0.5]",
        "reward.verl.reward_combine_func=['add','mul']", "reward.verl.temperature=[0.7,0.7]",
        "reward.verl.gpu_memory_utilization=[0.8,0.6]",
    ])
    judges = judge_configs(cfg.reward)
    assert [(j.module, j.model, j.weight, j.combine, j.temperature) for j in judges] == [
        ("rider_reward.py", "/m/rm1", 0.3, "add", 0.7), ("consistency_reward.py", "/m/rm2", 0.5, "mul", 0.7)]
    assert judges[1].engine_options == {"gpu_memory_utilization": 0.6}
    assert [judge_name(j) for j in judges] == ["rider_reward", "consistency_reward"]


def test_judge_module_with_mismatched_lists_fails_at_startup_dry_run(tmp_path: Path) -> None:
    bad = tmp_path / "double.py"
    bad.write_text("def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):\n"
                   "    return [r for r in text_responses for _ in range(2)]\n"
                   "def rm_postprocess(results):\n    return [0.0 for _ in results]\n")
    judges = f'[{{module = "{bad}", model = "tiny:qwen3:1", max_new_tokens = 2}}]'
    with pytest.raises(UserError, match=r"double.py.*rm_preprocess returned a list of 2 for 1 response"):
        app.main(tiny_overrides(tmp_path / "runs", **{"reward.judges": judges, "reward.embedding.model": "null"}))


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes(tmp_path: Path) -> None:
    """The same recipe under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo DDP;
    `--cpu` alone would start one process without MPI)."""
    overrides = tiny_overrides(tmp_path, **{"reward.judges": JUDGES, "reward.rule": f'"{TESTS}/rules/parity_rule.py"',
                                            "train.batch_size": 4, "train.max_steps": 2, "train.save_freq": 2})
    launch(APP / "__main__.py", overrides, cwd=REPO)
    run = (tmp_path / "latest").resolve()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == ["1", "2"]
    assert [r["world_size"] for r in rows] == ["2", "2"]  # two processes really ran
    assert int(rows[0]["judge/consistency/scored"]) == 8  # 4 prompts x n=2, judged on both ranks
    assert (run / "checkpoints" / "checkpoint-2").is_dir()


def test_full_size_example_config_loads() -> None:
    cfg = load_config(Config, REPO / "examples" / "rider-grm" / "verl-with-rms.toml")
    judges = judge_configs(cfg.reward)
    assert [(j.weight, j.combine, j.temperature) for j in judges] == [(0.3, "add", 0.7), (0.5, "add", 0.7)]
    assert (cfg.algo.advantage, cfg.algo.kl, cfg.algo.kl_coef, cfg.algo.kl_reward_coef) == ("reinforce_pp", "k3", 1e-4, 0.001)
    assert (cfg.rollout.n, cfg.train.lr, cfg.train.batch_size, cfg.train.save_freq) == (4, 1e-6, 32, 30)
    for judge in judges:
        assert (REPO / judge.module).is_file()


def test_trains_from_a_save_to_disk_directory(tmp_path: Path) -> None:
    """data.train_files / data.val_files name a `datasets` save_to_disk directory of judge rows."""
    import datasets
    import pyarrow.parquet as pq

    rows = datasets.Dataset.from_list(pq.read_table(REPO / "examples/data/rider/train.parquet").slice(0, 2).to_pylist())
    folder = tmp_path / "rider_ds"
    rows.save_to_disk(str(folder))
    run = app.main(tiny_overrides(tmp_path / "out", **{
        "data.train_files": f'["{folder}"]', "data.val_files": f'["{folder}"]',
        "reward.judges": "[]", "reward.embedding.model": "null", "reward.rule": '"rider_rules:letter_e_share"',
        "train.max_steps": 1, "train.samples_to_log": 100,
    }))
    assert [r["step"] for r in read_metrics(run)] == ["1"]
    questions = {row["prompt"][-1]["content"] for row in rows}
    logged = read_samples(run)  # train and eval samples: the two rows' questions, nothing else
    assert len(questions) == 2 and {s["prompt"] for s in logged} == questions


def test_help_lists_the_keys_of_each_judge_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` shows the `[[reward.judges]]` sub-keys (module, model, gate, ...), not just the list."""
    assert app.main(["--help"]) is None
    keys = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  reward.")}
    for sub in ("module", "model", "weight", "combine", "gate", "gated_out", "engine", "url", "spec",
                "completion_field", "prompt"):
        assert f"reward.judges[i].{sub}" in keys, sub


def test_help_lists_the_rl_core_algorithm_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert app.main(["--help"]) is None
    keys = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    for key in ("algo.loss_options", "algo.off_policy_mask", "algo.rollout_correction", "algo.reward_aggregation",
                "train.dynamic_sampling.enable", "train.dynamic_sampling.metric", "train.dynamic_sampling.max_rounds"):
        assert key in keys, key


def test_gdpo_normalises_each_component_of_a_summed_spec(tmp_path: Path) -> None:
    """normalize_then_sum with a `combine = "sum"` spec: sequence scores, each component
    normalised per group; the shorthand judges (a fold) and kl_in_reward are refused."""
    spec = ('{combine = "sum", components = {short = {scorer = "length", options = {tokenizer = "whitespace", '
            'l1 = 1, l2 = 6}}, overlong = {scorer = "overlong", weight = 0.5, options = {max_length = 8, cache = 4}}}}')
    run = app.main(tiny_overrides(tmp_path, **{"reward.spec": spec, "train.batch_size": 4, "train.mini_batch_size": 4,
                                              "train.max_steps": 1, "algo.advantage": "grpo",
                                              "algo.reward_aggregation": "normalize_then_sum",
                                              "algo.loss": "cispo", "algo.clip_low": 1.0, "algo.clip_high": 4.0}))
    row = read_metrics(run)[0]
    assert not unknown_metric_names(row) and float(row["reward/overlong.n_tokens"]) > 0
    assert abs(float(row["adv/mean"])) < 1e-5 and float(row["optimizer_steps"]) == 1
    with pytest.raises(ConfigError, match="kl_in_reward"):
        app.main(tiny_overrides(tmp_path, **{"algo.reward_aggregation": "normalize_then_sum",
                                              "algo.kl_in_reward": "true"}))


SPEC = '[components.short]\nscorer = "length"\noptions = { tokenizer = "whitespace", l1 = 2, l2 = 6 }\n'


@pytest.mark.parametrize("given", ["inline", "file"])
def test_reward_spec_replaces_rule_judges_and_embedding(tmp_path: Path, given: str) -> None:
    """`reward.spec` (an inline `[reward.spec.components.NAME]` table or a TOML file): its
    components alone make the reward, built from the registry; the default's rule, judges and
    embedding are not loaded, and the run's config.toml reads back with the same spec."""
    (tmp_path / "spec.toml").write_text(SPEC)
    config = tmp_path / "config.toml"  # the embedded default, with an inline spec or none
    config.write_text(DEFAULT_CONFIG.read_text() + "\n" + SPEC.replace("[components.", "[reward.spec.components.")
                      if given == "inline" else DEFAULT_CONFIG.read_text())
    extra = {"reward.spec": f'"{tmp_path / "spec.toml"}"'} if given == "file" else {}
    run = app.main(["--config", str(config), *tiny_overrides(tmp_path / "out", **extra, **{
        "train.max_steps": 1, "train.samples_to_log": 100})])
    [row] = read_metrics(run)
    assert unknown_metric_names(row) == []
    assert {k for k in row if k.startswith(("reward/", "judge/"))} == {
        "reward/mean", "reward/std", "reward/failed", "reward/short", "reward/short.n_tokens"}
    samples = [s for s in read_samples(run) if s["split"] == "train"]
    assert len(samples) == 4 and all(s["judges"] == {} for s in samples)
    for s in samples:
        assert set(s["components"]) == {"short", "short.n_tokens"}
        assert s["reward"] == length_reward(int(s["components"]["short.n_tokens"]), 2, 6)
    expected = load_config(Config, config, [f"reward.spec={extra['reward.spec']}"] if extra else []).reward.spec
    assert load_config(Config, run / "config.toml").reward.spec == expected


@pytest.mark.parametrize("old_logprobs", ["replay", "auto"])
def test_dynamic_sampling_merges_rounds_and_trains(tmp_path: Path, old_logprobs: str) -> None:
    """Groups whose rule reward is the same for both samples are dropped and refilled from more
    rounds; the merged batch (old log-probs, records, completions of several rounds) passes the
    first-step engine check and trains, also with the old log-probs from the update's forward."""
    run = app.main(tiny_overrides(tmp_path, **{"algo.old_logprobs": old_logprobs,
        "reward.judges": "[]", "reward.embedding.model": "null", "reward.rule": '"rider_rules:letter_e_share"',
        "train.batch_size": 4, "train.mini_batch_size": 4, "train.max_steps": 2, "train.dynamic_sampling.enable": "true",
        "train.dynamic_sampling.max_rounds": 3, "rollout.max_new_tokens": 2}))
    table = read_metrics(run)
    assert not unknown_metric_names(table[0])
    assert max(float(r["dynamic_sampling/rounds"]) for r in table) >= 2, table
    for r in table:  # 4 prompts x 2 samples per step: informative groups, then uniform fillers
        assert float(r["dynamic_sampling/kept_groups"]) + float(r["dynamic_sampling/filled_groups"]) == 4
        assert float(r["optimizer_steps"]) == 1


def test_auto_old_logprobs_skip_the_replay_pass_and_train_the_same(tmp_path: Path) -> None:
    """`algo.old_logprobs = auto` with one optimizer step a batch: no replay pass (`time/logprob`
    absent), and the same run as `replay` (the update's own forward gives the old log-probs: ratio
    1). With two minibatches a step, `auto` keeps the pass: the weights move between them."""
    rows = {mode: read_metrics(app.main(tiny_overrides(tmp_path / mode, **{
        "train.max_steps": 2, "algo.old_logprobs": mode})))
        for mode in ("replay", "auto")}
    for replayed, own in zip(rows["replay"], rows["auto"], strict=True):
        assert "time/logprob" in replayed and "time/logprob" not in own
        for key in ("loss/policy", "loss/kl", "policy/entropy", "reward/mean", "replay/engine_diff_max"):
            assert float(own[key]) == pytest.approx(float(replayed[key]), rel=1e-4, abs=1e-6), key
        assert float(own["policy/ratio_max"]) == 1.0
    [row] = read_metrics(app.main(tiny_overrides(tmp_path / "two", **{
        "train.max_steps": 1, "algo.old_logprobs": "auto", "train.batch_size": 4, "rollout.n": 1})))
    assert "time/logprob" in row and float(row["optimizer_steps"]) == 2
