"""The docs check (`nox -s docs`): every shell and Python block of every tracked Markdown file,
run as written, in order, in a copy of the checkout, as a new user would from a fresh clone.

Blocks are read with pytest-codeblocks (`extract_from_file`): ```bash / ```sh / ```python
fences, and its HTML-comment markers on the line before a block (invisible on GitHub, so the doc
also says it in words):

- `<!--pytest.mark.skip(reason="needs a GPU")-->`: not run. Reasons used: needs a GPU, downloads
  from the Hub, placeholder paths, not published yet, recursive (`uv run nox` itself).
- `<!--pytest.mark.server(health="http://127.0.0.1:18889/health")-->`: a command that serves
  until stopped. It is started in the background, must answer 200 on `health` within 120 s, and
  keeps running for the blocks after it in the same file (then it is stopped with SIGTERM).
- `<!--pytest-codeblocks:cont-->`: the block continues the previous one (one script).
- `<!--pytest-codeblocks:expected-output-->`: the next block is the previous one's exact stdout
  (`expected-output-ignore-whitespace`: the same, whitespace aside).

How blocks run (cwd: the copy's root, where every README's commands are meant to run):

- bash: `bash -euo pipefail -c BLOCK`, so every line must succeed, not just the last.
- python: `uv run python -` with the block on stdin (what pasting it into `uv run python` does).
- The environment is a new user's: no virtual environment active, the copy's own `.venv`
  (created by the first `uv run`, hard-linked from uv's cache), `HF_HUB_OFFLINE=1` and
  `HF_DATASETS_OFFLINE=1` (a block that would download fails at once instead of retrying).
- A block with a `pip install` line runs in a fresh virtual environment, activated. `pip` there
  is `uv pip ... --no-sources` (uv's resolver and cache: the same requirements and the same
  PyPI, without downloading torch again for every block; `--no-sources` because pip does not
  read uv's workspace sources either).

The copy holds the tracked files (and new, not ignored ones) of the working tree, committed in a
fresh git repository, so the last test can check that the blocks changed no tracked file and
left no untracked one behind (what they write is covered by .gitignore).
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest_codeblocks import CodeBlock, extract_from_file

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {"bash", "sh", "python"}
BLOCK_TIMEOUT_S = 600
SERVER_START_S = 120


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return sorted({name for name in out.split("\0") if name and (ROOT / name).is_file()})


@dataclass(frozen=True)
class Block:
    doc: str  # path of the Markdown file, relative to the root
    block: CodeBlock
    server: str | None  # health URL for a `server` block

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.block.lineno}"


def _marks(block: CodeBlock) -> tuple[list[pytest.MarkDecorator], str | None]:
    """pytest marks of a block, and the health URL of a `pytest.mark.server(health=...)` one
    (ours, read here rather than made a pytest mark)."""
    marks, server = [], None
    for text in block.marks:
        call = ast.parse(text, mode="eval").body
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.server":
            server = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "health"))
        else:
            marks.append(eval(text, {"pytest": pytest, "sys": sys}))  # what pytest-codeblocks' plugin does
    return marks, server


def _blocks() -> list[pytest.param]:
    params = []
    for doc in _tracked_files():
        if not doc.endswith(".md"):
            continue
        for block in extract_from_file(ROOT / doc):
            if block.syntax not in LANGUAGES:
                continue
            marks, server = _marks(block)
            item = Block(doc, block, server)
            params.append(pytest.param(item, marks=marks, id=item.id))
    return params


def test_the_root_readme_is_short_enough_to_read() -> None:
    """What it is, the two commands, the apps, the packages, the status in short and where to go
    next: under 2,000 words and 160 characters a line (details live in docs/ and the packages'
    READMEs)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(text.split())
    long_lines = [n for n, line in enumerate(text.splitlines(), 1) if len(line) > 160]
    assert words < 2000 and not long_lines, (words, long_lines)


def test_every_cont_marker_continues_a_block_that_runs() -> None:
    """A `cont` block is merged into the block before it; after an untagged or `text` fence the
    merged block is not a language this check runs, so the continued code would never run."""
    wrong = []
    for doc in (d for d in _tracked_files() if d.endswith(".md")):
        inside, language = False, None  # in a fenced block; the last block's language
        for number, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                if not inside:
                    language = stripped[3:].strip()
                inside = not inside
            elif stripped == "<!--pytest-codeblocks:cont-->" and not inside and language not in LANGUAGES:
                wrong.append(f"{doc}:{number} (the block before is {language or 'untagged'!r})")
    assert not wrong, "cont markers after a block the check does not run: " + ", ".join(wrong)


