"""Test sessions: one per package, each in its own environment holding only that package and
its declared dependencies (so an undeclared import fails), plus lint and opt-in marker sessions.

    uv run nox                 # CI: every session below except the opt-in ones, two at a time
    uv run nox -s lint         # ruff + mypy (see `lint` for how the apps are type-checked)
    uv run nox -s "tests(rl-core)"
    uv run nox -s gpu          # opt-in: tests marked gpu (needs CUDA)
    uv run nox -s docs         # every README command and snippet, run in a fresh copy

Type checking outside nox, from the root venv (`uv sync`):

    uv run mypy                                             # the packages' src trees
    MYPYPATH=apps/caption-rl uv run mypy apps/caption-rl    # one app
"""

from __future__ import annotations

import configparser
import email.parser
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["ci"]  # `uv run nox`: every session of CI_SESSIONS, CI_JOBS at a time (see `ci`)

# package -> extras its tests need (never vllm: it needs a GPU and is opt-in).
PACKAGES: dict[str, list[str]] = {
    "rl-core": ["train"],
    "rl-data": ["datasets"],
    "rl-models": ["diffusers"],
    "rl-rollout": ["diffusers", "ray"],
    "rl-policy": ["ray"],
    "rl-rewards": ["hf", "ocr", "vision", "ray", "ray-serve"],
}
DEFAULT_MARKERS = "not gpu and not slow and not vllm"
# Every app: a folder of apps/ with a __main__.py (and its own pyproject.toml, a workspace member).
# A new recipe is found here and by the root workspace (`members = ["apps/*"]`) without edits.
APPS = sorted(p.parent.name for p in Path(__file__).resolve().parent.glob("apps/*/__main__.py"))


# What `uv run nox` (CI) runs, each session in its own environment; `ci` starts the longest first
# (minutes each took alone on the 2-core dev machine; a new one counts 5) so its queues end together.
CI_MINUTES = {"docs": 19, "app(diffusion-grpo)": 9, "app(caption-rl)": 8, "tests(rl-rewards)": 6,
              "app(rider-grm)": 6, "tests(rl-rollout)": 5, "tests(rl-core)": 4, "rewards_no_torch": 3,
              "lint": 2, "tests(rl-models)": 2, "tests(rl-policy)": 2, "third_party": 2, "app(arith-grpo)": 2,
              "packaging": 2, "tests(rl-data)": 0.3, "coinstall_resolve": 0.2}
CI_SESSIONS = sorted(["lint", *(f"tests({p})" for p in PACKAGES), "rewards_no_torch", "third_party",
                      "coinstall_resolve", *(f"app({app})" for app in APPS), "packaging", "docs"],
                     key=lambda name: -CI_MINUTES.get(name, 5))
# Sessions run side by side by `ci`: one session keeps about one core busy (its tests wait on
# subprocesses, servers and Ray), so two fill a 2-core machine.
CI_JOBS = int(os.environ.get("CI_JOBS", "2"))
# Ray starts its workers at nice 15, below its driver: beside another session's tests they would
# get what CPU is left (a 35 s Ray test took 225 s); at 0 they share it evenly. One OpenMP thread
# per process: torch's default, a thread per core, has two sessions' processes (and a test's
# servers beside it) spin-waiting on each other's cores; 40 forward/backward passes of the tiny
# Qwen3 in two processes at once took 7-30 s each with 2 threads, 0.4-0.6 s with 1 (alone: 0.5 s).
CI_ENV = {**os.environ, "RAY_worker_niceness": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _sync(session: nox.Session, package: str, extras: list[str]) -> None:
    """Install exactly `package` (from uv.lock) and what it declares into the session venv."""
    args = ["uv", "sync", "--frozen", "--no-default-groups", "--package", package, "--group", "test"]
    for extra in extras:
        args += ["--extra", extra]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location})


