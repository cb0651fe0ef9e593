"""A server that starts a Ray of its own (`serve --backend ray-serve`, `serve --ray`, neither
given `ray_address`), run under `uv run` as the README runs it, through the real CLI.

Each backend's server runs once for the module, under a real `uv run --no-project --python
<this interpreter>` in a folder of its own, and with Ray's uv hook left on (the noxfile and
tests/conftest.py turn it off for every other test): Ray finds a `uv run` among a driver's
parents and would start each worker as `uv run ... python` in an upload of the driver's working
directory. The servers serve `probe` (2 replicas under Ray Serve) and `where`, scorers of
`serve_probes.py` that log the process that scores. Starting a local Ray takes most of the
module's time on 2 cores; the two servers run one after the other. Not `no_torch`: Ray is an
extra."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from conftest import RAY_TEST_ENV
from test_server_ray_serve import AUTH, HAS_SERVE, KEY, READY_S, Calls, probe, replica_pids, scores

from rl_rewards.server.process import ServerProcess

pytest.importorskip("ray")  # the extras rl-rewards[ray] / [ray-serve]; psutil comes with Ray
import psutil

UV = shutil.which("uv")
HERE = Path(__file__).resolve().parent  # serve_probes.py
HEARTBEAT_TIMEOUT_S = 3.0
CONFIG = """
[scorers]
call_probe = "serve_probes:CallProbe"
process_probe = "serve_probes:ProcessProbe"

[pool]
heartbeat_timeout_s = {heartbeat}   # a replica silent to Ray Serve's health checks this long is replaced

[rewards.probe.components.calls]
scorer = "call_probe"
options = {{ log = "{calls}", delay_s = 0.2 }}
[rewards.where.components.process]
scorer = "process_probe"
options = {{ log = "{where}" }}

[ray_serve]
num_cpus = 0.25
[ray_serve.rewards.probe]
num_replicas = 2
"""
BACKENDS = {"ray-serve": ["--backend", "ray-serve"], "ray": ["--ray", "--workers", "1"]}


class LocalServer(NamedTuple):
    backend: str
    url: str
    pid: int
    """The `uv run` process the server runs under: the server, its Ray and Ray's workers descend from it."""
    cwd: Path
    calls: Path
    where: Path


@pytest.fixture(scope="module", params=list(BACKENDS))
def local_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """`rl-rewards serve` with the backend of the param and no `ray_address`, under `uv run`,
    its working directory a fresh folder; each must stop with exit 0 (its local Ray stopped)."""
    if UV is None:
        pytest.skip("needs uv on PATH (the launcher these tests reproduce)")
    if request.param == "ray-serve" and not HAS_SERVE:
        pytest.skip('needs Ray Serve: pip install "rl-rewards[ray-serve]"')
    backend = request.param
    tmp = tmp_path_factory.mktemp(backend)
    calls, where = tmp / "calls.log", tmp / "where.log"
    calls.touch()
    config = tmp / "server.toml"
    config.write_text(CONFIG.format(heartbeat=HEARTBEAT_TIMEOUT_S, calls=calls, where=where))
    # the server runs as `uv run ... python -m rl_rewards.cli serve ...`: ServerProcess's `python`
    launcher = tmp / "uv-run-python"
    launcher.write_text(f'#!/bin/sh\ncd "{tmp}" && exec "{UV}" run --offline --no-project --python "{sys.executable}" '
                        'python "$@"\n')
    launcher.chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**{k: v for k, v in RAY_TEST_ENV.items() if k != "RAY_ENABLE_UV_RUN_RUNTIME_ENV"},
           "REWARD_API_KEY": KEY, "PYTHONPATH": pythonpath}
    with pytest.MonkeyPatch.context() as mp:  # Ray's uv hook as a user has it: on (unset)
        mp.delenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", raising=False)
        proc = ServerProcess(["--config", str(config), *BACKENDS[backend]], env=env, log_path=tmp / f"{backend}.log",
                             ready_timeout=READY_S, python=str(launcher))
    try:
        started = time.monotonic()
        proc.start()
        print(f"\n{backend} server ready in {time.monotonic() - started:.1f} s")
        assert proc.proc is not None
        yield LocalServer(backend, proc.url, proc.proc.pid, tmp, calls, where)
        assert proc.stop() == 0  # its local Ray stopped with it (left to the interpreter's exit, `--ray` aborted)
    finally:
        proc.stop()


