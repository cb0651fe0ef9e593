"""Shared fixtures: tiny random-weight checkpoints from `rl_models.tiny` (built offline)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import httpx
import pytest
import torch

from rl_models import tiny
from rl_rollout.hf import HFEngine


@pytest.fixture(scope="session")
def qwen3_path() -> Path:
    return tiny.build("qwen3")


@pytest.fixture(scope="session")
def qwen3_engine(qwen3_path: Path) -> HFEngine:
    """A float32 CPU engine shared by read-only tests (never put to sleep or reloaded)."""
    return HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")


@pytest.fixture()
def fresh_engine(qwen3_path: Path) -> HFEngine:
    """A private engine for tests that mutate weights or state."""
    return HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")


# --------------------------------------------------------------------------- transformers serve
# The server is started right after collection (when test_openai.py is selected) so that its
# slow start (importing torch + transformers + fastapi) overlaps the other tests.
_SERVE: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.path.name == "test_openai.py" for item in items) or importlib.util.find_spec("fastapi") is None:
        return
    port = _free_port()
    cli = Path(sys.executable).with_name("transformers")
    cmd = [str(cli), "serve", str(tiny.build("qwen3")), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32"]
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in pytest_sessionfinish
    proc = subprocess.Popen(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    _SERVE.update(proc=proc, log=log, url=f"http://127.0.0.1:{port}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "proc" in _SERVE:
        proc: subprocess.Popen = _SERVE.pop("proc")
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _SERVE.pop("log").close()


@pytest.fixture(scope="session")
def transformers_serve_url() -> str:
    """URL of a `transformers serve` process on the tiny qwen3 checkpoint, once it is healthy."""
    if "proc" not in _SERVE:
        pytest.skip("transformers serve was not started (needs transformers[serving], the test group)")
    proc, url = _SERVE["proc"], _SERVE["url"]
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            _SERVE["log"].seek(0)
            raise RuntimeError(f"transformers serve exited with {proc.returncode}: {_SERVE['log'].read().decode()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("transformers serve did not become healthy within 240 s")
        time.sleep(0.5)
