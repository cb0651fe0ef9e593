"""The client against real servers: a restarted `rl-rewards serve`, and small stdlib HTTP servers
that answer 503/429/422 on purpose."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl_rewards import wire
from rl_rewards.client import (
    AsyncRewardClient,
    RemoteScorer,
    RetryPolicy,
    RewardClient,
    RewardEncodeError,
    RewardRequestError,
    RewardResponseError,
    RewardServerCheckError,
    RewardServerUnavailable,
)
from rl_rewards.samples import AsyncScorer, Sample, Scorer
from rl_rewards.server.process import ServerProcess, free_port

pytestmark = pytest.mark.no_torch
FAST = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.05)


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers POSTs with the statuses in `server.script`, then 200 with `server.ok_body`;
    `server.arrivals` holds when each request came (time.monotonic())."""

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.server.calls += 1
        self.server.arrivals.append(time.monotonic())
        status, headers, body = self.server.script.pop(0) if self.server.script else (200, {}, self.server.ok_body)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.calls, server.script, server.arrivals = 0, [], []
    server.ok_body = json.dumps({"reward": "r", "results": [{"score": 0.5}]}).encode()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_retries_5xx_and_429_then_succeeds(scripted):
    scripted.script = [(503, {}, b"loading"), (500, {}, b"boom"), (429, {"retry-after": "0.01"}, b"slow down")]
    with RewardClient(url(scripted), retry=FAST) as client:
        results = client.score("", [Sample(completion="x")])
    assert [r.score for r in results] == [0.5]
    assert scripted.calls == 4


def test_never_retries_a_4xx(scripted):
    scripted.script = [(422, {}, b'{"error": "bad", "field": "$.samples[0]"}')] * 3
    with RewardClient(url(scripted), retry=FAST) as client, pytest.raises(RewardRequestError) as info:
        client.score("", [Sample(completion="x")])
    assert scripted.calls == 1
    assert info.value.status == 422 and info.value.field == "$.samples[0]"
    assert "$.samples[0]" in str(info.value)


def test_the_old_order_samples_then_reward_is_refused_with_the_new_one(scripted):
    """Every method names the reward first, as the wire does: the old `score(samples, reward)`
    is refused before anything is sent, with the call to make instead."""
    samples = [Sample(completion="x")]
    new_order = r'score\(reward, samples\): the reward\'s name comes first, as on the wire; score\(\"\", samples\)'
    with RewardClient(url(scripted), retry=FAST) as client:
        for old in ((samples,), (samples, "timestamp_format")):
            with pytest.raises(TypeError, match=new_order):
                client.score(*old)

    async def old_async_call() -> None:
        async with AsyncRewardClient(url(scripted), retry=FAST) as client:
            await client.score(samples, "timestamp_format")

    with pytest.raises(TypeError, match=new_order):
        asyncio.run(old_async_call())
    assert scripted.calls == 0


def test_a_request_json_cannot_carry_is_not_sent_and_names_its_item(scripted):
    """get_reward / vl_judge / openrlhf: a lone surrogate or an object with no JSON form is a
    `RewardEncodeError` naming the item, raised before anything is sent (not msgspec's bare error)."""
    with RewardClient(url(scripted), retry=FAST) as client:
        with pytest.raises(RewardEncodeError, match=r"POST /get_reward not sent: prompts\[1\] cannot be encoded as JSON "
                                                    r"\(UnicodeEncodeError"):
            client.get_reward([("a caption", [("Q?", "A")]), ("bad \ud800", [("Q?", "A")])])
        with pytest.raises(RewardEncodeError, match=r"POST /openrlhf/get_reward not sent: labels\[0\] "):
            client.openrlhf(["q"], labels=[object()])
        with pytest.raises(RewardEncodeError, match=r"POST /get_reward not sent: samples\[0\] "):
            client.vl_judge([wire.VLJudgeSample(caption="\ud800", video_path="v.mp4")])

    async def async_call() -> None:
        async with AsyncRewardClient(url(scripted), retry=FAST) as client:
            await client.openrlhf(["fine", "\udfff"])

    with pytest.raises(RewardEncodeError, match=r"query\[1\]"):
        asyncio.run(async_call())
    assert scripted.calls == 0


