"""caption-rl's reward and eval phases: scoring a step's captions (an error skips the step on
every process, never a zero reward), the sample rows written to `samples/`, and the greedy eval
on the held-out records."""

from __future__ import annotations

import math
from typing import Any

import torch
from accelerate.utils import gather_object
from caption_parts import RewardUnavailable, make_sample
from caption_rollout import encode_records
from caption_setup import awake_engine

from rl_rewards import ScoreResult
from rl_rollout import SamplingParams


def score(run: Any, records: list, generations: list) -> tuple[list[ScoreResult], str]:
    """Rewards of every generation, or an error that skips the step on every process."""
    samples = [make_sample(records[g.request_index], g.text) for g in generations]
    try:
        results, error = run.reward.score(samples), ""
    except RewardUnavailable as e:
        results, error = [], f"rank {run.acc.process_index}: {e}"
    if not error and results and all(x.score is None for x in results):
        error = f"rank {run.acc.process_index}: every sample failed to score; first error: {results[0].error}"
    if not generations:
        error = error or "no rollouts on some process (every prompt over rollout.max_prompt_length or a bad record?)"
    failed = run.acc.reduce(torch.tensor([float(bool(error))], device=run.acc.device), "max").item() > 0
    return results, error or ("another process failed to score" if failed else "")


def sample_rows(records: list, generations: list, results: list[ScoreResult]) -> list[dict[str, Any]]:
    samples = [make_sample(records[g.request_index], g.text) for g in generations]
    return [{"prompt": s.prompt, "caption": s.completion, "reward": x.score, "components": x.components,
             "error": x.error} for s, x in zip(samples, results, strict=True)]


def evaluate(run: Any, step: int) -> dict[str, Any]:
    """Greedy captions for the held-out records (sharded over processes), their reward and
    components; the captions go to samples/eval-step-<step>.jsonl."""
    acc = run.acc
    mine = slice(acc.process_index, None, acc.num_processes)
    records, _, messages, _ = encode_records(run, run.data.eval[mine], run.data.eval_where[mine])
    with awake_engine(run) as engine:
        generations = engine.generate(messages, SamplingParams(temperature=0.0,
                                                               max_new_tokens=run.cfg.rollout.max_new_tokens))
    samples = [make_sample(records[g.request_index], g.text) for g in generations]
    try:
        results = run.reward.score(samples)
    except RewardUnavailable as e:
        results = [ScoreResult.failed(str(e)) for _ in samples]
    rows = gather_object(sample_rows(records, generations, results))
    scores = [r["reward"] for r in rows if r["reward"] is not None]
    out: dict[str, Any] = {"eval/reward/mean": sum(scores) / len(scores) if scores else math.nan,
                           "eval/failed": float(len(rows) - len(scores))}
    for name in sorted({k for r in rows for k in r["components"]}):
        values = [r["components"][name] for r in rows if name in r["components"]]
        out[f"eval/reward/{name}"] = sum(values) / len(values)
    run.samples.write(f"eval-step-{step:06d}", step, rows)
    return out
