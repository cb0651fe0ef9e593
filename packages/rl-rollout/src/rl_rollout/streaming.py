"""Score a batch's samples while the engine is still sampling the rest of it.

    rollout = generate_scored(engine, prompts, params, score, seeds=seeds, stream=True)
    rollout.generations          # the batch, as `engine.generate` / `generate_seeded` gives it
    rollout.results()            # one result per generation, in order (waits for the last chunk)

A trainer that scores after the whole batch keeps a reward server idle while the policy samples
and the policy idle while the server scores. verl's reward loop and AReaL score each rollout as
it finishes instead; here the batch comes in chunks (with `seeds`, one engine call per prompt, as
`generate_seeded` makes anyway; without, the one engine call is the one chunk) and each finished
chunk goes to `score` on a worker thread at once, so the server scores chunk i while chunk i+1
generates, and what comes after the rollout (a trainer's log-probs) overlaps the last chunk.

The rewards equal the after-batch ones when `score` scores each sample on its own (a rule, a
served reward, a judge sampled with a per-sample seed): the chunks are the same samples cut
differently. Use it for rewards scored elsewhere (a server): an in-process model scored on the
worker thread would share the device with the policy's sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from rl_rollout.protocol import Engine, Generation, Prompt, SamplingParams, generate_seeded

__all__ = ["ScoredRollout", "generate_scored"]

R = TypeVar("R")


class PhaseTimer(Protocol):
    """A trainer's phase clock (`rl_core.train.PhaseTimer` is one): `timer(name)` times a phase
    in this thread; `pop()` takes this thread's phases, `add(times)` counts them in another's."""

    def __call__(self, phase: str, /) -> AbstractContextManager[Any]: ...

    def pop(self) -> dict[str, float]: ...

    def add(self, measured: Mapping[str, float]) -> None: ...


ChunkScorer = Callable[[int, list[Generation]], Sequence[R]]
"""`score(first, generations)`: one result per generation of a chunk; `first` is the row of its
first generation in the batch (sample ids that must not depend on the chunking start there)."""


class ScoredRollout(Generic[R]):
    """A batch's generations and their results (`generate_scored`). `results()` waits for the
    chunks still being scored and raises the first chunk's error, once every chunk is done (the
    scorer never runs on after it returns).

    A streamed one pickles (an asynchronous run's checkpoint holds the rollouts in flight, see
    `rl_core.train.pipeline`): it waits for its chunks and keeps their results or errors, not the
    worker, the scorer or the worker's phase times (the copy's `results()` adds none)."""

    def __init__(self, generations: list[Generation], chunks: list[Future[Sequence[R]]] | None,
                 score: ChunkScorer[R], timer: PhaseTimer | None = None, times: list[dict[str, float]] | None = None,
                 ) -> None:
        self.generations = generations
        self._chunks, self._score, self._timer = chunks, score, timer
        self._times = times if times is not None else []  # the worker appends to this very list (`or []` replaced an empty one)

    @property
    def streamed(self) -> bool:
        """Whether the chunks were scored while the batch was sampled (else at `results()`)."""
        return self._chunks is not None

    def results(self) -> list[R]:
        if self._chunks is None:
            out = list(self._score(0, self.generations))
        else:
            wait(self._chunks)
            if self._timer is not None:  # the worker's phases, counted once
                for times in self._times:
                    self._timer.add(times)
                self._times.clear()
            out = [result for chunk in self._chunks for result in chunk.result()]
        if len(out) != len(self.generations):
            raise RuntimeError(f"the scorer gave {len(out)} results for {len(self.generations)} generations")
        return out

    def __getstate__(self) -> dict[str, Any]:
        if self._chunks is None:  # scored at `results()`: the copy needs the scorer itself
            return {**self.__dict__, "_timer": None, "_times": []}
        wait(self._chunks)  # the original keeps its futures and times: its own `results()` is unchanged
        done = [(f.exception(), None if f.exception() else f.result()) for f in self._chunks]
        return {**self.__dict__, "_chunks": done, "_score": None, "_timer": None, "_times": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["_chunks"] is not None:
            state["_chunks"] = [_finished(error, value) for error, value in state["_chunks"]]
        self.__dict__.update(state)


def _finished(error: BaseException | None, value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


def generate_scored(engine: Engine, requests: Sequence[Prompt], params: SamplingParams, score: ChunkScorer[R], *,
                    seeds: Sequence[int] | None = None, stream: bool = True,
                    timer: PhaseTimer | None = None) -> ScoredRollout[R]:
    """`params.n` samples per request (request-major, `request_index` into `requests`), scored by
    `score` chunk by chunk on one worker thread as they finish (`stream`), or all at once when
    `results()` is first called (`stream=False`: the after-batch order, for comparison and for
    rewards in process). `seeds`: one engine call per request with its own seed, exactly
    `generate_seeded`'s samples, each request's samples a chunk; without, one engine call, one
    chunk (it is still scored on the worker, overlapping what the caller does before `results()`).
    Chunks are scored one at a time, in order: `score` need not be thread-safe, but must not be
    used by the caller's thread until `results()` returned. `timer`: the phases `score` times
    (`with timer("judge")`) on the worker are added to the caller's at `results()`."""
    if seeds is not None and len(seeds) != len(requests):
        raise ValueError(f"got {len(seeds)} seeds for {len(requests)} requests")
    if not stream:
        batch = engine.generate(requests, params) if seeds is None else generate_seeded(engine, requests, params, seeds)
        return ScoredRollout(batch, None, score)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-rollout-score")
    gens: list[Generation] = []
    chunks: list[Future[Sequence[R]]] = []
    times: list[dict[str, float]] = []

    def timed(first: int, chunk: list[Generation]) -> Sequence[R]:
        try:
            return score(first, chunk)
        finally:
            if timer is not None:
                times.append(timer.pop())

    try:
        for chunk in _chunks(engine, requests, params, seeds):
            chunks.append(worker.submit(timed, len(gens), chunk))
            gens += chunk
    except BaseException:
        worker.shutdown(wait=True, cancel_futures=True)  # the scorer is done before the error leaves
        raise
    worker.shutdown(wait=False)  # the thread ends after the last chunk
    return ScoredRollout(gens, chunks, score, timer, times)


def _chunks(engine: Engine, requests: Sequence[Prompt], params: SamplingParams,
            seeds: Sequence[int] | None) -> Iterator[list[Generation]]:
    """The batch's generations as the engine finishes them: per request (`generate_seeded`'s
    calls), or in one call."""
    if seeds is None:
        yield engine.generate(requests, params)
        return
    for i, (request, seed) in enumerate(zip(requests, seeds, strict=True)):
        yield [msgspec.structs.replace(g, request_index=i)
               for g in engine.generate([request], msgspec.structs.replace(params, seed=seed))]

