"""The reward side of rider-grm: the rule reward, the generative judges swapped on and off the
accelerator one at a time, the embedding-similarity reward, and their composition.

VeRL-with-RMs (docs/reference.md §3) keeps each judge's weights off the GPU and loads them into its
inference engine only while it scores. Here every judge is a `Scorer` wrapped in
`SwappedJudge`, which wakes the judge's engine, scores, and puts it back to sleep, timing each
part and recording the judge's raw outputs and parse failures. The composition
(`rl_rewards.composition`, combine = "fold") evaluates the rule gate *before* a judge is
called, so gated-out samples never reach it, and a judge with nothing to score is never woken.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec
import torch
from swapping import PinnedOffload, sleep_engine, wake_engine

from rl_core.train import ConfigError
from rl_rewards.client import RemoteScorer, RewardClient, RewardClientError
from rl_rewards.samples import Sample, Scorer, ScoreResult
from rl_rewards.scorers.judge import JudgeScorer
from rl_rollout import Engine, Generation, Prompt, SamplingParams
from rl_rollout.hf import HFEngine

# ------------------------------------------------------------------------------ monitoring


class PhaseMonitor:
    """Seconds and accelerator-memory high-water mark per phase of one step.

    `with monitor("generate"): ...` adds the phase's wall time to `time/generate` and records
    the peak allocated GPU memory inside it as `mem/generate_gib` (0 on CPU). Phases entered
    twice in a step are summed (time) and maxed (memory); `pop()` returns and resets them.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        self.prefix = ""

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Record the phases of a block under `prefix` (validation: `val_generate`, ...)."""
        self.prefix = prefix
        try:
            yield
        finally:
            self.prefix = ""

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        phase = self.prefix + phase
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0
            self.peak_gib[phase] = max(self.peak_gib.get(phase, 0.0), peak)

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out |= {f"mem/{k}_gib": v for k, v in self.peak_gib.items()}
        out["mem/peak_gib"] = max(self.peak_gib.values(), default=0.0)
        self.seconds, self.peak_gib = {}, {}
        return out


# ------------------------------------------------------------------------------ rule reward


def load_function(path: str, default_name: str = "compute_score") -> Callable[..., Any]:
    """`"pkg.module:fn"` or `"path/to/file.py:fn"` (`:fn` optional, default `compute_score`)."""
    target, _, name = path.partition(":")
    name = name or default_name
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            raise FileNotFoundError(f"reward function file not found: {file}")
        spec = importlib.util.spec_from_file_location(f"rider_grm_user_{file.stem}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = module.__dict__.get(name)
    if not callable(fn):
        raise AttributeError(f"{target} defines no function {name!r} (reward function path {path!r})")
    return fn


class RuleScorer:
    """A verl `compute_score(data_source, solution_str, ground_truth, extra_info)` function as a
    scorer. It may return a float or `{"score": float, **numeric extras}` (extras become
    components); an exception is that sample's error."""

    name = "rule"

    def __init__(self, fn: Callable[..., Any], monitor: PhaseMonitor) -> None:
        self.fn, self.monitor = fn, monitor

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
        with self.monitor("rule"):
            return [self._one(s) for s in samples]


# ------------------------------------------------------------------------------ judges


