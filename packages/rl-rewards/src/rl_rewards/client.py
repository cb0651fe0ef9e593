"""Clients of the reward server (`rl-rewards serve`) for all three protocols, sync and async.

    from rl_rewards.client import RewardClient
    with RewardClient("http://127.0.0.1:18889") as client:
        results = client.score([Sample(completion="[00:01] a dog runs")], reward="timestamp_format")

Connections are pooled (one httpx client per `RewardClient`). Every call has a timeout and is
retried with exponential backoff and full jitter on connection errors, timeouts, 5xx and 429
(honouring `Retry-After`), never on another 4xx: a bad request fails at once with
`RewardRequestError` naming the field or limit. After the last attempt `RewardServerUnavailable`
says how many attempts were made and what the last failure was. Scoring is a pure function of
the request, so retrying a POST is safe.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import httpx
import msgspec

from rl_rewards import wire
from rl_rewards.samples import Sample, ScoreResult

T = TypeVar("T")


class RewardClientError(Exception):
    """Base class of the client's errors."""


class RewardRequestError(RewardClientError):
    """The server refused the request (4xx other than 429): not retried."""

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


class RewardServerUnavailable(RewardClientError):
    """Every attempt failed with a connection error, timeout, 5xx or 429."""

    def __init__(self, url: str, attempts: int, last: str):
        super().__init__(f"{url}: gave up after {attempts} attempt(s); last failure: {last}")
        self.attempts, self.last = attempts, last


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


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


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


_ScoreMode = Literal["qa", "vl_judge"]  # wire.GetRewardRequest.score_mode


def _qa_request(prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None) -> wire.GetRewardRequest:
    # tuple(item): a [question, letter] list (as parsed from JSON) becomes the wire's pair
    return wire.GetRewardRequest(
        prompts=[(caption, [cast(wire.QAItem, tuple(item)) for item in qa]) for caption, qa in prompts],
        score_mode=score_mode,
    )


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

    def _call(self, method: str, path: str, kind: type[T], body: Any = None) -> T:
        content = None if body is None else wire.encode_json(body)
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

    def score(self, samples: Sequence[Sample], reward: str = "") -> list[ScoreResult]:
        """Native `/v1/score`: one ScoreResult per sample (`reward` "" = the server's default)."""
        request = wire.ScoreRequest(samples=list(samples), reward=reward)
        results = self._call("POST", "/v1/score", wire.ScoreResponse, request).results
        return _one_each(f"{self.base_url}/v1/score", results, len(samples))

    def get_reward(
        self, prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None = None
    ) -> wire.GetRewardResponse:
        """CapRL qa: `prompts` is `[(caption, [(question_text, answer_letter), ...]), ...]`."""
        response = self._call("POST", "/get_reward", wire.GetRewardResponse, _qa_request(prompts, score_mode))
        return _rewards_for(f"{self.base_url}/get_reward", response, len(prompts))

    def vl_judge(self, samples: Sequence[wire.VLJudgeSample]) -> wire.GetRewardResponse:
        request = wire.GetRewardRequest(score_mode="vl_judge", samples=list(samples))
        response = self._call("POST", "/get_reward", wire.GetRewardResponse, request)
        return _rewards_for(f"{self.base_url}/get_reward", response, len(samples))

    def openrlhf(
        self, query: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = ()
    ) -> wire.OpenRLHFResponse:
        request = wire.OpenRLHFRequest(query=list(query), prompts=list(prompts), labels=list(labels))
        response = self._call("POST", "/openrlhf/get_reward", wire.OpenRLHFResponse, request)
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

    async def _call(self, method: str, path: str, kind: type[T], body: Any = None) -> T:
        content = None if body is None else wire.encode_json(body)
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            try:
                response = await self._http.request(method, path, content=content)
                outcome = _outcome(response, kind)
                if not isinstance(outcome, str):
                    return outcome
                last, retry_after = outcome, response.headers.get("retry-after")
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
        raise RewardServerUnavailable(f"{self.base_url}{path}", self.retry.attempts, last)

    async def score(self, samples: Sequence[Sample], reward: str = "") -> list[ScoreResult]:
        request = wire.ScoreRequest(samples=list(samples), reward=reward)
        results = (await self._call("POST", "/v1/score", wire.ScoreResponse, request)).results
        return _one_each(f"{self.base_url}/v1/score", results, len(samples))

    async def get_reward(
        self, prompts: Sequence[wire.CaptionQA], score_mode: _ScoreMode | None = None
    ) -> wire.GetRewardResponse:
        response = await self._call("POST", "/get_reward", wire.GetRewardResponse, _qa_request(prompts, score_mode))
        return _rewards_for(f"{self.base_url}/get_reward", response, len(prompts))

    async def vl_judge(self, samples: Sequence[wire.VLJudgeSample]) -> wire.GetRewardResponse:
        request = wire.GetRewardRequest(score_mode="vl_judge", samples=list(samples))
        response = await self._call("POST", "/get_reward", wire.GetRewardResponse, request)
        return _rewards_for(f"{self.base_url}/get_reward", response, len(samples))

    async def openrlhf(
        self, query: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = ()
    ) -> wire.OpenRLHFResponse:
        request = wire.OpenRLHFRequest(query=list(query), prompts=list(prompts), labels=list(labels))
        response = await self._call("POST", "/openrlhf/get_reward", wire.OpenRLHFResponse, request)
        return _rewards_for(f"{self.base_url}/openrlhf/get_reward", response, len(query))

    async def health(self) -> wire.HealthResponse:
        response = await self._http.get("/health")
        return wire.decode_json(response.content, wire.HealthResponse)


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
        return self._client().score(samples, self.reward)

    async def ascore(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        async with AsyncRewardClient(self.url, **self._options) as client:
            return await client.score(samples, self.reward)

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
