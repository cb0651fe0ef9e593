# ruff: noqa: E402  (imports follow the importorskip of the optional extra)
"""caption_qa on real tiny judges (rl_models.tiny qwen3 through HFEngine): QA parsing, prompts from
the judge's chat template, per-sample errors, and `sample` converging to `exact`."""

import random

import pytest

torch = pytest.importorskip("torch")  # the [hf] extra; skipped in the torch-free session

from rl_rewards.samples import Sample
from rl_rewards.scorers.caption_qa import (
    CANNOT_ANSWER,
    CaptionQAScorer,
    Question,
    parse_qa,
    question_text,
)

SHORT_TEMPLATE = "{{ messages[-1]['content'] }}\n"  # template override: keeps CPU prompts short


@pytest.fixture(scope="module")
def tiny_judge():
    from rl_models.tiny import build
    from rl_rollout.hf import HFEngine

    return HFEngine.from_pretrained(build("qwen3"), device="cpu", max_batch_size=512)


@pytest.fixture(scope="module")
def letter_judge(tmp_path_factory):
    """The tiny qwen3 edited so its next token after "... The answer is" is always one of " A".." D":
    the token " is" gets a large residual component that the (untied) LM head turns into a -40
    logit for every token but the four letters, whose rows are scaled up so that their
    distribution is far from uniform. A real checkpoint loaded by the real HFEngine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

    from rl_models.tiny import build
    from rl_rollout.hf import HFEngine

    src = build("qwen3")
    tok = AutoTokenizer.from_pretrained(src)
    base = AutoModelForCausalLM.from_pretrained(src)
    base.config.tie_word_embeddings = False
    model = Qwen3ForCausalLM(base.config)
    state = base.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model.load_state_dict(state)
    letters = [tok.encode(f" {c}", add_special_tokens=False)[0] for c in "ABCD"]
    with torch.no_grad():
        model.model.embed_tokens.weight[tok.encode(" is", add_special_tokens=False)[-1], 0] = 2.0
        head = model.lm_head.weight  # [V, H]
        head[:, 0] = -8.0
        head[letters, 0] = 0.0
        head[letters] *= 150.0
    model.generation_config = base.generation_config
    out = tmp_path_factory.mktemp("letter_judge")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return HFEngine.from_pretrained(out, device="cpu", max_batch_size=1024)


def test_parse_qa_both_formats_and_normalization():
    rows = [
        {"question": "What is red?", "choices": ["A. car", "B) sky", "(C) tree"], "answer": "A"},
        {"question": "Which one?", "choices": ["dog", "cat", CANNOT_ANSWER], "answer": "C"},
        ["How many dogs?\n   - A) one\n   - B) C) two", "B"],  # stale letter left inside by an old client
    ]
    q = parse_qa(rows)
    assert q[0] == Question(question="What is red?", options=("car", "sky", "tree"), gold=0)
    assert q[1] == Question(question="Which one?", options=("dog", "cat"), gold=2)  # its own "cannot" -> the last one
    assert q[2] == Question(question="How many dogs?", options=("one", "two"), gold=1)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ([], "non-empty QA list"),
        (None, "non-empty QA list"),
        ([{"question": "q", "answer": "A"}], "question 0 is malformed: missing field 'choices'"),
        ([{"question": "q", "choices": ["a", "b"], "answer": "A"}, {"question": "q", "choices": ["a"], "answer": "Z"}],
         "question 1 is malformed: answer 'Z' matches no option"),
        ([["no options here", "A"]], "question 0 is malformed: no option lines"),
    ],
)
def test_parse_qa_errors_name_the_question(reference, message):
    with pytest.raises(ValueError, match=message):
        parse_qa(reference)


def test_question_text_relabels_and_tracks_gold():
    q = Question(question="What?", options=("car", "sky", "tree"), gold=1)
    text, gold = question_text(q, [2, 0, 1])
    assert text == f"What?\n   - A) tree\n   - B) car\n   - C) sky\n   - D) {CANNOT_ANSWER}"
    assert gold == 2
    cannot = Question(question="What?", options=("car", "sky"), gold=2)
    assert question_text(cannot, [1, 0])[1] == 2


def test_prompt_uses_the_judge_chat_template(tiny_judge):
    scorer = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, task="video")
    text = tiny_judge.tokenizer.decode(scorer.prompter.ids("[00:01] a cat", "Q?\n   - A) x"))
    assert text.startswith("<|im_start|>system\n") and "[mm:ss]" in text
    assert text.count("<Caption Start>") == 3  # two few-shot examples + the caption
    assert text.endswith("<|im_start|>user\nCaption: <Caption Start> [00:01] a cat <Caption End>\nQuestion: Q?\n"
                         "   - A) x<|im_end|>\n<|im_start|>assistant\nThe answer is")
    assert scorer.letter_ids == [tiny_judge.tokenizer.encode(f" {c}", add_special_tokens=False)[0] for c in "ABCDEFGHI"]


def test_exact_matches_a_hand_computed_softmax_and_isolates_bad_samples(tiny_judge):
    scorer = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, temperature=0.7)
    qa = [{"question": "Color?", "choices": ["red", "blue"], "answer": "B"}]
    good, empty, bad = scorer.score([
        Sample(completion="A blue ball.", reference=qa), Sample(completion="x", reference=[]),
        Sample(completion="x", reference=[{"question": "q", "choices": [], "answer": "A"}]),
    ])
    assert empty.error is not None and "non-empty QA list" in empty.error
    assert bad.error is not None and "question 0 is malformed" in bad.error
    # by hand: full-sequence logits at the prefill end, softmax over the vocab at T, renormalized over A-C
    ids = scorer.prompter.ids("A blue ball.", question_text(parse_qa(qa)[0], [0, 1])[0])
    with torch.no_grad():
        logits = tiny_judge.model(torch.tensor([ids])).logits[0, -1].double()  # [V]
    letters = (logits / 0.7).log_softmax(-1)[scorer.letter_ids[:3]]  # [3]
    assert good.score == pytest.approx(letters.softmax(-1)[1].item(), abs=1e-5)
    assert good.components["letter_mass"] == pytest.approx(letters.exp().sum().item(), rel=1e-4)


def test_sample_estimator_is_a_multiple_of_one_over_qa_num(tiny_judge):
    scorer = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, estimator="sample", qa_num=4, seed=0,
                             chat_template=SHORT_TEMPLATE)
    qa = [{"question": "Color?", "choices": ["red", "blue"], "answer": "B"}]
    results = scorer.score([Sample(completion="A blue ball.", reference=qa), Sample(completion="y", reference=[])])
    assert results[0].score is not None and results[0].score * 4 == int(results[0].score * 4)
    assert results[1].score is None and "non-empty QA list" in (results[1].error or "")


def test_sample_mean_converges_to_exact_on_a_single_letter_judge(letter_judge):
    rng = random.Random(0)
    words = ["red", "blue", "car", "dog", "tree", "sky", "house", "cat", "runs", "big", "small", "green"]
    captions = [
        (" ".join(rng.choice(words) for _ in range(8)),
         [{"question": "Big one?", "choices": ["dog", "cat", "tree"], "answer": "A"},
          {"question": "Who runs?", "choices": ["sky", "car", "cat", CANNOT_ANSWER], "answer": "D"}]),
        (" ".join(rng.choice(words) for _ in range(8)), [{"question": "Green one?", "choices": ["house", "sky", "dog"], "answer": "B"}]),
    ]
    # every question has 3 options + "cannot answer": the judge's letters A-D are exactly the options
    samples = [Sample(completion=c, reference=qa) for c, qa in captions]
    exact = CaptionQAScorer(letter_judge, letter_judge.tokenizer, permutations=3, temperature=1.0, chat_template=SHORT_TEMPLATE)
    exact_results = exact.score(samples)
    assert all(r.components["letter_mass"] > 0.999 for r in exact_results)  # the judge answers with a letter
    expected = [r.score for r in exact_results]
    sampler = CaptionQAScorer(letter_judge, letter_judge.tokenizer, estimator="sample", qa_num=8, max_new_tokens=1,
                              temperature=1.0, seed=0, chat_template=SHORT_TEMPLATE)
    runs = 60  # 60 independent runs per caption, scored in one batch
    results = sampler.score([samples[0]] * runs + [samples[1]] * runs)
    means = [sum(r.score for r in results[:runs]) / runs, sum(r.score for r in results[runs:]) / runs]
    # 480 draws per caption: standard error <= 0.023; allow about 3 of them
    assert means == pytest.approx(expected, abs=0.06)
    assert abs(expected[0] - expected[1]) > 0.05  # the two captions really differ (0.289 vs 0.219)


class _PerCallJudge:
    """The same HFEngine seen without `score_next_tokens_batch` (like the vllm/openai engines),
    so the scorer takes its one-call-per-caption path."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def score_next_tokens(self, *args, **kwargs):
        self.calls += 1
        return self.engine.score_next_tokens(*args, **kwargs)