# Ray starts its workers with `uv run` when it finds one among its parent processes (as under `uv run
# nox`), which re-syncs the whole workspace into the session's venv: tests start them with the
# session's interpreter instead, so each session keeps exactly what it installed.
TEST_ENV = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def _pytest(session: nox.Session, package: str, markers: str, *args: str, required: bool = True) -> None:
    """pytest over one package's tests; `required`: "no tests collected" (exit 5) fails the session."""
    session.run(
        "python", "-m", "pytest", f"packages/{package}/tests", "-m", markers, "-q", "--durations=8", *args,
        *session.posargs,
        success_codes=[0] if required else [0, 5], env=TEST_ENV,
    )


# rl-rewards' `no_torch` tests (its server, client, rules, adapters) run once, in the torch-free
# environment of `rewards_no_torch` (what `pip install rl-rewards` gives); `tests(rl-rewards)` runs
# the rest, with the extras installed.
NO_TORCH_MARKERS = f"no_torch and {DEFAULT_MARKERS}"


@nox.session(venv_backend="none")
def ci(session: nox.Session) -> None:
    """What CI runs (`uv run nox`): every session of CI_SESSIONS, each as its own `nox -s NAME`
    process, CI_JOBS at a time (env `CI_JOBS`, default 2). A session's output is printed whole
    when it ends (a line says when each starts), then a table of every session's result and time;
    fails if any session failed. `uv run nox -s NAME` runs one session alone, as before."""
    names = CI_SESSIONS
    logs = Path(".nox") / "ci-logs"
    logs.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    results: dict[str, tuple[int, float]] = {}

    def run(name: str) -> None:
        log = logs / (re.sub(r"[^\w.-]+", "_", name) + ".log")
        with lock:
            print(f"ci > {name}: started", flush=True)
        start = time.monotonic()
        with log.open("wb") as out:
            code = subprocess.run([sys.executable, "-m", "nox", "--no-color", "-s", name], env=CI_ENV,
                                  stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        seconds = time.monotonic() - start
        with lock:
            results[name] = (code, seconds)
            sys.stdout.write(log.read_text(errors="replace"))
            print(f"ci > {name}: {'passed' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s "
                  f"({len(results)} of {len(names)} sessions done)", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, CI_JOBS)) as pool:
        list(pool.map(run, names))
    width = max(map(len, names))
    for name in names:
        code, seconds = results[name]
        print(f"ci > {name:<{width}}  {'passed' if code == 0 else 'FAILED':<6}  {seconds:6.0f} s")
    failed = [name for name in names if results[name][0] != 0]
    if failed:
        session.error(f"{len(failed)} of {len(names)} sessions failed: {', '.join(failed)}")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree, then mypy (default strictness; config: [tool.mypy] in pyproject.toml).

    mypy sees the types of what the code imports only where it is installed, so the session syncs
    the root project from uv.lock (the workspace packages, editable, and what the apps need: torch,
    transformers, diffusers, peft, msgspec, ...) with the `lint` group (ruff, mypy). vllm, ray
    and datasets are not installed: `ignore_missing_imports` makes them Any.

    - `mypy` with no arguments checks the packages' src trees (`files`); `mypy_path` resolves
      imports between the packages from their source.
    - An app is a directory of sibling modules imported by bare name (`from caption_parts import
      ...`) and every app has a `__main__.py`, so the apps cannot share one run: each is checked
      as its own root, `mypy apps/<app>` with MYPYPATH=apps/<app> (its tests are excluded). Apps
      whose directory the config's `exclude` matches are skipped.
    """
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--frozen", "--no-default-groups", "--group", "lint", env=env)
    session.run("ruff", "check", ".")
    session.run("python", ".ci/import_graph.py")  # declared arrows only, no trainer runtime in engines, no cycle
    session.run("mypy")
    for app in APPS:
        if _mypy_excluded(f"apps/{app}/"):
            session.log(f"mypy: apps/{app} skipped (excluded in [tool.mypy])")
            continue
        session.run("mypy", f"apps/{app}", env={"MYPYPATH": f"apps/{app}"})


def _mypy_excluded(path: str) -> bool:
    """Whether a pattern of [tool.mypy] `exclude` matches `path` (as mypy matches it)."""
    config = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mypy"]
    return any(re.search(pattern, path) for pattern in config.get("exclude", []))


@nox.session
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """Default test suite of one package (markers gpu/slow/vllm excluded)."""
    _sync(session, package, PACKAGES[package])
    _pytest(session, package, DEFAULT_MARKERS if package != "rl-rewards" else f"not no_torch and {DEFAULT_MARKERS}")


@nox.session
def rewards_no_torch(session: nox.Session) -> None:
    """`pip install rl-rewards` alone: imports and serves rule scorers with no torch installed."""
    _sync(session, "rl-rewards", [])
    session.run("python", "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)")
    _pytest(session, "rl-rewards", NO_TORCH_MARKERS)


# verl and OpenRLHF pin transformers below the workspace's (verl 0.9.1: < 5.11; OpenRLHF 0.11.2:
# 5.15.0, and flash-attn and deepspeed sdists that build only with torch added, see
# COINSTALL_UV_CONFIG), so they cannot share uv.lock. Their reward code needs none of that: here
# they are installed without dependencies, plus the few light modules their reward managers,
# reward loop and Experience code import (`coinstall` installs them with all of theirs).
THIRD_PARTY_NO_DEPS = ["verl==0.9.1", "openrlhf==0.11.2"]
THIRD_PARTY_IMPORTS = ["tensordict==0.15.3", "codetiming==1.4.0", "omegaconf==2.4.0", "orjson>=3.10",
                       "pylatexenc==2.11", "aiohttp>=3.9"]


@nox.session
def third_party(session: nox.Session) -> None:
    """rl-rewards' adapters inside the real TRL, verl and OpenRLHF code, and rl-core's algorithms
    against TRL's own code (each package's tests/third_party; rl-rewards' hf extra brings
    rl-models and rl-core). One pytest run per package: each reads its own pytest config."""
    args = ["uv", "sync", "--frozen", "--no-default-groups", "--package", "rl-rewards",
            "--group", "test", "--group", "third-party", "--extra", "hf", "--extra", "ray"]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location})
    session.install("--no-deps", *THIRD_PARTY_NO_DEPS)
    session.install(*THIRD_PARTY_IMPORTS)
    for package in ("rl-rewards", "rl-core"):
        session.run("python", "-m", "pytest", f"packages/{package}/tests/third_party", "-m", "third_party", "-q",
                    f"--ignore=packages/{package}/tests/third_party/test_coinstall.py",  # coinstall's smoke
                    *session.posargs)


# `pip install TRAINER rl-core rl-models rl-rewards` must resolve and work, for each trainer (its
# pin). Resolved from PyPI with the trainer's own dependencies, not from uv.lock: verl 0.9.1 needs
# transformers < 5.11 and OpenRLHF 0.11.2 pins 5.15.0, below the lock's. rl-rewards without
# extras: its `hf` extra brings rl-rollout, which still needs transformers >= 5.17.
COINSTALL = {"verl": "verl==0.9.1", "trl": "trl==1.16.*", "openrlhf": "openrlhf==0.11.2"}
COINSTALL_OURS = ["./packages/rl-core", "./packages/rl-models", "./packages/rl-rewards"]
# Resolve as of this date, so that a release on PyPI neither changes what CI tests nor makes it
# download a new torch; move it forward to check against newer releases.
COINSTALL_EXCLUDE_NEWER = "2026-11-26"
# OpenRLHF's flash-attn and deepspeed are sdists whose setup.py imports torch without declaring
# it: build them against the environment's torch, flash-attn without its CUDA kernels (no nvcc on
# CI; its Python modules install, as a CPU-only reward process needs).
COINSTALL_UV_CONFIG = """
[extra-build-dependencies]
flash-attn = [{ requirement = "torch", match-runtime = true }, "psutil", "ninja", "packaging", "wheel"]
deepspeed = [{ requirement = "torch", match-runtime = true }]

