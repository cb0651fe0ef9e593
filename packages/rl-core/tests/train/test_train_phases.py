"""The shared training phases (`rl_core.train.groups`, `update`, `samples`, `app`): hand-worked
values in one process, and a real 2-process gloo run with uneven rank sizes that must equal one
process holding every sample."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from phases_case import GROUPS, OBJECTIVES, SCORES, WEIGHTS, loss_fn, make_model, split_rows

from rl_core.advantages import normalize_then_sum
from rl_core.train import (
    ConfigError,
    NonFiniteError,
    NonFiniteGuard,
    ReplayCheck,
    SampleLog,
    Schedule,
    UpdateStats,
    UserError,
    check_finite_parameters,
    gathered_means,
    group_advantages,
    latest_checkpoint,
    optimizer_step,
    run_app,
    save_checkpoint,
)

SCRIPT = Path(__file__).with_name("mp_phases_script.py")
EPS = 1e-6  # grpo's default
# Group 0 [1, 0, 0.5]: mean 0.5, unbiased std 0.5. Group 1: row 3 failed, row 4 alone -> 0.
# Group 2 [1, 0, 3]: mean 4/3, unbiased std sqrt(7/3).
EXPECTED = torch.tensor([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0, 0.0,
                         (-1 / 3) / (math.sqrt(7 / 3) + EPS), (-4 / 3) / (math.sqrt(7 / 3) + EPS),
                         (5 / 3) / (math.sqrt(7 / 3) + EPS)])


def test_failed_rewards_and_single_sample_groups_get_zero_and_are_counted():
    out = group_advantages("grpo", SCORES, GROUPS)
    torch.testing.assert_close(out.advantages, EXPECTED)
    assert out.valid.tolist() == [True, True, True, False, False, True, True, True]
    assert out.metrics["reward/failed"] == 1.0
    assert out.metrics["adv/small_groups"] == 1.0
    assert out.metrics["reward/mean"] == pytest.approx((1 + 0 + 0.5 + 2 + 1 + 0 + 3) / 7)


def test_a_global_estimator_keeps_a_lone_sample():
    out = group_advantages("reinforce_pp", SCORES[:, None].expand(8, 2).clone(), GROUPS,
                           mask=torch.tensor([[0.0, 1.0]] * 8))
    assert out.valid.tolist() == [True, True, True, False, True, True, True, True]
    assert out.advantages[3].abs().sum() == 0 and out.metrics["adv/small_groups"] == 0.0


def _gdpo(**kwargs):
    return group_advantages(kwargs.pop("estimator", "grpo"), SCORES, GROUPS, aggregation="normalize_then_sum",
                            **{"objectives": OBJECTIVES, "weights": WEIGHTS, **kwargs})


def test_normalize_then_sum_replaces_the_estimator_on_the_same_valid_rows():
    out, summed = _gdpo(), group_advantages("grpo", SCORES, GROUPS)
    keep = [0, 1, 2, 5, 6, 7]  # row 3 failed, row 4 is alone in group 1: both 0, as for grpo
    assert out.valid.tolist() == summed.valid.tolist()
    expected = torch.zeros(8)
    expected[keep] = normalize_then_sum(OBJECTIVES[keep], WEIGHTS, GROUPS[keep])
    torch.testing.assert_close(out.advantages, expected)
    # group 0, (c1, c2) = (1, 0), (0, 0), (0, 1): z_c1 = (1.155, -0.577, -0.577) (mean 1/3, std 0.577),
    # z_c2 = (-0.577, -0.577, 1.155); s = z_c1 + 0.5 z_c2 = (0.866, -0.866, 0), before the batch scaling
    assert out.advantages[1] < out.advantages[2] < out.advantages[0]
    reward_keys = [k for k in summed.metrics if k.startswith("reward/")]
    assert {k: out.metrics[k] for k in reward_keys} == {k: summed.metrics[k] for k in reward_keys}


def test_normalize_then_sum_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match=r"'normalize_then_sum' .* group advantage estimator .* 'reinforce_pp'"):
        _gdpo(estimator="reinforce_pp")
    with pytest.raises(ValueError, match=r"objectives must be \[B_r, K\]=\(8, 2\).* got shape \(8, 3\)"):
        _gdpo(objectives=torch.zeros(8, 3))
    with pytest.raises(ValueError, match=r"needs objectives \[B_r, K\]"):
        _gdpo(objectives=None)
    with pytest.raises(ValueError, match=r"weights must be \[K\]"):
        _gdpo(weights=torch.ones(2, 1))
    with pytest.raises(ValueError, match="unknown reward aggregation 'gdpo'"):
        group_advantages("grpo", SCORES, GROUPS, aggregation="gdpo")


def test_token_rewards_need_a_mask():
    with pytest.raises(ValueError, match="need a mask"):
        group_advantages("grpo", torch.zeros(2, 3), torch.zeros(2))


def _one_process_step(guard: NonFiniteGuard | None = None, scale: float = 1.0):
    acc = Accelerator(cpu=True)
    model = make_model()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    adv = group_advantages("grpo", SCORES, GROUPS).advantages * scale
    stats = UpdateStats()
    micro = split_rows(list(range(8)), 3)
    step = optimizer_step(acc, model, optimizer, [(m, adv[m]) for m in micro], loss_fn(model),
                          units=lambda m: float(len(m[0])), grad_clip=None, guard=guard or NonFiniteGuard(),
                          stats=stats)
    return acc.unwrap_model(model).weight.detach().clone(), stats.reduce(acc), step


def test_micro_batches_equal_one_batch_and_the_weights_are_pinned():
    weight, stats, step = _one_process_step()
    # one batch by hand: grad = -sum_i adv_i x_i / 8; SGD: w - 0.5 * grad
    from phases_case import FEATURES
    w0 = make_model().weight.detach()
    grad = -(EXPECTED[:, None] * FEATURES).sum(0, keepdim=True) / 8
    torch.testing.assert_close(weight, w0 - 0.5 * grad)
    assert step.stepped and stats["optimizer_steps"] == 1.0 and stats["nonfinite/skipped_steps"] == 0.0
    y = (FEATURES @ w0.T)[:, 0]
    assert stats["score"] == pytest.approx(float(y.mean()), abs=1e-6)  # unit-weighted mean of micro means
    assert stats["y_max"] == pytest.approx(float(y.max()), abs=1e-6)


def test_nonfinite_gradient_skips_the_step_and_three_in_a_row_stop():
    guard = NonFiniteGuard(max_consecutive=2)
    weight, stats, step = _one_process_step(guard, scale=math.nan)
    torch.testing.assert_close(weight, make_model().weight.detach())  # untouched
    assert not step.stepped and stats["nonfinite/skipped_steps"] == 1.0 and guard.skipped == 1
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        _one_process_step(guard, scale=math.nan)
    model = make_model()
    with torch.no_grad():
        model.weight[0, 1] = math.inf
    with pytest.raises(NonFiniteError, match="weight is not finite: export refused"):
        check_finite_parameters(model, "export")


def test_replay_check_mean_and_tolerance():
    check = ReplayCheck()
    check.add(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.5]))
    assert check.reduce() == (0.25, 0.5)
    assert check.verify(None, 0.3, "first replay")["replay/engine_diff_max"] == 0.5
    with pytest.raises(RuntimeError, match=r"first replay: mean \|engine logp - trainer logp\| = 0.25"):
        check.verify(None, 0.2, "first replay")


def test_sample_log_is_cut_back_on_resume(tmp_path):
    log = SampleLog(tmp_path)
    for step in (1, 2, 3):
        log.write("train", step, [{"text": f"s{step}"}])
        log.write(f"eval-step-{step:06d}", step, [{"text": "e"}])
    SampleLog(tmp_path, start_step=2)
    lines = (tmp_path / "samples" / "train.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "eval-step-000001.jsonl", "eval-step-000002.jsonl", "train.jsonl"]


def test_a_log_kept_off_the_trackers_is_cut_back_on_resume_too(tmp_path):
    """`track=False` (the prompts each step trained, `RunContext.record_prompts`): in the file,
    not in the rows the loop sends to the trackers' tables; cut back like the others."""
    log = SampleLog(tmp_path)
    for step in (1, 2, 3):
        log.write("prompts", step, [{"prompts": [step, 10 + step]}], track=False)
        log.write("train", step, [{"text": f"s{step}"}])
    assert list(log.pop()) == ["train"]
    SampleLog(tmp_path, start_step=2)
    lines = (tmp_path / "samples" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "prompts": [1, 11]}, {"step": 2, "prompts": [2, 12]}]


