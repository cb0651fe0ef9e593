"""Turn a reward (spec, scorer, or server URL) into the reward function a framework expects.

Signatures follow each framework exactly (docs/reference.md §4):
- TRL: `f(prompts, completions, completion_ids=None, **dataset_columns) -> list[float | None]`
  (None = abstain/failed; async when the reward is remote).
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw) -> dict`
  and the batch form `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`.
- OpenRLHF: `reward_func(queries, prompts, labels, **kw) -> {"rewards", "scores", "extra_logs"}`.

Every adapter reports the same keys for every sample — the reward's component keys
(`Reward.keys`, or the served reward's keys for a URL), failed and gated-out samples included:
verl takes its per-sample extra keys from the first sample of a batch, OpenRLHF checks that
every key has one value per sample, and TRL gathers metrics across ranks by name. A non-finite
reward or component is a failed sample on every adapter (`reject_non_finite`), its components 0.0
where they were not finite: verl and OpenRLHF never get a NaN, TRL's metrics never average one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_rewards.client import RemoteScorer
from rl_rewards.composition import Reward, build_reward, reject_non_finite
from rl_rewards.samples import AsyncScorer, Sample, Scorer, ScoreResult
from rl_rewards.spec import RewardSpec

Target = RewardSpec | Mapping[str, Any] | str | Path | Scorer | AsyncScorer


def resolve_scorer(target: Target, reward: str = "") -> Scorer | AsyncScorer:
    """A RewardSpec, dict or TOML path -> `build_reward`; an `http(s)://` URL -> the served
    reward named `reward` (`rl_rewards.client.RemoteScorer`; "" = the server's default); a
    scorer -> itself."""
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        return RemoteScorer(target, reward)
    if isinstance(target, (RewardSpec, Mapping, str, Path)):
        return build_reward(target)
    return target


def reward_keys(scorer: Scorer | AsyncScorer) -> tuple[str, ...]:
    """The component keys every result of `scorer` carries: a composed reward's `keys` or a
    served reward's keys (asked from the server once). A bare scorer reports none: its options,
    which decide its keys, are not known here; wrap it in a spec to report its components."""
    if isinstance(scorer, Reward):
        return scorer.keys
    if isinstance(scorer, RemoteScorer):
        return scorer.keys()
    return ()


def _is_remote(scorer: Scorer | AsyncScorer) -> bool:
    return isinstance(scorer, AsyncScorer) and not isinstance(scorer, Reward)


def _score_sync(scorer: Scorer | AsyncScorer, samples: list[Sample]) -> list[ScoreResult]:
    if isinstance(scorer, Scorer):
        results = scorer.score(samples)
    else:
        results = asyncio.run(scorer.ascore(samples))
    return reject_non_finite(results, f"scorer {scorer.name!r}")


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


def _log_trl_metrics(log_metric: Callable[[str, float], None], name: str, keys: Sequence[str],
                     results: list[ScoreResult]) -> None:
    """One scalar per key through TRL's `log_metric`: `name/failed` (the failed fraction) and
    `name/<key>` (the mean over the samples that did not fail; 0.0 when all failed). The same
    names on every call and rank: TRL gathers them across processes by name."""
    ok = [r for r in results if r.score is not None]
    log_metric(f"{name}/failed", (len(results) - len(ok)) / max(len(results), 1))
    for key in keys:
        log_metric(f"{name}/{key}", sum(r.components.get(key, 0.0) for r in ok) / len(ok) if ok else 0.0)


def as_trl_reward(
    target: Target, *, reference_column: str = "reference", name: str = "rl_rewards", reward: str = ""
) -> Callable:
    """A TRL `GRPOTrainer` reward function.

    TRL calls `f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`; string or
    conversational prompts/completions are both accepted. `reference_column` names the dataset
    column that becomes `Sample.reference`; the other per-row columns go to `Sample.metadata`.
    A failed sample returns None (TRL's abstain). When `target` is a server URL the function is
    `async` (TRL awaits async reward functions concurrently); `reward` names the served reward.

    TRL keeps one number per reward function; the reward's components are logged through the
    `log_metric` callable recent TRL versions pass to reward functions (`GRPOTrainer`): as
    `<name>/<component>` (mean over the batch's non-failed samples) and `<name>/failed`, next to
    TRL's own metrics. With a TRL that passes no `log_metric`, only the total is logged.
    """
    scorer = resolve_scorer(target, reward)

    def finish(results: list[ScoreResult], log_metric: Callable | None) -> list[float | None]:
        if log_metric is not None:
            _log_trl_metrics(log_metric, name, reward_keys(scorer), results)
        return [r.score for r in results]

    if _is_remote(scorer):

        async def reward_async(prompts, completions, completion_ids=None, log_metric=None, **dataset_columns):
            samples = _trl_samples(prompts, completions, reference_column, dataset_columns)
            results = reject_non_finite(await scorer.ascore(samples), f"reward {scorer.name!r}")
            return finish(results, log_metric)

        reward_async.__name__ = name
        return reward_async

    def reward_sync(prompts, completions, completion_ids=None, log_metric=None, **dataset_columns):
        samples = _trl_samples(prompts, completions, reference_column, dataset_columns)
        return finish(_score_sync(scorer, samples), log_metric)

    reward_sync.__name__ = name
    return reward_sync


def _verl_sample(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any) -> Sample:
    prompt = extra_info["prompt"] if isinstance(extra_info, dict) and isinstance(extra_info.get("prompt"), str) else ""
    metadata = {"data_source": data_source, "extra_info": extra_info}
    if isinstance(extra_info, dict):
        metadata.update({k: v for k, v in extra_info.items() if k in ("image", "video")})
    return Sample(prompt=prompt, completion=solution_str, reference=ground_truth, metadata=metadata)


class _VerlScore:
    """Shared state of the verl adapters: a picklable object (verl's remote reward manager ships
    the function to Ray workers), holding the scorer and its keys (resolved on first use)."""

    def __init__(self, scorer: Scorer | AsyncScorer, error_score: float) -> None:
        self.scorer, self.error_score = scorer, error_score
        self._keys: tuple[str, ...] | None = None

    def _dict(self, result: ScoreResult) -> dict[str, float]:
        """`score`, `failed` (0/1) and every key of the reward (0.0 where not computed)."""
        if self._keys is None:
            self._keys = reward_keys(self.scorer)
        out = {"score": self.error_score if result.score is None else result.score, "failed": float(result.score is None)}
        components = result.components
        out.update({key: components.get(key, 0.0) for key in self._keys})
        return out


class VerlComputeScore(_VerlScore):
    """verl's single form: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`."""

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kw) -> dict[str, float]:
        sample = _verl_sample(data_source, solution_str, ground_truth, extra_info)
        return self._dict(_score_sync(self.scorer, [sample])[0])


class VerlBatchComputeScore(_VerlScore):
    """verl's batch form: `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`."""

    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos, **kw) -> list[dict[str, float]]:
        samples = [_verl_sample(*row) for row in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)]
        return [self._dict(r) for r in _score_sync(self.scorer, samples)]


