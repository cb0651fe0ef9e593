"""Scorer registry: lazy built-ins, duplicate and unknown names, option checking."""

import subprocess
import sys

import pytest

from rl_rewards.registry import SCORERS, build_scorer, register_scorer
from rl_rewards.samples import Sample

pytestmark = pytest.mark.no_torch


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match=r"unknown scorer 'nope'; valid scorers: .*caption_qa.*timestamp_format"):
        build_scorer("nope")


def test_registering_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("length", lambda: None)


def test_bad_option_names_scorer_and_valid_options():
    with pytest.raises(TypeError, match=r"scorer 'length': .*valid options: tokenizer, l1, l2"):
        build_scorer("length", tokenizer="whitespace", l3=5)


def test_rule_scorers_build_and_score():
    scorer = build_scorer("length", tokenizer="whitespace", l1=1, l2=3)
    results = scorer.score([Sample(completion="one"), Sample(completion="one two"), Sample(completion="a b c d")])
    assert [r.score for r in results] == [1.0, 0.5, 0.0]
    assert build_scorer("timestamp_format").score([Sample(completion="[00:01]")])[0].score == 1.0


def test_import_and_rule_scorers_do_not_import_torch():
    code = (
        "import sys, rl_rewards, rl_rewards.offline, rl_rewards.adapters\n"
        "from rl_rewards import build_reward, Sample\n"
        "r = build_reward({'components': {'f': {'scorer': 'timestamp_format'}, "
        "'l': {'scorer': 'length', 'options': {'tokenizer': 'whitespace'}}}})\n"
        "r.score([Sample(completion='[00:01] hi')])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_builtin_names():
    assert {"timestamp_format", "length", "ocr", "clip_score", "aesthetic", "embedding_similarity", "caption_qa",
            "vl_judge", "judge"} <= set(SCORERS)


def test_readme_scorer_table_has_a_row_for_every_builtin_scorer():
    """`exact_answer` was registered but missing from README.md's table of scorers."""
    from pathlib import Path

    from rl_rewards.registry import LazyFactory

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("| name | what | extra |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    builtin = {name for name, f in SCORERS.items() if isinstance(f, LazyFactory) and f.path.startswith("rl_rewards.")}
    assert rows == builtin