[extra-build-variables]
flash-attn = { FLASH_ATTENTION_SKIP_CUDA_BUILD = "TRUE" }
deepspeed = { DS_BUILD_OPS = "0" }
"""


def _coinstall(session: nox.Session, tmp: str, *args: str) -> None:
    """`uv pip install` of `args` and our three packages into the session venv, as pip would:
    `--no-sources`, so the packages come from their folders and not as workspace links."""
    config = Path(tmp) / "uv.toml"
    config.write_text(COINSTALL_UV_CONFIG)
    session.install("--config-file", str(config), "--no-sources", "--exclude-newer", COINSTALL_EXCLUDE_NEWER,
                    *args, *COINSTALL_OURS)


@nox.session
def coinstall_resolve(session: nox.Session) -> None:
    """CI's check that each trainer and our packages resolve together (dry runs, seconds): the
    environments themselves cost half a minute to a minute or more each (OpenRLHF's sdists build
    every time), so they are opt-in (`coinstall(verl)`, `coinstall(trl)`, `coinstall(openrlhf)`;
    CI's time is near its limit) and the third_party session runs TRL, verl and OpenRLHF's reward
    code with the lock's versions."""
    with tempfile.TemporaryDirectory(prefix="rl-coinstall-") as tmp:
        for requirement in COINSTALL.values():
            _coinstall(session, tmp, "--dry-run", requirement)


@nox.session
@nox.parametrize("trainer", list(COINSTALL), ids=list(COINSTALL))
def coinstall(session: nox.Session, trainer: str) -> None:
    """One environment with a trainer and rl-core, rl-models and rl-rewards, resolved together
    from PyPI with every dependency, then rl-rewards' adapter smoke for that trainer
    (tests/third_party/test_coinstall.py), with rl-models' tiny qwen3 built under the
    transformers the trainer resolved (`nox -s "coinstall(openrlhf)"`)."""
    with tempfile.TemporaryDirectory(prefix="rl-coinstall-") as tmp:
        _coinstall(session, tmp, COINSTALL[trainer], "pytest>=8.3")
        session.run("uv", "pip", "show", trainer, "transformers", "torch", external=True)
        out = session.run("python", "-m", "pytest", "packages/rl-rewards/tests/third_party/test_coinstall.py",
                          "-m", "third_party", "-k", f"test_{trainer}_", "-q", "-p", "no:cacheprovider",
                          *session.posargs, env={"RL_MODELS_CACHE": str(Path(tmp) / "tiny")}, silent=True)
        summary = str(out).strip().splitlines()[-1]
        session.log(summary)
        if "skipped" in summary:  # the test importorskips its trainer: here that must not happen
            session.error(f"the {trainer} smoke was skipped: its trainer did not import\n{out}")


@nox.session
@nox.parametrize("app", APPS, ids=APPS)
def app(session: nox.Session, app: str) -> None:
    """An app's default test suite, in an env holding only the app and what it declares
    (`uv run nox -s "app(caption-rl)"`)."""
    _sync(session, app, [])
    session.run("python", "-m", "pytest", f"apps/{app}/tests", "-m", DEFAULT_MARKERS, "-q", "--durations=8", *session.posargs,
                env=TEST_ENV)




def _marker_session(session: nox.Session, marker: str) -> None:
    """Every package's and every app's tests with `marker` (each in its own environment)."""
    for package, extras in PACKAGES.items():
        _sync(session, package, extras)
        _pytest(session, package, marker, required=False)
    for app in APPS:
        _sync(session, app, [])
        session.run("python", "-m", "pytest", f"apps/{app}/tests", "-m", marker, "-q", *session.posargs,
                    success_codes=[0, 5])


@nox.session
def gpu(session: nox.Session) -> None:
    """Opt-in: tests marked `gpu` (needs CUDA); skipped, saying so, on a machine without one."""
    _sync(session, "rl-core", PACKAGES["rl-core"])
    cuda = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True)
    if not isinstance(cuda, str) or cuda.strip() != "True":
        session.skip("the gpu tests need a CUDA GPU, and torch.cuda.is_available() is False on this machine")
    _marker_session(session, "gpu")


