"""rider-grm's generative judges. VeRL-with-RMs (docs/reference.md §3) keeps each judge's weights
off the GPU and loads them into its engine only while it scores: a `Judge` in process wakes its
engine, scores and puts it back to sleep (`time/judge_<name>_{wake,score,sleep}`); a served one
sends its samples to an `rl-rewards serve` reward server. Either way it records the raw outputs
and parse failures. The composition (`rewarding`) checks a judge's gate before calling it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import msgspec
import torch
from rider_config import REPO_ROOT, JudgeConfig, judge_name, resolve_model
from transformers import AutoTokenizer

from rl_core.train import ConfigError, PhaseTimer, PinnedOffload, UserError, resolve_path
from rl_policy.engine import PolicyEngine
from rl_rewards.client import (
    RemoteScorer,
    RewardClient,
    RewardClientError,
    RewardResponseError,
    RewardServerCheckError,
)
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.judge import JudgeModuleError, JudgeScorer
from rl_rollout import Engine, RecordingEngine, load_engine, resolve_judge_engine
from rl_rollout.hf import HFEngine


@dataclass
class JudgeLog:
    """What one judge did in one step (reset by `pop`)."""

    scored: int = 0
    failures: int = 0  # samples whose judge output did not parse (or that the server answered with garbage)
    request_failures: int = 0  # samples of requests that failed as a whole (server unreachable, HTTP errors)
    judged: set[int] = field(default_factory=set)  # uids sent to the judge (not gated out)
    raw: dict[int, str] = field(default_factory=dict)  # sample uid -> raw judge output
    errors: dict[int, str] = field(default_factory=dict)  # sample uid -> parse error
    policy_awake: int = 0  # times the policy engine was awake while this judge was

    def add(self, other: JudgeLog) -> None:
        """Count `other` here too: another chunk of the same step (`reward.stream`)."""
        self.scored += other.scored
        self.failures += other.failures
        self.request_failures += other.request_failures
        self.judged |= other.judged
        self.raw.update(other.raw)
        self.errors.update(other.errors)
        self.policy_awake += other.policy_awake

    def record(self, samples: Sequence[Sample], results: Sequence[ScoreResult], raw: Sequence[str] | None, *,
               parse_failures: bool = True) -> None:
        """`parse_failures=False`: the failed results are a failed request's, counted there, not twice."""
        for pos, (sample, result) in enumerate(zip(samples, results, strict=True)):
            uid = sample.metadata["uid"]
            self.judged.add(uid)
            if raw is not None:
                self.raw[uid] = raw[pos]
            if result.error is not None:
                self.failures += parse_failures
                self.errors[uid] = result.error
        self.scored += len(samples)


class Judge:
    """One generative judge: a VeRL-with-RMs module run here (`JudgeScorer` on `engine`, woken
    for the samples that reach it and put back to sleep after unless `swap=False`; `offload`: an
    `hf` engine's weights through pinned buffers on CUDA), or a reward of an `rl-rewards serve`
    server (`RemoteScorer`, no `engine`, no accelerator memory here). `text_prompts` are the row's
    `rm_prompt_{index}` (VeRL-with-RMs) or, `use_rm_prompt=False`, the policy's prompt (modules
    that write their own instructions, such as `rl_rewards.judges.rubric`). An unparseable output
    or a sample the server fails fails that sample only: the judge's `fallback` scores it, counted
    in `judge/<name>/parse_failures`, a whole failed request (unreachable, HTTP errors) in
    `request_failures` instead (each sample counted once); served
    judges return no raw text (samples/*.jsonl: `raw: null, judged: true`)."""

    def __init__(self, name: str, index: int, scorer: JudgeScorer | RemoteScorer, timer: PhaseTimer, *,
                 engine: RecordingEngine | None = None, offload: PinnedOffload | None = None,
                 use_rm_prompt: bool = True, swap: bool = True) -> None:
        self.name, self.index, self.scorer, self.timer = name, index, scorer, timer
        self.engine, self.offload, self.use_rm_prompt, self.swap = engine, offload, use_rm_prompt, swap
        self.policy: Engine | PolicyEngine | None = None  # counted in `check/policy_awake_during_<name>`
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
                parsed = True
                try:
                    results = self.scorer.score(requests)
                except (RewardResponseError, msgspec.MsgspecError, ValueError) as e:
                    # the server answered, not in our wire format (HTML, a string score): parse failures
                    error = f"reward server answer did not parse: {type(e).__name__}: {e}"
                    results = [ScoreResult.failed(error) for _ in requests]
                except (RewardClientError, httpx.HTTPError) as e:  # down after retries, HTTP errors: the request
                    self.log.request_failures += len(requests)
                    parsed = False
                    error = f"reward server request failed: {type(e).__name__}: {e}"
                    results = [ScoreResult.failed(error) for _ in requests]
            self.log.record(samples, results, raw=None, parse_failures=parsed)
            return results
        with self.timer(f"judge_{self.name}_wake"):
            self.wake()
        if self.policy is not None and self.policy.state == "awake":
            self.log.policy_awake += 1
        self.engine.texts.clear()
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

    def check(self, sample: Sample) -> None:
        """Start-up dry run on one sample: a served judge's request must go through; a module's
        lists must match (`check_judge`)."""
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
        (self.engine or cast(RemoteScorer, self.scorer)).close()  # a served judge's: its HTTP connections