@pytest.fixture(scope="session")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree's tracked files in a fresh git repository (one commit)."""
    dest = tmp_path_factory.mktemp("clone")
    for name in _tracked_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    git = ["git", "-c", "user.name=docs", "-c", "user.email=docs@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "docs check"], cwd=dest, check=True)
    return dest


def _is_venv_bin(entry: str) -> bool:
    return (Path(entry).parent / "pyvenv.cfg").is_file()


@pytest.fixture(scope="session")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A new user's environment: no venv active, uv and a `pip` (= `uv pip`) on PATH."""
    uv = shutil.which("uv")
    assert uv is not None, "uv is not on PATH"
    shims = tmp_path_factory.mktemp("bin")
    (shims / "uv").symlink_to(uv)
    pip = shims / "pip"
    pip.write_text('#!/usr/bin/env bash\n'
                   'if [ "${1:-}" = install ]; then shift; exec uv pip install --no-sources "$@"; fi\n'
                   'exec uv pip "$@"\n')
    pip.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH", "CONDA_PREFIX"}}
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and not _is_venv_bin(entry)]
    env["PATH"] = os.pathsep.join([str(shims), *path])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1", NO_COLOR="1")
    return env


class Servers:
    """`server` blocks still running, stopped when a block of another file starts."""

    def __init__(self) -> None:
        self.doc: str | None = None
        self.procs: list[subprocess.Popen[bytes]] = []

    def enter(self, doc: str) -> None:
        if doc != self.doc:
            self.stop()
            self.doc = doc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.procs.clear()


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    running = Servers()
    yield running
    running.stop()


def _command(block: CodeBlock) -> list[str]:
    if block.syntax == "python":
        return ["uv", "run", "python", "-"]
    return ["bash", "-euo", "pipefail", "-c", block.code]


def _venv_for_pip(block: CodeBlock, env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """A fresh activated venv for a block that installs with pip (as its reader would have)."""
    if not any(line.lstrip().startswith("pip install") for line in block.code.splitlines()):
        return env
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "--quiet", "--python", f"{sys.version_info.major}.{sys.version_info.minor}",
                    str(venv)], check=True, env=env)
    shims, rest = env["PATH"].split(os.pathsep, 1)  # the pip shim stays ahead of the venv's own pip
    return {**env, "VIRTUAL_ENV": str(venv), "PATH": os.pathsep.join([shims, str(venv / "bin"), rest])}


def _start_server(item: Block, clone: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    assert item.server is not None
    with log.open("wb") as out:
        proc = subprocess.Popen(_command(item.block), cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{item.id}: the server exited ({proc.returncode}) before {item.server} answered:\n"
                        f"{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(item.server, timeout=2) as response:
                if response.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"{item.id}: {item.server} did not answer 200 within {SERVER_START_S} s:\n{log.read_text()[-4000:]}")


@pytest.mark.parametrize("item", _blocks())
def test_block(item: Block, clone: Path, user_env: dict[str, str], servers: Servers, tmp_path: Path) -> None:
    servers.enter(item.doc)
    block = item.block
    if block.syntax == "python":
        ast.parse(block.code, filename=item.id)  # a syntax error is reported as such, with its line
    env = _venv_for_pip(block, user_env, tmp_path)
    if item.server is not None:
        servers.procs.append(_start_server(item, clone, env, tmp_path / "server.log"))
        return
    start = time.monotonic()
    try:
        ran = subprocess.run(_command(block), cwd=clone, env=env, capture_output=True, text=True,
                             input=block.code if block.syntax == "python" else None, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{item.id}: still running after {BLOCK_TIMEOUT_S} s\n{e.stdout!s}{e.stderr!s}")
    print(f"{item.id}: {time.monotonic() - start:.1f} s")
    if ran.returncode != 0:
        pytest.fail(f"{item.id}: exit {ran.returncode}\n```\n{block.code}```\nstdout:\n{ran.stdout[-6000:]}\n"
                    f"stderr:\n{ran.stderr[-6000:]}", pytrace=False)
    if block.expected_output is not None:
        got, want = ran.stdout, block.expected_output
        if block.expected_output_ignore_whitespace:
            got, want = "".join(got.split()), "".join(want.split())
        assert got == want, f"{item.id}: stdout differs from the documented output"


def test_blocks_leave_the_clone_clean(clone: Path) -> None:
    """No tracked file changed (examples/data/generate.py rewrites its files byte for byte), and
    what the documented commands write (runs, tiny checkpoints, dist/) is covered by .gitignore."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                            check=True, capture_output=True, text=True).stdout
    assert status == "", f"files changed, or left behind and not covered by .gitignore:\n{status}"
