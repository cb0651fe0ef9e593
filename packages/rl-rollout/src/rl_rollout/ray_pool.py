"""Rollout workers as Ray actors (extra `rl-rollout[ray]`): any engine, weights synced by version.

VRL / Flow-GRPO's distributed rollout (and verl's rollout workers): when sampling and training
should run on different GPUs (or nodes), each worker is a Ray actor that builds its own engine
from a picklable `EngineSpec`, the trainer pushes its new weights after every update with a
version number (`RolloutPool.load_weights(state, version)`), and every rollout reports the
version it was produced with, so an off-policy batch is caught instead of trained on.

- Work is sharded: `map(fn, items)` / `generate(requests, params)` split the items into one
  contiguous shard per worker and gather the results in item order.
- Versions: a worker rejects weights older than the ones it holds and a rollout that expects
  another version (`StaleWeightsError`); a restarted worker gets the pool's latest weights
  before it serves again.
- Failures: a worker that dies mid-rollout is restarted (engine rebuilt, latest weights
  reloaded) and its shard retried once; a second death raises `WorkerDiedError` naming the
  worker and the items.

`connect()` joins `RAY_ADDRESS` (or the address passed) or starts a local Ray instance: a new
one (never the cluster a past `ray start` left on the machine) bound to 127.0.0.1 only, and, also
under `uv run`, with workers that run this interpreter (Ray's uv hook, which would start each
worker as `uv run` in an upload of the working directory and build an environment of its own
for it, stays off unless `RAY_ENABLE_UV_RUN_RUNTIME_ENV` is set). To use several machines,
start a cluster with `ray start` and pass its address; its workers run the Python its nodes were
started with. Pick a
pool when generation is the bottleneck and spare devices exist (split), or to keep an engine
in its own process next to the trainer (colocated, with `sleep()`/`wake()` around training);
otherwise an in-process engine is simpler and has no copy of the weights to keep in sync.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from unittest import mock

import msgspec
import torch

__all__ = [
    "EngineSpec",
    "EngineWorker",
    "Rollout",
    "RolloutPool",
    "StaleWeightsError",
    "WorkerDiedError",
    "WorkerHealth",
    "connect",
    "ship_module",
]

INSTALL = 'rl_rollout.ray_pool needs Ray: pip install "rl-rollout[ray]"; in a clone of the repository: uv sync --all-packages --extra ray'


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:
        raise ImportError(INSTALL) from error
    return ray


class StaleWeightsError(RuntimeError):
    """A worker was sent weights older than it holds, or asked to roll out with a version it
    does not hold."""


class WorkerDiedError(RuntimeError):
    """A worker died twice on the same shard (once is restarted and retried)."""


@dataclass(frozen=True)
class EngineSpec:
    """How a worker builds its engine: `factory(**kwargs)`, called inside the actor.

    `factory` and `load_weights` must be picklable (Ray uses cloudpickle: module-level functions
    of an installed package, or of a module passed to `ship_module`). `load_weights(engine,
    state)` applies a weight update; default: the `Engine` protocol's
    `engine.load_weights(state.items())`.
    """

    factory: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    load_weights: Callable[[Any, Mapping[str, torch.Tensor]], None] | None = None

    def build(self) -> Any:
        return self.factory(**self.kwargs)


class WorkerHealth(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    pid: int
    node: str
    version: int | None  # None = the weights the factory built
    gpu_ids: list[str]
    asleep: bool


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's outputs and the weight version that produced them."""

    version: int | None
    outputs: list[Any]


@dataclass(frozen=True)
class Rollout:
    """`outputs` in item order; `versions[i]` / `workers[i]`: the weight version and the worker
    that produced `outputs[i]`. Trainers assert `versions` all equal the version they pushed."""

    outputs: list[Any]
    versions: list[int | None]
    workers: list[int]