def test_gives_up_with_a_clear_error(scripted):
    scripted.script = [(503, {}, b"down")] * 10
    with RewardClient(url(scripted), retry=FAST) as client, pytest.raises(RewardServerUnavailable) as info:
        client.score("", [Sample(completion="x")])
    assert scripted.calls == 4 and info.value.attempts == 4
    assert "gave up after 4 attempt(s)" in str(info.value) and "HTTP 503" in str(info.value)


def test_connection_refused_is_retried_then_reported():
    with RewardClient(f"http://127.0.0.1:{free_port()}", retry=FAST) as client, pytest.raises(RewardServerUnavailable) as info:
        client.openrlhf(["q"])
    assert "ConnectError" in info.value.last


def test_backoff_is_exponential_with_full_jitter():
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0)
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (5, 3.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= cap for d in delays) and max(delays) > cap / 2
    assert policy.delay(0, retry_after="2") == 2.0
    assert policy.delay(0, retry_after="100") == 3.0


def test_call_survives_a_server_restart(tmp_path: Path):
    port = free_port()
    config = tmp_path / "rules.toml"  # rule rewards only: no OCR engine to load on restart
    config.write_text('[rewards.timestamp_format.components.format]\nscorer = "timestamp_format"\n')
    args = ["--config", str(config)]
    server = ServerProcess(args, port=port, log_path=tmp_path / "first.log").start()
    client = RewardClient(server.url, retry=RetryPolicy(attempts=100, backoff_s=0.2, max_backoff_s=1.0))
    assert client.score("timestamp_format", [Sample(completion="[00:01] a")])[0].score == 1.0
    server.stop()
    restarted = ServerProcess(args, port=port, log_path=tmp_path / "second.log")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.score, "timestamp_format", [Sample(completion="[00:02] b [00:01] c")])
            time.sleep(0.5)
            assert not pending.done()  # retrying against a dead port
            restarted.start()
            assert pending.result(timeout=120)[0].score == 0.5
    finally:
        client.close()
        restarted.stop()


def test_async_client_all_protocols(tmp_path: Path):
    async def scenario(base: str):
        async with AsyncRewardClient(base, retry=FAST) as client:
            health = await client.health()
            scored = await client.score("timestamp_format", [Sample(completion="[00:01] a")])
            rlhf = await client.openrlhf(["p[00:01] a"], prompts=["p"])
            empty = await client.get_reward([])
            with pytest.raises(RewardRequestError, match="no judge configured"):
                await client.get_reward([("caption", [("Q?\n   - A) x", "A")])])
            return health, scored, rlhf, empty

    with ServerProcess([], log_path=tmp_path / "s.log") as server:
        health, scored, rlhf, empty = asyncio.run(scenario(server.url))
        remote = RemoteScorer(server.url, "timestamp_format", retry=FAST)
        assert isinstance(remote, Scorer) and isinstance(remote, AsyncScorer)
        assert remote.score([Sample(completion="[00:01] a")])[0].score == 1.0
        assert asyncio.run(remote.ascore([Sample(completion="none")]))[0].score == 0.0
        remote.close()
    assert health.ready and scored[0].score == 1.0
    assert rlhf.rewards == [1.0] and empty == wire.GetRewardResponse(rewards=[])


def test_a_response_that_breaks_the_protocol_is_the_clients_own_error(scripted):
    # e.g. an old server that sent a NaN reward as JSON null
    scripted.ok_body = json.dumps({"rewards": [None], "scores": [None], "extra_logs": {}}).encode()
    with RewardClient(url(scripted), retry=FAST) as client, pytest.raises(RewardResponseError, match=r"rewards\[0\]"):
        client.openrlhf(["q"])
    assert scripted.calls == 1  # not retried: the same body would come back


