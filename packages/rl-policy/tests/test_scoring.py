"""A text recipe's `score` hook in one call (`rl_policy.scoring.group_scores`), with real
`rl_rewards.ScoreResult`s and `rl_rollout.Generation`s: NaN rewards for the failed and the
excluded samples, group ids apart on every process, the components and response metrics, and
the loop's advantages over them, in one process and in two (a real gloo launch)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from rl_core.train import group_advantages
from rl_policy.scoring import group_scores
from rl_rewards import ScoreResult
from rl_rollout import Generation

SCRIPT = Path(__file__).with_name("mp_scoring_script.py")


def answers(lengths: list[int], *, n: int) -> list[Generation]:
    """`n` answers a prompt, request-major, with these completion lengths (4 prompt tokens each;
    an answer of 3 tokens or more stopped at the length cap)."""
    return [Generation(request_index=i // n, prompt_ids=[1, 2, 3, 4], completion_ids=[7] * k, text="x" * k,
                       logprobs=[-0.5] * k, finish_reason="length" if k >= 3 else "stop")
            for i, k in enumerate(lengths)]


def results(scores: list[float | None]) -> list[ScoreResult]:
    return [ScoreResult.failed("no number") if s is None else ScoreResult(score=s, components={"format": 2 * s})
            for s in scores]


def test_failed_and_excluded_samples_are_nan_and_get_no_advantage() -> None:
    """2 prompts x 2 answers: prompt 0 scored 1 and 0; prompt 1's first answer failed and its
    second is excluded (caption-rl's vision placeholder), so group 1 has no valid sample. GRPO on
    group 0: mean 0.5, unbiased std sqrt(0.5), advantages +-0.5 / sqrt(0.5)."""
    acc = Accelerator(cpu=True)
    gens = answers([1, 2, 3, 2], n=2)
    scores = group_scores(acc, results([1.0, 0.0, None, 0.5]), gens, prompts_per_rank=3, estimator="grpo",
                          exclude=[False, False, False, True], metrics={"data/skipped_records": 4.0})
    assert scores.rewards.tolist()[:2] == [1.0, 0.0] and all(math.isnan(r) for r in scores.rewards.tolist()[2:])
    assert scores.group_ids.tolist() == [0, 0, 1, 1] and scores.estimator == "grpo"  # rank 0: the request index
    assert scores.components == [{"format": 2.0}, {"format": 0.0}, {}, {"format": 1.0}]
    assert scores.metrics == {"response/length_mean": 2.0, "response/length_max": 3.0, "response/truncation_rate": 0.25,
                              "tokens": 4 * 4 + 8, "data/skipped_records": 4.0}
    assert (scores.aggregation, scores.weights) == ("sum_then_normalize", {})
    adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=acc)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)  # grpo's eps 1e-6
    assert adv.advantages.tolist() == pytest.approx([expected, -expected, 0.0, 0.0])
    assert adv.valid.tolist() == [True, True, False, False] and adv.metrics["reward/failed"] == 2.0


def test_the_aggregation_and_its_weights_reach_the_loop_and_a_miscount_is_refused() -> None:
    acc = Accelerator(cpu=True)
    gens = answers([1, 1], n=2)
    scores = group_scores(acc, results([1.0, 0.5]), gens, prompts_per_rank=1, estimator="rloo",
                          aggregation="normalize_then_sum", weights={"format": 0.5})
    assert (scores.estimator, scores.aggregation, scores.weights) == ("rloo", "normalize_then_sum", {"format": 0.5})
    with pytest.raises(ValueError, match=r"^group_scores: 1 results and 2 exclusion flags for 2 generations"):
        group_scores(acc, results([1.0]), gens, prompts_per_rank=1, estimator="grpo")
    with pytest.raises(ValueError, match=r"^group_scores: 2 results and 1 exclusion flags for 2 generations"):
        group_scores(acc, results([1.0, 0.5]), gens, prompts_per_rank=1, estimator="grpo", exclude=[True])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_number_their_groups_apart_and_equal_one_process(tmp_path: Path) -> None:
    """Rank 0 samples prompts 0 and 1, rank 1 prompt 2 (a process one prompt short, as after
    dynamic sampling or dropped records); `prompts_per_rank=2` on both keeps the ids apart, so the
    advantages and the response metrics over both equal one process holding the 3 prompts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
         str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"result-{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["groups"] == [0, 0, 1, 1] and ranks[1]["groups"] == [2, 2]
    acc = Accelerator(cpu=True)
    one = group_scores(acc, results(SCORES), answers(LENGTHS, n=2), prompts_per_rank=3, estimator="grpo")
    adv = group_advantages("grpo", one.rewards, one.group_ids, accelerator=acc)
    assert ranks[0]["advantages"] + ranks[1]["advantages"] == pytest.approx(adv.advantages.tolist())
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == pytest.approx(one.metrics)


SCORES = [1.0, 0.0, 0.5, 0.5, 2.0, 0.0]  # 3 prompts x 2 answers; prompt 1 scored alike: advantage 0
LENGTHS = [1, 2, 3, 1, 2, 2]
