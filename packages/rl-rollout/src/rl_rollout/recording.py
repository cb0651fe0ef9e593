"""An engine wrapper that keeps what it generated: a judge's raw outputs, logged with its scores.

A generative judge (`rl_rewards.scorers.judge.JudgeScorer`) returns scores only; the text the
judge model wrote is what tells a parse failure from a harsh judge. Wrap the judge's engine in a
`RecordingEngine`, hand the wrapper to the scorer, and read `texts` after each call (clear it
before the next). Everything else (sleep/wake, weights, scoring, `state`) goes to the engine
inside, so the wrapper stands wherever the engine did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from rl_rollout.protocol import Engine, Generation, Prompt, SamplingParams


class RecordingEngine:
    """An `Engine` that forwards everything to `inner` (its `state` too) and appends the text of
    each generation to `texts`, in the order `generate` returned them (request-major), across
    calls until its user clears the list. Choose it over reading the scorer when you need the
    judge's words, not only its numbers (sample logs, debugging a reward module's parser)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.texts: list[str] = []

    @property
    def state(self) -> str:
        return self.inner.state

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        out = self.inner.generate(requests, params)
        self.texts += [g.text for g in out]
        return out

    def score_next_tokens(self, shared_prefix: list[int], suffixes: Sequence[list[int]],
                          candidates: Sequence[int], *, temperature: float = 1.0) -> torch.Tensor:
        return self.inner.score_next_tokens(shared_prefix, suffixes, candidates, temperature=temperature)  # [S, K]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        self.inner.load_weights(named_tensors, version=version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()
