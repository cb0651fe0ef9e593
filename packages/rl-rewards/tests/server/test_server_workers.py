"""`--workers 2`: a worker process SIGKILLed under load loses no request; graceful shutdown
drains an in-flight request."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import assert_healthy, metric, server_process

from rl_rewards.rules import timestamp_format

pytestmark = pytest.mark.no_torch


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(p) for p in text]
    return out


def captions(seed: int, n: int = 64) -> list[str]:
    # a mix of valid, out-of-order and invalid stamps, different per request
    return [f"[00:{(seed + i) % 70:02d}] a [00:{(seed * i) % 60:02d}] b" for i in range(n)]


@pytest.fixture(scope="module")
def workers_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    args = ["--workers", "2", "--max-batch-size", "16", "--max-wait-ms", "1"]
    with server_process(tmp, "workers", args) as proc:
        yield proc


def test_health_reports_two_workers(workers_server):
    health = httpx.get(f"{workers_server.url}/health").json()
    assert health["workers"] == 2 and health["workers_alive"] == 2
    assert len(children(workers_server.proc.pid)) == 2


def test_worker_killed_under_load_loses_no_request(workers_server):
    url = workers_server.url
    stop_at = time.monotonic() + 4.0
    answered: list[bool] = []
    failures: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = 0
            while time.monotonic() < stop_at:
                texts = captions(k * 1000 + i)
                r = http.post(f"{url}/v1/score", json={"samples": [{"completion": t} for t in texts]})
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                    continue
                got = [x["score"] for x in r.json()["results"]]
                answered.append(got == [timestamp_format(t) for t in texts])
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = children(workers_server.proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join()
    assert failures == []
    assert len(answered) > 10 and all(answered)
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").json()["workers_alive"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{url}/health").json()["workers_alive"] == 2
    assert victim not in children(workers_server.proc.pid)
    assert metric(url, "rl_rewards_worker_restarts_total") >= 1
    assert_healthy(url)


def test_sigterm_drains_in_flight_request(tmp_path):
    # a 1.5 s batching window keeps the request in flight when SIGTERM arrives
    args = ["--max-wait-ms", "1500", "--max-batch-size", "1000"]
    server = server_process(tmp_path, "drain", args).start()
    texts = captions(7, 10)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            httpx.post, f"{server.url}/v1/score", json={"samples": [{"completion": t} for t in texts]}, timeout=30
        )
        time.sleep(0.4)
        server.proc.send_signal(signal.SIGTERM)
        response = future.result()
    assert response.status_code == 200
    assert [x["score"] for x in response.json()["results"]] == [timestamp_format(t) for t in texts]
    assert server.proc.wait(30) == 0  # drained: exit 0 (uvicorn alone re-raised SIGTERM: -15)
    assert "Application shutdown complete" in (tmp_path / "drain.log").read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
