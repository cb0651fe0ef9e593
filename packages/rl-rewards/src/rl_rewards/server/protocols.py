"""Translation between the wire protocols and samples/results (pure functions, no I/O).

CapRL qa: each `[caption, qa_list]` becomes `Sample(completion=caption, reference=qa_list)` for the
`caption_qa` judge (qa_list as CapRL sends it: `[[question_text, answer_letter], ...]`); the video
task adds `FORMAT_REWARD_WEIGHT * R_fmt` from `timestamp_format`. vl_judge: `Sample(completion=
caption, metadata={"video": path})`, or no media at all when `video_path` is empty (CapRL++'s client
sends "" for a sample without a video; the judge then sees the caption alone). A sample that fails (bad QA list, path outside the media
roots, judge error) gets reward 0.0 and its message in `errors[i]`; the others are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from rl_rewards import wire
from rl_rewards.composition import reject_non_finite
from rl_rewards.samples import Sample, ScoreResult

Prepared = Sample | str
"""A sample ready to score, or the error message that replaces it."""


def qa_sample(caption: str, qa: list[wire.QAItem]) -> Prepared:
    """CapRL qa pair -> Sample, or an error naming what is wrong (CapRL raised and zeroed the
    worker's whole chunk on an empty QA list)."""
    if not qa:
        return "empty QA list: a caption needs at least one [question_text, answer_letter] pair"
    for j, (_, letter) in enumerate(qa):
        if len(letter.strip()) != 1 or not letter.strip().isalpha():
            return f"qa[{j}]: answer {letter!r} is not a single option letter"
    return Sample(completion=caption, reference=[[q, a.strip()] for q, a in qa])


def vl_judge_sample(sample: wire.VLJudgeSample) -> Sample:
    """CapRL vl_judge sample -> Sample; an empty (or blank) `video_path` means no media."""
    if not sample.video_path.strip():
        return Sample(completion=sample.caption)
    return Sample(completion=sample.caption, metadata={"video": sample.video_path})


def qa_texts(request: wire.GetRewardRequest) -> Iterator[tuple[str, str]]:
    for i, (caption, qa) in enumerate(request.prompts):
        yield f"$.prompts[{i}][0]", caption
        for j, (question, _) in enumerate(qa):
            yield f"$.prompts[{i}][1][{j}][0]", question


def vl_texts(request: wire.GetRewardRequest) -> Iterator[tuple[str, str]]:
    for i, sample in enumerate(request.samples):
        yield f"$.samples[{i}].caption", sample.caption
        yield f"$.samples[{i}].video_path", sample.video_path


def value(result: ScoreResult) -> float:
    return result.score if result.score is not None else 0.0


def errors_or_none(results: Sequence[ScoreResult]) -> list[str | None] | None:
    errors = [r.error for r in results]
    return errors if any(e is not None for e in errors) else None


def qa_response(
    qa: Sequence[ScoreResult], fmt: Sequence[ScoreResult] | None, format_weight: float
) -> wire.GetRewardResponse:
    """CapRL qa response; with `fmt` (video task) total = R_acc + format_weight * R_fmt."""
    qa_values = [value(r) for r in qa]
    if fmt is None:
        return wire.GetRewardResponse(rewards=qa_values, qa_rewards=qa_values, errors=errors_or_none(qa))
    fmt_values = [value(r) if q.error is None else 0.0 for q, r in zip(qa, fmt, strict=True)]
    merged = [q if q.error is not None else f for q, f in zip(qa, fmt, strict=True)]
    rewards = [
        0.0 if r.error is not None else q + format_weight * f
        for q, f, r in zip(qa_values, fmt_values, merged, strict=True)
    ]
    return wire.GetRewardResponse(
        rewards=rewards, qa_rewards=qa_values, format_rewards=fmt_values, errors=errors_or_none(merged)
    )


def judge_response(results: Sequence[ScoreResult]) -> wire.GetRewardResponse:
    values = [value(r) for r in results]
    return wire.GetRewardResponse(rewards=values, judge_rewards=values, errors=errors_or_none(results))


def openrlhf_samples(request: wire.OpenRLHFRequest) -> list[Sample]:
    """OpenRLHF sends prompt + response as `query`; the completion is what follows the prompt."""
    samples = []
    for i, query in enumerate(request.query):
        prompt = request.prompts[i] if request.prompts else ""
        completion = query[len(prompt) :] if prompt and query.startswith(prompt) else query
        reference = request.labels[i] if request.labels else None
        samples.append(Sample(completion=completion, prompt=prompt, reference=reference))
    return samples


def openrlhf_response(results: Sequence[ScoreResult], keys: Sequence[str]) -> wire.OpenRLHFResponse:
    """`keys`: the served reward's component keys (`served_keys`): every response carries
    exactly `failed` (1.0/0.0, the name `as_openrlhf_reward_func` uses) and those, whatever
    failed, so OpenRLHF's per-key lists stay aligned."""
    values = [value(r) for r in results]
    extra = {"failed": [0.0 if r.error is None else 1.0 for r in results]}
    extra.update({key: [r.components.get(key, 0.0) for r in results] for key in keys})
    return wire.OpenRLHFResponse(rewards=values, scores=list(values), extra_logs=extra)


def sample_texts(samples: Sequence[Sample], prefix: str, longer_than: int = -1) -> Iterator[tuple[str, str]]:
    """(JSON path, text) of the completion and prompt of every sample with a text longer than
    `longer_than` characters (a limit check needs only those; formatting every path cost more
    than the check)."""
    for i, sample in enumerate(samples):
        if len(sample.completion) > longer_than or len(sample.prompt) > longer_than:
            yield f"{prefix}[{i}].completion", sample.completion
            yield f"{prefix}[{i}].prompt", sample.prompt


def merge(prepared: Sequence[Prepared], scored: Sequence[ScoreResult]) -> list[ScoreResult]:
    """Put scored results back between the samples that failed before scoring; a non-finite
    score becomes that sample's error on every route (JSON has no NaN: it would be `null`)."""
    scored = reject_non_finite(list(scored), "the reward")
    if len(scored) == len(prepared):  # none failed
        return scored
    it = iter(scored)
    return [ScoreResult.failed(p) if isinstance(p, str) else next(it) for p in prepared]
