"""DAPO's soft overlong punishment, by hand (L_max = 512, L_cache = 128: the ramp is 384 < n <= 512)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rl_rewards import Sample, build_reward, build_scorer
from rl_rewards.rules import overlong_punishment

pytestmark = pytest.mark.no_torch

SPEC = {"components": {"overlong": {"scorer": "overlong", "options": {"max_length": 512, "cache": 128}}}}


def _score(n: object) -> tuple[float | None, str | None]:
    [result] = build_reward(SPEC).score([Sample(completion="x", metadata={"completion_tokens": n})])
    return result.score, result.error


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, 0.0),
        (100, 0.0),  # well inside L_max - L_cache = 384
        (384, 0.0),  # boundary: n = L_max - L_cache is still free
        (385, -1 / 128),  # first step into the ramp: (384 - 385) / 128
        (448, -0.5),  # halfway: (384 - 448) / 128 = -64 / 128
        (512, -1.0),  # boundary: n = L_max ends the ramp at (384 - 512) / 128 = -1
        (513, -1.0),  # past L_max
        (10_000, -1.0),
    ],
)
def test_the_three_regions_and_their_boundaries(n: int, expected: float) -> None:
    assert _score(n) == (expected, None)
    assert overlong_punishment(n, 512, 128) == expected


def test_n_tokens_is_reported_and_the_scorer_is_inline() -> None:
    [result] = build_reward(SPEC).score([Sample(completion="x", metadata={"completion_tokens": 448})])
    assert result.components == {"overlong": -0.5, "overlong.n_tokens": 448.0}
    assert build_scorer("overlong", max_length=512, cache=128).inline


def test_no_cache_is_a_hard_cut_at_max_length() -> None:
    scorer = build_scorer("overlong", max_length=10, cache=0)
    results = scorer.score([Sample(completion="", metadata={"completion_tokens": n}) for n in (10, 11)])
    assert [r.score for r in results] == [0.0, -1.0]


def test_a_sample_without_the_token_count_fails_alone() -> None:
    reward = build_reward(SPEC)
    ok, missing = reward.score([Sample(completion="x", metadata={"completion_tokens": 448}), Sample(completion="x")])
    assert ok.score == -0.5
    assert missing.score is None
    assert "overlong" in missing.error and "metadata.completion_tokens" in missing.error
    score, error = _score("448")  # a string is not a count
    assert score is None and "metadata.completion_tokens must be an int >= 0, got '448'" in error
    score, error = _score(-1)
    assert score is None and "got -1" in error


def test_the_whitespace_tokenizer_counts_only_where_metadata_lacks_the_count() -> None:
    scorer = build_scorer("overlong", max_length=4, cache=2, tokenizer="whitespace")
    given, counted = scorer.score([Sample(completion="a b c", metadata={"completion_tokens": 1}),
                                   Sample(completion="a b c")])
    assert given.score == 0.0  # the trainer's 1 token wins over the 3 words
    assert counted.score == -0.5 and counted.components == {"n_tokens": 3.0}  # (2 - 3) / 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_length": 0, "cache": 0}, "option max_length"),
        ({"max_length": 100, "cache": 101}, "option cache"),
        ({"max_length": 100, "cache": -1}, "option cache"),
        ({"max_length": 100.0, "cache": 10}, "option max_length"),
    ],
)
def test_bad_options_raise_at_build_time(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_reward({"components": {"o": {"scorer": "overlong", "options": options}}})
    with pytest.raises(TypeError, match="valid options: max_length, cache, tokenizer"):
        build_scorer("overlong", max_length=10, cache=2, l_cache=2)


def test_scoring_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from rl_rewards import Sample, build_reward\n"
        "r = build_reward({'components': {'o': {'scorer': 'overlong', 'options': {'max_length': 4, 'cache': 2}}}})\n"
        "assert r.score([Sample(completion='', metadata={'completion_tokens': 3})])[0].score == -0.5\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
