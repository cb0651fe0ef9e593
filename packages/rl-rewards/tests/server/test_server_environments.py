"""`[rewards.NAME] python = ...`: a reward scored by worker processes of another Python
environment, through the real CLI and real virtual environments.

Each environment is a venv made here (`python -m venv --without-pip`, ~0.5 s): its own
site-packages holds a `clash_dep.py` of its own version (a stand-in for a library two rewards need
in different versions) and a `.pth` that adds this test environment's site-packages after it, so
rl-rewards and its dependencies import there without a download. The server runs in one (clash_dep
1.0), the reward `there` in the other (2.0), and `there`'s scorer cannot be built with 1.0: the
server starts only if it never builds it itself. `no_torch`: the base package is all it needs."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from typer.testing import CliRunner

import rl_rewards
from rl_rewards.cli import app as cli
from rl_rewards.server.process import ServerProcess
from rl_rewards.server.settings import load_settings

pytestmark = pytest.mark.no_torch
HERE = Path(__file__).resolve().parent  # env_probes.py
CONFIG = """[scorers]
where = "env_probes:Where"
[rewards.there]
python = "{python}"
[rewards.there.components.where]
scorer = "where"
options = {{ needs = 2.0 }}
[rewards.here.components.where]
scorer = "where"
"""


def make_env(root: Path, clash_dep: float | None, rl_rewards_here: bool = True) -> str:
    """A venv at `root` (its `bin/python`): `clash_dep.py` with VERSION = `clash_dep` in its
    site-packages, and this environment's site-packages added after its own where `rl_rewards_here`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    [own] = (root / "lib").glob("python*/site-packages")
    if clash_dep is not None:
        (own / "clash_dep.py").write_text(f"VERSION = {clash_dep}\n")
    if rl_rewards_here:
        (own / "test_environment.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                          for d in site.getsitepackages()))
    return str(root / "bin" / "python")


def test_a_reward_with_its_own_python_is_scored_by_workers_of_that_environment(tmp_path):
    """The server (clash_dep 1.0) scores `here` itself and `there` (python = a path relative to
    the config file) in a worker of the other venv (clash_dep 2.0): the scores are the versions,
    the `where.pid` components the processes, and that worker's command line names the other venv."""
    server_python = make_env(tmp_path / "server-env", 1.0)
    reward_python = make_env(tmp_path / "reward-env", 2.0)
    config = tmp_path / "server.toml"
    config.write_text(CONFIG.format(python=os.path.relpath(reward_python, tmp_path)))  # reward-env/bin/python
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    server = ServerProcess(["--config", str(config)], env=env, log_path=tmp_path / "server.log", ready_timeout=120,
                           python=server_python)
    with server:
        body = {"samples": [{"completion": "a"}, {"completion": "b"}]}
        here, there = (httpx.post(f"{server.url}/v1/score", json={**body, "reward": name}, timeout=60)
                       for name in ("here", "there"))
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert there.status_code == 200, there.text
        [worker] = {int(r["components"]["where.pid"]) for r in there.json()["results"]}
        with open(f"/proc/{worker}/cmdline", "rb") as f:  # read while it runs: it stops with the server
            command = f.read().split(b"\0")
    assert here.status_code == 200, here.text
    here_results, there_results = here.json()["results"], there.json()["results"]
    assert [r["score"] for r in here_results] == [1.0, 1.0] and [r["score"] for r in there_results] == [2.0, 2.0]
    assert {r["components"]["where.pid"] for r in here_results} == {float(server.proc.pid)}
    assert worker != server.proc.pid
    assert command[:4] == [reward_python.encode(), b"-m", b"rl_rewards.server.workers", b"0"]
    assert health["rewards"] == ["there", "here"] and health["workers"] == health["workers_alive"] == 1


def test_a_python_that_cannot_run_the_reward_is_refused_naming_file_line_reward_and_field(tmp_path, monkeypatch):
    """One line each: no such file, no such command, no rl-rewards there, another version there;
    through the CLI exit 2; and not with backends that do not start worker processes."""
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the interpreter is checked with this environment
    venv = make_env(tmp_path / "venv", None, rl_rewards_here=False)
    [own] = (tmp_path / "venv" / "lib").glob("python*/site-packages")
    old = {"rl_rewards/__init__.py": '__version__ = "0.0.1"\n', "rl_rewards/server/__init__.py": "",
           "rl_rewards/server/workers.py": ""}  # written after the case without rl-rewards
    install = f'-m pip install "rl-rewards=={rl_rewards.__version__}"'
    config = tmp_path / "server.toml"
    for python, error in [
        ("/no/such/venv/bin/python", "no such file"),
        ("no-such-python3", "no such command on PATH; give the interpreter's path, e.g. /opt/venvs/judge/bin/python"),
        (venv, f"rl_rewards does not import there (ModuleNotFoundError: No module named 'rl_rewards'); install it "
               f"there: {venv} {install}"),
        (venv, f"it has rl-rewards '0.0.1', this server '{rl_rewards.__version__}' (the server and its workers "
               f"must run the same version); install it there: {venv} {install}"),
    ]:
        if error.startswith("it has"):  # the same venv, now with an rl_rewards of another version
            for path, text in old.items():
                (own / path).parent.mkdir(parents=True, exist_ok=True)
                (own / path).write_text(text)
        config.write_text(CONFIG.format(python=python))
        with pytest.raises(ValueError) as caught:
            load_settings(config, environ={})
        assert str(caught.value) == f"{config}:4 [rewards.there]: python = {python!r}: {error}"
    run = CliRunner().invoke(cli, ["serve", "--config", str(config)])
    assert run.exit_code == 2, run.output
    assert run.stderr.strip().splitlines() == [f"rl-rewards serve: error: {config}:4 [rewards.there]: python = "
                                               f"{python!r}: {error}"]
    config.write_text(CONFIG.format(python=sys.executable))
    settings = load_settings(config, environ={})
    settings.check()
    for flags, how in [({"backend": "ray-serve"}, "backend=ray-serve"), ({"ray": True}, "--ray"),
                       ({"http_processes": 2}, "http_processes=2")]:
        with pytest.raises(ValueError, match=f"^\\[rewards.there\\] python: .*; {how} cannot start them"):
            msgspec.structs.replace(settings, **flags).check()
