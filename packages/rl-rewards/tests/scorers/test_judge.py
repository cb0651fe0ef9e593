"""`judge` scorer: a VeRL-with-RMs module file + the tiny qwen3 judge through HFEngine."""

import pytest

from rl_rewards.composition import build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample

MODULE = '''
def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [tgt_tokenizer.apply_chat_template([{"role": "user", "content": f"{p} -> {r}"}], tokenize=False,
                                              add_generation_prompt=True) for p, r in zip(text_prompts, text_responses)]


def rm_postprocess(results):
    if any("FAIL" in r for r in results):
        raise ValueError("unreadable")
    return [len(r) / 100.0 for r in results]
'''


@pytest.fixture(scope="module")
def tiny_path():
    from rl_models.tiny import build

    return str(build("qwen3"))


def test_judge_from_module_file_scores_generated_text(tmp_path, tiny_path):
    from rl_rollout.hf import HFEngine
    from rl_rollout.protocol import SamplingParams

    path = tmp_path / "len_rm.py"
    path.write_text(MODULE)
    judge = build_scorer("judge", module=str(path), model=tiny_path, max_new_tokens=4, engine_options={"device": "cpu"})
    samples = [Sample(prompt="2+2?", completion="4"), Sample(prompt="sky?", completion="blue")]
    results = judge.score(samples)
    # the same greedy generation done by hand
    engine = HFEngine.from_pretrained(tiny_path, device="cpu")
    inputs = judge.module.preprocess(["2+2?", "sky?"], ["4", "blue"], judge.tokenizer)
    texts = [g.text for g in engine.generate(inputs, SamplingParams(temperature=0.0, max_new_tokens=4))]
    assert [r.score for r in results] == pytest.approx([len(t) / 100.0 for t in texts])


def test_postprocess_failure_is_per_sample(tmp_path, tiny_path):
    from rl_rollout.hf import HFEngine
    from rl_rollout.protocol import Generation

    class FailsOnSecond:
        """A wrapped real engine whose second output reads 'FAIL' (the module then raises)."""

        def __init__(self, engine):
            self.engine = engine

        def generate(self, requests, params):
            out = self.engine.generate(requests, params)
            return [g if i != 1 else Generation(request_index=1, prompt_ids=g.prompt_ids, completion_ids=[], text="FAIL",
                                                logprobs=[], finish_reason="stop") for i, g in enumerate(out)]

    from rl_rewards.scorers.judge import JudgeScorer

    path = tmp_path / "len_rm.py"
    path.write_text(MODULE)
    engine = HFEngine.from_pretrained(tiny_path, device="cpu")
    judge = JudgeScorer(FailsOnSecond(engine), engine.tokenizer, str(path), max_new_tokens=2)
    results = judge.score([Sample(prompt=str(i), completion="x") for i in range(3)])
    assert [r.error is None for r in results] == [True, False, True]
    assert "rm_postprocess failed on 'FAIL'" in results[1].error


def test_build_validates_module_before_loading_the_model(tmp_path):
    bad = tmp_path / "no_post.py"
    bad.write_text("def rm_preprocess(a, b, c):\n    return a\n")
    with pytest.raises(AttributeError, match=r"no_post.py' does not define rm_postprocess"):
        build_reward({"components": {"j": {"scorer": "judge", "options": {"module": str(bad), "model": "/nonexistent"}}}})


ECHO = '''
def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [f"grade: {r}" for r in text_responses]


def rm_postprocess(results):
    return [0.5 for _ in results]
'''


