"""Server test helpers: real `rl-rewards serve` processes on 127.0.0.1 (no torch imported)."""

from __future__ import annotations

from pathlib import Path

import httpx

from rl_rewards.server.process import ServerProcess


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
