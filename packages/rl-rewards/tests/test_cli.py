"""`rl-rewards` on the command line: what a user sees when `serve` cannot start, and `--help`.
`serve` runs as a real child process (`python -m rl_rewards.cli`); `--help` through typer's runner."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from rl_rewards.cli import app
from rl_rewards.server.process import free_port

pytestmark = pytest.mark.no_torch


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    """`rl-rewards serve ARGS` expected to stop on its own; one that serves instead is stopped
    after `timeout` and fails the test."""
    cmd = [sys.executable, "-m", "rl_rewards.cli", "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"`rl-rewards serve {' '.join(args)}` started serving instead of refusing; stderr:\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    return lines[0]


def test_a_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(serve("--port", str(port)))
    assert line.startswith(f"rl-rewards serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in line and "--port" in line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_negative_workers_are_refused_in_one_line(how):
    args, env = (["--workers", "-1"], None) if how == "flag" else ([], {"REWARD_NUM_WORKERS": "-1"})
    line = one_line(serve("--port", str(free_port()), *args, env=env))
    assert line == ("rl-rewards serve: error: workers = -1: must be >= 0 (0 scores in the server process, "
                    "N >= 1 starts N worker processes)")


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path: Path):
    config = tmp_path / "server.toml"
    config.write_text('[rewards.caption.components.format]\nscorer = "timestamp_format"\nweight = \n')
    line = one_line(serve("--config", str(config), "--port", str(free_port())))
    assert line.startswith(f"rl-rewards serve: error: {config}:3: invalid TOML: "), line


def _commands() -> dict[str, Any]:
    root = get_command(app)  # a click group of typer's own (vendored) click
    return {"": root, **{f"{name} ": command for name, command in root.commands.items()}}


def _flat(text: str) -> str:
    """Whitespace as one space, and no break after a hyphen (click wraps `--http-processes`)."""
    return re.sub(r"- (?=\w)", "-", " ".join(text.split()))


@pytest.mark.parametrize("name", ["", "score ", "serve "])
def test_help_shows_every_help_text_whole(name):
    """Typer's rich markup took `[ray-serve]`, `[rewards.NAME]` and `[ray_serve]` for style tags
    and dropped them; every help text (the command's and each option's) must show as written."""
    command = _commands()[name]
    done = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "100"}, terminal_width=100)
    assert done.exit_code == 0, done.output
    shown = _flat(done.output)
    texts = [command.help or "", *(p.help for p in command.params if p.help)]
    for text in texts:
        assert _flat(text.split("\n\n")[0]) in shown, text
    if name == "serve ":
        for words in ('pip install "rl-rewards[ray-serve]"', "[ray_serve] in --config", "Each [rewards.NAME] table"):
            assert words in shown
