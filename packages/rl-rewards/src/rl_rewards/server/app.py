"""The ASGI app (starlette): routes, request validation, and the scoring service behind them.

Routes (scoring routes require the bearer token when an API key is configured):

| route | protocol |
|---|---|
| `POST /get_reward` | CapRL++ (qa and vl_judge), drop-in |
| `POST /openrlhf/get_reward` | OpenRLHF remote reward model (`--reward.remote_url http://HOST:PORT/openrlhf/get_reward`; older OpenRLHF: `--remote_rm_url`) |
| `POST /v1/score` | native: samples + reward name -> ScoreResults |
| `GET /health` | 200 `{"ready": true, ...}` once every reward is loaded, else 503 (`error`: why loading failed; `judge_engine`: the judge's engine, `hf` or `vllm`) |
| `GET /metrics` | Prometheus text |

Loading happens in the background after startup, so `/health` answers (503) while a judge loads.
A load that fails sets `error` in `/health` and calls `on_load_failure` (`serve` then exits 1).
Every error body is JSON (`wire.ErrorResponse`): 4xx when the request can never succeed as sent
(the client must not retry it), 5xx only for what a retry may fix (loading, a worker pool that
gave up, shutdown, a bug here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rl_rewards import wire
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server import protocols
from rl_rewards.server.batching import Batcher
from rl_rewards.server.limits import (
    HTTPProblem,
    check_api_key,
    check_auth,
    check_batch,
    check_metadata,
    check_texts,
    confine_sample,
    read_body,
)
from rl_rewards.server.metrics import CONTENT_TYPE, Metrics
from rl_rewards.server.rewards import (
    CAPRL_FORMAT,
    CAPRL_QA,
    CAPRL_VL_JUDGE,
    judge_name,
    reward_names,
    served_keys,
)
from rl_rewards.server.settings import LimitSettings, ServerSettings, from_json
from rl_rewards.server.workers import SETTINGS_ENV, LocalPool, Pool, process_router

log = logging.getLogger("rl_rewards.server")
W = TypeVar("W", bound=msgspec.Struct)
JSON = "application/json"


def make_pool(settings: ServerSettings, metrics: Metrics) -> Pool:
    if settings.interpreters():  # rewards in environments of their own: see `environments`
        from rl_rewards.server.environments import EnvironmentPool, serves_others

        return EnvironmentPool(settings, _own_pool(settings, metrics) if serves_others(settings) else None, metrics)
    return _own_pool(settings, metrics)


def _own_pool(settings: ServerSettings, metrics: Metrics) -> Pool:
    if settings.ray:
        from rl_rewards.server.ray_pool import ray_router

        return ray_router(settings, metrics)
    if settings.workers > 0:
        return process_router(settings, metrics)
    return LocalPool(settings)


class RewardService:
    """Pool + one batcher per served reward. `ready` once the pool has loaded every reward."""

    def __init__(self, settings: ServerSettings, pool: Pool | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.pool = pool or make_pool(settings, self.metrics)
        self.names: list[str] = []
        self.default = settings.default_reward
        self.batchers: dict[str, Batcher] = {}
        self.load_error: str | None = None
        self.on_load_failure: Callable[[], None] | None = None
        """Called once loading failed (`serve` stops the server then, to exit with status 1)."""
        self._loader: asyncio.Task[None] | None = None

    def ready(self) -> bool:
        return bool(self.batchers) and self.pool.ready()

    async def start(self) -> None:
        self._loader = asyncio.create_task(self._load())

    async def loaded(self) -> None:
        """Wait for the background load started by `start`."""
        if self._loader is not None:
            await self._loader

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            await self.pool.start()
        except Exception as e:
            self.load_error = f"loading the rewards failed: {type(e).__name__}: {e}"
            log.debug("loading the rewards failed", exc_info=True)
            log.error("%s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        self.names = self.pool.rewards
        self.default = self.settings.default_reward or self.names[0]
        limits = self.settings.max_concurrency()
        for name in self.names:
            if name in limits:
                self.metrics.max_concurrency.labels(name).set(limits[name])
            slots = min(self.pool.size, limits.get(name, self.pool.size))
            batcher = Batcher(name, self.pool.score, self.settings.batching, slots, self.metrics,
                              timeout_s=self.settings.pool.request_timeout_s)
            batcher.start()
            self.batchers[name] = batcher
        log.info("ready: rewards %s loaded in %.1fs", self.names, time.perf_counter() - started)

    def abort(self, reason: str) -> None:
        """Answer every request still waiting for a batch with 503 `reason` (the shutdown's
        grace period is over); rule rewards scored inline never wait."""
        for batcher in self.batchers.values():
            batcher.abort(RuntimeError(reason))

    async def close(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loader
        await asyncio.gather(*(b.close() for b in self.batchers.values()))
        await self.pool.close()

    def check_served(self, name: str) -> None:
        # loaded, not ready(): with every worker restarting at once the request waits for one
        # (up to request_timeout_s) instead of a 503 it would have to retry
        if not self.batchers:
            raise HTTPProblem(503, self.load_error or "the server is still loading its rewards; poll GET /health")
        if name not in self.batchers:
            raise HTTPProblem(
                404, f"unknown reward {name!r}; served rewards: {', '.join(self.names)}", field="$.reward"
            )

    async def score(self, name: str, prepared: Sequence[protocols.Prepared]) -> list[ScoreResult]:
        """Score the prepared samples with reward `name`; pre-failed ones keep their error.
        Rule-only rewards are scored right here (no queue, no thread hop); the others go
        through the reward's batcher to the pool."""
        self.check_served(name)
        samples = [p for p in prepared if isinstance(p, Sample)]
        if name in self.pool.inline:
            started = time.perf_counter()
            scored = self.pool.score_inline(name, samples)
            if samples:
                self.metrics.observe_batch(name, samples, scored, time.perf_counter() - started)
            return protocols.merge(prepared, scored)
        try:
            scored = await self.batchers[name].score(samples)
        except RuntimeError as e:
            raise HTTPProblem(503, f"not scored: {e}") from None
        return protocols.merge(prepared, scored)


