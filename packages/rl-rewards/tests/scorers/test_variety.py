"""The word-variety rule, by hand: distinct words up to the target, times the share of clean pieces."""

from __future__ import annotations

import pytest

from rl_rewards import Sample, build_reward

pytestmark = pytest.mark.no_torch

SPEC = {"components": {"variety": {"scorer": "word_variety", "options": {"target": 4}}}}


@pytest.mark.parametrize(
    ("text", "score", "words", "clean"),
    [
        ("a cat sat on the mat", 5 / 6, 5, 5 / 6),  # "a" is one letter: 5 words of 6 pieces, 5 >= 4 distinct
        ("cat dog", 2 / 4, 2, 1.0),
        ("cat cat cat cat cat cat", 1 / 4, 1, 1.0),  # repeating a word adds no distinct word
        ("Cat cAT dog", 2 / 4, 2, 1.0),  # case-blind
        ("catcatcatcatcatcat", 1 / 4, 1, 1.0),  # one piece, one word
        ("cat, dog 42 ,,,,", 1 / 4 * 1 / 4, 1, 1 / 4),  # "cat," and "42" are not words: dog alone, 1 of 4 pieces
        ("dog 42 ,,,, red", 2 / 4 * 2 / 4, 2, 2 / 4),
        ("кошка собака", 2 / 4, 2, 1.0),  # letters of any script
        ("", 0.0, 0, 0.0),
    ],
)
def test_word_variety_by_hand(text: str, score: float, words: int, clean: float) -> None:
    [r] = build_reward(SPEC).score([Sample(completion=text)])
    assert r.error is None
    assert r.score == pytest.approx(score)
    assert r.components == pytest.approx({"variety.words": words, "variety.clean": clean, "variety": score})


def test_target_below_one_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="target must be >= 1"):
        build_reward({"components": {"v": {"scorer": "word_variety", "options": {"target": 0}}}})