def test_workers_run_the_servers_interpreter_and_environment(local_server: LocalServer) -> None:
    """A scorer runs, in a replica (or actor), with the server's interpreter, environment and
    working directory: not in an environment Ray's uv hook had uv build for each worker from a
    lockfile (where a scorer installed in the user's environment is missing) or in an upload of
    the working directory (where relative paths resolve elsewhere), not started through `uv run`."""
    body = {"reward": "where", "samples": [{"completion": "x"}]}
    assert scores(httpx.post(f"{local_server.url}/v1/score", json=body, headers=AUTH, timeout=60)) == [1.0]
    where = [json.loads(line) for line in local_server.where.read_text().splitlines()][-1]
    print(f"\nthe {local_server.backend} worker that scored: {where}")
    assert {k: where[k] for k in ("executable", "prefix", "cwd")} == {
        "executable": sys.executable, "prefix": sys.prefix, "cwd": str(local_server.cwd)}
    assert psutil.Process(where["pid"]).parent().name() == "raylet"  # started by Ray itself, not by a `uv run`
    uv_runs = [p.pid for p in psutil.Process(local_server.pid).children(recursive=True) if p.name() == "uv"]
    assert uv_runs == []  # only the server runs under `uv run`


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_a_local_ray_listens_on_the_loopback_only(local_server: LocalServer) -> None:
    """Every port the server and its local Ray listen on (GCS, raylet, workers, agents, the HTTP
    proxy or uvicorn) is bound to the loopback, as the server's own `--host 127.0.0.1` is: a
    Ray of the server's own takes no connections from other machines."""
    listening: dict[tuple[str, str, int], str] = {}
    root = psutil.Process(local_server.pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening[(proc.name(), c.laddr.ip, c.laddr.port)] = " ".join(proc.cmdline()[:2])
    print("\nlistening: " + ", ".join(f"{name} {ip}:{port}" for name, ip, port in sorted(listening)))
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}  # the local Ray was found
    exposed = sorted(key for key in listening if key[1] not in LOOPBACK)
    assert exposed == []


@pytest.mark.parametrize("local_server", ["ray-serve"], indirect=True)  # `--ray` actors: test_server_ray.py
def test_a_stopped_replica_delays_requests_by_seconds_only(local_server: LocalServer) -> None:
    """4 clients send 4-sample requests to `probe` (2 replicas, busy 0.2 s a batch); one replica
    is SIGSTOPped (hung: its process runs no code) as it starts a batch. The default chunk
    deadline (60 s) is not what frees the calls it holds: Ray Serve's health check finds it
    within `heartbeat_timeout_s` and kills it at once (a graceful stop would wait
    `shutdown_timeout_s`, 30 s, for a process that runs nothing), and the calls it held go to the
    other replica. Every request is answered 200, none later than a few seconds after it was sent."""
    url = local_server.url
    _, victim = sorted(replica_pids(url, local_server.calls))
    answered: list[tuple[int, float]] = []

    async def scenario() -> None:
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            async def client_loop() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    response = await client.post("/v1/score", json=probe(4))
                    answered.append((response.status_code, time.monotonic() - started))

            loops = [asyncio.create_task(client_loop()) for _ in range(4)]
            try:
                calls, waiting = Calls(local_server.calls), time.monotonic()
                while victim not in {call.pid for call in calls.read()}:  # it starts a batch
                    assert time.monotonic() - waiting < 60, f"replica {victim} took no call within 60 s"
                    await asyncio.sleep(0.005)
                os.kill(victim, signal.SIGSTOP)
                await asyncio.sleep(3 * HEARTBEAT_TIMEOUT_S)  # requests sent before, while and after it is found
            finally:
                done.set()
                await asyncio.gather(*loops)

    try:
        asyncio.run(scenario())
    finally:
        with contextlib.suppress(ProcessLookupError):  # Ray Serve killed it; if not, nothing else will
            os.kill(victim, signal.SIGKILL)
    statuses = {status for status, _ in answered}
    slowest = max(seconds for _, seconds in answered)
    print(f"\n{len(answered)} requests, one replica of 2 SIGSTOPped: the slowest answered in {slowest:.1f} s")
    assert statuses == {200}
    assert slowest < 3 * HEARTBEAT_TIMEOUT_S
