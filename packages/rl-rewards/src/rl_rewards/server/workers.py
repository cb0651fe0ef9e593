"""Where batches are scored: in the server process, or in worker processes behind a router.

`LocalPool` (`--workers 0`): the rewards live in the server process; batches run one at a time
in a dedicated thread (model scorers are not thread-safe), so the event loop keeps serving.
Rewards made of rules only (`rl_rewards.samples.runs_inline`) skip the queue and the thread:
they are scored on the event loop as requests arrive.

`Router` over `ProcessWorker`s (`--workers N`): N worker processes (`python -m
rl_rewards.server.workers`), one per GPU group of `CUDA_VISIBLE_DEVICES` or N CPU workers. Each
batch goes to the worker with the fewest outstanding samples (CapRL's static chunking kept worker
0 hot). When a worker dies, its in-flight chunks are retried on another worker and the dead one is
restarted, so a crash loses no request. A worker that hangs instead is caught by the chunk
deadline (a stuck judge), or within seconds by its heartbeat when the whole process stops running
(a SIGSTOP, a deadlock): marked unhealthy, its chunks retried elsewhere, killed after a grace
period and restarted (`PoolSettings`). Router and worker speak length-prefixed msgpack
(`rl_rewards.wire.WorkRequest` / `WorkReply`) over the worker's stdin/stdout; in the worker, a
reader thread answers the router's pings at once and queues chunks for the scoring thread, so a
worker busy with a long chunk still answers its heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

from prometheus_client import Counter

from rl_rewards import wire
from rl_rewards.samples import Sample, ScoreResult, runs_inline
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.rewards import build_served, score_with
from rl_rewards.server.settings import PoolSettings, ServerSettings, from_json, to_json

log = logging.getLogger("rl_rewards.server")
_HEADER = struct.Struct(">I")
SETTINGS_ENV = "RL_REWARDS_WORKER_SETTINGS"


class WorkerLost(RuntimeError):
    """The worker died (or its actor was lost) before answering; the chunk may be retried."""


class Pool(Protocol):
    """What the batchers score through."""

    size: int
    rewards: list[str]
    """Names of the loaded rewards (filled by `start`)."""
    inline: frozenset[str]
    """Rewards scored at once on the caller's thread (`score_inline`), not through a batcher."""

    async def start(self) -> None: ...
    async def score(self, reward: str, samples: list[Sample]) -> list[ScoreResult]: ...
    def score_inline(self, reward: str, samples: list[Sample]) -> list[ScoreResult]: ...
    async def close(self) -> None: ...
    def alive(self) -> int: ...
    def ready(self) -> bool: ...