def test_remote_scorer_pickles_without_its_connection(scripted):
    import pickle

    scorer = RemoteScorer(url(scripted), "r", retry=FAST)
    assert scorer.score([Sample(completion="x")])[0].score == 0.5  # the client (with its locks) exists now
    copy = pickle.loads(pickle.dumps(scorer))
    assert copy.score([Sample(completion="x")])[0].score == 0.5
    assert scripted.calls == 2


def test_a_garbage_answer_is_a_response_error_and_a_failed_request_is_not(scripted):
    """The two failures an app counts apart (rider-grm: `parse_failures` vs `request_failures`):
    a 200 whose body is garbage — an HTML page, or one result for two samples (it was handed
    back as if it paired up) — is `RewardResponseError` at once, not retried: the request went
    through, its answer does not parse. A server that keeps failing (503) is
    `RewardServerUnavailable` after the retries: the request failed. Never one for the other."""
    two = [Sample(completion="x"), Sample(completion="y")]
    with RewardClient(url(scripted), retry=FAST) as client:
        scripted.ok_body = b"<html><body>502 Bad Gateway</body></html>"
        with pytest.raises(RewardResponseError, match="does not match the protocol"):
            client.score("", two)
        assert scripted.calls == 1
        scripted.ok_body = json.dumps({"reward": "r", "results": [{"score": 0.5}]}).encode()
        with pytest.raises(RewardResponseError, match=r"1 answer\(s\) for 2 sample\(s\)"):
            client.score("", two)
        remote = RemoteScorer(url(scripted), "r", retry=FAST)
        with pytest.raises(RewardResponseError, match=r"1 answer\(s\) for 2 sample\(s\)"):
            asyncio.run(remote.ascore(two))
        remote.close()
        scripted.script = [(503, {}, b"busy")] * FAST.attempts
        with pytest.raises(RewardServerUnavailable) as failed:
            client.score("", two)
        assert not isinstance(failed.value, RewardResponseError)


class Loading(http.server.BaseHTTPRequestHandler):
    """A server still loading its judge: GET /health answers 503, not ready, naming its reward."""

    def do_GET(self):
        body = json.dumps({"ready": False, "rewards": ["judge"], "default_reward": "judge"}).encode()
        self.send_response(503)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_check_serves_says_what_is_wrong_before_a_run_depends_on_the_server(tmp_path: Path):
    """Down, serving other rewards, or still loading: each a `RewardServerCheckError` naming the
    URL and what to do; a ready server serving the reward passes and returns its health."""
    down = f"http://127.0.0.1:{free_port()}"
    with RewardClient(down, retry=FAST) as client, pytest.raises(RewardServerCheckError) as raised:
        client.check_serves("timestamp_format")
    assert str(raised.value).startswith(f"no rl-rewards server answers at {down} (ConnectError: ")
    assert str(raised.value).endswith("; start one with `rl-rewards serve --config FILE`")

    loading = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=loading.serve_forever, daemon=True).start()
    try:
        with RewardClient(url(loading), retry=FAST) as client:
            start = time.monotonic()
            with pytest.raises(RewardServerCheckError, match=r"does not serve spec 'nope'; it serves judge \("):
                client.check_serves("nope", ready_timeout=30)
            assert time.monotonic() - start < 5  # a wrong name is known while the server loads: not waited for
            for reward in ("judge", ""):  # "" is the server's default reward
                with pytest.raises(RewardServerCheckError, match=rf"^the reward server at {url(loading)} is not ready: "
                                                                 r".*/health not ready after 0\.3s"):
                    client.check_serves(reward, ready_timeout=0.3)
    finally:
        loading.shutdown()
        loading.server_close()

    with ServerProcess([], log_path=tmp_path / "s.log") as server, RewardClient(server.url, retry=FAST) as client:
        health = client.check_serves("timestamp_format", ready_timeout=5)
        assert health.ready and "timestamp_format" in health.rewards
        with pytest.raises(RewardServerCheckError, match=rf"^the reward server at {server.url} does not serve spec "
                                                         r"'nope'; it serves .*timestamp_format"):
            client.check_serves("nope")
