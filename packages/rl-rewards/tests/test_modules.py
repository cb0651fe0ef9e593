"""VeRL-with-RMs reward modules: loaded unchanged from a file path or an import path."""

import pytest

from rl_rewards.judges import rubric, yes_no
from rl_rewards.modules import load_function, load_reward_module
from rl_rewards.rules import timestamp_format

pytestmark = pytest.mark.no_torch

MODULE_FILE = '''
def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [f"Q: {p}\\nA: {r}\\nGood? " for p, r in zip(text_prompts, text_responses)]


def rm_postprocess(results):
    return [float(len(r.split())) for r in results]
'''


def test_module_file_loaded_from_a_path(tmp_path):
    path = tmp_path / "helpful_rm.py"
    path.write_text(MODULE_FILE)
    module = load_reward_module(str(path))
    assert module.preprocess(["1+1"], ["2"], None) == ["Q: 1+1\nA: 2\nGood? "]
    assert module.postprocess(["a b c", ""]) == [3.0, 0.0]


def test_import_path_and_validation_names_module_and_function(tmp_path):
    assert load_reward_module("rl_rewards.judges.yes_no").postprocess is yes_no.rm_postprocess
    half = tmp_path / "half.py"
    half.write_text("def rm_preprocess(a, b, c):\n    return []\n")
    with pytest.raises(AttributeError, match=r"reward module '.*half.py' does not define rm_postprocess"):
        load_reward_module(str(half))
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        load_reward_module(str(tmp_path / "missing.py"))
    with pytest.raises(ModuleNotFoundError):
        load_reward_module("no_such_package.rm")


def test_example_postprocessors():
    assert rubric.rm_postprocess(['```json\n{"reason": "ok", "score": 7}\n```', 'blah {"score": 12} x', "score: 4", "nothing"]) == [
        0.7, 1.0, 0.4, 0.0,
    ]
    assert yes_no.rm_postprocess(["Yes.", " yes, it is", "No", "**Yes**", "maybe"]) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_load_function_from_a_file_or_an_import_path_and_what_a_bad_path_says(tmp_path):
    """`file.py:fn` and `pkg.module:fn`, `compute_score` when no function is named; a missing
    file, module or function is an error naming it (a config check prints it as one line)."""
    rule = tmp_path / "my_rule.py"
    rule.write_text("def compute_score(ds, s, gt, extra=None):\n    return len(s)\n"
                    "def other(ds, s, gt, extra=None):\n    return -1\n")
    assert load_function(str(rule))("d", "abc", None) == 3
    assert load_function(f"{rule}:other")("d", "abc", None) == -1
    assert load_function("rl_rewards.rules:timestamp_format") is timestamp_format
    with pytest.raises(FileNotFoundError, match=rf"^reward function file not found: {tmp_path}/missing\.py$"):
        load_function(f"{tmp_path}/missing.py:compute_score")
    with pytest.raises(AttributeError, match=rf"^{rule} defines no function 'nope' \(reward function path '{rule}:nope'\)$"):
        load_function(f"{rule}:nope")
    with pytest.raises(AttributeError, match=r"^rl_rewards\.rules defines no function 'compute_score'"):
        load_function("rl_rewards.rules")
    with pytest.raises(ModuleNotFoundError, match="no_such_rules"):
        load_function("no_such_rules:compute_score")