@nox.session
def slow(session: nox.Session) -> None:
    """Opt-in: tests marked `slow`."""
    _marker_session(session, "slow")


@nox.session
def vllm(session: nox.Session) -> None:
    """Opt-in: tests marked `vllm` in every package and app (needs a GPU): the engine itself, the
    judges of rl-rewards serve, caption-rl's colocated rollouts, rider-grm's judges. One
    environment with the whole workspace and rl-rollout[vllm]; `.ci/marked_tests.py vllm` runs
    the same tests with an existing Python (a GPU machine with vLLM from the wheel set)."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--frozen", "--all-packages", "--all-extras", env=env)
    session.run("python", ".ci/marked_tests.py", "vllm", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Every `bash` and `python` block of every tracked Markdown file (the READMEs, examples/,
    docs/), run as written, in order, from the root of a fresh copy of the repository, as a new
    user would: no environment active, the copy's own `.venv` made by its first `uv run`. Blocks
    marked as needing a GPU, a Hub download or placeholder paths are skipped (docs/test_docs.py
    has the convention). The session's own venv holds only pytest and pytest-codeblocks."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--frozen", "--only-group", "docs", env=env)
    session.run("python", "-m", "pytest", "docs/test_docs.py", "-q", "-p", "no:cacheprovider", "--durations=15",
                *session.posargs)


# --- packaging: each package as `pip install NAME` would give it once published ---------------

# Packages whose wheel must install and run its README example without torch.
NO_TORCH = {"rl-data", "rl-rewards"}
# Engines and what builds on them without a trainer: no trainer extras (rl-core[train] brings
# accelerate's trackers and matplotlib), so `pip install "rl-rewards[hf]"` stays a judge server.
NO_TRAINER = {"rl-core", "rl-models", "rl-rollout"}
# README examples that read the repository's examples/data: run with the repository root as the
# working directory (still with the installed package: `python -I` keeps the checkout off sys.path).
EXAMPLE_FROM_REPO_ROOT = {"rl-data"}


def _wheel_file(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(f".dist-info/{suffix}")] or [""]
        return zf.read(name).decode() if name else ""


def _siblings(package: str, metadata: dict[str, email.message.Message]) -> list[str]:
    """Workspace packages that `package` needs without extras, transitively (from wheel metadata)."""
    found: list[str] = []
    todo = [package]
    while todo:
        for line in metadata[todo.pop()].get_all("Requires-Dist") or []:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if name in metadata and name not in found and (req.marker is None or req.marker.evaluate({"extra": ""})):
                found.append(name)
                todo.append(name)
    return found


def _first_python_block(readme: Path) -> str:
    match = re.search(r"^```python\n(.*?)^```", readme.read_text(), re.M | re.S)
    if match is None:
        raise ValueError(f"{readme}: no ```python block")
    return match.group(1)


@nox.session
def packaging(session: nox.Session) -> None:
    """Build every package's wheel and sdist and install each wheel alone into a fresh venv.

    Per package: `uv build --package NAME` (sdist, then the wheel from the sdist); a fresh venv
    with the wheel, its declared third-party dependencies from PyPI (at uv.lock's versions, the
    ones CI tests; the lock only constrains, it adds nothing) and the workspace packages it
    declares from their own freshly built wheels, never from the checkout; no torch for
    rl-data and rl-rewards; import it from a temp dir; run each console script with --help; run
    the first ```python block of its README with the venv's `python -I`; LICENSE in wheel and
    sdist; `twine check --strict` and `check-wheel-contents` on every artifact. One venv per
    package: uv hard-links torch from its cache, so a torch venv costs about a second.
    """
    session.install("twine>=6.1", "check-wheel-contents>=0.6")
    root = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="rl-packaging-") as tmp_name:
        tmp = Path(tmp_name)
        dist = tmp / "dist"
        constraints = tmp / "constraints.txt"
        session.run("uv", "export", "--frozen", "--quiet", "--no-hashes", "--all-packages", "--all-extras",
                    "--no-emit-workspace", "--no-header", "--no-annotate", "-o", str(constraints),
                    external=True, silent=True)
        for package in PACKAGES:
            session.run("uv", "build", "--quiet", "--package", package, "--out-dir", str(dist), external=True)
        wheels = {p: next(dist.glob(f"{p.replace('-', '_')}-*.whl")) for p in PACKAGES}
        sdists = {p: next(dist.glob(f"{p.replace('-', '_')}-*.tar.gz")) for p in PACKAGES}
        metadata = {p: email.parser.Parser().parsestr(_wheel_file(w, "METADATA")) for p, w in wheels.items()}
        artifacts = sorted(dist.glob("*.whl")) + sorted(dist.glob("*.tar.gz"))
        if len(artifacts) != 2 * len(PACKAGES):
            session.error(f"expected one wheel and one sdist per package, got {[a.name for a in artifacts]}")
        session.run("twine", "check", "--strict", *map(str, artifacts))
        session.run("check-wheel-contents", *map(str, wheels.values()))

        for package in PACKAGES:
            start = time.monotonic()
            module = package.replace("-", "_")
            work = tmp / package
            work.mkdir()
            venv = work / "venv"
            python = str(venv / "bin" / "python")

            if not _wheel_file(wheels[package], "licenses/LICENSE"):
                session.error(f"{wheels[package].name}: no .dist-info/licenses/LICENSE")
            with tarfile.open(sdists[package]) as tar:
                if not any(n.endswith("/LICENSE") and n.count("/") == 1 for n in tar.getnames()):
                    session.error(f"{sdists[package].name}: no LICENSE at its top level")

            siblings = _siblings(package, metadata)
            session.run("uv", "venv", "--quiet", "--python", sys.executable, str(venv), external=True)
            with session.chdir(work):
                session.run("uv", "pip", "install", "--quiet", "--python", python, "-c", str(constraints),
                            str(wheels[package]), *(str(wheels[s]) for s in siblings), external=True)
                installed = session.run(
                    python, "-I", "-c",
                    "import importlib.metadata as m; print(*sorted(d.metadata['Name'] for d in m.distributions()))",
                    external=True, silent=True,
                ).split()
                ours = {canonicalize_name(n) for n in installed} & set(PACKAGES)
                if ours != {package, *siblings}:
                    session.error(f"{package}: workspace packages installed {sorted(ours)}, expected {[package, *siblings]}")
                if package in NO_TORCH and "torch" in installed:
                    session.error(f"{package}: torch was installed, but its wheel must work without it")
                if package in NO_TRAINER and "matplotlib" in installed:
                    session.error(f"{package}: matplotlib was installed, but the trainer's extras must stay out")
                session.run(python, "-I", "-c",
                            f"import sys, {module}; assert {module}.__file__.startswith(sys.prefix), {module}.__file__",
                            external=True)
                scripts = configparser.ConfigParser()
                scripts.read_string(_wheel_file(wheels[package], "entry_points.txt"))
                for script in scripts["console_scripts"] if scripts.has_section("console_scripts") else []:
                    session.run(str(venv / "bin" / script), "--help", external=True, silent=True)

            example = work / "readme_example.py"
            example.write_text(_first_python_block(root / "packages" / package / "README.md"))
            env = {"RL_MODELS_CACHE": str(work / "tiny-models"), "HF_HUB_OFFLINE": "1"}
            with session.chdir(root if package in EXAMPLE_FROM_REPO_ROOT else work):
                session.run(python, "-I", str(example), external=True, env=env)
            session.log(f"{package}: wheel + {', '.join(siblings) or 'no workspace packages'} "
                        f"checked in {time.monotonic() - start:.1f}s")
