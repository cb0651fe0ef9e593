"""Swap plans (`rl_policy.swap.compute_swap_plan`) on hand-worked memory budgets; the swap itself
runs in rider-grm's tests (judges in process, `reward.swap`)."""

from __future__ import annotations

import pytest

from rl_policy.swap import PLANS, compute_swap_plan


def test_swap_plan_keeps_everything_resident_when_it_fits() -> None:
    # never = max(30 + 20, 25 + 20 + 20 - 10, 25 + 20 + 20 - 10) = 55 <= 80
    assert compute_swap_plan(30, 20, [10, 10], [25, 25], capacity=80) == "never"


def test_swap_plan_keeps_the_policy_when_only_one_judge_fits_beside_it() -> None:
    # never = max(30 + 20, 25 + 20 + 10, 35 + 20 + 10) = 65 > 60; judges = 35 + 20 = 55 <= 60
    assert compute_swap_plan(30, 20, [10, 10], [25, 35], capacity=60) == "judges"


def test_swap_plan_swaps_everything_when_a_judge_and_the_policy_do_not_fit() -> None:
    # judges = 35 + 20 = 55 > 50
    assert compute_swap_plan(30, 20, [10, 10], [25, 35], capacity=50) == "always"


def test_swap_plan_without_judges_and_bad_input() -> None:
    assert compute_swap_plan(30, 20, [], [], capacity=1) == "never"
    with pytest.raises(ValueError, match="2 judge weights but 1 judge peaks"):
        compute_swap_plan(30, 20, [1, 2], [3], capacity=80)
    assert [PLANS[n].offload_policy for n in ("always", "judges", "never")] == [True, False, False]
    assert [PLANS[n].sleep_judges for n in ("always", "judges", "never")] == [True, True, False]
