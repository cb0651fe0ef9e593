"""`judge`: a generative reward model built from a VeRL-with-RMs reward module.

The module's `rm_preprocess(prompts, responses, judge_tokenizer)` builds the judge inputs, the
engine generates, and `rm_postprocess(outputs)` turns them into scores — the module is loaded
unchanged (`rl_rewards.modules`). If `rm_postprocess` raises on a batch, it is called again one
output at a time so only the unreadable outputs fail.

`completion_field`: VeRL-with-RMs' policy answers with a JSON object and its judges grade only
its `"Response"` field (`rules.json_field`). Set `completion_field="Response"` to send the judge
that field instead of the whole completion; a completion without it (malformed JSON) is not sent
to the judge and scores `on_malformed` (0.0, as there; None makes it the sample's error). The
`malformed` component says which samples those were (1.0) and is reported only with a field.
Use it with modules that take plain text; VeRL-with-RMs' own modules extract the field inside
`rm_preprocess` themselves (leave `completion_field` unset for them).

`JudgeScorer.check(prompt, response)` is a dry run on one sample for start-up: a module whose
functions return the wrong lists raises `JudgeModuleError` naming its file before a run depends
on it (during scoring such a module fails whole batches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rl_rewards.modules import RewardModule, load_reward_module
from rl_rewards.rules import json_field
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.engines import Engine, SamplingParams, judge_engine, load_tokenizer


class JudgeModuleError(ValueError):
    """A reward module's function returned something other than one item per input
    (`JudgeScorer.check`); the message names the module, what it returned and what it must."""


class JudgeScorer:
    """Scores `Sample.completion` (the response) to `Sample.prompt` with a judge LLM.

    temperature/top_p/max_new_tokens/seed: the judge's sampling (VeRL-with-RMs sets one
    temperature per judge; 0 = greedy, the default, for a deterministic judge).
    completion_field/on_malformed: judge one JSON field of the completion (module docstring).
    """

    name = "judge"

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        module: str | RewardModule,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 512,
        seed: int | None = None,
        completion_field: str | None = None,
        on_malformed: float | None = 0.0,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.completion_field, self.on_malformed = completion_field, on_malformed
        self.module = load_reward_module(module) if isinstance(module, str) else module
        self.params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        if self.completion_field is None:
            return self._judge([s.prompt for s in samples], [s.completion for s in samples])
        results: list[ScoreResult | None] = [None] * len(samples)
        keep, answers = [], []
        for i, sample in enumerate(samples):
            try:
                answers.append(json_field(sample.completion, self.completion_field))
                keep.append(i)
            except ValueError as e:
                results[i] = (
                    ScoreResult.failed(f"{self.module.name}: {e}") if self.on_malformed is None
                    else ScoreResult(score=self.on_malformed, components={"malformed": 1.0})
                )
        judged = self._judge([samples[i].prompt for i in keep], answers) if keep else []
        for i, result in zip(keep, judged, strict=True):
            result.components["malformed"] = 0.0
            results[i] = result
        return [r for r in results if r is not None]

    def check(self, prompt: str, response: str) -> None:
        """Dry run on one sample (the engine awake; one generation): `rm_preprocess` must return
        a list of one judge input string, `rm_postprocess` a list of one score, else
        `JudgeModuleError` naming the module's file, what the function returned and what it
        must. An output the module cannot parse passes: a random or untrained judge writes
        anything, and `score` fails such a sample alone. Call it once before training on a
        module you did not write; `score` checks only the number of inputs."""
        module = self.module
        inputs = module.preprocess([prompt], [response], self.tokenizer)
        if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], str):
            raise JudgeModuleError(f"judge module {module.name!r}: rm_preprocess returned {_describe(inputs)} for 1 "
                                   "response; expected a list of 1 judge input string, one per response")
        text = self.engine.generate(inputs, self.params)[0].text
        try:
            scores = module.postprocess([text])
        except Exception:  # unparseable output: a per-sample error while scoring, not a bad module
            return
        if not isinstance(scores, list) or len(scores) != 1:
            raise JudgeModuleError(f"judge module {module.name!r}: rm_postprocess returned {_describe(scores)} for 1 "
                                   "judge output; expected a list of 1 score, one per output")

    def _judge(self, prompts: list[str], completions: list[str]) -> list[ScoreResult]:
        inputs = self.module.preprocess(prompts, completions, self.tokenizer)
        if len(inputs) != len(completions):
            raise ValueError(f"{self.module.name}.rm_preprocess returned {len(inputs)} inputs for {len(completions)} samples")
        texts = [g.text for g in self.engine.generate(list(inputs), self.params)]
        try:
            scores: list[Any] = list(self.module.postprocess(texts))
            if len(scores) != len(texts):
                raise ValueError(f"returned {len(scores)} scores for {len(texts)} outputs")
        except Exception:  # retry one by one: only the unreadable outputs fail
            scores = [self._one(text) for text in texts]
        return [s if isinstance(s, ScoreResult) else self._result(s) for s in scores]

    def _one(self, text: str) -> float | ScoreResult:
        try:
            return self.module.postprocess([text])[0]
        except Exception as e:
            return ScoreResult.failed(f"{self.module.name}.rm_postprocess failed on {text[:80]!r}: {type(e).__name__}: {e}")

    def _result(self, value: Any) -> ScoreResult:
        if isinstance(value, bool) or not isinstance(value, int | float):  # None, "0.5", a dict: not a score
            return ScoreResult.failed(f"{self.module.name}.rm_postprocess returned {value!r}, not a number")
        value = float(value)
        if not math.isfinite(value):
            return ScoreResult.failed(f"{self.module.name}.rm_postprocess returned {value}")
        return ScoreResult(score=value)


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    return f"a list of {len(value)}" if isinstance(value, list) else f"a {type(value).__name__}"


def build_judge(
    *,
    module: str,
    model: str,
    engine: str = "auto",
    engine_options: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    seed: int | None = None,
    completion_field: str | None = None,
    on_malformed: float | None = 0.0,
) -> JudgeScorer:
    """`judge` from a config: the module is checked before the judge model is loaded."""
    reward_module = load_reward_module(module)
    return JudgeScorer(
        judge_engine(engine, model, engine_options, who="judge"), load_tokenizer(tokenizer or model), reward_module,
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
        completion_field=completion_field, on_malformed=on_malformed,
    )