def test_checkpoint_is_published_only_after_its_extra_files(tmp_path):
    save_checkpoint(tmp_path, 1, state={"n": 1}, write_files=lambda d: (d / "lora").mkdir())

    def crash(folder: Path) -> None:
        raise KeyboardInterrupt  # a kill between the state files and the adapter

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, state={"n": 2}, write_files=crash)
    assert latest_checkpoint(tmp_path).name == "checkpoint-1"
    assert (latest_checkpoint(tmp_path) / "lora").is_dir()


def test_user_errors_are_one_line_without_traceback(capsys):
    def main(argv):
        raise ConfigError("rollout.temperature: must be a finite number, got nan (from override x)")

    assert run_app("my-app", main, ["a=1"]) == 2
    assert capsys.readouterr().err == "my-app: error: rollout.temperature: must be a finite number, got nan (from override x)\n"
    with pytest.raises(UserError):
        run_app("my-app", main, ["--debug"])
    assert run_app("my-app", lambda argv: None, []) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(_free_port()), str(SCRIPT), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, check=False)


def test_two_processes_with_uneven_rows_equal_one_process(tmp_path):
    result = _launch(tmp_path)
    if result.returncode != 0 and "terminate called without an active exception" in result.stderr:
        # seen about once in 8 launches under pytest on the 2-core box (never in 6 direct launches):
        # a gloo rank aborts in C++; the computation is not at fault, so launch once more
        result = _launch(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"result-{r}.pt", weights_only=False) for r in (0, 1)]
    torch.testing.assert_close(torch.cat([ranks[0]["adv"], ranks[1]["adv"]]), EXPECTED)
    torch.testing.assert_close(torch.cat([ranks[0]["gdpo_adv"], ranks[1]["gdpo_adv"]]), _gdpo().advantages)
    assert ranks[0]["gdpo_metrics"] == ranks[1]["gdpo_metrics"] == pytest.approx(_gdpo().metrics)
    weight, stats, _ = _one_process_step()
    for r in ranks:
        assert r["means"]["score"] == pytest.approx(7.5 / 7) and math.isnan(r["means"]["empty"])  # 3 + 4 values
        torch.testing.assert_close(r["weight"], weight)  # 2 + 3 micro-batches == 3 micro-batches of 8 rows
        assert r["metrics"]["reward/failed"] == 1.0 and r["metrics"]["adv/small_groups"] == 1.0
        assert r["stats"]["score"] == pytest.approx(stats["score"], abs=1e-6)
        assert r["stats"]["loss/policy"] == pytest.approx(stats["loss/policy"], abs=1e-6)
        assert r["stats"]["y_max"] == pytest.approx(stats["y_max"], abs=1e-6)


