"""CapRL++'s training-side reward, as its trainer computes it: caption QA (a judge LLM answers
each row's multiple-choice questions from the caption alone) + `format_weight` x timestamp format
(video rows) + `length_weight` x length (+ `variety_weight` x word variety), in this process
(`CaprlLocalReward`: the terms compiled into a `RewardSpec` per task, or a `RewardSpec` of your
own), or QA and format from a running CapRL-protocol reward server with the length (and variety)
added here (`CaprlServerReward`), as CapRL++ does.

    reward = build_caprl_reward(CaprlRewardConfig(judge="Qwen/Qwen3-4B-Instruct-2507"),
                                policy_path="Qwen/Qwen3-VL-4B-Instruct", seed=0)
    results = reward.score(samples)   # sample.metadata["task"]: "image" or "video"

A failure is never a zero reward: a sample that fails to score fails alone (`ScoreResult.error`),
and a server still down after its retries raises `RewardUnavailable`, for the trainer to skip
the step. `CaprlRewardConfig` is the `[reward]` table of caption-rl; its keys are named for it.
The in-process reward needs `pip install "rl-rewards[hf]"`; the server's, a length tokenizer
(`"whitespace"` needs nothing more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from rl_rewards.client import RetryPolicy, RewardClient, RewardClientError
from rl_rewards.composition import build_reward
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.spec import Component, RewardSpec

__all__ = ["CaprlLocalReward", "CaprlRewardConfig", "CaprlServerReward", "RewardUnavailable", "build_caprl_reward",
           "caprl_spec"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
_NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
_UnitInterval = Annotated[float, msgspec.Meta(ge=0, le=1)]

JUDGE_ENGINE_KEY = "reward.judge_engine"
JUDGE_MAX_MODEL_LEN = 16384  # vllm judge: a ~1.2k-token judge prompt around a caption of up to 4096 tokens, with room


class CaprlRewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    url: str | None = None
    """Running reward server (`rl-rewards serve` or CapRL's), e.g. http://host:18889/get_reward;
    unset = score in process."""
    port: _Positive = 18889  # with host: url = http://host:port/get_reward
    host: str | None = None
    judge: str = "Qwen/Qwen3-4B-Instruct-2507"  # in-process QA judge (text LLM)
    judge_engine: Literal["auto", "hf", "vllm"] = "auto"
    """The in-process judge's engine. vllm: the faster judge on a GPU (rl-rollout's README, "hf
    or vLLM?"); a vLLM engine in a process of its own, asleep outside the reward phase, `judge_gpu_memory_utilization` of the GPU while it scores;
    one training process only (a second would start its judge on GPU 0 too). hf: on the
    trainer's GPU (or the CPU), always loaded. auto: vllm on a CUDA machine where vLLM imports
    and the run has one process, else hf; the pick and why are printed at start."""
    judge_gpu_memory_utilization: _UnitInterval = 0.25  # vllm judge: GPU fraction for weights + KV cache while awake
    judge_engine_options: dict[str, Any] = {}
    """vllm judge: more `vllm.LLM` arguments, e.g. `{enforce_eager = true}`; `max_model_len`
    defaults to 16384 (or the judge's own maximum when lower): judge prompt + caption fit, and the
    KV cache of one such sequence fits the memory share (Qwen3-4B-2507's own 262,144 would not)."""
    qa_estimator: Literal["exact", "sample"] = "exact"  # see rl_rewards.scorers.caption_qa
    qa_num: _Positive = 8  # questions drawn per caption (estimator=sample)
    format_weight: _NonNegativeFloat = 0.2  # x timestamp-format reward, video rows
    format_variant: Literal["readme", "caprl-server"] = "readme"
    """Timestamp-format formula: `readme` (CapRL++'s published formula; "[00:01] x" scores 1.0)
    or `caprl-server` (what CapRL++'s reward server computes; 0.70 for the same caption)."""
    format_min_brackets: _Positive = 3  # caprl-server: stamps at which its coverage term saturates
    answer_parser: Literal["strict", "caprl"] = "strict"
    """Sampled judge answers (qa_estimator = sample): `strict` (ours) or `caprl` (the first capital
    A-I anywhere in the answer, as CapRL++)."""
    qa_prompt_file: str | None = None
    """Judge prompt template file (placeholders {caption} {question} {options} {task}, or CapRL++'s
    two `{}`): point it at the prompt you trained with. None: our prompt."""
    length_tokenizer: str | None = None  # default: the caption model's tokenizer
    length_l1: _NonNegative = 2048
    length_l2: _Positive = 3072
    length_weight: _NonNegativeFloat = 0.2
    variety_weight: _NonNegativeFloat = 0.0
    """x `word_variety` (distinct words up to `variety_target`, times the share of pieces that
    are words), added on the training side; 0 = off, as in CapRL++. Choose it when a policy
    games the length term by repeating one token."""
    variety_target: _Positive = 8
    spec: str | RewardSpec | None = None
    """A RewardSpec replacing QA + format + length in process: a TOML file, or an inline table
    (`[reward.spec.components.NAME]` with `scorer`, `weight`, `options`, ...)."""
    retries: _Positive = 5  # attempts per server call; then the step is skipped
    timeout: _PositiveFloat = 180.0  # seconds per server call

    def server_url(self) -> str | None:
        """`url`, else `http://host:port/get_reward` when `host` is set; None: in process."""
        return self.url or (f"http://{self.host}:{self.port}/get_reward" if self.host else None)


class RewardUnavailable(RuntimeError):
    """The reward server failed after every retry: the step is skipped, never scored as zero."""


def training_side(r: CaprlRewardConfig, length_tokenizer: str) -> dict[str, Component]:
    """The terms CapRL++ adds on the training side: length_weight x `length`, and variety_weight
    x `word_variety` when that weight is above 0."""
    terms = {"length": Component(scorer="length", weight=r.length_weight, options={
        "tokenizer": length_tokenizer, "l1": r.length_l1, "l2": r.length_l2})}
    if r.variety_weight > 0:
        terms["variety"] = Component(scorer="word_variety", weight=r.variety_weight,
                                     options={"target": r.variety_target})
    return terms


def caprl_spec(r: CaprlRewardConfig, task: str, length_tokenizer: str) -> RewardSpec:
    """CapRL++'s reward as a RewardSpec: `caption_qa` + format_weight x `timestamp_format` (video
    rows; `format_variant` picks its formula) + the `training_side` terms."""
    components = {"qa": Component(scorer="caption_qa"), **training_side(r, length_tokenizer)}
    if task == "video":
        components["format"] = Component(scorer="timestamp_format", weight=r.format_weight, options={
            "variant": r.format_variant, "min_brackets": r.format_min_brackets})
    return RewardSpec(components=components)


def vllm_judge_options(r: CaprlRewardConfig, judge: str) -> dict[str, Any]:
    """`vllm.LLM` arguments of the judge: its memory share, a `max_model_len` whose KV cache fits
    it (vLLM refuses to start when one sequence of the model's own maximum does not), then
    `judge_engine_options`."""
    from transformers import AutoConfig

    longest = AutoConfig.from_pretrained(judge).max_position_embeddings
    return {"gpu_memory_utilization": r.judge_gpu_memory_utilization,
            "max_model_len": min(JUDGE_MAX_MODEL_LEN, longest)} | r.judge_engine_options


class CaprlLocalReward:
    """The reward in process: `spec` for every row, or `caprl_spec` per task with one judge
    engine shared by the image and the video QA scorer (`qa_estimator`, `answer_parser` and
    `qa_prompt_file` pick CapRL++'s server formulas). A vLLM judge is asleep (weights in host
    memory, no KV cache) but while it scores, so a trainer and its policy's engine have the GPU;
    an hf judge stays loaded. `weights`: every task's component weights (empty for a fold)."""

    def __init__(self, r: CaprlRewardConfig, *, length_tokenizer: str, seed: int, world_size: int = 1) -> None:
        self.weights: dict[str, float] = {}
        self.swapped: Any = None  # the judge's engine, woken for each score call
        if r.spec is not None:
            self.by_task = dict.fromkeys(("image", "video"), build_reward(r.spec))
            self._weigh()
            return
        from rl_models import tiny
        from rl_rewards.scorers.caption_qa import CaptionQAScorer
        from rl_rewards.scorers.engines import load_tokenizer
        from rl_rollout import load_engine, resolve_judge_engine

        judge = tiny.resolve(r.judge, key="reward.judge")
        kind, why = resolve_judge_engine(r.judge_engine, key=JUDGE_ENGINE_KEY, world_size=world_size)
        print(f"caption_qa judge {r.judge}: engine {why}")
        options = vllm_judge_options(r, judge) if kind == "vllm" else {}
        # its own engine-core process: built before the policy's engine, which may run one in this process
        engine = load_engine(kind, judge, key=JUDGE_ENGINE_KEY, in_process=False, **options)
        tokenizer = load_tokenizer(judge)
        if kind == "vllm":
            engine.sleep()
            self.swapped = engine
        self.by_task = {task: build_reward(caprl_spec(r, task, length_tokenizer), scorers={"qa": CaptionQAScorer(
            engine, tokenizer, task=task, estimator=r.qa_estimator, qa_num=r.qa_num, seed=seed,
            answer_parser=r.answer_parser, prompt_template=r.qa_prompt_file)}) for task in ("image", "video")}
        self._weigh()

    def _weigh(self) -> None:
        for reward in self.by_task.values():
            try:
                self.weights |= reward.sum_weights()
            except ValueError:  # a fold reward: refused only where normalize_then_sum asks for weights
                self.weights = {}
                return

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        if self.swapped is not None:
            self.swapped.wake()
        try:
            results: list[ScoreResult | None] = [None] * len(samples)
            for task, reward in self.by_task.items():
                todo = [i for i, s in enumerate(samples) if s.metadata["task"] == task]
                for i, result in zip(todo, reward.score([samples[i] for i in todo]), strict=True):
                    results[i] = result
            return [r for r in results if r is not None]
        finally:
            if self.swapped is not None:
                self.swapped.sleep()

    def close(self) -> None:
        if self.swapped is not None:
            self.swapped.close()


class CaprlServerReward:
    """A running CapRL-protocol server (`rl-rewards serve`, or CapRL's own): POST /get_reward
    with `[caption, [[question_text, letter], ...]]`; it returns QA (+ weighted format, when the
    server runs with REWARD_TASK=video). The length reward is added here, as CapRL++ does on the
    training side. A server that does not answer at start raises `RewardClientError` naming the
    URL; one that fails mid-run is retried `retries` times, then `RewardUnavailable`."""

    def __init__(self, r: CaprlRewardConfig, url: str, *, length_tokenizer: str) -> None:
        base = url.removesuffix("/").removesuffix("/get_reward")
        self.client = RewardClient(base, timeout=r.timeout, retry=RetryPolicy(attempts=r.retries))
        try:
            self.client.health()
        except Exception as e:  # httpx connection errors, bad JSON from a non-reward server
            self.client.close()
            raise RewardClientError(f"reward server {base} is not reachable ({type(e).__name__}: {e}); start it "
                                    "with `rl-rewards serve` or fix reward.url / REWARD_REMOTE_URL") from None
        self.training_side = build_reward(RewardSpec(components=training_side(r, length_tokenizer)))
        self.weights: dict[str, float] = {}  # the server's total is not a sum known here

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        try:
            response = self.client.get_reward([(s.completion, list(s.reference)) for s in samples])
        except RewardClientError as e:
            raise RewardUnavailable(str(e)) from e
        errors = response.errors or [None] * len(samples)
        out = []
        for i, added in enumerate(self.training_side.score(samples)):
            if errors[i] is not None or added.score is None:
                out.append(ScoreResult.failed(errors[i] or added.error or "length failed"))
                continue
            components = {"qa": response.qa_rewards[i] if response.qa_rewards else response.rewards[i],
                          **{k: v for k, v in added.components.items() if "." not in k}}
            if response.format_rewards:
                components["format"] = response.format_rewards[i]
            out.append(ScoreResult(score=response.rewards[i] + added.score, components=components))
        return out

    def close(self) -> None:
        self.client.close()


def build_caprl_reward(r: CaprlRewardConfig, *, policy_path: str, seed: int, world_size: int = 1,
                       ) -> CaprlLocalReward | CaprlServerReward:
    """A server's reward when `r.server_url()` is set, else the reward in process; the length is
    counted with `length_tokenizer`, else the policy's tokenizer (`policy_path`)."""
    url, tokenizer = r.server_url(), r.length_tokenizer or policy_path
    if url:
        return CaprlServerReward(r, url, length_tokenizer=tokenizer)
    return CaprlLocalReward(r, length_tokenizer=tokenizer, seed=seed, world_size=world_size)