class LocalPool:
    """Rewards in the server process; one scoring thread."""

    size = 1

    def __init__(self, settings: ServerSettings) -> None:
        self._settings = settings
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-rewards-score")
        self._served: dict | None = None
        self.rewards: list[str] = []
        self.inline: frozenset[str] = frozenset()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        served = await loop.run_in_executor(self._executor, build_served, self._settings)
        self._served = served
        self.rewards = list(served)
        self.inline = frozenset(name for name, scorer in served.items() if runs_inline(scorer))

    async def score(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        """The batch's results; RuntimeError (503) after `request_timeout_s`. A thread cannot be
        restarted: a judge that can hang belongs in `--workers 1`, where a stuck worker is."""
        loop = asyncio.get_running_loop()
        timeout = self._settings.pool.request_timeout_s
        work = loop.run_in_executor(self._executor, score_with, self._scorers(), reward, samples)
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            raise RuntimeError(
                f"reward {reward!r}: no result within request_timeout_s={timeout} from the in-process scorer "
                "(run it with --workers 1 to have a stuck scorer restarted)"
            ) from None

    def score_inline(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        return score_with(self._scorers(), reward, samples)

    def _scorers(self) -> dict:
        if self._served is None:
            raise RuntimeError("the in-process pool was not started")
        return self._served

    async def close(self) -> None:
        self._executor.shutdown(wait=True)

    def alive(self) -> int:
        return 1 if self._served is not None else 0

    def ready(self) -> bool:
        return self._served is not None


class WorkerHandle(Protocol):
    """One worker as the router sees it (a process, or a Ray actor)."""

    index: int
    load: int
    rewards: list[str]

    async def start(self) -> None: ...
    async def call(self, chunk: wire.ScoreChunk) -> wire.WorkReply: ...
    def abandon(self, reason: str) -> None:
        """Take no more chunks and fail the ones in flight with `WorkerLost` (they are retried)."""
    async def stop(self, grace: float) -> None:
        """Ask the worker to exit; kill it if it has not after `grace` seconds."""
    def is_alive(self) -> bool: ...
    def ping(self) -> None:
        """Send a liveness probe without waiting for it; its answer, as any answer, moves `last_seen`."""
    def last_seen(self) -> float:
        """Event-loop time of the worker's last answer (a worker that cannot be pinged: now)."""


class Router:
    """Least-loaded routing with a deadline per chunk, retry on another worker, and restart of
    dead or stuck workers.

    A chunk not answered within `PoolSettings.chunk_deadline()` marks its worker unhealthy (it
    leaves `alive()`, so `/health` and `rl_rewards_workers_healthy` drop), fails the worker's
    other chunks so they are retried at once, and restarts it. A request gives up with
    RuntimeError (the app answers 503) after `request_timeout_s` or `max_attempts` tries.

    A heartbeat catches a worker whose process runs no code (SIGSTOP, deadlock) well before the
    deadline: every worker is pinged each `PoolSettings.heartbeat_interval()`, and one that has
    answered nothing for `heartbeat_timeout_s` is treated the same way."""

    def __init__(
        self, factory: Callable[[int], WorkerHandle], size: int, metrics: Metrics, pool: PoolSettings | None = None
    ) -> None:
        self.size = size
        self._factory = factory
        self._metrics = metrics
        self._pool = pool or PoolSettings()
        self._workers: list[WorkerHandle] = [factory(i) for i in range(size)]
        self.rewards: list[str] = []
        self.inline: frozenset[str] = frozenset()  # the rewards live in the workers: all routed
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self._started = False
        self._next_id = 0
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self._workers))
        self.rewards = self._workers[0].rewards
        self._started = True
        self._watcher = asyncio.create_task(self._watch())

    def alive(self) -> int:
        """Workers that take chunks now (not dead, not stuck, not restarting)."""
        return sum(1 for w in self._workers if w.is_alive())

    def ready(self) -> bool:
        return self._started and self.alive() > 0

    async def score(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._pool.request_timeout_s
        errors: list[str] = []
        tried: set[int] = set()
        timed_out = f"reward {reward!r}: no result within request_timeout_s={self._pool.request_timeout_s}"
        for attempt in range(self._pool.max_attempts):
            if attempt and loop.time() >= give_up_at:  # a deadline of 0 would take the next worker for a hung one
                raise RuntimeError(f"{timed_out}: {'; '.join(errors)}")
            worker = await self._pick(tried, give_up_at, errors)
            tried.add(worker.index)
            self._next_id += 1
            chunk = wire.ScoreChunk(id=self._next_id, reward=reward, samples=samples)
            deadline = min(self._pool.chunk_deadline(), give_up_at - loop.time())
            worker.load += len(samples)
            try:
                reply = await asyncio.wait_for(worker.call(chunk), deadline)
            except TimeoutError:
                errors.append(f"worker {worker.index}: no answer within {deadline:.1f} s (chunk_deadline_s)")
                self._suspend(worker, f"sent no answer in {deadline:.1f} s (chunk_deadline_s)",
                              self._metrics.deadline_misses)
                if deadline < self._pool.chunk_deadline():  # the request's time is over: no other worker to try
                    raise RuntimeError(f"{timed_out}: {'; '.join(errors)}") from None
                self._count_retry(attempt)
                continue
            except WorkerLost as e:
                errors.append(f"worker {worker.index}: {e}")
                self._restart(worker)
                self._count_retry(attempt)
                continue
            finally:
                worker.load -= len(samples)
            if reply.error is None:
                return reply.results
            errors.append(f"worker {worker.index}: {reply.error}")
        raise RuntimeError(f"reward {reward!r}: chunk failed on {len(errors)} attempts: {'; '.join(errors)}")

    def _count_retry(self, attempt: int) -> None:
        if attempt + 1 < self._pool.max_attempts:
            self._metrics.chunk_retries.inc()

    def score_inline(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        raise RuntimeError("a worker pool scores every reward in its workers; nothing is inline")

    async def _pick(self, tried: set[int], give_up_at: float, errors: list[str]) -> WorkerHandle:
        """The least-loaded live worker, preferring ones this chunk has not failed on; waits for
        a restart when none is alive, until `give_up_at` (then RuntimeError)."""
        loop = asyncio.get_running_loop()
        while True:
            for w in self._workers:
                if not w.is_alive():
                    self._restart(w)  # died while idle: nobody else noticed
            live = [w for w in self._workers if w.is_alive()]
            fresh = [w for w in live if w.index not in tried] or live
            if fresh:
                return min(fresh, key=lambda w: w.load)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), give_up_at - loop.time())
            except TimeoutError:
                raise RuntimeError(
                    f"no worker could take the chunk within request_timeout_s={self._pool.request_timeout_s}: "
                    f"{'; '.join(errors) or 'every worker is restarting'}"
                ) from None

    async def _watch(self) -> None:
        """The heartbeat: ping every live worker each interval; one silent for `heartbeat_timeout_s`
        is hung. After a tick that came late (this event loop was blocked, so answers may sit
        unread in the pipes) nobody is judged until the next one."""
        loop = asyncio.get_running_loop()
        timeout, interval = self._pool.heartbeat_timeout_s, self._pool.heartbeat_interval()
        last_tick = loop.time()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            late, last_tick = now - last_tick > 2 * interval, now
            for worker in list(self._workers):
                if not worker.is_alive():
                    continue
                silent = now - worker.last_seen()
                if silent > timeout and not late:
                    self._suspend(worker, f"answered no heartbeat for {silent:.1f} s (heartbeat_timeout_s={timeout})",
                                  self._metrics.heartbeat_misses)
                else:
                    worker.ping()

    def _suspend(self, worker: WorkerHandle, why: str, counter: Counter) -> None:
        """A worker that missed its chunk deadline or its heartbeat: unhealthy now, its chunks
        retried, restarted."""
        if worker.index in self._restarting or self._workers[worker.index] is not worker:
            return
        log.warning("worker %d %s: marked unhealthy, its chunks go elsewhere; restarting it", worker.index, why)
        counter.inc()
        worker.abandon(f"{why}; restarting it")  # the router's error names the worker
        self._restart(worker)

    def _restart(self, worker: WorkerHandle) -> None:
        if worker.index in self._restarting or self._workers[worker.index] is not worker:
            return
        self._restarting[worker.index] = asyncio.create_task(self._do_restart(worker))

    async def _do_restart(self, dead: WorkerHandle) -> None:
        try:
            log.warning("worker %d is down; restarting it", dead.index)
            await dead.stop(self._pool.restart_grace_s)
            fresh = self._factory(dead.index)
            await fresh.start()
            self._workers[dead.index] = fresh
            self._metrics.worker_restarts.inc()
            log.info("worker %d restarted", dead.index)
        except Exception:
            log.exception("restarting worker %d failed; trying again in 1 s", dead.index)
            await asyncio.sleep(1.0)
        finally:
            self._restarting.pop(dead.index, None)
            self._changed.set()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for task in list(self._restarting.values()):
            with contextlib.suppress(Exception):
                await task
        grace = self._pool.restart_grace_s
        await asyncio.gather(*(w.stop(grace) for w in self._workers), return_exceptions=True)


