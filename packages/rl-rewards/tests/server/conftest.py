"""Server test helpers: real `rl-rewards serve` processes on 127.0.0.1 (no torch imported)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl_rewards.server.process import ServerProcess

RAY_TEST_ENV = {
    # on a busy 2-core machine the raylet's default wait for its agents' port files is too short
    "RAY_raylet_start_wait_time_s": "180", "RAY_agent_register_timeout_ms": "180000",
    # servers started on their own (not from these tests' process): see tests/conftest.py
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}
_ray_last_item: list[str] = []  # node id of the last test of the last module using `ray_cluster`


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    """The GCS address of one local Ray cluster (2 CPUs; this process is its first driver) for
    every test module that needs one (`--ray` actors, `--backend ray-serve`): starting Ray takes
    ~10 s of a 2-core machine, once. It stops after the last test of the last module that uses
    it, not at the session's end (idle Ray and Ray Serve processes keep taking CPU from the tests
    after them): see `pytest_runtest_teardown`."""
    ray = pytest.importorskip("ray")
    # Ray reads RAY_TEST_ENV as it starts (servers joining the cluster inherit it); the workers
    # import test scorers (`serve_probes`) from this folder, as a user's `[scorers]` module must
    # be importable on each node.
    pythonpath = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    environ = {**RAY_TEST_ENV, "PYTHONPATH": pythonpath}
    serve_env = {}
    if importlib.util.find_spec("ray.serve") is not None:  # Ray Serve in the mode a local `--backend ray-serve` runs in
        with warnings.catch_warnings():  # Ray Serve 2.60 declares its pydantic fields the pre-2.0 way
            warnings.filterwarnings("ignore", "Using extra keyword arguments on `Field`", DeprecationWarning)
            from rl_rewards.server.ray_serve import throughput_env

        serve_env = throughput_env()
    saved = {key: os.environ.get(key) for key in {**environ, **serve_env}}
    os.environ.update({**environ, **serve_env})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # the cluster's processes took them as it started; a server starting a Ray of its own picks
    # its own HAProxy ports (these would be taken)
    for key in serve_env:
        _restore(key, saved[key])
    # its users' module fixtures (a server joined to it) stop after their module's last test
    modules = {item.path for item in request.session.items if "ray_cluster" in item.fixturenames}
    _ray_last_item[:] = [item.nodeid for item in request.session.items if item.path in modules][-1:]
    yield ray.get_runtime_context().gcs_address
    _stop_ray(ray)  # a no-op once stopped after its last test
    for key, value in saved.items():
        _restore(key, value)


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the last test of the last module that uses `ray_cluster` (and that module's fixtures:
    servers joined to the cluster stop first), stop the cluster."""
    yield
    if _ray_last_item == [item.nodeid]:
        import ray

        _stop_ray(ray)


def _stop_ray(ray: Any) -> None:
    """Shut the cluster down, and the high-throughput mode's HAProxy with it (as `serve` does)."""
    if not ray.is_initialized():
        return
    if importlib.util.find_spec("ray.serve") is None:
        ray.shutdown()
        return
    from rl_rewards.server.ray_serve import shutdown_local_ray

    shutdown_local_ray()


def server_process(
    tmp: Path, name: str, args: list[str], env: dict[str, str] | None = None, ready_timeout: float = 60.0
) -> ServerProcess:
    """A server (started by `with`) whose output goes to `tmp/name.log` (shown when it fails)."""
    return ServerProcess(args, env=env, log_path=tmp / f"{name}.log", ready_timeout=ready_timeout)


def assert_healthy(url: str) -> None:
    response = httpx.get(f"{url}/health", timeout=5)
    assert response.status_code == 200, response.text
    assert response.json()["ready"] is True


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics, 0.0 when absent."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric_name, _, label_text = key.partition("{")
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if metric_name == name and got == want:
            return float(value)
    return 0.0