class RecordingEngine:
    """An `Engine` that forwards everything to `inner` and keeps the texts it generated since
    `reset()`, so the judge's raw outputs can be logged next to its scores. `state` is the inner
    engine's ("awake"/"asleep"/"closed" for an `HFEngine`, "remote" for engines with no local
    state)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.texts: list[str] = []

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


@contextmanager
def vllm_engine_core(in_process: bool) -> Iterator[None]:
    """Build a vLLM engine inside this block with its engine core in this process (`in_process`:
    the colocated policy engine, whose weight pushes then pass tensors by reference) or in a
    process of its own (a judge: two engine cores cannot share one process).

    vLLM reads `VLLM_ENABLE_V1_MULTIPROCESSING` when an engine is built, and an engine core
    built in this process freezes vLLM's view of the environment (`vllm.envs.enable_envs_cache`
    at the end of its start-up): so every judge is built before the policy's engine, and the
    variable is set here for each build and put back after it."""
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "0" if in_process else "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def engine_state(engine: Engine) -> str:
    """"awake"/"asleep"/"closed" for an engine in this process (`hf`, `vllm`: a vLLM engine whose
    weights alone are awake counts as asleep); "remote" for engines with no local state."""
    inner = engine.inner if isinstance(engine, RecordingEngine) else engine
    state = getattr(inner, "state", None) if isinstance(inner, HFEngine) or hasattr(inner, "llm") else None
    if state is None:
        return "remote"
    return "asleep" if state == "weights" else str(state)


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


class Judge(Protocol):
    """What the loop needs of a judge, in process (`SwappedJudge`) or served (`ServedJudge`)."""

    name: str
    log: JudgeLog

    def state(self) -> str: ...  # "awake" | "asleep" | "remote"

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]: ...

    def check(self, sample: Sample) -> None: ...  # start-up dry run on one sample

    def pop(self) -> JudgeLog: ...

    def close(self) -> None: ...  # release the engine / HTTP connections at the end of the run


def judge_prompt(sample: Sample, index: int, use_rm_prompt: bool) -> str:
    """The judge module's `text_prompts` entry: the row's `rm_prompt_{index}` or the policy prompt."""
    return sample.metadata["rm_prompts"][index] if use_rm_prompt else sample.prompt


class SwappedJudge:
    """Wake the judge, score the samples that reached it, put it back to sleep (`swap=False`:
    the judge stays resident once woken).

    The judge module's `text_prompts` are the row's `rm_prompt_{index}` (VeRL-with-RMs' per-judge
    template, `use_rm_prompt=True`) or the policy's own prompt (for modules such as
    `rl_rewards.judges.rubric` that write their own instructions). A sample whose output the
    module cannot parse is an error for that sample only; the composition then uses the
    judge's `fallback` score and this wrapper counts it in `judge_<name>/parse_failures`.
    `offload` (CUDA) moves the weights through reused pinned buffers (`swapping`).
    """

    def __init__(self, name: str, index: int, scorer: JudgeScorer, engine: RecordingEngine,
                 monitor: PhaseMonitor, policy: Engine | None, use_rm_prompt: bool = True,
                 swap: bool = True, offload: PinnedOffload | None = None) -> None:
        self.name, self.index, self.scorer, self.engine = name, index, scorer, engine
        self.use_rm_prompt, self.swap, self.offload = use_rm_prompt, swap, offload
        self.monitor, self.policy = monitor, policy
        self.log = JudgeLog()

    def state(self) -> str:
        return engine_state(self.engine)

    def wake(self) -> None:
        if self.state() != "awake":  # remote/vLLM engines: their own wake (a no-op for a server)
            wake_engine(self.engine, self.offload)

    def sleep(self) -> None:
        if self.state() != "asleep":
            sleep_engine(self.engine, self.offload)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        judged = [msgspec.structs.replace(s, prompt=self.judge_prompt(s)) for s in samples]
        with self.monitor(f"judge_{self.name}_wake"):
            self.wake()
        if self.policy is not None and engine_state(self.policy) == "awake":
            self.log.policy_awake += 1
        self.engine.reset()
        try:
            with self.monitor(f"judge_{self.name}_score"):
                results = self.scorer.score(judged)
        finally:
            if self.swap:
                with self.monitor(f"judge_{self.name}_sleep"):
                    self.sleep()
        texts = self.engine.texts
        self.log.record(samples, results, texts if len(texts) == len(samples) else [" | ".join(texts)] * len(samples))
        return results

    def judge_prompt(self, sample: Sample) -> str:
        return judge_prompt(sample, self.index, self.use_rm_prompt)

    def check(self, sample: Sample) -> None:
        self.wake()
        try:
            check_judge(self.scorer, self.judge_prompt(sample), sample.completion)
        finally:
            if self.swap:
                self.sleep()

    def pop(self) -> JudgeLog:
        log, self.log = self.log, JudgeLog()
        return log

    def close(self) -> None:
        self.engine.close()


class ServedJudge:
    """A judge scored by an `rl-rewards serve` reward server through its native `/v1/score`
    (`rl_rewards.client.RemoteScorer`): the server holds the judge model and its VeRL-with-RMs
    module in its reward `spec` (a `[rewards.NAME]` table of the server's TOML), so this process
    needs no accelerator memory for it. The gate and the add/mul fold stay here, exactly as for
    an in-process judge: gated-out samples are never sent.

    The served reward's total is this judge's score. A sample the server fails (an unparseable
    judge output) comes back with an error: counted in `judge_<name>/parse_failures` and scored
    by the judge's `fallback`. A request that fails as a whole after the client's retries fails
    its samples the same way and is counted in `judge_<name>/request_failures` too. The server
    does not return the judge's raw text, so samples/*.jsonl record `raw: null, judged: true`.
    """

    def __init__(self, name: str, index: int, scorer: RemoteScorer, monitor: PhaseMonitor,
                 use_rm_prompt: bool = True) -> None:
        self.name, self.index, self.scorer, self.monitor = name, index, scorer, monitor
        self.use_rm_prompt = use_rm_prompt
        self.log = JudgeLog()

    def state(self) -> str:
        return "remote"

    def request(self, sample: Sample) -> Sample:
        """What is sent: the judge prompt as `prompt`, the response, reference and row fields."""
        meta = sample.metadata
        return Sample(completion=sample.completion, prompt=judge_prompt(sample, self.index, self.use_rm_prompt),
                      reference=sample.reference,
                      metadata={"uid": meta["uid"], "data_source": meta["data_source"], "extra_info": meta["extra_info"]})

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with self.monitor(f"judge_{self.name}_score"):
            try:
                results = self.scorer.score([self.request(s) for s in samples])
            except (RewardClientError, httpx.HTTPError, msgspec.MsgspecError, ValueError) as e:
                # down after retries, or an answer that is not our wire format (HTML, a string score)
                results = [ScoreResult.failed(f"reward server request failed: {type(e).__name__}: {e}")
                           for _ in samples]
                self.log.request_failures += len(samples)
        self.log.record(samples, results, raw=None)
        return results

    def check(self, sample: Sample) -> None:
        """Start-up dry run: the server scores one sample (an error for that sample is fine: an
        untrained judge writes anything; a refused or failed request raises)."""
        self.scorer.score([self.request(sample)])

    def pop(self) -> JudgeLog:
        log, self.log = self.log, JudgeLog()
        return log

    def close(self) -> None:
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
    """A scorer whose `score` calls are timed as one phase (`time/<phase>`, `mem/<phase>_gib`)."""

    def __init__(self, inner: Scorer, monitor: PhaseMonitor, phase: str) -> None:
        self.inner, self.monitor, self.name = inner, monitor, phase

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with self.monitor(self.name):
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
