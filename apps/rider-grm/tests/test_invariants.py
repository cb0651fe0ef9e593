"""rider-grm's update invariants, pinned for one full RL step (torchtune's recipe tests are the
model): 2 processes x 2 prompts = 1 process x 4 prompts, gradient accumulation over micro-batches
= one micro-batch, and every registered advantage estimator and policy loss trains every
parameter. The reward is the parity rule plus the embedding similarity (deterministic), and
rollouts are seeded per prompt, so the runs see the same samples whatever the split."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import APP, REPO, TESTS, app, tiny_overrides
from safetensors.torch import load_file

from rl_core.advantages import ADVANTAGE_ESTIMATORS
from rl_core.losses import POLICY_LOSSES
from rl_core.train.testing import launch
from rl_models import tiny


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy's weights in a checkpoint: Accelerate's file, or (train.sharding=fsdp2) the
    `torch.distributed.checkpoint` shards of every process put together."""
    folder = run / "checkpoints" / f"checkpoint-{step}"
    if not (folder / "sharded").is_dir():
        return load_file(folder / "model.safetensors")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "sharded", run / "sharded.pt")
    return torch.load(run / "sharded.pt", weights_only=True)["model"]


def one_step(tmp_path: Path, name: str, **extra: object) -> list[str]:
    return tiny_overrides(tmp_path, **{"reward.judges": "[]", "reward.rule": f'"{TESTS}/rules/parity_rule.py"',
                                       "rollout.per_prompt_seeds": "true", "train.batch_size": 4,
                                       "train.mini_batch_size": 4, "train.max_steps": 1, "train.save_freq": 1,
                                       "train.run_name": name, "algo.advantage": "grpo", "train.lr": 1e-3,
                                       **extra})


# one process, 4 prompts x 2 responses (pinned on the 2-core CPU; a changed formula moves them by far more)
PINNED = {"reward/mean": 1.055692, "grad_norm": 0.73106, "policy/entropy": 6.45467}


ASYNC = {"train.max_staleness": 1, "train.max_steps": 2, "train.save_freq": 2,
         "algo.rollout_correction": '"token_truncate"'}


# `none` is opt-in (nox -s slow), for CI time: `async` runs the same first step, pinned, then a stale one;
# `fsdp2-async` (~1 min) too: `fsdp2` and `async` each run in the default suite
@pytest.mark.parametrize("case", [pytest.param("none", marks=pytest.mark.slow), "fsdp2", "async",
                                  pytest.param("fsdp2-async", marks=pytest.mark.slow)])
def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path: Path, case: str) -> None:
    """DDP, or FSDP2 (`train.sharding=fsdp2`: weights, gradients and Adam state sharded over the
    2 gloo processes, the rollout decoding from gathered full weights) = 1 unsharded process.
    `async` (`train.max_staleness=1`, DDP): step 2 trains on samples the rollout thread drew from
    the starting weights while step 1 trained; its first step is the synchronous one.
    `fsdp2-async`: both; each process's rollout copy is whole, each version all-gathered by the
    trainer threads of both processes."""
    extra = ASYNC if "async" in case else {}
    steps = 2 if "async" in case else 1
    single = app.main(one_step(tmp_path, "one", **extra))
    sharding = "fsdp2" if case.startswith("fsdp2") else "none"
    launch(APP / "__main__.py", one_step(tmp_path, "two", **{"train.sharding": f'"{sharding}"', **extra}), cwd=REPO)
    one, two = rows(single), rows(tmp_path / "two")
    assert len(one) == len(two) == steps and (one[0]["world_size"], two[0]["world_size"]) == ("1", "2")
    for key, value in PINNED.items():
        assert float(one[0][key]) == pytest.approx(value, abs=2e-4), (key, one[0][key])
    keys = ["reward/mean", "reward/std", "adv/std", "loss/policy", "loss/kl", "grad_norm", "policy/entropy",
            "replay/engine_diff_mean"]
    for a, b in zip(one, two, strict=True):
        for key in keys + (["rollout/staleness", "policy/is_ratio_mean"] if "async" in case else []):
            assert float(b[key]) == pytest.approx(float(a[key]), abs=2e-5), (key, a[key], b[key])
    if "async" in case:
        assert [r["rollout/staleness"] for r in one] == ["0.0", "1.0"]
        assert float(one[1]["replay/engine_diff_mean"]) > 1e-4  # step 2's samples are older than its weights
    wa, wb = weights(single, steps), weights(tmp_path / "two", steps)
    start = load_file(Path(tiny.build("qwen3")) / "model.safetensors")
    assert max((wa[f"model.{k}"] - v).abs().max().item() for k, v in start.items()) > 1e-4  # the step moved them
    assert set(wa) <= set(wb)  # (the sharded state also names the tied lm_head, which safetensors drops)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=5e-6, rtol=0, msg=name)
    if case == "fsdp2":
        assert float(two[0]["time/weight_gather"]) > 0
    if case.startswith("fsdp2"):  # the shards of both processes, through DCP
        assert (tmp_path / "two" / "checkpoints" / f"checkpoint-{steps}" / "sharded").is_dir()


def test_gradient_accumulation_equals_one_micro_batch(tmp_path: Path) -> None:
    big = app.main(one_step(tmp_path, "big", **{"train.micro_batch_size": 8}))
    small = app.main(one_step(tmp_path, "small", **{"train.micro_batch_size": 1}))
    wa, wb = weights(big, 1), weights(small, 1)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=2e-6, rtol=0, msg=name)
    assert float(rows(big)[0]["loss/policy"]) == pytest.approx(float(rows(small)[0]["loss/policy"]), abs=1e-6)


# gae needs a value model (a critic), which none of the apps trains: it is tested in rl-core only
ESTIMATORS = [name for name in ADVANTAGE_ESTIMATORS.names() if name != "gae"]


# every estimator with ppo_clip, every loss with grpo: estimator and loss are independent choices
PAIRS = sorted({(e, "ppo_clip") for e in ESTIMATORS} | {("grpo", loss) for loss in POLICY_LOSSES.names()})


@pytest.mark.parametrize(("estimator", "loss"), PAIRS)
def test_every_estimator_and_loss_trains_every_parameter(tmp_path: Path, estimator: str, loss: str) -> None:
    run = app.main(one_step(tmp_path, f"{estimator}-{loss}", **{
        "algo.advantage": estimator, "algo.loss": loss, "train.max_steps": 2, "train.save_freq": 2,
        "train.mini_batch_size": 2}))
    table = rows(run)
    assert [r["step"] for r in table] == ["1", "2"]
    assert all(float(r["nonfinite/skipped_steps"]) == 0 for r in table)
    start = load_file(Path(tiny.build("qwen3")) / "model.safetensors")
    end = weights(run, 2)
    unchanged = [k for k, v in start.items() if torch.equal(end[f"model.{k}"], v)]
    assert not unchanged, unchanged
