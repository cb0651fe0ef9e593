"""`AsyncRewardClient.stream` against real `rl-rewards serve` processes serving a rule from a temp
file (the `rule` scorer), and the stdlib stand-in of test_client.py for 429 (the server never
sends one: it queues instead of refusing)."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import httpx
import pytest
from test_client import scripted, url  # noqa: F401  (a fixture, used by name)

from rl_rewards.client import AsyncRewardClient, RetryPolicy, RewardClient, RewardRequestError
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server.process import ServerProcess, free_port

pytestmark = pytest.mark.no_torch

RULE = '''
import time


def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise ValueError("boom is no caption")
    time.sleep((extra_info or {}).get("sleep", 0.0))
    return {"score": len(solution_str) / 10, "words": len(solution_str.split())}
'''


def rule_config(tmp: Path) -> Path:
    (tmp / "slow_rule.py").write_text(RULE)
    config = tmp / "server.toml"
    config.write_text(
        "[rewards.slow.components.rule]\n"
        f'scorer = "rule"\noptions = {{ function = "{tmp / "slow_rule.py"}:compute_score", components = ["words"] }}\n'
    )
    return config


def sample(text: str, sleep: float = 0.0) -> Sample:
    return Sample(completion=text, metadata={"extra_info": {"sleep": sleep}} if sleep else {})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two workers, one request per scorer batch (`--max-batch-size 4` = the streams' batch size),
    so a slow request holds one worker while the other scores the rest."""
    tmp = tmp_path_factory.mktemp("stream")
    args = ["--config", str(rule_config(tmp)), "--workers", "2", "--max-batch-size", "4", "--max-text-chars", "200"]
    with ServerProcess(args, log_path=tmp / "server.log") as process:
        yield process


async def collect(base: str, batches: list[list[Sample]], **options) -> tuple[list[tuple[int, ScoreResult]], list[range]]:
    """Stream `batches` (each submitted at once, the next right after) and return what the
    iteration yielded, in order, with the ranges `submit` returned."""
    async with AsyncRewardClient(base) as client, client.stream("slow", **options) as stream:
        ranges = [stream.submit(batch) for batch in batches]
        stream.close_submissions()
        return [item async for item in stream], ranges


def test_streamed_results_equal_score_results(server):
    """Scores, components, a sample the rule raises on, and one over the server's text limit
    (a 422 naming `$.samples[k]`: that sample fails alone, its request's others are sent again)."""
    texts = ["[00:01] a dog", "boom", "x" * 300, "two words", "", "a b c d e f", "last one"]
    samples = [sample(t) for t in texts]

    async def scored() -> list[ScoreResult]:
        async with AsyncRewardClient(server.url) as client:
            return await client.score("slow", [s for s in samples if len(s.completion) <= 200])

    streamed, [indices] = asyncio.run(collect(server.url, [samples], batch_size=4))
    assert indices == range(len(texts))
    assert sorted(i for i, _ in streamed) == list(range(len(texts)))
    by_index = dict(streamed)
    too_long = by_index.pop(2)
    assert too_long.score is None and "max_text_chars" in (too_long.error or "")
    assert too_long.error.startswith("request failed:")
    direct = asyncio.run(scored())
    assert [by_index[i] for i in sorted(by_index)] == direct
    assert direct[0] == ScoreResult(score=1.3, components={"rule": 1.3, "rule.words": 3.0})
    assert direct[1].score is None and "boom is no caption" in (direct[1].error or "")


def test_fast_results_arrive_before_a_slow_request_is_done(server):
    """Sample 0 takes 1 s to score; its request (samples 0-3) holds one worker while the other
    scores samples 4-11: those eight are yielded first, in the iteration, while 0-3 are pending."""
    slow = [sample("slow", sleep=1.0)] + [sample(f"first {i}") for i in range(1, 4)]
    fast = [sample(f"later {i}") for i in range(4, 12)]
    streamed, _ = asyncio.run(collect(server.url, [slow, fast], batch_size=4, max_in_flight=3))
    order = [i for i, _ in streamed]
    assert sorted(order) == list(range(12))
    assert set(order[:8]) == set(range(4, 12)) and set(order[8:]) == {0, 1, 2, 3}
    assert all(result.score == len(f"later {i}") / 10 for i, result in streamed[:8])


