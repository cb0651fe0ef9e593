"""Dynamic batching: across concurrent requests, by count, by token budget, long requests split."""

from __future__ import annotations

import asyncio

import pytest

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server.batching import Batcher, estimate_tokens
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import BatchSettings

pytestmark = pytest.mark.no_torch


def run(settings: BatchSettings, requests: list[list[Sample]], slots: int = 1, delay: float = 0.0):
    """Submit `requests` concurrently; return (per-request results, batch sizes seen)."""
    seen: list[int] = []

    async def score(reward: str, samples: list[Sample]) -> list[ScoreResult]:
        seen.append(len(samples))
        await asyncio.sleep(delay)
        return [ScoreResult(score=float(len(s.completion))) for s in samples]

    async def main():
        batcher = Batcher("r", score, settings, slots, Metrics())
        batcher.start()
        results = await asyncio.gather(*(batcher.score(r) for r in requests))
        await batcher.close()
        return results

    return asyncio.run(main()), seen


def samples(n: int, text: str = "x") -> list[Sample]:
    return [Sample(completion=text * (i + 1)) for i in range(n)]


def test_concurrent_requests_share_batches_and_keep_order():
    requests = [samples(3), samples(5), samples(2)]
    results, seen = run(BatchSettings(max_batch_size=64, max_wait_ms=50), requests)
    assert seen == [10]  # one batch for all three requests
    assert [[r.score for r in res] for res in results] == [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2]]


def test_long_request_is_split_by_count():
    results, seen = run(BatchSettings(max_batch_size=4, max_wait_ms=5), [samples(10)])
    assert seen == [4, 4, 2]
    assert [r.score for r in results[0]] == list(range(1, 11))


def test_token_budget_closes_a_batch():
    big = [Sample(completion="y" * 400)]  # ~101 tokens each
    assert estimate_tokens(big[0]) == 101
    _, seen = run(BatchSettings(max_batch_size=64, max_batch_tokens=250, max_wait_ms=20), [big, big, big])
    assert seen == [2, 1]


def test_pieces_arriving_while_busy_fill_the_next_batch():
    seen: list[int] = []

    async def score(reward, batch):
        seen.append(len(batch))
        await asyncio.sleep(0.05)
        return [ScoreResult(score=1.0) for _ in batch]

    async def main():
        batcher = Batcher("r", score, BatchSettings(max_batch_size=64, max_wait_ms=0), 1, Metrics())
        batcher.start()
        first = asyncio.ensure_future(batcher.score(samples(1)))
        await asyncio.sleep(0.01)  # the first batch (1 sample) is now scoring
        rest = [asyncio.ensure_future(batcher.score(samples(2))) for _ in range(3)]
        await asyncio.gather(first, *rest)
        await batcher.close()

    asyncio.run(main())
    assert seen == [1, 6]


def test_pool_failure_fails_only_its_requests():
    calls = 0

    async def score(reward, batch):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("every worker failed")
        return [ScoreResult(score=1.0) for _ in batch]

    async def main():
        batcher = Batcher("r", score, BatchSettings(max_wait_ms=0), 1, Metrics())
        batcher.start()
        with pytest.raises(RuntimeError, match="every worker failed"):
            await batcher.score(samples(2))
        ok = await batcher.score(samples(1))
        await batcher.close()
        return ok

    assert [r.score for r in asyncio.run(main())] == [1.0]


def test_a_call_cancelled_while_queued_is_not_scored_and_the_batch_leader_is_reported_once():
    """One slot busy with a first call's batch; a second call waits in the queue and is cancelled
    (a hedged try that lost): its samples never reach the scorer. `score_led` reports the batch
    (samples, seconds) to the call that led it only."""
    seen: list[int] = []

    async def score(reward: str, batch: list[Sample]) -> list[ScoreResult]:
        seen.append(len(batch))
        await asyncio.sleep(0.1)
        return [ScoreResult(score=1.0) for _ in batch]

    async def main():
        batcher = Batcher("r", score, BatchSettings(max_batch_size=64, max_wait_ms=1), 1, Metrics())
        batcher.start()
        first = asyncio.create_task(batcher.score_led(samples(2)))
        await asyncio.sleep(0.03)  # the first batch is being scored
        queued = asyncio.create_task(batcher.score_led(samples(5)))
        await asyncio.sleep(0.01)
        queued.cancel()
        third = asyncio.create_task(batcher.score_led(samples(3)))
        out = await asyncio.gather(first, third)
        await batcher.close()
        return out

    (first, first_led), (third, third_led) = asyncio.run(main())
    assert seen == [2, 3]  # the cancelled call's 5 samples were never scored
    assert len(first) == 2 and first_led[0][0] == 2 and first_led[0][1] >= 0.1
    assert len(third) == 3 and third_led[0][0] == 3