def test_batched_exact_equals_per_caption_scoring_and_a_too_long_caption_fails_alone(tiny_judge):
    from rl_rollout.protocol import BatchScoringEngine

    assert isinstance(tiny_judge, BatchScoringEngine)
    qa = [
        {"question": "Color?", "choices": ["red", "blue"], "answer": "B"},
        {"question": "Shape?", "choices": ["A. ball", "B. cube", "C. cone"], "answer": "A"},
    ]
    too_long = "word " * (tiny_judge.max_context + 10)
    samples = [Sample(completion=c, reference=qa) for c in ("A blue ball.", "A red cube on a table.", too_long, "cone")]
    batched = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, permutations=2).score(samples)
    per_call_judge = _PerCallJudge(tiny_judge)
    one_by_one = CaptionQAScorer(per_call_judge, tiny_judge.tokenizer, permutations=2).score(samples)
    assert per_call_judge.calls == 4  # one engine call per caption on the fallback path
    assert batched[2].error is not None and "context" in batched[2].error
    assert one_by_one[2].error is not None and "context" in one_by_one[2].error
    for i in (0, 1, 3):
        assert batched[i].error is None
        assert batched[i].score == pytest.approx(one_by_one[i].score, abs=1e-5)
        assert batched[i].components["letter_mass"] == pytest.approx(one_by_one[i].components["letter_mass"], rel=1e-4)