def test_server_killed_mid_stream_retries_then_fails_samples(tmp_path: Path):
    """Two streams, 8 samples each, when the server is SIGKILLed with requests of both open and
    restarted on its port (seconds later). The patient one (200 attempts) retries through the
    restart: every sample is yielded once, with its score. The brief one (4 attempts, ~0.3 s)
    gives up first: its samples not yet answered are yielded failed, saying why, each once;
    both iterations end. Its own server, without workers: two starts of one process cost less
    than a restart of the module's three."""
    args = ["--config", str(rule_config(tmp_path)), "--max-batch-size", "2"]  # one request per batch, in turn
    server = ServerProcess(args, log_path=tmp_path / "server.log").start()
    texts = [f"caption {i}" for i in range(8)]
    right = [ScoreResult(score=len(t) / 10, components={"rule": len(t) / 10, "rule.words": 2.0}) for t in texts]
    patient = RetryPolicy(attempts=200, backoff_s=0.05, max_backoff_s=0.3)  # ~30 s: a loaded machine
    brief = RetryPolicy(attempts=4, backoff_s=0.05, max_backoff_s=0.1)

    async def read(stream, got: list, killed: asyncio.Event) -> None:
        async for item in stream:
            got.append(item)
            if not killed.is_set():  # one request of 8 is answered: both streams have open ones
                killed.set()
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait()

    async def scenario() -> tuple[list, list]:
        got_patient: list[tuple[int, ScoreResult]] = []
        got_brief: list[tuple[int, ScoreResult]] = []
        killed = asyncio.Event()
        p, b = AsyncRewardClient(server.url, retry=patient), AsyncRewardClient(server.url, retry=brief)
        async with p, b, p.stream("slow", batch_size=2, max_in_flight=2) as ps, b.stream("slow", batch_size=2) as bs:
            for stream in (ps, bs):
                stream.submit(sample(t, sleep=0.1) for t in texts)
                stream.close_submissions()
            readers = asyncio.gather(read(ps, got_patient, killed), read(bs, got_brief, killed))
            await killed.wait()
            await asyncio.to_thread(server.start)
            await readers
        return got_patient, got_brief

    try:
        got_patient, got_brief = asyncio.run(scenario())
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    assert sorted(i for i, _ in got_patient) == list(range(8))
    assert [r for _, r in sorted(got_patient, key=lambda item: item[0])] == right
    assert sorted(i for i, _ in got_brief) == list(range(8))
    failed = [(i, r) for i, r in got_brief if r != right[i]]
    assert failed, "the brief stream's open requests should have given up"
    for _, result in failed:
        assert result.score is None and result.error is not None
        assert result.error.startswith("request failed:") and "gave up after 4 attempt(s)" in result.error
    # the restarted server scored the patient stream's samples whose requests the kill cut off
    scored = re.search(r'^rl_rewards_samples_total\{reward="slow"\} (\S+)$', metrics, re.M)
    assert scored is not None and float(scored[1]) >= 1


def test_408_is_retried_429_retry_after_is_honoured_and_a_lasting_429_fails_the_samples(scripted):  # noqa: F811
    """The stand-in answers 408 (what our server says to a client too slow to send its body),
    then 429 with `Retry-After: 0.3`: the retry after the 429 comes no sooner (the policy's own
    backoff is 1 ms) and the sample is scored. A 429 that never ends: the sample
    is yielded failed with the status, after the policy's attempts."""
    policy = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=5.0)
    scripted.script = [(408, {}, b'{"error": "body not received within body_timeout_s=60"}'),
                       (429, {"retry-after": "0.3"}, b'{"error": "slow down"}')]
    arrivals = scripted.arrivals

    async def one() -> list[tuple[int, ScoreResult]]:
        async with AsyncRewardClient(url(scripted), retry=policy) as client, client.stream("r") as stream:
            stream.submit([Sample(completion="x")])
            stream.close_submissions()
            return [item async for item in stream]

    assert asyncio.run(one()) == [(0, ScoreResult(score=0.5))]
    assert len(arrivals) == 3 and arrivals[2] - arrivals[1] >= 0.3
    scripted.script = [(429, {}, b'{"error": "slow down"}')] * policy.attempts
    [(index, result)] = asyncio.run(one())
    assert index == 0 and result.score is None
    assert "gave up after 3 attempt(s)" in (result.error or "") and "HTTP 429" in (result.error or "")
    assert len(arrivals) == 6