class EngineWorker:
    """The actor body (wrapped with `ray.remote` by the pool): one engine, its weight version."""

    def __init__(self, spec: EngineSpec, index: int) -> None:
        self._spec, self._index = spec, index
        self._engine = spec.build()
        self._version: int | None = None
        self._asleep = False

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> int:
        """Apply `state` as `version`; an older version is rejected, the same one is a no-op."""
        if self._version is not None and version < self._version:
            raise StaleWeightsError(f"worker {self._index} holds weights v{self._version}; refusing older v{version}")
        if version != self._version:
            if self._spec.load_weights is None:
                self._engine.load_weights(state.items())
            else:
                self._spec.load_weights(self._engine, state)
            self._version = version
        return version

    def load_shared_weights(self, payload: bytes, version: int) -> int:
        """`load_weights` from CUDA IPC handles (`rl_rollout.cuda_ipc.ipc_payload`) of tensors on
        this actor's GPU, in the trainer's process on the same machine: opened, loaded, and the
        GPU synchronized before this returns, so the trainer may free them then."""
        from rl_rollout.cuda_ipc import open_ipc_payload

        device = torch.cuda.current_device()  # the actor's one GPU, numbered as it sees it
        state = dict(open_ipc_payload(payload, device))
        try:
            return self.load_weights(state, version)
        finally:
            torch.cuda.synchronize(device)
            state.clear()  # the trainer's memory: no reference kept past this call

    def version(self) -> int | None:
        return self._version

    def health(self) -> WorkerHealth:
        ray = _ray()
        return WorkerHealth(index=self._index, pid=os.getpid(), node=ray.util.get_node_ip_address(),
                            version=self._version, gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                            asleep=self._asleep)

    def map(self, fn: str | Callable[..., Any], items: Sequence[Any], kwargs: Mapping[str, Any],
            expected_version: int | None) -> Reply:
        """`fn(engine, item, **kwargs)` (or `engine.<fn>(item, **kwargs)` for a method name) per item."""
        self._check(expected_version)
        call = getattr(self._engine, fn) if isinstance(fn, str) else (lambda item, **kw: fn(self._engine, item, **kw))
        return Reply(version=self._version, outputs=[call(item, **kwargs) for item in items])

    def generate(self, requests: Sequence[Any], params: Any, expected_version: int | None) -> Reply:
        """`engine.generate(requests, params)` on this shard (the `Engine` protocol)."""
        self._check(expected_version)
        return Reply(version=self._version, outputs=list(self._engine.generate(requests, params)))

    def sleep(self) -> None:
        self._engine.sleep()
        self._asleep = True

    def wake(self) -> None:
        self._engine.wake()
        self._asleep = False

    def _check(self, expected: int | None) -> None:
        if expected != self._version:
            raise StaleWeightsError(f"worker {self._index} holds weights v{self._version}, rollout expects v{expected}")
        if self._asleep:
            raise RuntimeError(f"worker {self._index} is asleep: call RolloutPool.wake() before a rollout")


def connect(address: str | None = None, *, num_cpus: int | None = None,
            gpu_ids: Sequence[str] | None = None) -> bool:
    """Join `address` (else `RAY_ADDRESS`) or start a local Ray instance; True if this call
    started one (the caller then owns `ray.shutdown()`). Already connected: returns False.

    A local instance (on the loopback, see the module's docstring) gets `num_cpus` (default: the
    machine's, at least 1) and exactly the GPUs `gpu_ids` (CUDA ids as `CUDA_VISIBLE_DEVICES`
    names them; None = none unless CUDA is visible, then all), so actors can be kept off the
    trainer's GPU.
    """
    ray = _ray()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        with _ray_defaults(local=False):
            ray.init(address=address)
        return False
    kwargs: dict[str, Any] = {"num_cpus": num_cpus or os.cpu_count() or 1, "include_dashboard": False}
    env = dict(LOCAL_RAY_ENV)  # the raylet reads CUDA_VISIBLE_DEVICES when it starts; this process's CUDA is unaffected
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        kwargs["num_gpus"] = len(gpu_ids)
    with _ray_defaults(local=True), mock.patch.dict(os.environ, env):  # the processes Ray starts inherit it
        ray.init(address="local", **kwargs)
    return True


LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Taken along by the processes of a local Ray: each binds the loopback (Ray's single-machine mode)."""


def _ray_defaults(*, local: bool) -> contextlib.AbstractContextManager[Any]:
    """Ray's module constants as `connect` wants them for one `ray.init` (Ray read them from the
    environment when it was imported): uv hook off unless the user set it; a local node on the
    loopback."""
    from ray._private import ray_constants

    values: dict[str, Any] = {} if "RAY_ENABLE_UV_RUN_RUNTIME_ENV" in os.environ else {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": False}
    if local:
        values["ENABLE_RAY_CLUSTER"] = False
    return mock.patch.multiple(ray_constants, **values) if values else contextlib.nullcontext()


def ship_module(module: ModuleType) -> None:
    """Send `module`'s functions and classes to workers by value: for code that workers cannot
    import (an app folder run as a script) but that an `EngineSpec` or `map` refers to."""
    _ray().cloudpickle.register_pickle_by_value(module)


class RolloutPool:
    """`num_workers` Ray actors, each holding `spec.build()`, with versioned weight sync.

    Each actor asks Ray for `num_cpus` and `num_gpus` (fractions share a GPU). Not connected to
    Ray yet: connects to `address` (or `RAY_ADDRESS`) or starts a local instance with the GPUs
    `gpu_ids` (`connect`), which `close()` shuts down.
    """

    def __init__(self, spec: EngineSpec, num_workers: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 address: str | None = None, start_timeout_s: float = 600.0,
                 gpu_ids: Sequence[str] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._ray = _ray()
        self._owns_ray = connect(address, num_cpus=max(os.cpu_count() or 1, int(num_workers * num_cpus)),
                                 gpu_ids=gpu_ids)
        self._actor_cls = self._ray.remote(EngineWorker).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)
        self._spec, self._timeout = spec, start_timeout_s
        self._weights: Any = None  # ObjectRef of the latest state dict (refreshes restarted workers)
        self._shared: Sequence[bytes] | None = None  # or the latest push's CUDA IPC handles, one set per worker
        self._version: int | None = None
        self._asleep = False
        self._workers: list[Any] = [None] * num_workers
        for i in range(num_workers):  # start all, then wait: the engines load in parallel
            self._workers[i] = self._actor_cls.remote(spec, i)
        try:
            self.health()
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def version(self) -> int | None:
        """The version of the last `load_weights` (None: the weights the factory built)."""
        return self._version

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles (`EngineWorker` methods, `.remote()`), restarting dead ones."""
        return [self._worker(i) for i in range(self.num_workers)]

    def health(self) -> list[WorkerHealth]:
        """Every worker's state; restarts dead ones. Raises if one cannot start."""
        return [self._await_start(i, self._worker(i).health.remote()) for i in range(self.num_workers)]

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Push `state` (tensors, copied to CPU) to every worker as `version` (must not go back)."""
        self._check_newer(version)
        self._weights = self._ray.put({name: t.detach().cpu() for name, t in state.items()})
        self._shared, self._version = None, version
        self._await_loads([self._worker(i).load_weights.remote(self._weights, version) for i in range(self.num_workers)])

    def load_shared_weights(self, payloads: Sequence[bytes], version: int) -> None:
        """Push `version` to every worker as CUDA IPC handles (`rl_rollout.cuda_ipc.ipc_payload`),
        `payloads[i]` of tensors on worker `i`'s GPU: no copy through host memory. Only for
        workers on this machine's GPUs (`WorkerHealth.gpu_ids`). The caller keeps the tensors
        alive until its next push (a restarted worker reloads them from these handles)."""
        if len(payloads) != self.num_workers:
            raise ValueError(f"got {len(payloads)} weight payloads for {self.num_workers} workers")
        self._check_newer(version)
        self._weights, self._shared, self._version = None, list(payloads), version
        self._await_loads([self._worker(i).load_shared_weights.remote(payloads[i], version)
                           for i in range(self.num_workers)])

    def map(self, fn: str | Callable[..., Any], items: Sequence[Any], **kwargs: Any) -> Rollout:
        """`fn(engine, item, **kwargs)` for every item (`engine.<fn>(item, ...)` for a method
        name), items sharded contiguously over the workers, outputs in item order."""
        return self._run(lambda w, shard: w.map.remote(fn, shard, kwargs, self._version), list(items))

    def generate(self, requests: Sequence[Any], params: Any) -> Rollout:
        """`Engine.generate` over the workers: `len(requests) * params.n` generations, request
        major, `request_index` counted over all requests. A `params.seed` seeds each shard's call,
        so seeded samples depend on the number of workers."""
        rollout = self._run(lambda w, shard: w.generate.remote(shard, params, self._version), list(requests))
        # each output is one Generation; shard-local request indexes become global ones
        offsets = self._offsets(len(requests))
        outputs = [msgspec.structs.replace(g, request_index=g.request_index + offsets[w])
                   for g, w in zip(rollout.outputs, rollout.workers, strict=True)]
        return Rollout(outputs, rollout.versions, rollout.workers)

    def sleep(self) -> None:
        """Free the workers' accelerator memory (`engine.sleep()`): VRL's colocated preset
        releases rollout actors before the trainer's replay/backward."""
        self._ray.get([self._worker(i).sleep.remote() for i in range(self.num_workers)])
        self._asleep = True

    def wake(self) -> None:
        self._ray.get([self._worker(i).wake.remote() for i in range(self.num_workers)])
        self._asleep = False

    def close(self) -> None:
        for actor in self._workers:
            if actor is not None:
                self._ray.kill(actor)
        self._workers = [None] * self.num_workers
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _check_newer(self, version: int) -> None:
        if self._version is not None and version < self._version:
            raise StaleWeightsError(f"pool holds weights v{self._version}; refusing older v{version}")

    def _await_loads(self, refs: list[Any]) -> None:
        """Wait for each worker's weight load; a worker that died is restarted with the latest weights."""
        for i, ref in enumerate(refs):
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                self._workers[i] = None  # restarted with these weights on next use
                self._worker(i)

    def shard_spans(self, count: int) -> list[tuple[int, int]]:
        """The `[start, end)` item spans `map` and `generate` give the workers, in worker order,
        for `count` items: contiguous, sizes differing by at most one, empty ones left out."""
        offsets = self._offsets(count)
        return [(offsets[i], offsets[i + 1]) for i in range(self.num_workers) if offsets[i + 1] > offsets[i]]

    def _offsets(self, count: int) -> list[int]:
        sizes = [count // self.num_workers + (i < count % self.num_workers) for i in range(self.num_workers)]
        return [sum(sizes[:i]) for i in range(self.num_workers + 1)]

    def _run(self, call: Callable[[Any, list[Any]], Any], items: list[Any]) -> Rollout:
        if self._asleep:
            raise RuntimeError("the rollout pool is asleep: call wake() before a rollout")
        offsets = self._offsets(len(items))
        shards = {i: items[offsets[i]:offsets[i + 1]] for i in range(self.num_workers) if offsets[i + 1] > offsets[i]}
        refs = {i: call(self._worker(i), shard) for i, shard in shards.items()}  # all in flight at once
        outputs: list[Any] = []
        versions: list[int | None] = []
        workers: list[int] = []
        for i, shard in shards.items():
            reply = self._gather(i, refs[i], call, shard, offsets[i])
            outputs += reply.outputs
            versions += [reply.version] * len(reply.outputs)
            workers += [i] * len(reply.outputs)
        return Rollout(outputs, versions, workers)

    def _gather(self, i: int, ref: Any, call: Callable[[Any, list[Any]], Any], shard: list[Any], start: int) -> Reply:
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            self._workers[i] = None  # restarted (engine rebuilt, weights reloaded) just below
        try:
            return ray.get(call(self._worker(i), shard))
        except ray.exceptions.RayActorError as error:
            self._workers[i] = None  # restarted on the next use
            raise WorkerDiedError(
                f"rollout worker {i} died twice on its shard (items {start}..{start + len(shard) - 1}); "
                f"last error: {error}") from None

    def _worker(self, i: int) -> Any:
        """Worker `i`, restarted first if it died (then given the latest weights and sleep state)."""
        if self._workers[i] is None:
            actor = self._actor_cls.remote(self._spec, i)
            self._workers[i] = actor
            self._await_start(i, actor.health.remote())
            if self._weights is not None:
                self._ray.get(actor.load_weights.remote(self._weights, self._version))
            elif self._shared is not None:
                self._ray.get(actor.load_shared_weights.remote(self._shared[i], self._version))
            if self._asleep:
                self._ray.get(actor.sleep.remote())
        return self._workers[i]

    def _await_start(self, i: int, ref: Any) -> Any:
        ray = self._ray
        start = time.monotonic()
        try:
            return ray.get(ref, timeout=self._timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"rollout worker {i} did not start within {time.monotonic() - start:.0f} s: the cluster may lack "
                f"the resources asked per worker (available: {ray.available_resources()})") from None
        except ray.exceptions.RayActorError as error:
            self._workers[i] = None
            raise RuntimeError(f"rollout worker {i} failed to start: {error}") from None