def test_completion_field_judges_the_response_field_and_malformed_json_scores_zero(tmp_path, tiny_path):
    from rl_rewards.scorers.judge import JudgeScorer
    from rl_rollout.hf import HFEngine

    class Recording:
        def __init__(self, engine):
            self.engine, self.inputs = engine, []

        def generate(self, requests, params):
            self.inputs += requests
            return self.engine.generate(requests, params)

    path = tmp_path / "echo.py"
    path.write_text(ECHO)
    engine = Recording(HFEngine.from_pretrained(tiny_path, device="cpu"))
    judge = JudgeScorer(engine, engine.engine.tokenizer, str(path), max_new_tokens=1, completion_field="Response")
    completions = [
        'Thinking... {"Response": "we will refund you", "Solution": "refund"}',  # judged: the field only
        '{"Response": "sorry"',  # VeRL-with-RMs closes a missing final brace: judged as "sorry"
        "no json here",  # malformed: 0.0, never sent to the judge
        '{"Solution": "refund"}',  # no Response field: malformed
        '{"Response": 3}',  # not a string: malformed
    ]
    results = judge.score([Sample(prompt="p", completion=c) for c in completions])
    assert engine.inputs == ["grade: we will refund you", "grade: sorry"]
    assert [r.score for r in results] == [0.5, 0.5, 0.0, 0.0, 0.0]
    assert [r.components["malformed"] for r in results] == [0.0, 0.0, 1.0, 1.0, 1.0]
    strict = JudgeScorer(engine, engine.engine.tokenizer, str(path), max_new_tokens=1, completion_field="Response",
                         on_malformed=None)
    (bad,) = strict.score([Sample(prompt="p", completion="no json here")])
    assert bad.score is None and "no JSON object" in bad.error


@pytest.mark.parametrize(("pre", "post", "message"), [
    ("None", "[0.5]", "rm_preprocess returned None for 1 response; expected a list of 1 judge input string, one per "
                      "response"),
    ("[p + r for p, r in zip(a, b)] * 2", "[0.5]", "rm_preprocess returned a list of 2 for 1 response; expected a "
                                                   "list of 1 judge input string, one per response"),
    ("list(a)", "None", "rm_postprocess returned None for 1 judge output; expected a list of 1 score, one per output"),
    ("list(a)", "[]", "rm_postprocess returned a list of 0 for 1 judge output; expected a list of 1 score, one per "
                      "output"),
    ("list(a)", "(0.5,)", "rm_postprocess returned a tuple for 1 judge output; expected a list of 1 score, one per "
                          "output"),
])
def test_check_names_the_module_and_what_its_function_returned(tmp_path, tiny_path, pre, post, message):
    from rl_rewards.scorers.judge import JudgeModuleError, JudgeScorer
    from rl_rollout.hf import HFEngine

    bad = tmp_path / "bad_judge.py"
    bad.write_text(f"def rm_preprocess(a, b, c):\n    return {pre}\ndef rm_postprocess(results):\n    return {post}\n")
    engine = HFEngine.from_pretrained(tiny_path, device="cpu")
    judge = JudgeScorer(engine, engine.tokenizer, str(bad), max_new_tokens=2)
    with pytest.raises(JudgeModuleError) as raised:
        judge.check("prompt", "response")
    assert str(raised.value) == f"judge module {str(bad)!r}: {message}"


def test_check_passes_a_good_module_and_an_output_it_cannot_parse(tmp_path, tiny_path):
    """The module of the first test scores what the tiny judge writes; one that cannot parse any
    output passes the check too (an untrained judge writes anything), its samples failing alone."""
    from rl_rewards.scorers.judge import JudgeScorer
    from rl_rollout import RecordingEngine
    from rl_rollout.hf import HFEngine

    good, unreadable = tmp_path / "len_rm.py", tmp_path / "never_parses.py"
    good.write_text(MODULE)
    unreadable.write_text(MODULE.replace('if any("FAIL" in r for r in results):', "if True:"))
    engine = RecordingEngine(HFEngine.from_pretrained(tiny_path, device="cpu"))
    for path in (good, unreadable):
        judge = JudgeScorer(engine, engine.inner.tokenizer, str(path), max_new_tokens=3)
        judge.check("2+2?", "4")
    assert len(engine.texts) == 2  # one generation per check
    [result] = JudgeScorer(engine, engine.inner.tokenizer, str(unreadable), max_new_tokens=3).score(
        [Sample(prompt="2+2?", completion="4")])
    assert result.score is None and "rm_postprocess failed" in result.error
