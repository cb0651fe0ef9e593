"""`--ray`: workers as Ray actors on a local Ray cluster (one cluster for the module: slow to start).

Not `no_torch`: Ray is an extra. The router is exercised in-process (an actor killed mid-load: its chunk is retried, the actor
restarted) and through a real `rl-rewards serve --ray` process joined to the same cluster."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from conftest import assert_healthy, server_process

from rl_rewards.rules import timestamp_format
from rl_rewards.samples import Sample
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import ServerSettings

# Opt-in (`-m slow` / nox -s slow): starting Ray takes ~45 s on a busy 2-core machine and the
# module ~90 s in all, more than half the package's default-suite budget.
pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
from rl_rewards.server.ray_pool import RayRouter  # noqa: E402

# On a busy 2-core machine the raylet's default wait for its agents' port files is too short.
SLOW_HOST = {"RAY_raylet_start_wait_time_s": "180", "RAY_agent_register_timeout_ms": "180000"}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in SLOW_HOST}
    os.environ.update(SLOW_HOST)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key)
        else:
            os.environ[key] = value


def texts(seed: int, n: int = 32) -> list[str]:
    return [f"[00:{(seed + i) % 70:02d}] a [00:{(seed * i) % 60:02d}] b" for i in range(n)]


def test_ray_router_retries_a_chunk_of_a_killed_actor(cluster):
    settings = ServerSettings(workers=2, ray=True, ray_address=cluster)
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
        await router.close()
        return [*ok, again[0].score == 1.0]

    assert all(asyncio.run(scenario()))
    assert metrics.worker_restarts._value.get() >= 1


def test_serve_with_ray_workers(cluster, tmp_path):
    args = ["--ray", "--workers", "2", "--ray-address", cluster]
    with server_process(tmp_path, "ray", args) as server:
        health = httpx.get(f"{server.url}/health").json()
        assert health["workers"] == 2 and health["workers_alive"] == 2
        batch = texts(3, 40)
        r = httpx.post(f"{server.url}/v1/score", json={"samples": [{"completion": t} for t in batch]}, timeout=60)
        assert [x["score"] for x in r.json()["results"]] == [timestamp_format(t) for t in batch]
        assert_healthy(server.url)
