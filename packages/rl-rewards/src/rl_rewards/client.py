"""Clients of the reward server (`rl-rewards serve`) for all three protocols, sync and async.

    from rl_rewards.client import RewardClient
    with RewardClient("http://127.0.0.1:18889") as client:
        results = client.score("timestamp_format", [Sample(completion="[00:01] a dog runs")])

Connections are pooled (one httpx client per `RewardClient`). Every call has a timeout and is
retried with exponential backoff and full jitter on connection errors, timeouts, 5xx, 408 (the
server did not get the whole request in time) and 429 (honouring `Retry-After`), never on another
4xx: a bad request fails at once with
`RewardRequestError` naming the field or limit. After the last attempt `RewardServerUnavailable`
says how many attempts were made and what the last failure was. Scoring is a pure function of
the request, so retrying a POST is safe.

`score` sends only the samples JSON can carry: one it cannot (a string with a lone surrogate,
metadata nested past Python's recursion limit) comes back failed (`error` starting with
`not sent:`), the others are scored, as the server fails one bad sample alone.

Every method names the reward first, as the wire does (`{"reward": ..., "samples": [...]}`):
`score(reward, samples)`, `stream(reward)`; `""` is the server's default reward.

`AsyncRewardClient.stream` scores samples as rollouts finish and yields each result as soon as
its request is answered (`RewardStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import httpx
import msgspec

import rl_rewards.wire as wire
from rl_rewards.samples import Sample, ScoreResult

T = TypeVar("T")


class RewardClientError(Exception):
    """Base class of the client's errors."""


class RewardRequestError(RewardClientError):
    """The server refused the request (4xx other than 408 and 429): not retried."""

    def __init__(self, status: int, body: wire.ErrorResponse, url: str):
        where = f" (field {body.field})" if body.field else ""
        limit = f" (limit {body.limit})" if body.limit else ""
        super().__init__(f"{url} -> {status}: {body.error}{where}{limit}")
        self.status, self.error, self.field, self.limit = status, body.error, body.field, body.limit


class RewardResponseError(RewardClientError):
    """The server answered 200 with a body that is not the protocol's response (an HTML page, a
    `null` where a reward must be a number, fewer or more results than samples sent): a server
    bug or a mismatched server, not retried. The request went through and the answer is garbage:
    count it as a parse failure of its samples, not as a failed request (`RewardServerUnavailable`,
    `RewardRequestError`)."""

    def __init__(self, url: str, problem: str):
        super().__init__(f"{url}: the response does not match the protocol: {problem}")
        self.problem = problem


class RewardEncodeError(RewardClientError, ValueError):
    """A request the client cannot send: a value JSON cannot carry (a lone surrogate, nesting
    past the recursion limit, an object with no JSON form) in a `get_reward`, `vl_judge` or
    `openrlhf` call, named by its place (`prompts[2]`). Nothing was sent. (`score` sends the
    other samples and fails such a sample alone.)"""


class RewardServerUnavailable(RewardClientError):
    """Every attempt failed with a connection error, timeout, 5xx, 408 or 429."""

    def __init__(self, url: str, attempts: int, last: str):
        super().__init__(f"{url}: gave up after {attempts} attempt(s); last failure: {last}")
        self.attempts, self.last = attempts, last


class RewardServerCheckError(RewardClientError):
    """`RewardClient.check_serves` found the server unusable: nothing answers at the URL, it does
    not serve the reward asked for, or it is not ready in time. The message says which and what
    to do (start a server; the rewards it does serve)."""


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; before try k+1 sleep uniform(0, min(max_backoff_s,
    backoff_s * 2**k)) ("full jitter"), or the server's Retry-After when it sends one.
    OpenRLHF's own client tries 5 times, which is the default here."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 20.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after is not None and retry_after.replace(".", "", 1).isdigit():
            return min(float(retry_after), self.max_backoff_s)
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))


_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # 408: our server's slow-client cut-off


