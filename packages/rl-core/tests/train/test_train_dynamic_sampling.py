"""DAPO's dynamic sampling in the trainer loop (`train.dynamic_sampling`): which groups are kept,
how rounds merge, and that it learns faster where groups saturate (pinned on the bandit)."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bandit_recipe as bandit

from rl_core.train import ConfigError, Scores, UserError, unknown_metric_names
from rl_core.train.dynamic_sampling import (
    GroupFilter,
    informative_groups,
    merge_scores,
    metric_values,
)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_groups_split_into_informative_and_uniform() -> None:
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, math.nan, 0.5, 0.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 5, 5])
    keep, uniform = informative_groups(values, groups)
    assert keep == [[0, 1]]  # 1 vs 0
    assert uniform == [[2, 3], [4, 5], [6, 7]]  # all 1; one finite value (NaN = failed); all 0


def test_the_metric_is_the_total_or_one_component() -> None:
    scores = Scores(torch.tensor([1.2, math.nan, 0.2]), torch.tensor([0, 0, 1]), "grpo",
                    components=[{"acc": 1.0, "overlong": 0.2}, {"acc": 1.0}, {"acc": 0.0}])
    assert metric_values(scores, "reward").tolist()[::2] == pytest.approx([1.2, 0.2])
    acc = metric_values(scores, "acc")
    assert acc[0] == 1.0 and math.isnan(acc[1]) and acc[2] == 0.0  # a failed sample has no metric
    tokens = Scores(torch.tensor([[0.0, 1.0], [0.5, 0.0]]), torch.tensor([0, 0]), "grpo",
                    mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert metric_values(tokens, "reward").tolist() == [1.0, 0.5]  # token rewards: the sequence total


def test_rounds_fill_the_batch_then_uniform_groups_fill_a_short_one() -> None:
    first = Scores(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), "grpo")  # uniform, informative
    second = Scores(torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), "grpo")  # both uniform
    f = GroupFilter("reward")
    f.add(0, first)
    assert (f.target, f.short, f.dropped) == (2, 1, 1)
    f.add(1, second)
    chosen, filled = f.selection()
    assert chosen == [(0, [2, 3]), (0, [0, 1])] and filled == 1  # the informative group, then the first spare
    merged = merge_scores([((first, second)[r], rs) for r, rs in chosen], [first, second], group_offset=10)
    assert merged.rewards.tolist() == [0.0, 1.0, 1.0, 1.0] and merged.group_ids.tolist() == [10, 10, 11, 11]


def test_merged_token_rewards_are_padded_and_tokens_summed() -> None:
    a = Scores(torch.tensor([[1.0], [0.0]]), torch.tensor([0, 0]), "grpo", mask=torch.ones(2, 1),
               components=[{"x": 1.0}, {"x": 0.0}], metrics={"tokens": 10.0, "response/length_mean": 1.0})
    b = Scores(torch.tensor([[0.0, 2.0], [0.0, 0.0]]), torch.tensor([4, 4]), "grpo",
               mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), metrics={"tokens": 14.0, "response/length_mean": 1.5})
    merged = merge_scores([(a, [0, 1]), (b, [0, 1])], [a, b], group_offset=0)
    assert merged.rewards.tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [0.0, 0.0]]
    assert merged.mask.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]
    assert merged.group_ids.tolist() == [0, 0, 1, 1] and merged.components[:2] == [{"x": 1.0}, {"x": 0.0}]
    assert merged.metrics == {"tokens": 24.0, "response/length_mean": 1.0}  # round 1's, every round's tokens


# The bandit with lr 1, 18 steps, evaluated every step (the greedy policy on all 8 prompts): with
# dynamic sampling (4 rounds at most) it answers every prompt right at step 18; without, it is at
# 0.75 then (and reaches 1.0 at step 26). Pinned on the 2-core CPU.
PINNED_EVAL = {"plain": (0.75, None), "dynamic": (1.0, 18)}


def test_dynamic_sampling_reaches_the_target_in_fewer_steps(tmp_path: Path) -> None:
    seen = {}
    for name, extra in (("plain", []), ("dynamic", ["train.dynamic_sampling.enable=true",
                                                    "train.dynamic_sampling.max_rounds=4"])):
        run_dir = bandit.main([f"train.output_dir={tmp_path}", f"train.run_name={name}", "train.max_steps=18",
                               "train.eval_every=1", "train.lr=1.0", *extra])
        assert run_dir is not None
        table = rows(run_dir)
        evals = [float(r["eval/reward/mean"]) for r in table]
        seen[name] = (max(evals), next((int(r["step"]) for r in table if float(r["eval/reward/mean"]) >= 1.0), None))
        assert not unknown_metric_names(table[0])
    assert seen == PINNED_EVAL
    first = rows(tmp_path / "dynamic")[0]
    assert float(first["dynamic_sampling/rounds"]) == 2  # round 1 had uniform groups: one more round
    assert float(first["dynamic_sampling/kept_groups"]) == 4 and float(first["dynamic_sampling/filled_groups"]) == 0
    assert float(first["dynamic_sampling/dropped_groups"]) >= 1


def test_a_metric_no_sample_reports_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"dynamic_sampling\.metric='acc'"):
        bandit.main([f"train.output_dir={tmp_path}", "train.dynamic_sampling.enable=true",
                     "train.dynamic_sampling.metric=acc"])


def test_a_recipe_without_merge_refuses_dynamic_sampling_before_setup(tmp_path: Path) -> None:
    from rl_core.train import run

    with pytest.raises(ConfigError, match="cannot merge rollout rounds"):
        run(bandit.Plain(), [f"train.output_dir={tmp_path}", "train.dynamic_sampling.enable=true"])
    assert not list(tmp_path.iterdir())  # refused before the run directory


def test_a_recipe_that_samples_whole_groups_refuses_partial_rollouts_before_setup(tmp_path: Path) -> None:
    from rl_core.train import run

    with pytest.raises(ConfigError, match=r"train\.partial_rollouts\.steps=1: .* samples whole groups only"):
        run(bandit.Plain(), [f"train.output_dir={tmp_path}", "train.partial_rollouts.steps=1"])
    assert not list(tmp_path.iterdir())
