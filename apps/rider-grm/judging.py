"""The reward side of rider-grm: the rule reward and the generative judges.

VeRL-with-RMs (docs/reference.md §3) keeps each judge's weights off the GPU and loads them into its
inference engine only while it scores. Here every judge is a `Judge`: in process, it wakes its
engine, scores and puts it back to sleep, timing each part (`time/judge_<name>_{wake,score,sleep}`);
served, an `rl-rewards serve` reward server scores for it. Either way it records the raw outputs
and parse failures. The composition (`rl_rewards.composition`, combine = "fold") evaluates the rule
gate *before* a judge is called, so gated-out samples never reach it, and a judge with nothing to
score is never woken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import msgspec
import torch

from rl_core.train import ConfigError, PhaseTimer, PinnedOffload
from rl_rewards.client import RemoteScorer, RewardClient, RewardClientError
from rl_rewards.samples import Sample, Scorer, ScoreResult
from rl_rewards.scorers.judge import JudgeScorer
from rl_rollout import Engine, Generation, Prompt, SamplingParams

# ------------------------------------------------------------------------------ rule reward


class RuleScorer:
    """A verl `compute_score(data_source, solution_str, ground_truth, extra_info)` function as a
    scorer. It may return a float or `{"score": float, **numeric extras}` (extras become
    components); an exception is that sample's error."""

    name = "rule"

    def __init__(self, fn: Callable[..., Any], timer: PhaseTimer) -> None:
        self.fn, self.timer = fn, timer

    def _one(self, sample: Sample) -> ScoreResult:
        meta = sample.metadata
        try:
            value = self.fn(meta["data_source"], sample.completion, sample.reference, meta["extra_info"])
        except Exception as e:  # a rule bug on one sample fails that sample only
            return ScoreResult.failed(f"{type(e).__name__}: {e}")
        extras = {}
        if isinstance(value, dict):
            extras = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, int | float)}
            value = value.get("score")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            # a NaN rule score would pass every gate (NaN < threshold is false) and poison the fold
            return ScoreResult.failed(f"rule returned {value!r}, not a finite number")
        return ScoreResult(score=float(value), components=extras)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with self.timer("rule"):
            return [self._one(s) for s in samples]


# ------------------------------------------------------------------------------ judges


class RecordingEngine:
    """An `Engine` that forwards everything to `inner` (its `state` too) and keeps the texts it
    generated since `reset()`, so the judge's raw outputs can be logged next to its scores."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.texts: list[str] = []

    @property
    def state(self) -> str:
        return self.inner.state

    def reset(self) -> None:
        self.texts = []

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        out = self.inner.generate(requests, params)
        self.texts += [g.text for g in out]
        return out

    def score_next_tokens(self, shared_prefix: list[int], suffixes: Sequence[list[int]],
                          candidates: Sequence[int], *, temperature: float = 1.0) -> torch.Tensor:
        return self.inner.score_next_tokens(shared_prefix, suffixes, candidates, temperature=temperature)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        self.inner.load_weights(named_tensors, version=version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


class HasState(Protocol):
    """What a judge asks of the policy's engine: whether it is awake (`rl_rollout.policy.PolicyEngine`)."""

    @property
    def state(self) -> str: ...


@dataclass
class JudgeLog:
    """What one judge did in one step (reset by `pop`)."""

    scored: int = 0
    failures: int = 0  # samples whose judge output did not parse, or that the server failed
    request_failures: int = 0  # samples of requests that failed as a whole (server unreachable)
    judged: set[int] = field(default_factory=set)  # uids sent to the judge (not gated out)
    raw: dict[int, str] = field(default_factory=dict)  # sample uid -> raw judge output
    errors: dict[int, str] = field(default_factory=dict)  # sample uid -> parse error
    policy_awake: int = 0  # times the policy engine was awake while this judge was

    def record(self, samples: Sequence[Sample], results: Sequence[ScoreResult], raw: Sequence[str] | None) -> None:
        for pos, (sample, result) in enumerate(zip(samples, results, strict=True)):
            uid = sample.metadata["uid"]
            self.judged.add(uid)
            if raw is not None:
                self.raw[uid] = raw[pos]
            if result.error is not None:
                self.failures += 1
                self.errors[uid] = result.error
        self.scored += len(samples)


