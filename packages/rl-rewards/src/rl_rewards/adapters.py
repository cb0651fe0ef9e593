"""Turn a reward (spec, scorer, or server URL) into the reward function a framework expects.

Signatures follow each framework exactly (REFERENCE.md §4):
- TRL: `f(prompts, completions, completion_ids=None, **dataset_columns) -> list[float | None]`
  (None = abstain/failed; async when the reward is remote).
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw) -> dict`
  and the batch form `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`.
- OpenRLHF: `reward_func(queries, prompts, labels, **kw) -> {"rewards", "scores", "extra_logs"}`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_rewards.composition import Reward, build_reward
from rl_rewards.samples import AsyncScorer, Sample, Scorer, ScoreResult
from rl_rewards.spec import RewardSpec

Target = RewardSpec | Mapping[str, Any] | str | Path | Scorer | AsyncScorer


def resolve_scorer(target: Target, reward: str = "") -> Scorer | AsyncScorer:
    """A RewardSpec, dict or TOML path -> `build_reward`; an `http(s)://` URL -> the served
    reward named `reward` (`rl_rewards.client.RemoteScorer`; "" = the server's default); a
    scorer -> itself."""
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        from rl_rewards.client import RemoteScorer

        return RemoteScorer(target, reward)
    if isinstance(target, (RewardSpec, Mapping, str, Path)):
        return build_reward(target)
    return target


def _is_remote(scorer: Scorer | AsyncScorer) -> bool:
    return isinstance(scorer, AsyncScorer) and not isinstance(scorer, Reward)


def _score_sync(scorer: Scorer | AsyncScorer, samples: list[Sample]) -> list[ScoreResult]:
    if isinstance(scorer, Scorer):
        return scorer.score(samples)
    return asyncio.run(scorer.ascore(samples))


def _text(message_or_text: Any) -> str:
    """Plain text of a TRL prompt/completion: a string, or chat messages (last message's content;
    a content list contributes its text parts)."""
    if isinstance(message_or_text, str):
        return message_or_text
    content = message_or_text[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _trl_samples(prompts: Sequence[Any], completions: Sequence[Any], reference_column: str, columns: dict) -> list[Sample]:
    n = len(completions)
    rows = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == n}  # drops trainer_state
    samples = []
    for i in range(n):
        metadata = {k: v[i] for k, v in rows.items() if k != reference_column}
        reference = rows[reference_column][i] if reference_column in rows else None
        samples.append(
            Sample(prompt=_text(prompts[i]), completion=_text(completions[i]), reference=reference, metadata=metadata)
        )
    return samples


def as_trl_reward(
    target: Target, *, reference_column: str = "reference", name: str = "rl_rewards", reward: str = ""
) -> Callable:
    """A TRL `GRPOTrainer` reward function.

    TRL calls `f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`; string or
    conversational prompts/completions are both accepted. `reference_column` names the dataset
    column that becomes `Sample.reference`; the other per-row columns go to `Sample.metadata`.
    A failed sample returns None (TRL's abstain). When `target` is a server URL the function is
    `async` (TRL awaits async reward functions concurrently); `reward` names the served reward.
    """
    scorer = resolve_scorer(target, reward)

    def to_scores(results: list[ScoreResult]) -> list[float | None]:
        return [r.score for r in results]

    if _is_remote(scorer):

        async def reward_async(prompts, completions, completion_ids=None, **dataset_columns):
            samples = _trl_samples(prompts, completions, reference_column, dataset_columns)
            return to_scores(await scorer.ascore(samples))

        reward_async.__name__ = name
        return reward_async

    def reward(prompts, completions, completion_ids=None, **dataset_columns):
        samples = _trl_samples(prompts, completions, reference_column, dataset_columns)
        return to_scores(_score_sync(scorer, samples))

    reward.__name__ = name
    return reward


def _verl_sample(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any) -> Sample:
    prompt = extra_info["prompt"] if isinstance(extra_info, dict) and isinstance(extra_info.get("prompt"), str) else ""
    metadata = {"data_source": data_source, "extra_info": extra_info}
    if isinstance(extra_info, dict):
        metadata.update({k: v for k, v in extra_info.items() if k in ("image", "video")})
    return Sample(prompt=prompt, completion=solution_str, reference=ground_truth, metadata=metadata)


def _verl_dict(result: ScoreResult, error_score: float, keys: Sequence[str]) -> dict[str, Any]:
    """verl collects every returned key into a per-batch list, so every sample reports the same
    keys: `score`, `failed` (0/1), and each top-level component (0.0 where it was not computed)."""
    out: dict[str, Any] = {"score": error_score if result.score is None else result.score}
    out["failed"] = float(result.score is None)
    out.update({k: 0.0 for k in keys})
    out.update(result.components)
    return out


def as_verl_compute_score(
    target: Target, *, batch: bool = False, error_score: float = 0.0, reward: str = ""
) -> Callable:
    """A verl `custom_reward_function`.

    Single form (verl's NaiveRewardManager):
    `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`;
    batch form (`batch=True`, verl's BatchRewardManager):
    `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`.
    Each returns `{"score": float, "failed": 0/1, **components}`; a failed sample scores
    `error_score` (verl needs a number) and is flagged by `failed`.
    `extra_info["prompt"]` (if a string) becomes `Sample.prompt`; `extra_info["image"/"video"]`
    go to `Sample.metadata` for media scorers. `reward`: the served reward when `target` is a URL.
    """
    scorer = resolve_scorer(target, reward)
    keys = list(scorer.spec.components) if isinstance(scorer, Reward) else []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
        sample = _verl_sample(data_source, solution_str, ground_truth, extra_info)
        return _verl_dict(_score_sync(scorer, [sample])[0], error_score, keys)

    def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kw):
        samples = [_verl_sample(*row) for row in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)]
        return [_verl_dict(r, error_score, keys) for r in _score_sync(scorer, samples)]

    return compute_score_batch if batch else compute_score


def as_openrlhf_reward_func(target: Target, *, error_score: float = 0.0, reward: str = "") -> Callable:
    """An OpenRLHF `--remote_rm_url /path/reward_func.py` function:
    `reward_func(queries, prompts, labels, **kw)`.

    `queries[i]` is prompt + response with template tokens; the completion is the part after
    `prompts[i]` (the whole query when it does not start with the prompt); `labels[i]` becomes
    `Sample.reference`. Returns `{"rewards": Tensor, "scores": Tensor, "extra_logs": {...}}` as
    OpenRLHF expects (torch is imported when called; OpenRLHF always has it). A failed sample
    scores `error_score`; `extra_logs` holds per-component means and the failure count.
    `reward`: the served reward when `target` is a URL.
    """
    scorer = resolve_scorer(target, reward)

    def reward_func(queries, prompts, labels, **kw):
        import torch

        samples = [
            Sample(prompt=p, completion=q[len(p) :] if q.startswith(p) else q, reference=label)
            for q, p, label in zip(queries, prompts, labels, strict=True)
        ]
        results = _score_sync(scorer, samples)
        scores = torch.tensor([error_score if r.score is None else r.score for r in results], dtype=torch.float32)
        logs: dict[str, float] = {"failed": float(sum(r.score is None for r in results))}
        for key in sorted({k for r in results for k in r.components}):
            values = [r.components[key] for r in results if key in r.components]
            logs[key] = math.fsum(values) / len(values)
        return {"rewards": scores, "scores": scores.clone(), "extra_logs": logs}

    return reward_func