# ----------------------------------------------------------- CapRL++ drop-in options


CAPRL_STYLE = (  # CapRL++'s prompt shape: raw chat tokens, two positional fields, ends on the prefill
    "<|im_start|>user\nAnswer strictly based on the caption.\n\n"
    "Caption: <Caption Start> {} <Caption End>  \nQuestion: {}  <|im_end|>\n<|im_start|>assistant\nThe answer is"
)
NAMED = "[{task}] {caption}\nQ: {question}\n{options}\nThe answer is"


def _template(tmp_path, text: str) -> str:
    path = tmp_path / "prompt.txt"
    path.write_text(text)
    return str(path)


class _ScriptedJudge:
    """Reads each prompt it is sent (the real tiny tokenizer decodes it), finds the letter of the
    option `right`, and answers it wrapped as `answer.format(letter)`: the parser is what decides."""

    def __init__(self, tokenizer, right: str, answer: str):
        self.tokenizer, self.right, self.answer, self.prompts = tokenizer, right, answer, []

    def generate(self, prompts, params):
        from rl_rollout.protocol import Generation

        out = []
        for i, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids)
            self.prompts.append(text)
            letter = next(line.split(")")[0][-1] for line in text.splitlines() if line.endswith(f") {self.right}"))
            out.append(Generation(request_index=i, prompt_ids=ids, completion_ids=[], text=self.answer.format(letter),
                                  logprobs=[], finish_reason="stop"))
        return out


@pytest.mark.parametrize(("answer", "strict", "caprl"), [
    (" **{}**", 0.0, 1.0), (" {} is correct", 0.0, 1.0), ("Option {}", 0.0, 1.0), ("answer: {}", 0.0, 1.0),
    (" {}", 1.0, 1.0),
])
def test_answer_parser_caprl_reads_what_strict_refuses(tiny_judge, answer, strict, caprl):
    qa = [{"question": "Color?", "choices": ["red", "blue", "green"], "answer": "B"}]
    sample = Sample(completion="A blue ball.", reference=qa)
    for parser, expected in (("strict", strict), ("caprl", caprl)):
        judge = _ScriptedJudge(tiny_judge.tokenizer, "blue", answer)
        scorer = CaptionQAScorer(judge, tiny_judge.tokenizer, estimator="sample", qa_num=4, seed=1,
                                 answer_parser=parser, chat_template=SHORT_TEMPLATE)
        (result,) = scorer.score([sample])
        assert result.score == expected, (parser, answer)
        assert result.components["parsed"] == (1.0 if expected else 0.0)


def test_answer_parser_is_checked():
    with pytest.raises(ValueError, match=r"answer_parser must be one of \['caprl', 'strict'\], got 'loose'"):
        CaptionQAScorer(None, None, answer_parser="loose")