def test_component_weights_are_asked_only_for_normalize_then_sum_and_refused_where_there_are_none() -> None:
    from rl_core.train import ConfigError, component_weights

    class Summed:
        def sum_weights(self) -> dict[str, float]:
            return {"qa": 1.0, "format": 0.2}

    class Folded:
        def sum_weights(self) -> dict[str, float]:
            raise ValueError("a fold reward has no summed weights")

    assert component_weights(Summed(), "normalize_then_sum") == {"qa": 1.0, "format": 0.2}
    assert component_weights(Folded(), "sum_then_normalize") == {} and component_weights(object(), "sum_then_normalize") == {}
    with pytest.raises(ConfigError, match=r"^algo\.reward_aggregation=normalize_then_sum: a fold reward has no"):
        component_weights(Folded(), "normalize_then_sum")
    with pytest.raises(ConfigError, match=r"^algo\.reward_aggregation=normalize_then_sum: object reports no component"):
        component_weights(object(), "normalize_then_sum")


def test_gathered_means_weigh_every_value_the_same_and_a_schedule_evaluates_periodically() -> None:
    """Means of columns of different lengths (NaN for an empty one), and `Schedule.periodic`: a
    `train.eval_freq` of 6 evaluates before step 1, after 6 and 12 and after the last; 0 never."""
    assert gathered_means({"reward/mean": [1.0, 0.0, 0.5], "accuracy": [1.0, 0.0, 0.0, 0.0]}) == {
        "reward/mean": 0.5, "accuracy": 0.25}
    assert math.isnan(gathered_means({"none": []})["none"]) and gathered_means({}) == {}
    assert Schedule.periodic(13, 6) == Schedule(13, eval_every=6, eval_at_start=True, eval_at_end=True)
    assert Schedule.periodic(13, 0) == Schedule(13)
