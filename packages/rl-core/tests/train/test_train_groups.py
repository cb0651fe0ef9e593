"""Group helpers an image recipe uses: ids by a key, the share of groups with no signal, and
the samples a replay plan trains (one process; the multi-process forms are the apps' tests)."""

from __future__ import annotations

import math

import torch

from rl_core.train import gathered_group_ids, zero_std_fraction
from rl_core.train.replay_plan import trained_samples


def test_ids_by_key_are_numbered_in_order_of_first_appearance() -> None:
    assert gathered_group_ids(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_zero_std_fraction_counts_groups_whose_finite_rewards_are_all_equal() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, math.nan, 2.0])  # [7]
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 2 has one finite reward, group 3 one sample
    assert zero_std_fraction(rewards, groups) == 0.5  # of groups 0 and 1, group 0 is flat


def test_trained_samples_weighs_each_micro_batch() -> None:
    plan = [[(0, torch.tensor([0, 1, 2]), 1.0)], [(1, torch.tensor([0]), 1.0), (1, torch.tensor([0]), 0.0)]]
    assert trained_samples(plan) == 4.0  # the weight-0 filler trains nothing