def _outcome(response: httpx.Response, kind: type[T]) -> T | str:
    """Decoded body, or the failure text when the status is retryable; raises on other 4xx and
    on a 200 body that does not decode (`RewardResponseError`)."""
    if response.status_code == 200:
        try:
            return wire.decode_json(response.content, kind)
        except msgspec.MsgspecError as e:
            raise RewardResponseError(str(response.request.url), str(e)) from None
    if response.status_code in _RETRY_STATUS or response.status_code >= 500:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    try:
        body = wire.decode_json(response.content, wire.ErrorResponse)
    except msgspec.MsgspecError:
        body = wire.ErrorResponse(error=response.text[:500])
    raise RewardRequestError(response.status_code, body, str(response.request.url))


def _one_each(url: str, answers: Sequence[T], sent: int) -> list[T]:
    """`answers` when there is one per sample sent, else `RewardResponseError` (a mismatched
    server: pairing its answers with the samples would credit rewards to the wrong ones)."""
    if len(answers) != sent:
        raise RewardResponseError(url, f"{len(answers)} answer(s) for {sent} sample(s)")
    return list(answers)


_Rewards = TypeVar("_Rewards", wire.GetRewardResponse, wire.OpenRLHFResponse)


def _rewards_for(url: str, response: _Rewards, sent: int) -> _Rewards:
    _one_each(url, response.rewards, sent)
    return response


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


_SAMPLE_FIELD = re.compile(r"^\$\.samples\[(\d+)\]")  # a 4xx about one sample of a /v1/score request

# what msgspec raises for a value JSON cannot carry: a lone surrogate (UnicodeEncodeError), nesting
# past Python's recursion limit, a type with no JSON form (TypeError), an int over 64 bits
_ENCODE_ERRORS = (msgspec.EncodeError, TypeError, ValueError, RecursionError, OverflowError)


def _body(request: msgspec.Struct, path: str) -> bytes:
    """`request` as JSON, or a `RewardEncodeError` naming the first field or item JSON cannot carry."""
    try:
        return wire.encode_json(request)
    except _ENCODE_ERRORS as e:
        raise RewardEncodeError(f"POST {path} not sent: {_unencodable(request)} cannot be encoded as JSON "
                                f"({type(e).__name__}: {e})") from None


