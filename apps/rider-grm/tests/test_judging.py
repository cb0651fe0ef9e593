"""The reward side: judges swapped on and off, VeRL-with-RMs module files, the rule function."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, TESTS
from judging import Judge, RecordingEngine, check_judge
from rewarding import RuleScorer
from rider_config import load_function
from transformers import AutoTokenizer

from rl_core.train import PhaseTimer, UserError
from rl_models import tiny
from rl_rewards.modules import load_reward_module
from rl_rewards.samples import Sample
from rl_rewards.scorers.judge import JudgeScorer
from rl_rollout.hf import HFEngine

MODULES = REPO / "examples" / "rider-grm" / "reward_function"


@pytest.fixture(scope="module")
def judge_path() -> Path:
    return tiny.build("qwen3", seed=1)


def sample(uid: int, completion: str = "Paid every Tuesday.") -> Sample:
    return Sample(completion=completion, prompt="When am I paid?", reference="Tuesday",
                  metadata={"uid": uid, "rm_prompts": ["Rate 0-10: {response}", "Contradiction? {response}"],
                            "data_source": "rider", "extra_info": {}})


def test_verl_with_rms_module_file_loads_unchanged(judge_path: Path) -> None:
    """A module written for VeRL-with-RMs (plain functions, no imports of ours) works as is."""
    module = load_reward_module(str(MODULES / "rating_judge.py"))
    tokenizer = AutoTokenizer.from_pretrained(judge_path)
    inputs = module.preprocess(["Rate the reply: {response}"], ["Paid on Tuesday."], tokenizer)
    assert len(inputs) == 1 and "Rate the reply: Paid on Tuesday." in inputs[0]
    assert inputs[0].endswith("<|im_start|>assistant\n")  # the judge's own chat template
    assert module.postprocess(["7", "score: 10"]) == [0.7, 1.0]
    with pytest.raises(ValueError, match="no number"):
        module.postprocess(["seven"])


class StateProbe:
    """A judge scorer stand-in that records the engine states it sees while scoring."""

    def __init__(self, inner: JudgeScorer, engines: dict[str, object]) -> None:
        self.inner, self.engines, self.seen = inner, engines, []
        self.module, self.params, self.tokenizer, self.engine = inner.module, inner.params, inner.tokenizer, inner.engine

    def score(self, samples):
        self.seen.append({k: e.state for k, e in self.engines.items()})
        return self.inner.score(samples)


def test_swapped_judge_is_awake_only_while_scoring(judge_path: Path) -> None:
    policy = HFEngine.from_pretrained(tiny.build("qwen3"))
    policy.sleep()
    engine = RecordingEngine(HFEngine.from_pretrained(judge_path))
    engine.sleep()
    scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(judge_path), str(MODULES / "no_contradiction_judge.py"),
                         temperature=0.7, max_new_tokens=4)
    probe = StateProbe(scorer, {"judge": engine, "policy": policy})
    timer = PhaseTimer()
    judge = Judge("consistency", 1, probe, timer, engine=engine)
    judge.policy = policy
    results = judge.score([sample(0), sample(1)])
    assert probe.seen == [{"judge": "awake", "policy": "asleep"}]
    assert engine.state == "asleep"
    log = judge.pop()
    assert log.scored == 2 and log.policy_awake == 0
    assert set(log.raw) == {0, 1}  # raw outputs kept per sample uid
    assert log.failures == sum(r.error is not None for r in results)
    times = timer.pop()
    assert set(times) == {"time/judge_consistency_wake", "time/judge_consistency_score", "time/judge_consistency_sleep"}


def test_swapped_judge_sends_rm_prompt_of_its_index(judge_path: Path) -> None:
    engine = RecordingEngine(HFEngine.from_pretrained(judge_path))
    scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(judge_path), str(MODULES / "rating_judge.py"),
                         temperature=0.0, max_new_tokens=2)
    seen: list[str] = []
    original = scorer.module.preprocess

    class Spy:
        name, postprocess = scorer.module.name, scorer.module.postprocess

        @staticmethod
        def preprocess(prompts, responses, tok):
            seen.extend(prompts)
            return original(prompts, responses, tok)

    scorer.module = Spy()
    Judge("b", 1, scorer, PhaseTimer(), engine=engine).score([sample(0)])
    Judge("p", 1, scorer, PhaseTimer(), engine=engine, use_rm_prompt=False).score([sample(1)])
    assert seen == ["Contradiction? {response}", "When am I paid?"]


@pytest.mark.parametrize(("pre", "post", "message"), [
    ("list(r)", "None", "rm_postprocess returned None for 1 judge output; expected a list of 1 score, one per output"),
    ("list(r)", "[]", "rm_postprocess returned a list of 0 for 1 judge output; expected a list of 1 score, one per "
                      "output"),
    ("list(r)", "[0.5, 0.5]", "rm_postprocess returned a list of 2 for 1 judge output; expected a list of 1 score, "
                              "one per output"),
    ("None", "[0.5]", "rm_preprocess returned None for 1 response; expected a list of 1 judge input string, one per "
                      "response"),
])
def test_a_judge_module_returning_the_wrong_lists_is_a_user_error(tmp_path: Path, judge_path: Path, pre: str,
                                                                   post: str, message: str) -> None:
    """The start-up dry run (`check_judge`) of a module whose functions return None or the wrong
    number of items: a user error (one line, exit 2) naming the module's file, not a traceback."""
    bad = tmp_path / "bad_judge.py"
    bad.write_text(f"def rm_preprocess(p, r, t):\n    return {pre}\ndef rm_postprocess(results):\n    return {post}\n")
    engine = HFEngine.from_pretrained(judge_path)
    scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(judge_path), str(bad), max_new_tokens=2)
    with pytest.raises(UserError) as raised:
        check_judge(scorer, "prompt", "response")
    assert str(raised.value) == f"judge module {str(bad)!r}: {message}"


def test_rule_function_from_file_and_import_path() -> None:
    parity = RuleScorer(load_function(str(TESTS / "rules" / "parity_rule.py")))
    assert [r.score for r in parity.score([sample(0, "ab"), sample(1, "abc")])] == [1.0, 0.0]
    rider = RuleScorer(load_function("rider_rules:compute_score"))
    result = rider.score([sample(0, "One. Two. Three. Four.")])[0]
    assert result.score == 0.0 and result.components == {"sentences": 4.0}
    with pytest.raises(AttributeError, match="no function 'nope'"):
        load_function("rider_rules:nope")


def test_rule_error_fails_only_that_sample() -> None:
    def fragile(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 / len(solution_str)

    results = RuleScorer(fragile).score([sample(0, ""), sample(1, "ab")])
    assert results[0].score is None and "ZeroDivisionError" in results[0].error
    assert results[1].score == 0.5
