"""`caption_qa`: how well a text LLM answers multiple-choice questions from the caption alone.

CapRL++ (docs/reference.md §1) rewards a caption with the accuracy of a judge LLM that sees only the
caption. Each question's options are relabelled A, B, ... with "Can not answer based on the
caption" always last; the judge's turn is pre-filled with "The answer is".

Two estimators of the same quantity:

- `exact` (default): every question is scored once, in one shared-prefix pass per caption
  (`Engine.score_next_tokens`: system prompt + few-shot examples + caption are computed once,
  each question is a suffix). For question q with m options (the last one "cannot answer"),
  let l_j be the judge's next-token log-prob of the option letter token j (" A", " B", ...)
  under softmax(logits / temperature) over the full vocabulary. Then

      p_q(j) = exp(l_j) / sum_{k<m} exp(l_k)         (renormalized over q's option letters)
      R_acc  = mean over questions of mean over K permutations of p_q(gold letter)

  i.e. the expected accuracy of a judge that answers with a letter. Renormalizing is what makes
  `exact` the limit of `sample`: when the judge's first token is always an option letter,
  sampling at the same temperature picks letter j with probability p_q(j), so the mean of
  many `sample` runs converges to `exact`. Mass on other tokens (" the", a newline) would in
  sampling usually continue to a letter a few tokens later; renormalizing treats it as
  answering in the same proportions instead of counting it wrong. The unnormalized letter
  mass is reported as the `letter_mass` component (near 1 for a well-prompted judge).
  `permutations=K` averages over K cyclic shifts of the options ("cannot answer" stays last);
  K = number of options puts every option in every position once, cancelling position bias.
- `sample`: CapRL-compatible. `qa_num` questions drawn with replacement, options shuffled,
  one prompt per draw, sampled at `temperature` (top_p 1) for up to `max_new_tokens` tokens;
  the answer is read by `answer_parser` (below). R_acc is a multiple of 1/qa_num, as in CapRL.
  Pick it to reproduce CapRL's reward distribution; pick `exact` for training (lower variance,
  and about qa_num times fewer prefills).

Reading sampled answers (`answer_parser`, `sample` only): `strict` (default,
`rules.first_option_letter`) counts a letter only as a standalone answer token; `caprl`
(`rules.first_capital_letter`) reproduces CapRL++: the first capital A-I anywhere. They differ on
`" **C**"`, `" C is correct"`, `"Option C"`, `"answer: C"` (strict: no answer, scores 0; caprl: C)
and on `"I think B"` (strict: no answer; caprl: I, wrong). Use `caprl` to reproduce a CapRL++
run's rewards, `strict` otherwise.

The judge prompt (`prompt_template`): by default our prompt is rendered with the judge's chat
template (system instructions, two few-shot examples, the caption and question, then
"The answer is"). A template file replaces all of it: its text, formatted with Python
`str.format` fields, is the judge's whole raw prompt (no chat template is applied; write the
chat tokens into the file, as CapRL++'s prompts do) and must end where the judge writes its
answer letter (e.g. "... The answer is"). Fields:

- `{caption}`: the caption; `{question}`: the question alone; `{options}`: the option lines
  (`   - A) red` ... `   - D) Can not answer based on the caption`), relabelled and with
  "cannot answer" last; `{task}`: `image` or `video`.
- Two positional `{}`: the caption, then the question followed by its option lines — how
  CapRL++'s own prompts are written (`Caption: <Caption Start> {} <Caption End> ... Question: {}`),
  so the prompt a CapRL++ run trained with loads unchanged once saved to a file.

Literal braces are written `{{` and `}}`. Both estimators use the template; `exact` still shares
the longest common token prefix of a caption's prompts (everything up to the first token that
differs between its questions), so a template that puts the caption before the question keeps
that saving.

"Can not answer" (a known, kept difference): CapRL++ deletes an existing
`E) Can not answer based on the caption` or `F) ...` line, appends it again always as `F`, and
keeps the gold letter it was sent. When the gold answer was that line (`E`), the judge's correct
choice is now written `F` while the gold stays `E` — that question can never be answered right
(and with 4 options, E now names nothing). Here options are relabelled consistently: an existing
"cannot answer" option is dropped, appended as the next letter after the real options, and the
gold follows it.

Both use temperature 0.6 by default, CapRL's sampling temperature, so `exact` estimates the
expectation of CapRL's reward. `Sample.completion` is the caption; `Sample.reference` the QA
list, either CapRL data rows `[{"question", "choices", "answer"}, ...]` or CapRL wire pairs
`[[question_text, answer_letter], ...]`. An empty or malformed QA list fails that sample only.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

try:
    import torch
except ImportError as e:  # the base install: without this, the server's error named no extra
    raise ImportError(f'caption_qa needs torch: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e

from rl_rewards.rules import ANSWER_PARSERS
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.engines import (
    BatchScoringEngine,
    Engine,
    SamplingParams,
    judge_engine,
    load_tokenizer,
)

try:
    from rl_data.choices import (
        Choice,
        answer_index,
        format_question_text,
        normalize_choices,
        parse_question_text,
    )
except ImportError as e:  # pragma: no cover - the [hf] extra installs rl-data
    raise ImportError(f'caption_qa needs rl-data: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e

CANNOT_ANSWER = "Can not answer based on the caption"
PREFILL = "The answer is"
LETTERS = "ABCDEFGHI"  # CapRL parses A-I: at most 8 options plus "cannot answer"


class Question(msgspec.Struct, frozen=True):
    """One question: option texts without labels ("cannot answer" excluded), gold index."""

    question: str
    options: tuple[str, ...]
    gold: int  # == len(options) when the answer is "cannot answer"


def _parse_item(item: Any) -> Question:
    if isinstance(item, dict):
        question, choices, answer = item["question"], list(item["choices"]), str(item["answer"])
        texts = [c.text for c in normalize_choices(choices)]
        gold = answer_index(choices, answer)
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        question, parsed = parse_question_text(item[0])
        texts = [c.text for c in parsed]
        gold = answer_index([f"{c.letter}) {c.text}" for c in parsed], str(item[1]))
    else:
        raise ValueError("expected {'question', 'choices', 'answer'} or [question_text, answer_letter]")
    # "cannot answer" is always appended last; drop a copy the data already carries.
    keep = [i for i, t in enumerate(texts) if t.strip().lower() != CANNOT_ANSWER.lower()]
    gold = keep.index(gold) if gold in keep else len(keep)
    if not question.strip() or not keep:
        raise ValueError("empty question or no options besides 'cannot answer'")
    if len(keep) + 1 > len(LETTERS):
        raise ValueError(f"{len(keep)} options: at most {len(LETTERS) - 1} fit the letters {LETTERS} with 'cannot answer'")
    return Question(question=question.strip(), options=tuple(texts[i] for i in keep), gold=gold)


def parse_qa(reference: Any) -> list[Question]:
    """The sample's QA list as Questions; ValueError names the bad question's index."""
    if not isinstance(reference, (list, tuple)) or not reference:
        raise ValueError(f"caption_qa: Sample.reference must be a non-empty QA list, got {reference!r:.80}")
    questions = []
    for i, item in enumerate(reference):
        try:
            questions.append(_parse_item(item))
        except KeyError as e:
            raise ValueError(f"caption_qa: question {i} is malformed: missing field {e}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"caption_qa: question {i} is malformed: {e}") from None
    return questions


def question_text(question: Question, order: Sequence[int]) -> tuple[str, int]:
    """CapRL question text with options in `order` and "cannot answer" last; the gold position."""
    texts = [question.options[i] for i in order] + [CANNOT_ANSWER]
    gold = len(order) if question.gold == len(question.options) else list(order).index(question.gold)
    return format_question_text(question.question, normalize_choices([Choice("A", t) for t in texts])), gold


_OPTIONS_START = re.compile(r"\n   - [A-Z]\) ")  # where `format_question_text` starts the option lines
TEMPLATE_FIELDS = ("caption", "question", "options", "task")


def split_question_text(text: str) -> tuple[str, str]:
    """(question, option lines) of a `question_text` (the inverse of `format_question_text`)."""
    match = _OPTIONS_START.search(text)
    if match is None:
        return text, ""
    return text[: match.start()], text[match.start() + 1 :]


def load_prompt_template(path: str) -> str:
    """Read and check a judge prompt template (fields: see the module docstring); the errors
    name the file and the bad field."""
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except OSError as e:
        raise FileNotFoundError(f"caption_qa: cannot read prompt_template {path!r} (REWARD_QA_PROMPT_FILE): {e}") from None
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"caption_qa: prompt_template {path!r} is not a str.format template ({e}); "
                         "write literal braces as {{ and }}") from None
    positional = [f for f in fields if f == "" or f.isdigit()]
    unknown = sorted({f for f in fields if f not in positional and f not in TEMPLATE_FIELDS})
    if unknown:
        raise ValueError(f"caption_qa: prompt_template {path!r} uses unknown field(s) {unknown}; valid fields: "
                         f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}, or two positional {{}} (caption, question)")
    if len(positional) > 2 or any(f.isdigit() and int(f) > 1 for f in positional):
        raise ValueError(f"caption_qa: prompt_template {path!r} has more than two positional fields; "
                         "CapRL++'s prompts use two: the caption, then the question with its options")
    has_caption = "caption" in fields or bool(positional)
    has_question = len(positional) == 2 or {"question", "options"} <= set(fields)
    if not (has_caption and has_question):
        raise ValueError(f"caption_qa: prompt_template {path!r} never shows the judge the "
                         f"{'caption' if not has_caption else 'question and its options'}; use {{caption}}, "
                         "{question} and {options} (or CapRL++'s two positional {})")
    try:
        template.format("c", "q\n   - A) x", caption="c", question="q", options="   - A) x", task="image")
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"caption_qa: prompt_template {path!r} cannot be formatted: {e}") from None
    return template


_SYSTEM = {
    "image": (
        "You are given a caption of an image and a multiple-choice question about the image. Answer using only "
        "the information in the caption; do not guess from common sense. If the caption does not contain the "
        f'answer, choose "{CANNOT_ANSWER}". Reply with "{PREFILL}" followed by the option letter.'
    ),
    "video": (
        "You are given a caption of a video and a multiple-choice question about the video. The caption marks "
        "events with [mm:ss] timestamps; use the timestamps and the order of events in the caption for questions "
        "about when or in what order things happen. Answer using only the information in the caption; do not "
        f'guess. If the caption does not contain the answer, choose "{CANNOT_ANSWER}". Reply with "{PREFILL}" '
        "followed by the option letter."
    ),
}
_FEW_SHOT = {
    "image": (
        "A red car is parked on a wet street in front of a bakery. Two people with umbrellas walk past it.",
        [("What color is the car?", ("Blue", "Red", "Green"), "B"), ("What brand is the car?", ("Toyota", "Ford"), "C")],
    ),
    "video": (
        "[00:00 - 00:05] A man opens a fridge. [00:05 - 00:12] He takes out two eggs and cracks them into a pan. "
        "[00:12 - 00:20] He stirs the eggs and serves them on a plate.",
        [
            ("What does the man do right after opening the fridge?", ("Serves a plate", "Takes out eggs", "Washes a pan"), "B"),
            ("What does the man drink at the end?", ("Coffee", "Orange juice"), "C"),
        ],
    ),
}


@dataclass(frozen=True)
class QAPrompter:
    """Builds the judge's prompt token ids: our prompt through the judge's own chat template
    (or `chat_template`), or a raw `template` (see the module docstring)."""

    tokenizer: Any
    task: Literal["image", "video"] = "image"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    template: str | None = None

    def messages(self, caption: str, text: str) -> list[dict[str, str]]:
        shot_caption, shots = _FEW_SHOT[self.task]
        messages = [{"role": "system", "content": _SYSTEM[self.task]}]
        for question, options, answer in shots:
            shot = Question(question=question, options=options, gold="ABC".index(answer))
            messages.append({"role": "user", "content": _user(shot_caption, question_text(shot, range(len(options)))[0])})
            messages.append({"role": "assistant", "content": f"{PREFILL} {answer}."})
        messages.append({"role": "user", "content": _user(caption, text)})
        return messages

    def render(self, caption: str, text: str) -> str:
        """The prompt text for a caption and a `question_text` (question + option lines)."""
        if self.template is not None:
            question, options = split_question_text(text)
            return self.template.format(caption, text, caption=caption, question=question, options=options,
                                        task=self.task)
        rendered = self.tokenizer.apply_chat_template(
            self.messages(caption, text), tokenize=False, add_generation_prompt=True,
            chat_template=self.chat_template, **(self.chat_template_kwargs or {}),
        )
        return rendered + PREFILL

    def ids(self, caption: str, text: str) -> list[int]:
        return self.tokenizer(self.render(caption, text), add_special_tokens=False)["input_ids"]

    def ids_batch(self, pairs: Sequence[tuple[str, str]]) -> list[list[int]]:
        """`ids` of many (caption, text) pairs in one tokenizer call (a fast tokenizer encodes a
        batch on several threads: ~1,000 judge prompts of ~1,300 tokens take seconds one by one)."""
        if not pairs:
            return []
        return list(self.tokenizer([self.render(c, t) for c, t in pairs], add_special_tokens=False)["input_ids"])

    def letter_ids(self) -> list[int]:
        """Token id of " A", " B", ... as the judge would write it right after the prompt;
        checks that appending a letter never re-tokenizes the prompt."""
        base = self.ids("a caption", "a question\n   - A) yes")
        ids = []
        for letter in LETTERS:
            extended = self.tokenizer(self.tokenizer.decode(base) + " " + letter, add_special_tokens=False)["input_ids"]
            if extended[:-1] != base:
                end = "the prompt template" if self.template is not None else repr(PREFILL)
                raise ValueError(
                    f"the judge tokenizer does not write ' {letter}' as one token after {end} "
                    f"(got {extended[len(base) - 1 :]}); caption_qa needs single-token option letters"
                    + ("; end the template with the words before the letter, e.g. 'The answer is'"
                       if self.template is not None else "")
                )
            ids.append(extended[-1])
        return ids


def _user(caption: str, text: str) -> str:
    return f"Caption: <Caption Start> {caption} <Caption End>\nQuestion: {text}"


@dataclass(frozen=True)
class _ExactPlan:
    """One caption's questions for the `exact` estimator: `variants[row]` is (question index,
    gold position, number of letters) of `suffixes[row]`."""

    prefix: list[int]
    suffixes: list[list[int]]
    variants: list[tuple[int, int, int]]
    num_questions: int
    width: int


def _aggregate(plan: _ExactPlan, logprobs: torch.Tensor) -> ScoreResult:
    """Expected accuracy from letter log-probs `[S, C>=width]`: per question, the probability of
    the gold letter renormalized over its options, averaged over permutations, then questions."""
    per_question = torch.zeros(plan.num_questions, dtype=torch.float64)  # [Q]
    counts = torch.zeros(plan.num_questions, dtype=torch.float64)  # [Q]
    mass = 0.0
    for row, (qi, gold, m) in enumerate(plan.variants):
        letters = logprobs[row, :m].double()  # [m]
        per_question[qi] += letters.softmax(-1)[gold]
        counts[qi] += 1
        mass += letters.exp().sum().item()
    accuracy = (per_question / counts).mean().item()
    return ScoreResult(score=accuracy, components={"letter_mass": mass / len(plan.variants)})


def _common_prefix_len(rows: Sequence[list[int]]) -> int:
    """Longest common prefix, leaving at least one suffix token per row."""
    n = min(len(r) for r in rows) - 1
    low, high = min(rows), max(rows)  # the common prefix of all rows is that of the extremes
    for i in range(n):
        if low[i] != high[i]:
            return i
    return n


class CaptionQAScorer:
    """The `caption_qa` scorer over any `Engine` (see the module docstring for the estimators).

    engine/tokenizer: the judge LLM and its tokenizer. estimator: `exact` | `sample`.
    task: `image` | `video` prompt. temperature: both estimators (CapRL: 0.6).
    permutations (exact): K cyclic option shifts averaged. qa_num, max_new_tokens, seed
    (sample): draws per caption, decode length, RNG seed for draws/shuffles/sampling.
    answer_parser (sample): `strict` | `caprl`. prompt_template: path of a judge prompt
    template file (None: our prompt). See the module docstring for both.
    """

    name = "caption_qa"

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        estimator: Literal["exact", "sample"] = "exact",
        task: Literal["image", "video"] = "image",
        temperature: float = 0.6,
        permutations: int = 1,
        qa_num: int = 8,
        max_new_tokens: int = 10,
        seed: int | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        answer_parser: Literal["strict", "caprl"] = "strict",
        prompt_template: str | None = None,
    ) -> None:
        if answer_parser not in ANSWER_PARSERS:
            raise ValueError(f"caption_qa: answer_parser must be one of {sorted(ANSWER_PARSERS)}, got {answer_parser!r}")
        if estimator not in ("exact", "sample"):
            raise ValueError(f"caption_qa: estimator must be 'exact' or 'sample', got {estimator!r}")
        if task not in _SYSTEM:
            raise ValueError(f"caption_qa: task must be 'image' or 'video', got {task!r}")
        if temperature <= 0 or permutations < 1 or qa_num < 1:
            raise ValueError(f"caption_qa: need temperature > 0, permutations >= 1, qa_num >= 1; got "
                             f"{temperature}, {permutations}, {qa_num}")
        self.engine, self.estimator, self.temperature = engine, estimator, temperature
        self.permutations, self.qa_num, self.max_new_tokens = permutations, qa_num, max_new_tokens
        template = load_prompt_template(prompt_template) if prompt_template is not None else None
        self.prompter = QAPrompter(tokenizer, task, chat_template, chat_template_kwargs, template)
        self.parse_answer = ANSWER_PARSERS[answer_parser]
        self.letter_ids = self.prompter.letter_ids()
        self.rng = random.Random(seed)
        self.seeded = seed is not None

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        parsed: list[list[Question] | ScoreResult] = []
        for sample in samples:
            try:
                parsed.append(parse_qa(sample.reference))
            except ValueError as e:
                parsed.append(ScoreResult.failed(str(e)))
        if self.estimator == "exact":
            return self._exact_batch(samples, parsed)
        return self._sample(samples, parsed)

    def _plans(self, captions: dict[int, tuple[str, list[Question]]]) -> dict[int, _ExactPlan]:
        """`_plan` of every caption, all prompts tokenized in one call."""
        texts = {i: self._question_texts(qs) for i, (_, qs) in captions.items()}
        pairs = [(captions[i][0], text) for i, (ts, _) in texts.items() for text in ts]
        ids = iter(self.prompter.ids_batch(pairs))
        return {i: self._plan_rows(variants, [next(ids) for _ in ts], len(captions[i][1]))
                for i, (ts, variants) in texts.items()}

    def _plan(self, caption: str, questions: list[Question]) -> _ExactPlan:
        """Every question (x permutations) of one caption as token ids after their shared prefix."""
        return self._plans({0: (caption, questions)})[0]

    def _question_texts(self, questions: list[Question]) -> tuple[list[str], list[tuple[int, int, int]]]:
        """Every question x permutation as text, with its (question index, gold position, number
        of letters)."""
        texts, variants = [], []
        for qi, q in enumerate(questions):
            n = len(q.options)
            for k in range(min(self.permutations, n)):
                text, gold = question_text(q, [(j + k) % n for j in range(n)])
                texts.append(text)
                variants.append((qi, gold, n + 1))
        return texts, variants

    def _plan_rows(self, variants: list[tuple[int, int, int]], rows: list[list[int]], num_questions: int) -> _ExactPlan:
        """The plan of one caption from its prompts' token ids (`rows`, one per variant)."""
        cut = _common_prefix_len(rows)
        return _ExactPlan(
            prefix=rows[0][:cut],
            suffixes=[r[cut:] for r in rows],
            variants=variants,
            num_questions=num_questions,
            width=max(v[2] for v in variants),
        )

    def _exact_batch(self, samples: Sequence[Sample], parsed: list) -> list[ScoreResult]:
        """One engine call for the whole batch when the engine packs several prefixes together
        (`BatchScoringEngine`); otherwise, or if that call fails, one call per caption so a bad
        sample (e.g. longer than the judge's context) fails alone."""
        plans = self._plans({i: (s.completion, q) for i, (s, q) in enumerate(zip(samples, parsed, strict=True))
                             if not isinstance(q, ScoreResult)})
        results: list[ScoreResult | None] = [p if isinstance(p, ScoreResult) else None for p in parsed]
        if plans and isinstance(self.engine, BatchScoringEngine):
            width = max(plan.width for plan in plans.values())
            try:
                tables = self.engine.score_next_tokens_batch(
                    [(plan.prefix, plan.suffixes) for plan in plans.values()],
                    self.letter_ids[:width], temperature=self.temperature,
                )  # one [S_i, width] table per caption
            except (ValueError, RuntimeError):
                tables = None
            if tables is not None:
                for (i, plan), table in zip(plans.items(), tables, strict=True):
                    results[i] = _aggregate(plan, table)
        for i, plan in plans.items():
            if results[i] is None:
                results[i] = self._exact_one(plan)
        return [r for r in results if r is not None]

    def _exact_one(self, plan: _ExactPlan) -> ScoreResult:
        try:
            logprobs = self.engine.score_next_tokens(
                plan.prefix, plan.suffixes, self.letter_ids[: plan.width], temperature=self.temperature
            )  # [S, C]
        except (ValueError, RuntimeError) as e:
            return ScoreResult.failed(f"caption_qa: judge failed: {e}")
        return _aggregate(plan, logprobs)

    def _sample(self, samples: Sequence[Sample], parsed: list) -> list[ScoreResult]:
        pairs, golds, owners = [], [], []
        for i, (sample, questions) in enumerate(zip(samples, parsed, strict=True)):
            if isinstance(questions, ScoreResult):
                continue
            for _ in range(self.qa_num):
                q = self.rng.choice(questions)
                text, gold = question_text(q, self.rng.sample(range(len(q.options)), len(q.options)))
                pairs.append((sample.completion, text))
                golds.append(LETTERS[gold])
                owners.append(i)
        prompts = self.prompter.ids_batch(pairs)
        params = SamplingParams(
            temperature=self.temperature, top_p=1.0, max_new_tokens=self.max_new_tokens,
            seed=self.rng.randrange(2**31) if self.seeded else None,
        )
        generations = self.engine.generate(prompts, params) if prompts else []
        correct: dict[int, list[float]] = {}
        parsed_letters: dict[int, list[float]] = {}
        for owner, gold_letter, generation in zip(owners, golds, generations, strict=True):
            letter = self.parse_answer(generation.text, LETTERS)
            correct.setdefault(owner, []).append(float(letter == gold_letter))
            parsed_letters.setdefault(owner, []).append(float(letter is not None))
        return [
            p if isinstance(p, ScoreResult) else ScoreResult(
                score=sum(correct[i]) / self.qa_num, components={"parsed": sum(parsed_letters[i]) / self.qa_num}
            )
            for i, p in enumerate(parsed)
        ]


def build_caption_qa(
    *,
    model: str,
    engine: str = "auto",
    engine_options: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    estimator: Literal["exact", "sample"] = "exact",
    task: Literal["image", "video"] = "image",
    temperature: float = 0.6,
    permutations: int = 1,
    qa_num: int = 8,
    max_new_tokens: int = 10,
    seed: int | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    answer_parser: Literal["strict", "caprl"] = "strict",
    prompt_template: str | None = None,
) -> CaptionQAScorer:
    """`caption_qa` from a config: judge checkpoint `model` served by `engine` (`auto`: vllm on a
    CUDA machine where vLLM imports, else hf, logged; `hf`, `vllm`, `openai`), tokenizer from
    `tokenizer` (default: `model`). Other options: `CaptionQAScorer`."""
    return CaptionQAScorer(
        judge_engine(engine, model, engine_options, who="caption_qa judge"), load_tokenizer(tokenizer or model),
        estimator=estimator, task=task, temperature=temperature, permutations=permutations, qa_num=qa_num,
        max_new_tokens=max_new_tokens, seed=seed, chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs, answer_parser=answer_parser, prompt_template=prompt_template,
    )
