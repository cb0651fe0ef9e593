"""`generate_scored`: a batch scored chunk by chunk while the tiny hf engine samples the rest."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence

import pytest

from rl_core.train import PhaseTimer
from rl_rollout import Generation, Prompt, SamplingParams, generate_seeded
from rl_rollout.hf import HFEngine
from rl_rollout.streaming import generate_scored

PROMPTS = ["one", "two two", "three three three"]
SEEDS = [11, 12, 13]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)


class WaitingEngine:
    """The tiny engine, whose call for the last prompt first waits (up to 10 s) for `scored`: it
    goes on at once only if the first prompt's samples were scored while the batch sampled."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner, self.scored, self.waited = inner, threading.Event(), False
        self.state = inner.state

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        if requests == [PROMPTS[-1]]:
            self.waited = self.scored.wait(timeout=10)
        return self.inner.generate(requests, params)


def length_score(first: int, gens: list[Generation]) -> list[tuple[int, int]]:
    return [(first + i, len(g.completion_ids) + g.request_index) for i, g in enumerate(gens)]


def test_each_prompt_is_scored_while_the_next_samples_and_the_rewards_equal_the_after_batch_ones(qwen3_engine):
    engine, calls, timer = WaitingEngine(qwen3_engine), [], PhaseTimer()

    def score(first: int, gens: list[Generation]) -> list[tuple[int, int]]:
        with timer("judge"):
            calls.append((first, len(gens), threading.current_thread().name))
            time.sleep(0.05)
        engine.scored.set()
        return length_score(first, gens)

    streamed = generate_scored(engine, PROMPTS, PARAMS, score, seeds=SEEDS, timer=timer)
    assert engine.waited  # prompt 0 was scored before prompt 2 began sampling
    results = streamed.results()
    expected = generate_seeded(qwen3_engine, PROMPTS, PARAMS, SEEDS)
    assert streamed.generations == expected  # the same samples as one seeded batch
    assert [(f, n) for f, n, _ in calls] == [(0, 2), (2, 2), (4, 2)]  # one chunk per prompt, rows 0, 2, 4
    assert all(name.startswith("rl-rollout-score") for _, _, name in calls)
    after = generate_scored(qwen3_engine, PROMPTS, PARAMS, length_score, seeds=SEEDS, stream=False)
    assert after.results() == results == length_score(0, expected)
    assert timer.pop()["time/judge"] >= 3 * 0.05  # the worker's phase, added to this thread's step


def test_without_seeds_the_batch_is_one_chunk_and_a_scorer_error_comes_out_of_results(qwen3_engine):
    calls = []

    def failing(first: int, gens: list[Generation]) -> list[int]:
        calls.append((first, len(gens)))
        raise ValueError("judge exploded")

    rollout = generate_scored(qwen3_engine, PROMPTS, PARAMS, failing)
    assert len(rollout.generations) == 6 and rollout.streamed
    with pytest.raises(ValueError, match="judge exploded"):
        rollout.results()
    assert calls == [(0, 6)]
    with pytest.raises(ValueError, match="got 2 seeds for 3 requests"):
        generate_scored(qwen3_engine, PROMPTS, PARAMS, failing, seeds=SEEDS[:2])


def test_a_streamed_rollout_pickles_with_its_results_and_the_original_still_gives_its_times(qwen3_engine):
    """An asynchronous run's checkpoint pickles the rollouts in flight: the copy holds the
    chunks' results (or a chunk's error), and the original, still used by the run, is untouched."""
    timer = PhaseTimer()

    def score(first: int, gens: list[Generation]) -> list[tuple[int, int]]:
        with timer("judge"):
            time.sleep(0.02)
        return length_score(first, gens)

    streamed = generate_scored(qwen3_engine, PROMPTS, PARAMS, lambda f, g: score(f, g), seeds=SEEDS, timer=timer)
    copy = pickle.loads(pickle.dumps(streamed))  # a lambda scorer and the worker's futures do not travel
    assert copy.streamed and copy.generations == streamed.generations
    assert copy.results() == streamed.results() == length_score(0, streamed.generations)
    assert timer.pop()["time/judge"] >= 3 * 0.02  # the original's worker phases, once

    def failing(first: int, gens: list[Generation]) -> list[int]:
        raise ValueError("judge exploded")

    broken = pickle.loads(pickle.dumps(generate_scored(qwen3_engine, PROMPTS, PARAMS, failing, seeds=SEEDS)))
    with pytest.raises(ValueError, match="judge exploded"):
        broken.results()


def test_the_workers_phases_reach_the_caller_when_no_chunk_was_scored_before_the_rollout_returned(qwen3_engine):
    """Without seeds the one chunk is submitted as the rollout returns, so none has been scored
    yet: its `time/judge` still lands in the caller's timer at `results()` (it was lost while the
    rollout kept a new empty list in place of the worker's)."""
    timer = PhaseTimer()

    def score(first: int, gens: list[Generation]) -> list[tuple[int, int]]:
        with timer("judge"):
            time.sleep(0.05)
        return length_score(first, gens)

    rollout = generate_scored(qwen3_engine, PROMPTS, PARAMS, score, timer=timer)
    assert rollout.results() == length_score(0, rollout.generations)
    assert timer.pop()["time/judge"] >= 0.05