class Judge:
    """One generative judge: a VeRL-with-RMs module run here (`JudgeScorer` on `engine`), or a
    reward served by `rl-rewards serve` (`RemoteScorer`, no `engine`: the server holds the module,
    model and sampling, so this process needs no accelerator memory for it).

    In process, the judge's engine is woken for the samples that reached it and put back to sleep
    after (`swap=False`: it stays resident once woken); `offload` (an `hf` engine on CUDA) moves
    its weights through reused pinned buffers (`swapping`). The module's `text_prompts` are the
    row's `rm_prompt_{index}` (VeRL-with-RMs' per-judge template, `use_rm_prompt`) or the policy's
    own prompt (modules such as `rl_rewards.judges.rubric` that write their own instructions).

    A sample whose output the module cannot parse (or that the server fails) is an error for that
    sample only: the composition uses the judge's `fallback` and it is counted in
    `judge/<name>/parse_failures`. A served request that fails as a whole after the client's
    retries fails its samples the same way, counted in `judge/<name>/request_failures` too. The
    server returns no raw text: samples/*.jsonl then record `raw: null, judged: true`.
    """

    def __init__(self, name: str, index: int, scorer: JudgeScorer | RemoteScorer, timer: PhaseTimer, *,
                 engine: RecordingEngine | None = None, offload: PinnedOffload | None = None,
                 use_rm_prompt: bool = True, swap: bool = True) -> None:
        self.name, self.index, self.scorer, self.timer = name, index, scorer, timer
        self.engine, self.offload, self.use_rm_prompt, self.swap = engine, offload, use_rm_prompt, swap
        self.policy: HasState | None = None  # counted in `check/policy_awake_during_<name>`
        self.log = JudgeLog()

    def state(self) -> str:
        return self.engine.state if self.engine is not None else "remote"

    def wake(self) -> None:
        if self.engine is not None and self.engine.state != "awake":  # openai: its own wake, a no-op
            if self.offload is not None:
                self.offload.to_device()
            self.engine.wake()

    def sleep(self) -> None:
        if self.engine is not None and self.engine.state != "asleep":
            if self.offload is not None:
                self.offload.to_host()
            self.engine.sleep()

    def request(self, sample: Sample) -> Sample:
        """What the judge sees: the judge prompt as `prompt`, the response, reference and row fields."""
        meta = sample.metadata
        return Sample(completion=sample.completion, reference=sample.reference,
                      prompt=meta["rm_prompts"][self.index] if self.use_rm_prompt else sample.prompt,
                      metadata={"uid": meta["uid"], "data_source": meta["data_source"], "extra_info": meta["extra_info"]})

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        requests = [self.request(s) for s in samples]
        if self.engine is None:
            with self.timer(f"judge_{self.name}_score"):
                results = self._served(requests)
            self.log.record(samples, results, raw=None)
            return results
        with self.timer(f"judge_{self.name}_wake"):
            self.wake()
        if self.policy is not None and self.policy.state == "awake":
            self.log.policy_awake += 1
        self.engine.reset()
        try:
            with self.timer(f"judge_{self.name}_score"):
                results = self.scorer.score(requests)
        finally:
            if self.swap:
                with self.timer(f"judge_{self.name}_sleep"):
                    self.sleep()
        texts = self.engine.texts
        self.log.record(samples, results, texts if len(texts) == len(samples) else [" | ".join(texts)] * len(samples))
        return results

    def _served(self, requests: list[Sample]) -> list[ScoreResult]:
        try:
            return self.scorer.score(requests)
        except (RewardClientError, httpx.HTTPError, msgspec.MsgspecError, ValueError) as e:
            # down after retries, or an answer that is not our wire format (HTML, a string score)
            self.log.request_failures += len(requests)
            return [ScoreResult.failed(f"reward server request failed: {type(e).__name__}: {e}") for _ in requests]

    def check(self, sample: Sample) -> None:
        """Start-up dry run on one sample: the module's lists must match (`check_judge`); a served
        judge's request must go through (an unreadable output is fine: untrained judges write anything)."""
        if not isinstance(self.scorer, JudgeScorer):
            self.scorer.score([self.request(sample)])
            return
        self.wake()
        try:
            check_judge(self.scorer, self.request(sample).prompt, sample.completion)
        finally:
            if self.swap:
                self.sleep()

    def pop(self) -> JudgeLog:
        log, self.log = self.log, JudgeLog()
        return log

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        elif isinstance(self.scorer, RemoteScorer):
            self.scorer.close()


def check_server(url: str, spec: str, judge: str, ready_timeout: float = 120.0) -> None:
    """Raise `ConfigError` naming the judge and URL when no reward server answers there or it
    is not ready after `ready_timeout` s, or listing the served rewards when `spec` is not one."""
    client = RewardClient(url, timeout=10.0)
    try:
        try:
            health = client.health()  # answers (503) while the server still loads its judges
        except (httpx.TransportError, msgspec.MsgspecError) as e:
            raise ConfigError(f"judge {judge!r}: no rl-rewards server answers at {url} "
                              f"({type(e).__name__}: {e}); start one with `rl-rewards serve --config FILE`") from None
        if spec not in health.rewards:
            raise ConfigError(f"judge {judge!r}: the reward server at {url} does not serve spec {spec!r}; "
                              f"it serves {', '.join(health.rewards) or 'nothing'} (its [rewards.NAME] tables)")
        try:
            client.wait_ready(timeout=ready_timeout)
        except TimeoutError as e:
            raise ConfigError(f"judge {judge!r}: the reward server at {url} is not ready: {e}") from None
    finally:
        client.close()


class TimedScorer:
    """A scorer whose `score` calls are timed as one phase (`time/<phase>`, `memory/<phase>_peak_gib`)."""

    def __init__(self, inner: Scorer, timer: PhaseTimer, phase: str) -> None:
        self.inner, self.timer, self.name = inner, timer, phase

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with self.timer(self.name):
            return self.inner.score(samples)


# ------------------------------------------------------------------------------ start-up check


def check_judge(judge: JudgeScorer, rm_prompt: str, response: str) -> None:
    """Dry run of a judge on one sample (its engine awake): the module must return exactly one
    judge input and one score per item, or this raises naming the module and the function.
    An output the module cannot parse is fine here: random or untrained judges write anything."""
    module = judge.module
    inputs = module.preprocess([rm_prompt], [response], judge.tokenizer)
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], str):
        raise ValueError(f"judge module {module.name!r}: rm_preprocess returned {_describe(inputs)} for 1 "
                         "sample; it must return one judge input string per response")
    text = judge.engine.generate(inputs, judge.params)[0].text
    try:
        scores = module.postprocess([text])
    except Exception:  # unparseable output: a per-sample error during training, not a bad module
        return
    if not isinstance(scores, list) or len(scores) != 1:
        raise ValueError(f"judge module {module.name!r}: rm_postprocess returned {_describe(scores)} for 1 "
                         "judge output; it must return one score per output")


def _describe(value: Any) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else f"a {type(value).__name__}"
