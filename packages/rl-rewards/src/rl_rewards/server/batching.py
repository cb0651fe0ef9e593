"""Dynamic batching across concurrent requests, one queue per served reward (mosec-style).

Each request's samples are cut into pieces of at most `max_batch_size`; pieces from all
concurrent requests wait in the reward's queue. A batch is formed as soon as the pool has a free
slot: it takes the first waiting piece, then keeps adding pieces until it holds `max_batch_size`
samples or `max_batch_tokens` estimated tokens, or `max_wait_ms` have passed since it started.
Because a slot is taken *before* the batch is collected, the pool is never idle while pieces wait,
and pieces that arrive while every slot is busy make the next batch fuller.

The number of slots is the pool's size (one batch per worker), or fewer where the reward sets
`max_concurrency` (a judge behind a rate-limited API): pieces beyond it wait in the queue, in
order. A request not answered within `timeout_s` of its arrival, queue time included, fails with
RuntimeError (the app answers 503); its pieces still queued leave the queue unscored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import BatchSettings

ScoreFn = Callable[[str, list[Sample]], Awaitable[list[ScoreResult]]]


def estimate_tokens(sample: Sample) -> int:
    """Cheap token estimate for the batch budget: ~4 characters per token (prompt + completion)."""
    return (len(sample.prompt) + len(sample.completion)) // 4 + 1


@dataclass
class _Piece:
    samples: list[Sample]
    tokens: int
    future: asyncio.Future[list[ScoreResult]] = field(repr=False)
    led: tuple[int, float] | None = None  # the first piece of a batch: its (samples, scoring seconds)


class Batcher:
    """Queue and batch loop of one reward. `slots` batches may be in flight at once (one per
    worker, so every worker stays busy)."""

    def __init__(self, reward: str, score: ScoreFn, settings: BatchSettings, slots: int, metrics: Metrics,
                 timeout_s: float | None = None):
        self.reward = reward
        self._score = score
        self._settings = settings
        self.slots = max(slots, 1)
        self._slots = asyncio.Semaphore(self.slots)
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._queue: deque[_Piece] = deque()
        self._arrived = asyncio.Event()
        self._inflight: dict[asyncio.Task[None], list[_Piece]] = {}
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name=f"batcher-{self.reward}")

    async def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        """Score `samples` (any number) through the queue; results come back in order."""
        return (await self.score_led(samples))[0]

    async def score_led(self, samples: Sequence[Sample]) -> tuple[list[ScoreResult], list[tuple[int, float]]]:
        """`score`, and the `(samples, seconds)` of each batch one of these samples' pieces led
        (came first in): a caller that reports batches elsewhere counts each batch once."""
        if not samples:
            return [], []
        size = self._settings.max_batch_size
        loop = asyncio.get_running_loop()
        pieces = []
        for start in range(0, len(samples), size):
            chunk = list(samples[start : start + size])
            piece = _Piece(chunk, sum(estimate_tokens(s) for s in chunk), loop.create_future())
            pieces.append(piece)
            self._queue.append(piece)
        self._metrics.queue_depth.labels(self.reward).set(self._queued_samples())
        self._arrived.set()
        try:
            parts = await asyncio.wait_for(asyncio.gather(*(p.future for p in pieces)), self._timeout_s)
        except TimeoutError:
            raise RuntimeError(self._timed_out(pieces)) from None
        except asyncio.CancelledError:  # the caller gave up (a hedged try that lost): not scored for nothing
            self._drop(pieces)
            raise
        return [result for part in parts for result in part], [p.led for p in pieces if p.led is not None]

    def _drop(self, pieces: list[_Piece]) -> int:
        """Take these pieces out of the queue (a batch in flight drops their results: their
        futures are cancelled); the samples that were still waiting."""
        mine = {id(p) for p in pieces}
        waiting = sum(len(p.samples) for p in self._queue if id(p) in mine)
        self._queue = deque(p for p in self._queue if id(p) not in mine)
        self._metrics.queue_depth.labels(self.reward).set(self._queued_samples())
        return waiting

    def _timed_out(self, pieces: list[_Piece]) -> str:
        """Take this request's pieces out of the queue and say where the request was."""
        waiting = self._drop(pieces)
        where = (f"; {waiting} of its {sum(len(p.samples) for p in pieces)} sample(s) still waited in the queue "
                 f"behind {len(self._inflight)} batch(es) in flight (at most {self.slots} at once)") if waiting else ""
        return f"reward {self.reward!r}: no result within request_timeout_s={self._timeout_s}{where}"

    def _queued_samples(self) -> int:
        return sum(len(p.samples) for p in self._queue)

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            batch = await self._collect()
            self._metrics.queue_depth.labels(self.reward).set(self._queued_samples())
            task = asyncio.create_task(self._dispatch(batch))
            self._inflight[task] = batch
            self._metrics.batches_in_flight.labels(self.reward).set(len(self._inflight))
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._inflight.pop(task, None)
        self._metrics.batches_in_flight.labels(self.reward).set(len(self._inflight))

    async def _collect(self) -> list[_Piece]:
        """Take pieces until the batch is full by count or tokens, or the wait window closes."""
        max_size, max_tokens = self._settings.max_batch_size, self._settings.max_batch_tokens
        deadline = time.monotonic() + self._settings.max_wait_ms / 1000
        batch = [self._queue.popleft()]
        size, tokens = len(batch[0].samples), batch[0].tokens
        while size < max_size and tokens < max_tokens:
            if not self._queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                continue
            head = self._queue[0]
            if size + len(head.samples) > max_size or tokens + head.tokens > max_tokens:
                break
            batch.append(self._queue.popleft())
            size += len(head.samples)
            tokens += head.tokens
        return batch

    async def _dispatch(self, batch: list[_Piece]) -> None:
        samples = [s for piece in batch for s in piece.samples]
        started = time.perf_counter()
        try:
            results = await self._score(self.reward, samples)
        except Exception as e:  # the pool gave up (all retries failed): fail these requests only
            for piece in batch:
                if not piece.future.done():
                    piece.future.set_exception(e)
            return
        finally:
            self._slots.release()
        seconds = time.perf_counter() - started
        self._metrics.observe_batch(self.reward, samples, results, seconds)
        batch[0].led = (len(samples), seconds)
        offset = 0
        for piece in batch:
            part = results[offset : offset + len(piece.samples)]
            offset += len(piece.samples)
            if not piece.future.done():
                piece.future.set_result(part)

    def abort(self, error: Exception) -> None:
        """Fail every queued and in-flight piece with `error` and stop the batches in flight
        (shutdown after its grace period: the waiting requests are answered, not cut off)."""
        pieces = list(self._queue) + [p for batch in self._inflight.values() for p in batch]
        self._queue.clear()
        for piece in pieces:
            if not piece.future.done():
                piece.future.set_exception(error)
        for task in list(self._inflight):
            task.cancel()

    async def close(self) -> None:
        """Wait for in-flight batches and queued pieces (graceful drain), then stop the loop."""
        while self._queue or self._inflight:
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