class ProcessWorker:
    """A worker subprocess of interpreter `python` (this one by default; a reward's own
    environment: `[rewards.NAME] python`); its stdout carries only reply frames (its logs go to stderr)."""

    def __init__(self, index: int, settings: ServerSettings, cuda_devices: str | None, python: str = sys.executable) -> None:
        self.index = index
        self.load = 0
        self.rewards: list[str] = []
        self._settings = settings
        self._cuda = cuda_devices
        self._python = python
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[wire.WorkReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._dead = False
        self._write_lock = asyncio.Lock()
        self._seen = 0.0  # loop time of the last frame from the worker
        self._pinging: asyncio.Task[None] | None = None
        self._ping_id = 0  # pings count down from -1: chunk ids are positive, the hello is 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        env = dict(os.environ, **{SETTINGS_ENV: to_json(self._settings).decode()})
        if self._cuda is not None:
            env["CUDA_VISIBLE_DEVICES"] = self._cuda
        self._proc = await asyncio.create_subprocess_exec(
            self._python, "-m", "rl_rewards.server.workers", str(self.index),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 30,
        )
        hello = await self._read_frame()  # sent once the rewards are built
        if hello is None or hello.error is not None:
            self._dead = True
            raise RuntimeError(f"worker {self.index} failed to start: {hello.error if hello else 'exited'}")
        self.rewards = hello.rewards
        self._seen = asyncio.get_running_loop().time()
        self._reader = asyncio.create_task(self._read_loop())

    def is_alive(self) -> bool:
        return self._proc is not None and not self._dead

    def last_seen(self) -> float:
        return self._seen

    def ping(self) -> None:
        """Send a `Ping` unless the last one is still being written (a stopped worker's full pipe)."""
        if self.is_alive() and (self._pinging is None or self._pinging.done()):
            self._ping_id -= 1
            self._pinging = asyncio.create_task(self._send_ping(wire.Ping(id=self._ping_id)))

    async def _send_ping(self, ping: wire.Ping) -> None:
        with contextlib.suppress(WorkerLost):  # the read loop and the router see a dead worker
            await self._send(wire.encode_msgpack(ping))

    async def call(self, chunk: wire.ScoreChunk) -> wire.WorkReply:
        if not self.is_alive():
            raise WorkerLost("worker is not running")
        future: asyncio.Future[wire.WorkReply] = asyncio.get_running_loop().create_future()
        self._pending[chunk.id] = future
        # writing may block on a stopped worker's full pipe: an `abandon` (heartbeat) fails the
        # future, and the chunk must not wait for the write
        sending = asyncio.ensure_future(self._send(wire.encode_msgpack(chunk)))
        try:
            either: set[asyncio.Future[Any]] = {sending, future}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not future.done():
                sending.result()  # written (or WorkerLost: the pipe is closed)
            return await future
        finally:
            sending.cancel()  # a write still waiting on the pipe; a finished one's error is the future's too
            if sending.done() and not sending.cancelled():
                sending.exception()
            self._pending.pop(chunk.id, None)  # answered, lost, or given up on (chunk deadline)

    def _pipes(self) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
        """The started worker's stdin and stdout (both are pipes: see `start`)."""
        if self._proc is None or self._proc.stdin is None or self._proc.stdout is None:
            raise WorkerLost("the worker process was not started")
        return self._proc.stdin, self._proc.stdout

    async def _send(self, payload: bytes) -> None:
        try:
            async with self._write_lock:
                stdin = self._pipes()[0]
                if stdin.is_closing():  # died since is_alive(): its reader has not noticed yet
                    raise BrokenPipeError("the worker's stdin is closed")
                stdin.write(_HEADER.pack(len(payload)) + payload)
                await stdin.drain()
        # asyncio raises BrokenPipeError for a dead worker's pipe; uvloop raises RuntimeError
        # ("unable to perform operation on <WriteUnixTransport closed=True>")
        except (ConnectionError, BrokenPipeError, RuntimeError) as e:
            self._mark_dead()
            raise WorkerLost(f"pipe closed ({e})") from None

    async def _read_frame(self) -> wire.WorkReply | None:
        try:
            stdout = self._pipes()[1]
            header = await stdout.readexactly(_HEADER.size)
            body = await stdout.readexactly(_HEADER.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return wire.decode_msgpack(body, wire.WorkReply)

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while (reply := await self._read_frame()) is not None:
            self._seen = loop.time()
            future = self._pending.pop(reply.id, None)  # None for a ping's answer
            if future is not None and not future.done():
                future.set_result(reply)
        self._mark_dead()

    def _mark_dead(self, reason: str | None = None) -> None:
        self._dead = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(WorkerLost(reason or f"worker process {self.pid} exited"))

    def abandon(self, reason: str) -> None:
        self._mark_dead(reason)

    async def stop(self, grace: float = 10.0) -> None:
        """Close the worker's stdin (it exits after its current chunk); SIGKILL after `grace`
        seconds (a hung or SIGSTOPped worker never reads its stdin again)."""
        if self._proc is None:
            return
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, ConnectionError, BrokenPipeError, RuntimeError):
                self._pipes()[0].close()
            try:
                await asyncio.wait_for(self._proc.wait(), grace)
            except TimeoutError:
                log.warning("worker %d (pid %s) did not exit within %.1f s; killing it", self.index, self.pid, grace)
                self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._pinging is not None:
            self._pinging.cancel()
        self._mark_dead()


def process_router(settings: ServerSettings, metrics: Metrics, python: str = sys.executable) -> Router:
    groups = settings.gpu_groups()
    return Router(lambda i: ProcessWorker(i, settings, groups[i], python), settings.workers, metrics, settings.pool)


# ----------------------------------------------------------------------------- worker process


def _write(out: BinaryIO, reply: wire.WorkReply) -> None:
    payload = wire.encode_msgpack(reply)
    out.write(_HEADER.pack(len(payload)) + payload)
    out.flush()


def handle(served: dict, request: wire.WorkRequest) -> wire.WorkReply:
    """A worker's answer to one request (shared by process workers and Ray actors)."""
    if isinstance(request, wire.Ping):
        return wire.WorkReply(id=request.id, rewards=list(served))
    try:
        return wire.WorkReply(id=request.id, results=score_with(served, request.reward, request.samples))
    except Exception as e:
        return wire.WorkReply(id=request.id, error=f"{type(e).__name__}: {e}")


def _read_requests(source: BinaryIO, out: BinaryIO, lock: threading.Lock, served: dict,
                   chunks: queue.SimpleQueue[wire.ScoreChunk | None]) -> None:
    """The worker's reader thread: answers each `Ping` at once (the heartbeat: also while the
    main thread scores a long chunk; a stopped or deadlocked process answers nothing) and queues
    chunks for the main thread; None once stdin closes."""
    try:
        while header := source.read(_HEADER.size):
            request = wire.decode_msgpack(source.read(_HEADER.unpack(header)[0]), wire.WorkRequest)
            if isinstance(request, wire.Ping):
                with lock:
                    _write(out, handle(served, request))
            else:
                chunks.put(request)
    finally:
        chunks.put(None)


def worker_main(index: int) -> None:
    """Serve frames from stdin until it closes: chunks are scored one at a time on this thread,
    pings answered by a reader thread. stdout is reserved for frames: anything a library prints
    goes to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    source = sys.stdin.buffer
    settings = from_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper(), format=f"worker {index} %(levelname)s %(message)s")
    try:
        served = build_served(settings)
    except Exception as e:
        _write(out, wire.WorkReply(id=0, error=f"{type(e).__name__}: {e}"))
        return
    _write(out, wire.WorkReply(id=0, rewards=list(served)))
    lock = threading.Lock()
    chunks: queue.SimpleQueue[wire.ScoreChunk | None] = queue.SimpleQueue()
    threading.Thread(target=_read_requests, args=(source, out, lock, served, chunks), name="rl-rewards-reader",
                     daemon=True).start()
    while (chunk := chunks.get()) is not None:
        reply = handle(served, chunk)
        with lock:
            _write(out, reply)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