def test_caprl_style_template_renders_exactly(tiny_judge, tmp_path):
    scorer = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, prompt_template=_template(tmp_path, CAPRL_STYLE))
    text = f"Color?\n   - A) red\n   - B) blue\n   - C) {CANNOT_ANSWER}"
    assert scorer.prompter.render("A blue ball.", text) == CAPRL_STYLE.format("A blue ball.", text)
    assert tiny_judge.tokenizer.decode(scorer.prompter.ids("A blue ball.", text)) == CAPRL_STYLE.format("A blue ball.", text)
    named = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, task="video", prompt_template=_template(tmp_path, NAMED))
    assert named.prompter.render("cap", text) == (
        f"[video] cap\nQ: Color?\n   - A) red\n   - B) blue\n   - C) {CANNOT_ANSWER}\nThe answer is")


def test_exact_estimator_with_a_template_shares_the_prefix_and_matches_full_prompts(tiny_judge, tmp_path):
    scorer = CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, permutations=2, temperature=0.7,
                             prompt_template=_template(tmp_path, CAPRL_STYLE))
    qa = [{"question": "Color?", "choices": ["red", "blue"], "answer": "B"},
          {"question": "Shape?", "choices": ["ball", "cube", "cone"], "answer": "A"}]
    (questions,) = [parse_qa(qa)]
    plan = scorer._plan("A blue ball.", questions)
    caption_end = len(tiny_judge.tokenizer(CAPRL_STYLE.split("{}")[0] + "A blue ball.")["input_ids"])
    assert len(plan.prefix) >= caption_end - 1  # the caption is in the shared prefix
    (result,) = scorer.score([Sample(completion="A blue ball.", reference=qa)])
    # by hand: every (question, shift) prompt in full, its letter softmax, mean per question, then mean
    per_question = []
    for q in questions:
        n, probs = len(q.options), []
        for k in range(2):
            text, gold = question_text(q, [(j + k) % n for j in range(n)])
            ids = tiny_judge.tokenizer(CAPRL_STYLE.format("A blue ball.", text), add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = tiny_judge.model(torch.tensor([ids])).logits[0, -1].double()  # [V]
            letters = (logits / 0.7).log_softmax(-1)[scorer.letter_ids[: n + 1]]  # [n + 1]
            probs.append(letters.softmax(-1)[gold].item())
        per_question.append(sum(probs) / len(probs))
    assert result.score == pytest.approx(sum(per_question) / 2, abs=1e-5)


def test_sample_estimator_sends_the_rendered_template(tiny_judge, tmp_path):
    judge = _ScriptedJudge(tiny_judge.tokenizer, "blue", " {}")
    scorer = CaptionQAScorer(judge, tiny_judge.tokenizer, estimator="sample", qa_num=3, seed=0,
                             prompt_template=_template(tmp_path, NAMED))
    qa = [{"question": "Color?", "choices": ["red", "blue"], "answer": "B"}]
    (result,) = scorer.score([Sample(completion="A blue ball.", reference=qa)])
    assert result.score == 1.0
    assert len(judge.prompts) == 3
    for prompt in judge.prompts:
        assert prompt.startswith("[image] A blue ball.\nQ: Color?\n   - A) ") and prompt.endswith(
            f"   - C) {CANNOT_ANSWER}\nThe answer is")


@pytest.mark.parametrize(("text", "message"), [
    ("{caption} {question} {choices}", r"unknown field\(s\) \['choices'\]"),
    ("{caption} {question}", "never shows the judge the question and its options"),
    ("{question} {options}", "never shows the judge the caption"),
    ("{} {} {}", "more than two positional fields"),
    ("{caption {question}", "not a str.format template"),
])
def test_bad_templates_name_the_problem(tiny_judge, tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, prompt_template=_template(tmp_path, text))


def test_missing_template_file_names_the_setting(tiny_judge, tmp_path):
    with pytest.raises(FileNotFoundError, match="REWARD_QA_PROMPT_FILE"):
        CaptionQAScorer(tiny_judge, tiny_judge.tokenizer, prompt_template=str(tmp_path / "nope.txt"))


def test_server_settings_reach_the_served_judge(tmp_path):
    from rl_models.tiny import build
    from rl_rewards.rules import first_capital_letter
    from rl_rewards.server.rewards import build_served
    from rl_rewards.server.settings import load_settings

    env = {"REWARD_MODEL": str(build("qwen3")), "REWARD_ANSWER_PARSER": "caprl",
           "REWARD_QA_PROMPT_FILE": _template(tmp_path, CAPRL_STYLE)}
    settings = load_settings(flags={"judge_options": {"engine_options": {"device": "cpu"}}}, environ=env)
    judge = build_served(settings)["caption_qa"]
    assert judge.parse_answer is first_capital_letter
    assert judge.prompter.template == CAPRL_STYLE
    assert judge.estimator == "sample"  # CapRL's own estimator on the drop-in server