def as_verl_compute_score(
    target: Target, *, batch: bool = False, error_score: float = 0.0, reward: str = ""
) -> VerlComputeScore | VerlBatchComputeScore:
    """A verl `custom_reward_function`.

    Single form (verl's NaiveRewardManager and reward loop):
    `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`;
    batch form (`batch=True`, verl's BatchRewardManager):
    `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`.
    Each returns `{"score": float, "failed": 0/1, **components}` with exactly the same keys for
    every sample (verl collects the extra keys of the batch's first sample: a later sample
    without one raises KeyError, a key sample 0 lacks is dropped for the whole batch), gated-out
    components and sub-components (`length.n_tokens`) included at 0.0. A failed sample scores
    `error_score` (verl needs a number) and is flagged by `failed`. `extra_info["prompt"]` (if a
    string) becomes `Sample.prompt`; `extra_info["image"/"video"]` go to `Sample.metadata` for
    media scorers. `reward`: the served reward when `target` is a URL; the returned callable
    then pickles (verl's `remote` reward manager sends it to Ray workers).
    """
    scorer = resolve_scorer(target, reward)
    return VerlBatchComputeScore(scorer, error_score) if batch else VerlComputeScore(scorer, error_score)


def as_openrlhf_reward_func(target: Target, *, error_score: float = 0.0, reward: str = "") -> Callable:
    """An OpenRLHF reward function file's `reward_func(queries, prompts, labels, **kw)`, for
    `--reward.remote_url /path/reward_func.py` (older OpenRLHF: `--remote_rm_url`).

    `queries[i]` is prompt + response with template tokens; the completion is the part after
    `prompts[i]` (the whole query when it does not start with the prompt); `labels[i]` becomes
    `Sample.reference`. Returns `{"rewards": Tensor, "scores": Tensor, "extra_logs": {...}}` as
    OpenRLHF expects (torch is imported when called; OpenRLHF always has it). A failed sample
    scores `error_score`. `extra_logs` maps `failed` (1.0/0.0) and every component key of the
    reward to a tensor with one value per query — the same keys for every sample, failed ones
    included (0.0): OpenRLHF calls the function once per query and stacks each key across the
    batch, failing with "Size of info[x] does not match batch_size" when a key is missing.
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
        logs = {"failed": torch.tensor([float(r.score is None) for r in results])}
        for key in reward_keys(scorer):
            logs[key] = torch.tensor([r.components.get(key, 0.0) for r in results], dtype=torch.float32)
        return {"rewards": scores, "scores": scores.clone(), "extra_logs": logs}

    return reward_func