def decode(body: bytes, kind: type[W], limits: LimitSettings) -> W:
    """Decode a body into a wire Struct; 400 for malformed JSON (invalid UTF-8 included), 422
    naming the field or the limit otherwise."""
    try:
        return wire.decode_json(body, kind)
    except msgspec.ValidationError as e:
        raise HTTPProblem(422, f"invalid request: {e}", field=wire.validation_path(e)) from None
    except msgspec.DecodeError as e:
        raise HTTPProblem(400, f"malformed JSON: {e}") from None
    except UnicodeDecodeError as e:  # msgspec decodes strings with Python's codec
        raise HTTPProblem(400, f"malformed JSON: a string is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise HTTPProblem(
            422, f"JSON nested too deep to decode; metadata may nest at most max_metadata_depth="
            f"{limits.max_metadata_depth} levels", limit="max_metadata_depth",
        ) from None


def error_body(problem: HTTPProblem) -> bytes:
    return wire.encode_json(wire.ErrorResponse(error=problem.error, field=problem.field, limit=problem.limit))


def json_error(status: int, error: str) -> Response:
    return Response(error_body(HTTPProblem(status, error)), status_code=status, media_type=JSON)


async def _starlette_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405 (unknown route, wrong method) as JSON, like every other error."""
    return Response(error_body(HTTPProblem(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")),
                    status_code=exc.status_code, media_type=JSON, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_error(500, f"internal error: {type(exc).__name__}; see the server log")


def build_app(settings: ServerSettings, pool: Pool | None = None, service: RewardService | None = None) -> Starlette:
    """The server's app; `service` replaces the default scoring service (`--backend ray-serve`'s
    ingress passes one that calls the reward deployments)."""
    check_api_key(settings.api_key)
    service = service or RewardService(settings, pool)
    keys = served_keys(settings)  # per reward, the component keys of every result
    service.metrics.show_limits(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        if settings.http_processes > 1:
            # processes share the port: one must not take connections before its rewards exist
            # (rule rewards only, built in milliseconds), or a client gets 503 from it while
            # /health, answered by another, already says ready
            await service.loaded()
        yield
        log.info("shutting down: draining queued batches")
        await service.close()

    def route(path: str, handler: Callable[[Request], Awaitable[bytes]], scoring: bool = True) -> Route:
        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            try:
                if scoring:
                    check_auth(request, settings.api_key)
                body, status = await handler(request), 200
            except HTTPProblem as p:
                body, status = error_body(p), p.status
                log.info("%s %s -> %d: %s", request.method, path, status, p.error)
            except ClientDisconnect:  # gone before its body arrived (or cut off by body_timeout_s)
                body, status = error_body(HTTPProblem(400, "the client disconnected before sending its body")), 400
            except Exception as e:  # a bug here: still a JSON body, and the server keeps serving
                log.exception("%s %s failed", request.method, path)
                body, status = error_body(HTTPProblem(500, f"internal error: {type(e).__name__}; see the server log")), 500
            service.metrics.observe_request(path, status, time.perf_counter() - started)
            return Response(body, status_code=status, media_type=JSON)

        return Route(path, endpoint, methods=["POST"] if scoring else ["GET"])

    async def get_reward(request: Request) -> bytes:
        body = await read_body(request, settings.limits)
        req = decode(body, wire.GetRewardRequest, settings.limits)
        mode = req.score_mode or _shape_mode(req) or settings.score_mode
        if mode == "vl_judge":
            return wire.encode_json(await _vl_judge(service, req))
        return wire.encode_json(await _qa(service, req))

    async def openrlhf(request: Request) -> bytes:
        req = decode(await read_body(request, settings.limits), wire.OpenRLHFRequest, settings.limits)
        n = len(req.query)
        check_batch(n, "$.query", settings.limits)
        for field, values in (("$.prompts", req.prompts), ("$.labels", req.labels)):
            if values and len(values) != n:
                raise HTTPProblem(422, f"{field} has {len(values)} items but $.query has {n}", field=field)
        check_texts(((f"$.query[{i}]", q) for i, q in enumerate(req.query)), settings.limits)
        name = settings.openrlhf_reward or service.default
        results = await service.score(name, protocols.openrlhf_samples(req))
        return wire.encode_json(protocols.openrlhf_response(results, keys.get(name, ())))

    async def native(request: Request) -> bytes:
        req = decode(await read_body(request, settings.limits), wire.ScoreRequest, settings.limits)
        check_batch(len(req.samples), "$.samples", settings.limits)
        check_texts(protocols.sample_texts(req.samples, "$.samples", settings.limits.max_text_chars), settings.limits)
        check_metadata(req.samples, "$.samples", settings.limits)
        name = req.reward or service.default
        prepared = _confined_all(req.samples, settings.media_roots)
        results = await service.score(name, prepared)
        return wire.encode_json(wire.ScoreResponse(reward=name, results=results))

    async def health(request: Request) -> Response:
        info = wire.HealthResponse(
            ready=service.ready(), rewards=service.names or reward_names(settings), score_mode=settings.score_mode,
            judge=judge_name(settings), workers=service.pool.size, workers_alive=service.pool.alive(), pid=os.getpid(),
            keys=keys, default_reward=service.default or settings.default_reward, error=service.load_error,
            judge_engine=settings.engine if judge_name(settings) is not None else None,
        )
        return Response(wire.encode_json(info), status_code=200 if info.ready else 503, media_type=JSON)

    async def metrics(request: Request) -> Response:
        service.metrics.workers_healthy.set(service.pool.alive())
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    app = Starlette(
        routes=[
            route("/get_reward", get_reward),
            route("/openrlhf/get_reward", openrlhf),
            route("/v1/score", native),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _starlette_error, Exception: _server_error},  # type: ignore[dict-item]  # starlette types handlers by Exception only
    )
    app.state.service = service
    return app


def app_from_environment() -> Starlette:
    """The app of one of several server processes (`--http-processes`): settings from the
    environment variable the supervisor set, logging as in the parent."""
    from rl_rewards.server.logs import configure_logging

    settings = from_json(os.environ[SETTINGS_ENV])
    configure_logging(settings)
    return build_app(settings)


def _shape_mode(req: wire.GetRewardRequest) -> str | None:
    """The mode a request without `score_mode` is written in: CapRL's qa requests carry
    `prompts`, vl_judge ones `samples`. Without this, a qa batch sent to a vl_judge server read
    as an empty vl_judge batch and got 200 `{"rewards": []}` instead of the 422 naming the fix."""
    if req.prompts and not req.samples:
        return "qa"
    if req.samples and not req.prompts:
        return "vl_judge"
    return None


def _confined_all(samples: list[Sample], roots: list[str]) -> Sequence[protocols.Prepared]:
    if not any(s.metadata for s in samples):  # no media paths to resolve (rule rewards' requests)
        return samples
    return [_confined(s, roots) for s in samples]


def _confined(sample: Sample, roots: list[str]) -> protocols.Prepared:
    try:
        return confine_sample(sample, roots)
    except ValueError as e:
        return str(e)


async def _qa(service: RewardService, req: wire.GetRewardRequest) -> wire.GetRewardResponse:
    settings = service.settings
    if not req.prompts:
        return wire.GetRewardResponse(rewards=[])
    check_batch(len(req.prompts), "$.prompts", settings.limits)
    check_texts(protocols.qa_texts(req), settings.limits)
    if judge_name(settings) != CAPRL_QA:
        raise HTTPProblem(
            422,
            "no judge configured: a CapRL qa request needs the caption_qa judge; start the server with "
            "REWARD_MODEL=<text LLM> (or --model) and REWARD_SCORE_MODE=qa, with rl-rewards[hf] installed",
            field="$.score_mode",
        )
    prepared = [protocols.qa_sample(caption, qa) for caption, qa in req.prompts]
    if settings.task != "video":
        return protocols.qa_response(await service.score(CAPRL_QA, prepared), None, 0.0)
    captions = [Sample(completion=caption) for caption, _ in req.prompts]
    qa, fmt = await asyncio.gather(service.score(CAPRL_QA, prepared), service.score(CAPRL_FORMAT, captions))
    return protocols.qa_response(qa, fmt, settings.format_reward_weight)


async def _vl_judge(service: RewardService, req: wire.GetRewardRequest) -> wire.GetRewardResponse:
    settings = service.settings
    if not req.samples:
        return wire.GetRewardResponse(rewards=[])
    check_batch(len(req.samples), "$.samples", settings.limits)
    check_texts(protocols.vl_texts(req), settings.limits)
    if judge_name(settings) != CAPRL_VL_JUDGE:
        raise HTTPProblem(
            422,
            "no vl_judge configured: start the server with REWARD_MODEL=<VLM> and REWARD_SCORE_MODE=vl_judge",
            field="$.score_mode",
        )
    prepared = [_confined(protocols.vl_judge_sample(s), settings.media_roots) for s in req.samples]
    return protocols.judge_response(await service.score(CAPRL_VL_JUDGE, prepared))