def build_judge(i: int, judge: JudgeConfig, device: torch.device, timer: PhaseTimer, sleep: bool,
                world_size: int = 1) -> Judge:
    """Judge `i` of a run of `world_size` training processes: served (`engine = "server"`), or an engine + scorer here, asleep right after
    loading when `sleep`. Only an `hf` engine's weights are moved by a `PinnedOffload` (its module
    is known here, where it is built); vLLM sleeps by itself, a remote engine has nothing here."""
    prompt = judge.prompt == "rm_prompt"
    if judge.engine == "server":
        return Judge(judge_name(judge), i, RemoteScorer(str(judge.url), str(judge.spec), timeout=judge.timeout_s),
                     timer, use_rm_prompt=prompt)
    key = f"reward.judges[{i}].engine"
    kind, why = resolve_judge_engine(judge.engine, key=key, world_size=world_size)
    if judge.engine == "auto":
        print(f"judge {judge_name(judge)}: engine {why}")
    where: dict[str, Any] = {"base_url": judge.url} if kind == "openai" else {"device": device} if kind == "hf" else {}
    model = judge.model if kind == "openai" else resolve_model(judge.model, f"reward.judges[{i}].model")
    inner = load_engine(kind, model, key=key, in_process=False, **where, **judge.engine_options)
    offload = PinnedOffload(cast(HFEngine, inner).model, device) if kind == "hf" and device.type != "cpu" else None
    engine = RecordingEngine(inner)
    scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(resolve_path(judge.tokenizer or model, REPO_ROOT)),
                         resolve_path(judge.module, REPO_ROOT), temperature=judge.temperature, max_new_tokens=judge.max_new_tokens,
                         seed=judge.seed, completion_field=judge.completion_field, on_malformed=judge.on_malformed)
    out = Judge(judge_name(judge), i, scorer, timer, engine=engine, offload=offload, use_rm_prompt=prompt, swap=sleep)
    if sleep:
        out.sleep()
    return out


def check_served(judges: list[JudgeConfig], ready_timeout: float = 120.0) -> None:
    """Every `engine = "server"` judge's server answers, serves its spec and is ready within
    `ready_timeout` s (`RewardClient.check_serves`), else a `ConfigError` naming the judge and
    URL (before any model loads)."""
    for judge in (j for j in judges if j.engine == "server"):
        with RewardClient(str(judge.url), timeout=10.0) as client:
            try:
                client.check_serves(str(judge.spec), ready_timeout=ready_timeout)
            except RewardServerCheckError as e:
                raise ConfigError(f"judge {judge_name(judge)!r}: {e}") from None


def check_judge(judge: JudgeScorer, rm_prompt: str, response: str) -> None:
    """`JudgeScorer.check`, a dry run on one sample (its engine awake): a module returning the
    wrong lists is a `UserError` (one line, exit 2) naming the module's file."""
    try:
        judge.check(rm_prompt, response)
    except JudgeModuleError as e:
        raise UserError(str(e)) from None
