"""`--ray`: workers as Ray actors on a local Ray cluster (`ray_cluster`: one for the session's Ray tests, slow to start).

Not `no_torch`: Ray is an extra. The router is exercised in-process (an actor killed mid-load: its chunk is retried, the actor
restarted) and through a real `rl-rewards serve --ray` process joined to the same cluster. Waits are sized for a busy
2-core machine: Ray's own start-up waits (RAY_TEST_ENV), the server's readiness wait, and a bound on each scenario."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import httpx
import pytest
from conftest import assert_healthy, server_process
from test_server_faults import alive

from rl_rewards.rules import timestamp_format
from rl_rewards.samples import Sample
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import PoolSettings, ServerSettings

ray = pytest.importorskip("ray")
from rl_rewards.server.ray_pool import RayRouter  # noqa: E402

# Starting an actor (a fresh Python process importing rl_rewards and loading the default rewards) takes
# seconds when the machine is busy; nothing here should take minutes unless something is stuck.
ACTOR_WAIT_S = 300


def texts(seed: int, n: int = 32) -> list[str]:
    return [f"[00:{(seed + i) % 70:02d}] a [00:{(seed * i) % 60:02d}] b" for i in range(n)]


def test_ray_router_retries_a_chunk_of_a_killed_actor(ray_cluster):
    settings = ServerSettings(workers=2, ray=True, ray_address=ray_cluster)
    metrics = Metrics()

    async def scenario() -> list[bool]:
        router = RayRouter(settings, metrics)
        await router.start()
        assert router.rewards[:2] == ["timestamp_format", "length"]
        batches = [texts(k) for k in range(12)]
        calls = [router.score("timestamp_format", [Sample(completion=t) for t in b]) for b in batches]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0)
        ray.kill(router.actors()[0])
        results = await asyncio.gather(*tasks)
        ok = [[r.score for r in res] == [timestamp_format(t) for t in b] for res, b in zip(results, batches, strict=True)]
        again = await router.score("timestamp_format", [Sample(completion="[00:01] x")])
        await router.close()  # waits for the restart of the killed actor
        return [*ok, again[0].score == 1.0]

    assert all(asyncio.run(asyncio.wait_for(scenario(), ACTOR_WAIT_S)))
    assert metrics.worker_restarts._value.get() >= 1


def test_ray_router_replaces_an_actor_that_stops_answering(ray_cluster):
    """Actor 0 SIGSTOPped (alive to Ray, silent to us): its chunks miss the 2 s deadline and are
    retried on actor 1, every result is right, the router reports one healthy worker, kills the
    stuck actor and starts a new one in its place."""
    settings = ServerSettings(workers=2, ray=True, ray_address=ray_cluster,
                              pool=PoolSettings(chunk_deadline_s=2.0, restart_grace_s=0.5))
    metrics = Metrics()

    async def scenario() -> tuple[list[bool], int, int, int]:
        router = RayRouter(settings, metrics)
        await router.start()
        stuck_pid = await router.actors()[0].pid.remote()
        os.kill(stuck_pid, signal.SIGSTOP)
        try:
            batches = [texts(k) for k in range(8)]
            results = await asyncio.gather(*(router.score("timestamp_format", [Sample(completion=t) for t in b])
                                             for b in batches))
            healthy_while_stuck = router.alive()
            ok = [[r.score for r in res] == [timestamp_format(t) for t in b] for res, b in zip(results, batches, strict=True)]
            while router.alive() < 2:  # the replacement actor has started
                await asyncio.sleep(0.1)
            new_pid = await router.actors()[0].pid.remote()
            for _ in range(100):  # ray.kill ends the stopped process (SIGKILL from its raylet)
                if not alive(stuck_pid):
                    break
                await asyncio.sleep(0.1)
            assert not alive(stuck_pid), "the stuck actor's process was not killed"
            again = await router.score("timestamp_format", [Sample(completion="[00:01] x")] * 4)
            await router.close()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck_pid, signal.SIGCONT)
        return [*ok, [r.score for r in again] == [1.0] * 4], healthy_while_stuck, stuck_pid, new_pid

    ok, healthy_while_stuck, stuck_pid, new_pid = asyncio.run(asyncio.wait_for(scenario(), ACTOR_WAIT_S))
    assert all(ok)
    assert healthy_while_stuck == 1
    assert new_pid != stuck_pid
    assert metrics.deadline_misses._value.get() >= 1 and metrics.worker_restarts._value.get() >= 1


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    args = ["--ray", "--workers", "2", "--ray-address", ray_cluster]
    # ready = both actors built; they queue for the cluster's 2 CPUs behind any actor still dying
    with server_process(tmp, "ray", args, ready_timeout=ACTOR_WAIT_S) as proc:
        yield proc


def test_serve_with_ray_workers(ray_server):
    health = httpx.get(f"{ray_server.url}/health", timeout=30).json()
    assert health["workers"] == 2 and health["workers_alive"] == 2
    batch = texts(3, 40)
    r = httpx.post(f"{ray_server.url}/v1/score", json={"samples": [{"completion": t} for t in batch]}, timeout=120)
    assert r.status_code == 200, r.text
    assert [x["score"] for x in r.json()["results"]] == [timestamp_format(t) for t in batch]
    assert_healthy(ray_server.url)
