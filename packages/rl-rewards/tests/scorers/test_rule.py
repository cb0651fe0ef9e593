"""The `rule` scorer: a verl-style compute_score from a file, by hand."""

from __future__ import annotations

import pytest

from rl_rewards import Sample, build_reward, build_scorer

pytestmark = pytest.mark.no_torch

RULE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "1.0"
    if solution_str == "raise":
        raise KeyError("answer")
    hit = float(solution_str.strip() == str(ground_truth))
    return {"score": hit + (0.5 if data_source == "gsm8k" else 0.0), "acc": hit, "note": "not a number"}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str)
'''


def test_verl_signature_dict_extras_and_per_sample_failures(tmp_path) -> None:
    (tmp_path / "my_rule.py").write_text(RULE)
    reward = build_reward({"components": {"rule": {"scorer": "rule", "options": {
        "function": f"{tmp_path / 'my_rule.py'}", "components": ["acc"]}}}})
    assert reward.keys == ("rule", "rule.acc")
    samples = [Sample(completion=" 42", reference=42, metadata={"data_source": "gsm8k"}),
               Sample(completion="41", reference=42), Sample(completion="nan"), Sample(completion="text"),
               Sample(completion="raise")]
    results = reward.score(samples)
    assert [(r.score, r.components) for r in results[:2]] == [
        (1.5, {"rule": 1.5, "rule.acc": 1.0}), (0.0, {"rule": 0.0, "rule.acc": 0.0})]
    assert [r.score for r in results[2:]] == [None, None, None]
    assert "returned nan, not a finite number" in (results[2].error or "")
    assert "returned '1.0', not a finite number" in (results[3].error or "")
    assert "KeyError: 'answer'" in (results[4].error or "")


def test_a_named_function_and_a_missing_one(tmp_path) -> None:
    (tmp_path / "my_rule.py").write_text(RULE)
    scorer = build_scorer("rule", function=f"{tmp_path / 'my_rule.py'}:plain")
    assert [r.score for r in scorer.score([Sample(completion="abc")])] == [3.0]
    with pytest.raises(AttributeError, match=r"defines no function 'nope'"):
        build_scorer("rule", function=f"{tmp_path / 'my_rule.py'}:nope")
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        build_scorer("rule", function=f"{tmp_path / 'missing.py'}")


def test_the_function_itself_instead_of_a_path() -> None:
    """In Python the function goes in as it is (a trainer that loaded and checked it already):
    the same verl signature and dict extras; a sample's error names it by its qualified name."""
    from rl_rewards.scorers.rule import RuleScorer

    def sentences(data_source, solution_str, ground_truth, extra_info=None):
        count = solution_str.count(".")
        return {"score": 1.0 / count, "sentences": count, "source": data_source}

    scorer = RuleScorer(sentences)
    ok, failed = scorer.score([Sample(completion="One. Two.", metadata={"data_source": "rider"}),
                               Sample(completion="none")])
    assert (ok.score, ok.components) == (0.5, {"sentences": 2.0})
    assert failed.score is None
    assert failed.error == ("test_the_function_itself_instead_of_a_path.<locals>.sentences: ZeroDivisionError: "
                            "float division by zero")