def _unencodable(request: msgspec.Struct) -> str:
    for name in request.__struct_fields__:
        value = getattr(request, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            try:
                wire.encode_json(item)
            except _ENCODE_ERRORS:
                return f"{name}[{i}]" if isinstance(value, list) else name
    return "the request"


def _score_body(samples: Sequence[Sample], reward: str) -> tuple[bytes | None, dict[int, ScoreResult]]:
    """The `/v1/score` body of the samples JSON can carry (None when it carries none of them),
    and a failed result for each sample it cannot, by position: one such sample is that sample's
    failure, as the server's own per-sample errors, and the others are still scored."""
    try:  # the common case costs one encoding
        return wire.encode_json(wire.ScoreRequest(samples=list(samples), reward=reward)), {}
    except _ENCODE_ERRORS:
        pass
    failed: dict[int, ScoreResult] = {}
    for i, sample in enumerate(samples):
        try:
            wire.encode_json(sample)
        except _ENCODE_ERRORS as e:
            failed[i] = ScoreResult.failed(f"not sent: the sample cannot be encoded as JSON ({type(e).__name__}: {e})")
    sendable = [s for i, s in enumerate(samples) if i not in failed]
    if failed and not sendable:
        return None, failed
    # raises when the fault is the reward name's: about the whole call, not a sample
    return wire.encode_json(wire.ScoreRequest(samples=sendable, reward=reward)), failed


def _with_failed(results: list[ScoreResult], failed: dict[int, ScoreResult]) -> list[ScoreResult]:
    """The server's `results` with the samples that were not sent put back in their places."""
    if not failed:
        return results
    scored = iter(results)
    return [failed[i] if i in failed else next(scored) for i in range(len(results) + len(failed))]


def _renumbered(error: RewardRequestError, failed: dict[int, ScoreResult], url: str) -> RewardRequestError:
    """`error` about the k-th sample sent (`$.samples[k]...`) as about that sample's place in the
    caller's list, which also held the samples not sent (`failed`)."""
    match = _SAMPLE_FIELD.match(error.field or "") if failed else None
    if match is None:
        return error
    sent = [i for i in range(int(match[1]) + len(failed) + 1) if i not in failed]
    was, now = f"$.samples[{match[1]}]", f"$.samples[{sent[int(match[1])]}]"
    body = wire.ErrorResponse(error=error.error.replace(was, now), field=(error.field or "").replace(was, now, 1),
                              limit=error.limit)
    return RewardRequestError(error.status, body, url)


_ScoreMode = Literal["qa", "vl_judge"]  # wire.GetRewardRequest.score_mode


def _qa_request(prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None) -> wire.GetRewardRequest:
    # tuple(item): a [question, letter] list (as parsed from JSON) becomes the wire's pair
    return wire.GetRewardRequest(
        prompts=[(caption, [cast(wire.QAItem, tuple(item)) for item in qa]) for caption, qa in prompts],
        score_mode=score_mode,
    )


def _reward_first(method: str, reward: object, samples: Sequence[Sample] | None) -> Sequence[Sample]:
    """`samples`, or a TypeError naming the order for the old `score(samples, reward)` call."""
    if not isinstance(reward, str) or samples is None:
        raise TypeError(f"{method}(reward, samples): the reward's name comes first, as on the wire; "
                        f'{method}("", samples) scores with the server\'s default reward')
    return samples


class RewardClient:
    """Synchronous client. `timeout` is per attempt, in seconds (OpenRLHF uses 180)."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = 180.0,
        retry: RetryPolicy = RetryPolicy(), max_connections: int = 32,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, headers=_headers(api_key),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, kind: type[T], content: bytes | None = None) -> T:
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            try:
                response = self._http.request(method, path, content=content)
                outcome = _outcome(response, kind)
                if not isinstance(outcome, str):
                    return outcome
                last, retry_after = outcome, response.headers.get("retry-after")
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < self.retry.attempts:
                time.sleep(self.retry.delay(attempt, retry_after))
        raise RewardServerUnavailable(f"{self.base_url}{path}", self.retry.attempts, last)

    def score(self, reward: str, samples: Sequence[Sample] | None = None) -> list[ScoreResult]:
        """Native `/v1/score`: one ScoreResult per sample (`reward` "" = the server's default). A
        sample JSON cannot carry (a lone surrogate, metadata nested thousands deep) is not sent:
        its result is failed (`error` starting with `not sent:`), the others are scored."""
        samples = _reward_first("score", reward, samples)
        content, failed = _score_body(samples, reward)
        if content is None:
            return _with_failed([], failed)
        url = f"{self.base_url}/v1/score"
        try:
            results = self._call("POST", "/v1/score", wire.ScoreResponse, content).results
        except RewardRequestError as e:
            raise _renumbered(e, failed, url) from None
        return _with_failed(_one_each(url, results, len(samples) - len(failed)), failed)

    def get_reward(
        self, prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None = None
    ) -> wire.GetRewardResponse:
        """CapRL qa: `prompts` is `[(caption, [(question_text, answer_letter), ...]), ...]`."""
        body = _body(_qa_request(prompts, score_mode), "/get_reward")
        response = self._call("POST", "/get_reward", wire.GetRewardResponse, body)
        return _rewards_for(f"{self.base_url}/get_reward", response, len(prompts))

    def vl_judge(self, samples: Sequence[wire.VLJudgeSample]) -> wire.GetRewardResponse:
        request = wire.GetRewardRequest(score_mode="vl_judge", samples=list(samples))
        response = self._call("POST", "/get_reward", wire.GetRewardResponse, _body(request, "/get_reward"))
        return _rewards_for(f"{self.base_url}/get_reward", response, len(samples))

    def openrlhf(
        self, query: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = ()
    ) -> wire.OpenRLHFResponse:
        request = wire.OpenRLHFRequest(query=list(query), prompts=list(prompts), labels=list(labels))
        response = self._call("POST", "/openrlhf/get_reward", wire.OpenRLHFResponse, _body(request, "/openrlhf/get_reward"))
        return _rewards_for(f"{self.base_url}/openrlhf/get_reward", response, len(query))

    def health(self) -> wire.HealthResponse:
        """GET /health once (no retries): raises httpx errors when the server is down."""
        response = self._http.get("/health")
        return wire.decode_json(response.content, wire.HealthResponse)

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> wire.HealthResponse:
        """Poll /health until `ready` (TimeoutError naming the last state after `timeout` s)."""
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            try:
                health = self.health()
                if health.ready:
                    return health
                last = f"not ready: {health}"
            except (httpx.TransportError, msgspec.MsgspecError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(interval)
        raise TimeoutError(f"{self.base_url}/health not ready after {timeout}s ({last})")

    def check_serves(self, reward: str, ready_timeout: float = 120.0) -> wire.HealthResponse:
        """Before a run depends on the server: something answers `/health` here at once, it
        serves `reward` (one of its `[rewards.NAME]` tables; `""`: its default) and it is ready
        within `ready_timeout` s; else `RewardServerCheckError` naming the URL and what is wrong
        (for an unknown name, the ones it serves). A server still loading its models already
        answers (503, with its reward names), so a wrong name fails at once and only readiness
        is waited for. Returns the ready server's health. Use it at start-up, where `score`
        would retry a down server for minutes before saying so."""
        try:
            health = self.health()
        except (httpx.TransportError, msgspec.MsgspecError) as e:
            raise RewardServerCheckError(f"no rl-rewards server answers at {self.base_url} ({type(e).__name__}: {e}); "
                                         "start one with `rl-rewards serve --config FILE`") from None
        name = reward or health.default_reward
        if name not in health.rewards:
            raise RewardServerCheckError(f"the reward server at {self.base_url} does not serve spec {name!r}; it "
                                         f"serves {', '.join(health.rewards) or 'nothing'} (its [rewards.NAME] tables)")
        try:
            return self.wait_ready(timeout=ready_timeout)
        except TimeoutError as e:
            raise RewardServerCheckError(f"the reward server at {self.base_url} is not ready: {e}") from None


class AsyncRewardClient:
    """asyncio client with the same methods (coroutines) and retry semantics."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = 180.0,
        retry: RetryPolicy = RetryPolicy(), max_connections: int = 32,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers=_headers(api_key),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, kind: type[T], content: bytes | None = None, timeout: float | None = None
    ) -> T:
        per_attempt = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            try:
                response = await self._http.request(method, path, content=content, timeout=per_attempt)
                outcome = _outcome(response, kind)
                if not isinstance(outcome, str):
                    return outcome
                last, retry_after = outcome, response.headers.get("retry-after")
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
        raise RewardServerUnavailable(f"{self.base_url}{path}", self.retry.attempts, last)

    async def score(self, reward: str, samples: Sequence[Sample] | None = None,
                    timeout: float | None = None) -> list[ScoreResult]:
        """`RewardClient.score`; `timeout` (s, per attempt) overrides the client's for this call."""
        samples = _reward_first("score", reward, samples)
        content, failed = _score_body(samples, reward)
        if content is None:
            return _with_failed([], failed)
        url = f"{self.base_url}/v1/score"
        try:
            results = (await self._call("POST", "/v1/score", wire.ScoreResponse, content, timeout)).results
        except RewardRequestError as e:
            raise _renumbered(e, failed, url) from None
        return _with_failed(_one_each(url, results, len(samples) - len(failed)), failed)

    def stream(
        self, reward: str = "", *, batch_size: int = 32, max_wait_s: float = 0.005, max_in_flight: int = 8,
        timeout: float | None = None,
    ) -> RewardStream:
        """A `RewardStream` over `/v1/score` for `reward` ("" = the server's default); use it as
        `async with client.stream(...) as stream`. Samples submitted within `max_wait_s` of each
        other travel in one request of at most `batch_size`; at most `max_in_flight` requests are
        open at once (keep it <= the client's `max_connections`); `timeout` (s, per attempt)
        overrides the client's."""
        return RewardStream(self, reward, batch_size=batch_size, max_wait_s=max_wait_s,
                            max_in_flight=max_in_flight, timeout=timeout)

    async def get_reward(
        self, prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None = None
    ) -> wire.GetRewardResponse:
        body = _body(_qa_request(prompts, score_mode), "/get_reward")
        response = await self._call("POST", "/get_reward", wire.GetRewardResponse, body)
        return _rewards_for(f"{self.base_url}/get_reward", response, len(prompts))

    async def vl_judge(self, samples: Sequence[wire.VLJudgeSample]) -> wire.GetRewardResponse:
        request = wire.GetRewardRequest(score_mode="vl_judge", samples=list(samples))
        response = await self._call("POST", "/get_reward", wire.GetRewardResponse, _body(request, "/get_reward"))
        return _rewards_for(f"{self.base_url}/get_reward", response, len(samples))

    async def openrlhf(
        self, query: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = ()
    ) -> wire.OpenRLHFResponse:
        request = wire.OpenRLHFRequest(query=list(query), prompts=list(prompts), labels=list(labels))
        response = await self._call("POST", "/openrlhf/get_reward", wire.OpenRLHFResponse, _body(request, "/openrlhf/get_reward"))
        return _rewards_for(f"{self.base_url}/openrlhf/get_reward", response, len(query))

    async def health(self) -> wire.HealthResponse:
        response = await self._http.get("/health")
        return wire.decode_json(response.content, wire.HealthResponse)


_Item = tuple[int, ScoreResult]


class RewardStream:
    """Score samples as rollouts finish; get each one's result as soon as its request is answered.

        async with AsyncRewardClient(url) as client, client.stream("caption") as stream:
            stream.submit(samples)             # -> range of the indices given to these samples
            ...                                # submit more as they come (from other tasks too)
            stream.close_submissions()         # nothing more: the iteration ends once all are answered
            async for index, result in stream: # completion order; each index exactly once
                ...

    The iteration may run alongside the submitting (a consumer task, or a loop that submits and
    reads in turn); it ends once `close_submissions()` was called and every submitted sample has
    been yielded. Samples are coalesced (verl's reward loop and AReaL score per rollout as each
    finishes; one HTTP request per sample would cost more than a rule takes to score): a request
    leaves when it holds `batch_size` samples or `max_wait_s` after its first one, and only when
    one of `max_in_flight` request slots is free, so while the server is busy samples pile up into
    fuller requests instead of more of them (backpressure). The server batches across requests
    again.

    Each request is retried as `AsyncRewardClient` retries (the client's `RetryPolicy`:
    exponential backoff, `Retry-After`, on connection errors, timeouts, 5xx, 408 and 429). A request
    that still fails is not raised: each of its samples is yielded as a failed `ScoreResult`
    (`score=None`, `error` starting with `request failed:`), never as a reward of 0. A 4xx that
    names one sample (`$.samples[3]`: a text over the server's limit) fails that sample alone and
    the rest are sent again; a sample JSON cannot carry fails alone without being sent (`not
    sent:`, as `score`). Leaving the `async with` block cancels the requests still open.
    """

    def __init__(self, client: AsyncRewardClient, reward: str, *, batch_size: int, max_wait_s: float,
                 max_in_flight: int, timeout: float | None) -> None:
        for name, value, least in (("batch_size", batch_size, 1), ("max_in_flight", max_in_flight, 1)):
            if value < least:
                raise ValueError(f"stream: {name} = {value} must be >= {least}")
        if max_wait_s < 0 or (timeout is not None and timeout <= 0):
            raise ValueError(f"stream: max_wait_s = {max_wait_s} must be >= 0 and timeout = {timeout} > 0 (or None)")
        self._client, self.reward, self.timeout = client, reward, timeout
        self.batch_size, self.max_wait_s = batch_size, max_wait_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending: deque[tuple[int, Sample]] = deque()
        self._arrived = asyncio.Event()
        self._results: asyncio.Queue[_Item | BaseException | None] = asyncio.Queue()
        self._submitted = self._yielded = 0
        self._closed = self._exited = False
        self._sender: asyncio.Task[None] | None = None
        self._requests: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> RewardStream:
        self._sender = asyncio.create_task(self._send_loop(), name=f"reward-stream-{self.reward}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._exited = True
        tasks = [t for t in (self._sender, *self._requests) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, samples: Iterable[Sample]) -> range:
        """Queue `samples` for scoring; returns the indices they get (consecutive, from 0 for the
        stream's first sample), which the iteration yields with their results."""
        if self._sender is None or self._exited:
            raise RuntimeError("submit inside `async with client.stream(...) as stream:`")
        if self._closed:
            raise RuntimeError("submit after close_submissions(): this stream takes no more samples")
        start = self._submitted
        for sample in samples:
            self._pending.append((self._submitted, sample))
            self._submitted += 1
        self._arrived.set()
        return range(start, self._submitted)

    def close_submissions(self) -> None:
        """No more samples: what is queued is sent at once, and the iteration ends after them."""
        self._closed = True
        self._arrived.set()
        self._results.put_nowait(None)  # wakes an iteration waiting with nothing outstanding

    def __aiter__(self) -> RewardStream:
        return self

    async def __anext__(self) -> _Item:
        while not (self._closed and self._yielded == self._submitted):
            if self._exited:
                raise RuntimeError("the stream was left (`async with` block) before its results were read")
            item = await self._results.get()
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                self._yielded += 1
                return item
        raise StopAsyncIteration

    async def _send_loop(self) -> None:
        try:
            while True:
                await self._slots.acquire()  # before collecting: a busy server gets fuller requests
                batch = await self._next_batch()
                if not batch:
                    return
                task = asyncio.create_task(self._send(batch))
                self._requests.add(task)
                task.add_done_callback(self._request_done)
        except Exception as e:  # a bug here: the iteration raises it rather than wait for ever
            self._results.put_nowait(e)

    async def _next_batch(self) -> list[tuple[int, Sample]]:
        """Up to `batch_size` samples, waiting `max_wait_s` after the first for more; [] once
        submissions are closed and nothing is left."""
        while not self._pending:
            if self._closed:
                return []
            self._arrived.clear()
            await self._arrived.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(self._pending) < self.batch_size and not self._closed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)
        return [self._pending.popleft() for _ in range(min(self.batch_size, len(self._pending)))]

    async def _send(self, batch: list[tuple[int, Sample]]) -> None:
        try:
            while batch:
                try:
                    results = await self._client.score(self.reward, [s for _, s in batch], self.timeout)
                except RewardRequestError as e:
                    match = _SAMPLE_FIELD.match(e.field or "")
                    bad = int(match.group(1)) if match else len(batch)
                    if bad >= len(batch):  # about the whole request (unknown reward, auth)
                        self._fail(batch, e)
                        return
                    self._fail([batch.pop(bad)], e)
                    continue
                except (RewardClientError, httpx.HTTPError) as e:
                    self._fail(batch, e)
                    return
                for (index, _), result in zip(batch, results, strict=True):
                    self._results.put_nowait((index, result))
                return
        finally:
            self._slots.release()

    def _fail(self, batch: list[tuple[int, Sample]], error: Exception) -> None:
        for index, _ in batch:
            self._results.put_nowait((index, ScoreResult.failed(f"request failed: {error}")))

    def _request_done(self, task: asyncio.Task[None]) -> None:
        self._requests.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._results.put_nowait(cast(BaseException, task.exception()))


class RemoteScorer:
    """A served reward as a `Scorer` and `AsyncScorer`: what the TRL/verl/OpenRLHF adapters use
    when given a server URL. The async client is created per event loop call (httpx async
    clients are bound to the loop that made them).

    Picklable (only its settings travel; the copy opens its own connection pool): verl's remote
    reward manager ships the reward function to Ray workers, and an open httpx client holds
    locks that cannot be pickled."""

    def __init__(self, url: str, reward: str = "", *, api_key: str | None = None, timeout: float = 180.0,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        self.name = reward or "remote"
        self.url, self.reward = url, reward
        self._options: dict[str, Any] = {"api_key": api_key, "timeout": timeout, "retry": retry}
        self._keys: tuple[str, ...] | None = None
        self._sync = RewardClient(url, **self._options)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_sync"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sync = RewardClient(self.url, **self._options)

    def _client(self) -> RewardClient:
        return self._sync

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return self._client().score(self.reward, samples)

    async def ascore(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        async with AsyncRewardClient(self.url, **self._options) as client:
            return await client.score(self.reward, samples)

    def keys(self) -> tuple[str, ...]:
        """The component keys every result of the served reward carries (asked once from
        `GET /health`, waiting up to the timeout for the server to be ready)."""
        if self._keys is None:
            health = self._client().wait_ready(timeout=self._options["timeout"])
            name = self.reward or health.default_reward or health.rewards[0]
            if name not in health.keys:
                raise RewardRequestError(404, wire.ErrorResponse(
                    error=f"the server does not serve reward {name!r}; served: {', '.join(health.rewards)}"), self.url)
            self._keys = tuple(health.keys[name])
        return self._keys

    def close(self) -> None:
        self._sync.close()