def test_stream_settings_and_misuse_are_refused():
    async def scenario() -> None:
        async with AsyncRewardClient(f"http://127.0.0.1:{free_port()}") as client:
            with pytest.raises(ValueError, match="max_in_flight = 0 must be >= 1"):
                client.stream(max_in_flight=0)
            stream = client.stream()
            with pytest.raises(RuntimeError, match="inside `async with"):
                stream.submit([Sample(completion="x")])
            async with stream:
                stream.close_submissions()
                assert [item async for item in stream] == []  # nothing submitted: ends at once
                with pytest.raises(RuntimeError, match="after close_submissions"):
                    stream.submit([Sample(completion="x")])

    asyncio.run(scenario())


def _nested(depth: int) -> dict:
    inner: dict = {}
    for _ in range(depth):
        inner = {"a": inner}
    return inner


UNENCODABLE = {
    "lone_surrogate": Sample(completion="half a pair \ud800"),  # not UTF-8: JSON cannot carry it
    "nested_3000": Sample(completion="deep", metadata=_nested(3000)),  # past Python's recursion limit
}


@pytest.mark.parametrize("bad", sorted(UNENCODABLE))
def test_a_sample_that_cannot_be_encoded_fails_alone(server, bad):
    """Six good samples and one that cannot be encoded as JSON: the stream yields all 7, the bad
    one failed and saying why, the six scored as `score` scores them; `score` (async and sync)
    returns the same 7 results instead of raising. With an eighth sample over the server's text
    limit, the server's 422 names it by its place in what was sent (one sample fewer): the stream
    still fails that sample, not its neighbour, and `score`'s error names its place in the caller's list."""
    good = [sample(t) for t in ("one", "two words", "[00:01] a dog", "four", "five five", "six")]
    samples = [*good[:3], UNENCODABLE[bad], *good[3:]]
    right = [ScoreResult(score=len(s.completion) / 10,
                         components={"rule": len(s.completion) / 10, "rule.words": float(len(s.completion.split()))})
             for s in good]

    async def scenario() -> tuple[list[tuple[int, ScoreResult]], list[ScoreResult], list[tuple[int, ScoreResult]]]:
        async with AsyncRewardClient(server.url) as client:
            async with client.stream("slow", batch_size=8) as stream:
                stream.submit(samples)
                stream.close_submissions()
                streamed = [item async for item in stream]
            async with client.stream("slow", batch_size=8) as stream:
                stream.submit([*samples, sample("x" * 300)])
                stream.close_submissions()
                with_long = [item async for item in stream]
            with pytest.raises(RewardRequestError) as info:
                await client.score("slow", [*samples, sample("x" * 300)])
            assert info.value.field == "$.samples[7].completion", info.value
            return streamed, await client.score("slow", samples), with_long

    streamed, scored, with_long = asyncio.run(scenario())
    with RewardClient(server.url) as client:
        scored_sync = client.score("slow", samples)
        with pytest.raises(RewardRequestError, match=r"\$\.samples\[7\]\.completion has 300 characters"):
            client.score("slow", [*samples, sample("x" * 300)])
    assert sorted(i for i, _ in streamed) == list(range(7))
    assert sorted(i for i, _ in with_long) == list(range(8))
    long = dict(with_long).pop(7)
    assert long.score is None and "max_text_chars" in (long.error or "")
    for results in ([dict(streamed)[i] for i in range(7)], [dict(with_long)[i] for i in range(7)], scored, scored_sync):
        failed = results.pop(3)
        assert failed.score is None and "cannot be encoded as JSON" in (failed.error or "")
        assert results == right
