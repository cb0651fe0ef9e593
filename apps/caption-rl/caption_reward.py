"""caption-rl's reward backends: CapRL++'s reward in process (QA + format + length compiled into a
RewardSpec, or the RewardSpec given as `reward.spec`), or a running CapRL-protocol reward server.
A failure is never a zero reward: a sample that fails to score is left out of the update, a
server still down after its retries skips the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from caption_config import RewardConfig

from rl_core.train import UserError
from rl_models import tiny
from rl_rewards import Sample, ScoreResult, build_reward
from rl_rewards.client import RetryPolicy, RewardClient, RewardClientError
from rl_rewards.spec import Component, RewardSpec
from rl_rollout import Engine, resolve_judge_engine

JUDGE_ENGINE_KEY = "reward.judge_engine"
JUDGE_MAX_MODEL_LEN = 16384  # vllm judge: a ~1.2k-token judge prompt around a caption of up to 4096 tokens, with room


class RewardUnavailable(RuntimeError):
    """The reward server failed after every retry: the step is skipped, never scored as zero."""


def caprl_spec(r: RewardConfig, task: str, length_tokenizer: str) -> RewardSpec:
    """CapRL++'s reward as a RewardSpec: `caption_qa` + format_weight x `timestamp_format` (video
    rows; `format_variant` picks its formula) + length_weight x `length`."""
    components = {"qa": Component(scorer="caption_qa"), "length": Component(
        scorer="length", weight=r.length_weight,
        options={"tokenizer": length_tokenizer, "l1": r.length_l1, "l2": r.length_l2})}
    if task == "video":
        components["format"] = Component(scorer="timestamp_format", weight=r.format_weight, options={
            "variant": r.format_variant, "min_brackets": r.format_min_brackets})
    return RewardSpec(components=components)


def vllm_judge_options(r: RewardConfig, judge: str) -> dict[str, Any]:
    """`vllm.LLM` arguments of the judge: its memory share, a `max_model_len` whose KV cache fits
    it (vLLM refuses to start when one sequence of the model's own maximum does not), then
    `reward.judge_engine_options`."""
    from transformers import AutoConfig

    longest = AutoConfig.from_pretrained(judge).max_position_embeddings
    return {"gpu_memory_utilization": r.judge_gpu_memory_utilization,
            "max_model_len": min(JUDGE_MAX_MODEL_LEN, longest)} | r.judge_engine_options


class LocalReward:
    """The reward in process: `reward.spec` for every row, or `caprl_spec` per task with one
    judge engine shared by the image and the video QA scorer (`qa_estimator`, `answer_parser`
    and `qa_prompt_file` pick CapRL++'s server formulas: see the README). A vLLM judge is asleep
    (weights in host memory, no KV cache) but while it scores, so the trainer and the policy's
    engine have the GPU; an hf judge stays loaded, as before."""

    def __init__(self, r: RewardConfig, *, length_tokenizer: str, seed: int, world_size: int = 1) -> None:
        self.weights: dict[str, float] = {}  # every task's component weights (normalize_then_sum)
        self.swapped: Engine | None = None  # the judge woken for each score call
        if r.spec is not None:
            self.by_task = dict.fromkeys(("image", "video"), build_reward(r.spec))
            self._weigh()
            return
        from rl_rewards.scorers.caption_qa import CaptionQAScorer
        from rl_rewards.scorers.engines import load_tokenizer
        from rl_rollout import load_engine

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


class RemoteReward:
    """A running CapRL-protocol server (`rl-rewards serve`, or CapRL's own): POST /get_reward
    with `[caption, [[question_text, letter], ...]]`; it returns QA (+ weighted format, when the
    server runs with REWARD_TASK=video). The length reward is added here, as CapRL++ does on the
    training side. A server that is down at start is an error; one that fails mid-run is retried
    `reward.retries` times, then `RewardUnavailable` skips the step."""

    def __init__(self, r: RewardConfig, url: str, *, length_tokenizer: str) -> None:
        base = url.removesuffix("/").removesuffix("/get_reward")
        self.client = RewardClient(base, timeout=r.timeout, retry=RetryPolicy(attempts=r.retries))
        try:
            self.client.health()
        except Exception as e:  # httpx connection errors, bad JSON from a non-reward server
            raise UserError(f"reward server {base} is not reachable ({type(e).__name__}: {e}); start it with "
                            f"`rl-rewards serve` or fix reward.url / REWARD_REMOTE_URL") from None
        self.length = build_reward(RewardSpec(components={"length": Component(scorer="length", options={
            "tokenizer": length_tokenizer, "l1": r.length_l1, "l2": r.length_l2})}))
        self.length_weight = r.length_weight
        self.weights: dict[str, float] = {}  # the server's total is not a sum we know (refused in check)

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        try:
            response = self.client.get_reward([(s.completion, list(s.reference)) for s in samples])
        except RewardClientError as e:
            raise RewardUnavailable(str(e)) from e
        errors = response.errors or [None] * len(samples)
        out = []
        for i, length in enumerate(self.length.score(samples)):
            if errors[i] is not None or length.score is None:
                out.append(ScoreResult.failed(errors[i] or length.error or "length failed"))
                continue
            components = {"qa": response.qa_rewards[i] if response.qa_rewards else response.rewards[i],
                          "length": length.score}
            if response.format_rewards:
                components["format"] = response.format_rewards[i]
            out.append(ScoreResult(score=response.rewards[i] + self.length_weight * length.score,
                                   components=components))
        return out

    def close(self) -> None:
        self.client.close()


def build_reward_backend(r: RewardConfig, *, policy_path: str, seed: int, world_size: int) -> LocalReward | RemoteReward:
    """A server when `reward.url` (or `reward.host`) is set, else the reward in process."""
    url = r.url or (f"http://{r.host}:{r.port}/get_reward" if r.host else None)
    tokenizer = r.length_tokenizer or policy_path
    if url:
        return RemoteReward(r, url, length_tokenizer=tokenizer)
    return LocalReward(r, length_tokenizer=tokenizer, seed=seed, world_size=world_size)
