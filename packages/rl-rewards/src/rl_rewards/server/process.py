"""Run `rl-rewards serve` as a child process (apps that start their own reward server, tests,
benchmarks): pick a free port, wait for `/health` to say ready, stop with SIGTERM (graceful)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--workers", "2"]) as server: server.url ...`

    `args` are `rl-rewards serve` flags (`--port` is added unless given); `env` entries are added
    to this process's environment (CapRL variables, `REWARD_API_KEY`). Output goes to `log_path`
    (a temp-free default: inherited stderr). `python` runs the server: this interpreter, or that
    of another environment with rl-rewards (and the rewards' dependencies) installed."""

    def __init__(
        self, args: list[str] | None = None, *, env: dict[str, str] | None = None, port: int | None = None,
        log_path: Path | None = None, ready_timeout: float = 60.0, python: str = sys.executable,
    ) -> None:
        self.python = python
        self.args = list(args or [])
        self.port = port or free_port()
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> ServerProcess:
        cmd = [self.python, "-m", "rl_rewards.cli", "serve", "--port", str(self.port), *self.args]
        out = self.log_path.open("ab") if self.log_path is not None else None
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None)
        if out is not None:
            out.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"reward server exited with code {self.proc.returncode} before ready ({self._tail()})")
            try:
                response = httpx.get(f"{self.url}/health", timeout=2)
                if response.status_code == 200:
                    return
                last = response.text
            except httpx.TransportError as e:
                last = f"{type(e).__name__}"
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"reward server on {self.url} not ready after {self.ready_timeout}s: {last} ({self._tail()})")

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "see stderr"
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (uvicorn drains in-flight requests), SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
