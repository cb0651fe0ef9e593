"""`--ray`: workers as Ray actors (extra `rl-rewards[ray]`), behind the same `Router` as worker
processes — least-loaded routing, the same chunk deadline, a lost or stuck actor's chunks retried
on another, the actor replaced (no heartbeat: a busy actor could not answer one).

Connects to `RAY_ADDRESS` / `--ray-address` when set, else starts a local Ray instance on the
loopback; either way the actors run the server's interpreter, also under `uv run` (`ray_driver`). Each
actor asks Ray for `num_gpus = len(its CUDA group)` when `CUDA_VISIBLE_DEVICES` is split into
groups, so Ray places judges on GPU nodes; CPU workers ask for one CPU.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rl_rewards import wire
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import ServerSettings, from_json, to_json
from rl_rewards.server.workers import Router, WorkerLost

try:
    import ray
    from ray.exceptions import RayActorError

    from rl_rewards.server.ray_driver import init_ray
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('--ray needs Ray: pip install "rl-rewards[ray]"; in a clone of the repository: uv sync --all-packages --extra ray') from e


class RewardActor:
    """Holds the served rewards in a Ray worker process; speaks `wire` messages as msgpack bytes."""

    def __init__(self, settings_json: bytes) -> None:
        from rl_rewards.server.rewards import build_served

        self._served = build_served(from_json(settings_json))

    def rewards(self) -> list[str]:
        return list(self._served)

    def pid(self) -> int:
        return os.getpid()

    def handle(self, request: bytes) -> bytes:
        from rl_rewards.server.workers import handle

        return wire.encode_msgpack(handle(self._served, wire.decode_msgpack(request, wire.WorkRequest)))


class RayWorker:
    """One actor. Ray runs an actor's calls one at a time, so an actor that stops answering holds
    every chunk sent to it: `abandon` fails them at once (the router retries them elsewhere) and
    `stop` kills the actor (`ray.kill`: Ray has no gentler way to end a stuck actor)."""

    def __init__(self, index: int, settings: ServerSettings, num_gpus: float) -> None:
        self.index = index
        self.load = 0
        self.rewards: list[str] = []
        self._settings = settings
        self._num_gpus = num_gpus
        self._actor: Any = None
        self._dead = False
        self._abandoned: asyncio.Future[str] | None = None

    async def start(self) -> None:
        options: dict[str, Any] = {"num_gpus": self._num_gpus} if self._num_gpus else {"num_cpus": 1}
        actor_cls = ray.remote(**options)(RewardActor)
        self._abandoned = asyncio.get_running_loop().create_future()
        self._actor = actor_cls.remote(to_json(self._settings))
        self.rewards = await self._actor.rewards.remote()

    def is_alive(self) -> bool:
        return self._actor is not None and not self._dead

    async def call(self, chunk: wire.ScoreChunk) -> wire.WorkReply:
        if not self.is_alive():
            raise WorkerLost("actor is not running")
        reply = asyncio.ensure_future(self._actor.handle.remote(wire.encode_msgpack(chunk)))
        try:
            done, _ = await asyncio.wait({reply, self._abandoned}, return_when=asyncio.FIRST_COMPLETED)
            if reply not in done:
                assert self._abandoned is not None  # set in start(), before any chunk is sent
                raise WorkerLost(self._abandoned.result())
            return wire.decode_msgpack(reply.result(), wire.WorkReply)
        except RayActorError as e:
            self._dead = True
            raise WorkerLost(f"Ray actor lost: {e}") from None
        finally:
            reply.cancel()  # given up on (abandoned, or the router's deadline): do not wait for it

    def ping(self) -> None:
        """Actors are not pinged: Ray runs an actor's calls one at a time, so a busy actor could
        not answer; the chunk deadline covers them."""

    def last_seen(self) -> float:
        return asyncio.get_running_loop().time()

    def abandon(self, reason: str) -> None:
        self._dead = True
        if self._abandoned is not None and not self._abandoned.done():
            self._abandoned.set_result(reason)

    async def stop(self, grace: float = 0.0) -> None:
        if self._actor is not None:
            self.abandon("the actor was stopped")
            ray.kill(self._actor)

    @property
    def actor(self) -> Any:
        return self._actor


class RayRouter(Router):
    """`Router` that connects to Ray first (`ray.init` blocks, so it runs in a thread)."""

    def __init__(self, settings: ServerSettings, metrics: Metrics) -> None:
        groups = settings.gpu_groups() if settings.workers > 0 else [None]
        gpus = [float(len(g.split(","))) if g else 0.0 for g in groups]
        super().__init__(lambda i: RayWorker(i, settings, gpus[i]), len(groups), metrics, settings.pool)
        self._address = settings.ray_address
        self._connected = False  # this router called `ray.init` (and disconnects at close)

    async def start(self) -> None:
        if not ray.is_initialized():
            await asyncio.to_thread(init_ray, self._address, log_to_driver=False)
            self._connected = True
        await super().start()

    async def close(self) -> None:
        """Stop the actors, then leave Ray (a local Ray of the server's own stops with it): left
        to the interpreter's exit, Ray's shutdown aborted the process (SIGABRT) after a clean
        drain."""
        await super().close()
        if self._connected:
            await asyncio.to_thread(ray.shutdown)

    def actors(self) -> list[Any]:
        return [w.actor for w in self._workers if isinstance(w, RayWorker)]  # every worker here is one


def ray_router(settings: ServerSettings, metrics: Metrics) -> RayRouter:
    return RayRouter(settings, metrics)
