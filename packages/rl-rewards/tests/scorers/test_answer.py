"""The exact-answer rule, by hand."""

from __future__ import annotations

import pytest

from rl_rewards import Sample, build_reward


def _score(completion: str, reference: object, **options: object) -> tuple[float | None, dict[str, float], str | None]:
    reward = build_reward({"components": {"answer": {"scorer": "exact_answer", "options": options}}})
    [result] = reward.score([Sample(completion=completion, reference=reference)])
    return result.score, result.components, result.error


@pytest.mark.no_torch
def test_the_last_number_is_compared_as_a_number() -> None:
    assert _score("3 + 4 is 7.0", "7")[0] == 1.0  # the last number, 7.0 == 7
    assert _score("7, no wait, 8", 7)[0] == 0.0
    assert _score("7, no wait, 8", 7, answer="first")[0] == 1.0
    assert _score("-12", "-12")[0] == 1.0


@pytest.mark.no_torch
def test_partial_credit_for_a_number_and_none_without_one() -> None:
    assert _score("eight", 8, partial=0.1)[:2] == (0.0, {"answer": 0.0, "answer.has_number": 0.0})
    assert _score("9", 8, partial=0.1)[:2] == (0.1, {"answer": 0.1, "answer.has_number": 1.0})


@pytest.mark.no_torch
def test_near_grades_a_wrong_number_by_its_distance() -> None:
    """near=4, partial=0.1: 0.1 + 0.4 * (1 - d/4) for d < 4, 0.1 from d = 4 on; the exact answer 1."""
    assert _score("8", 8, partial=0.1, near=4)[0] == 1.0
    assert [_score(str(8 + d), 8, partial=0.1, near=4)[0] for d in (1, -2, 3, 4, 9)] == pytest.approx(
        [0.4, 0.3, 0.2, 0.1, 0.1])
    assert _score("9", 8, partial=0.7, near=4)[0] == 0.7  # a bonus above 0.5 is not lowered
    with pytest.raises(ValueError, match="near must be >= 0"):
        build_reward({"components": {"a": {"scorer": "exact_answer", "options": {"near": -1}}}})


@pytest.mark.no_torch
def test_a_reference_that_is_not_a_number_fails_the_sample() -> None:
    score, _, error = _score("8", "eight")
    assert score is None and "the reference 'eight' is not a number" in error
    with pytest.raises(ValueError, match="answer must be 'first' or 'last'"):
        build_reward({"components": {"a": {"scorer": "exact_answer", "options": {"answer": "middle"}}}})
