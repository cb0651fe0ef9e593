"""The Python interpreter a reward's worker processes run (`[rewards.NAME] python = ...`).

A scorer whose dependencies clash with the server's (another transformers, a pinned torch, an
OCR stack) runs in an environment of its own: the server starts that reward's worker processes
with the environment's interpreter, as flow_grpo runs one reward server per environment. The
environment needs rl-rewards itself, at the server's version (the router and the workers speak
`rl_rewards.wire`), and the scorer's dependencies; the server's environment needs neither.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import rl_rewards

CHECK_TIMEOUT_S = 120.0
"""How long `check_python` waits for the interpreter to import the worker module (a cold disk)."""
_PROBE = "import rl_rewards, rl_rewards.server.workers; print(rl_rewards.__version__)"


def resolve_python(raw: str, base: Path) -> str:
    """The interpreter `raw` names, as an absolute path: a path (with a `/`; relative ones from the
    folder `base` of the config file) or a command found on PATH (`python3.12`). A venv's
    `bin/python` is a symlink to its base interpreter: it is kept as given, not resolved, or the
    venv's packages would be lost. ValueError saying why when nothing runnable is there."""
    if "/" in raw:
        path = base / Path(raw).expanduser()
        if not path.exists():
            raise ValueError("no such file")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise ValueError("not an executable file")
        return os.path.abspath(path)
    found = shutil.which(raw)
    if found is None:
        raise ValueError("no such command on PATH; give the interpreter's path, e.g. /opt/venvs/judge/bin/python")
    return os.path.abspath(found)


def check_python(python: str) -> None:
    """ValueError saying why when `python` cannot run rl-rewards' worker processes: rl-rewards
    does not import there, or is another version than this server's."""
    try:
        # this process's environment, as the workers get it (PYTHONPATH included)
        run = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"it did not import rl_rewards within {CHECK_TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise ValueError(f"it does not run: {e.strerror}") from None
    install = f'install it there: {python} -m pip install "rl-rewards=={rl_rewards.__version__}"'
    if run.returncode != 0:
        last = [line for line in run.stderr.splitlines() if line.strip()][-1:] or [f"exit code {run.returncode}"]
        raise ValueError(f"rl_rewards does not import there ({last[0].strip()}); {install}")
    version = run.stdout.strip().splitlines()[-1:] or [""]
    if version[0] != rl_rewards.__version__:
        raise ValueError(f"it has rl-rewards {version[0]!r}, this server {rl_rewards.__version__!r} (the server and "
                         f"its workers must run the same version); {install}")
