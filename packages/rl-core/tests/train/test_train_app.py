"""rl_core.train.app's `parse_run`: an app's command line and config read without torch (help,
config errors, a `--resume` without a checkpoint), and the lazy exports of `rl_core` and
`rl_core.train` that make that possible."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

import rl_core
import rl_core.train
from rl_core.train import PolicyLossName, RunFields, UserError, parse_run

# an app's entry as the apps write it: the config, then `parse_run`, before any recipe or torch
TOY_APP = """
import sys

import msgspec

from rl_core.train import PolicyLossName, RunFields, parse_run, run_app


class Algo(msgspec.Struct, kw_only=True, frozen=True):
    loss: PolicyLossName = "ppo_clip"  # the policy loss


class Config(msgspec.Struct, kw_only=True, frozen=True):
    algo: Algo = Algo()
    train: RunFields = RunFields()


def main(argv):
    parsed = parse_run("toy", Config, None, {"TOY_LOSS": "algo.loss"}, argv)
    print(parsed)


code = run_app("toy", main)
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


class _Algo(msgspec.Struct, kw_only=True, frozen=True):
    loss: PolicyLossName = "ppo_clip"


class _Config(msgspec.Struct, kw_only=True, frozen=True):
    algo: _Algo = _Algo()
    train: RunFields = RunFields()


def _toy(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "toy.py"
    script.write_text(TOY_APP)
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, check=False)


@pytest.mark.parametrize(("argv", "code", "stderr"), [
    (["--help"], 0, ""),
    (["algo.loss=ppo"], 2, "toy: error: algo.loss: unknown policy loss 'ppo'; valid names: cispo, dual_clip, gspo, "
                           "ppo_clip, sapo (from override algo.loss=ppo)\n"),
    (["--resume", "nowhere"], 2, "toy: error: --resume nowhere: no complete checkpoint-<step> there\n"),
    (["--config", "nope.toml"], 2, "toy: error: --config nope.toml: no such file\n"),
])
def test_help_and_config_errors_import_no_torch(tmp_path: Path, argv: list[str], code: int, stderr: str) -> None:
    done = _toy(tmp_path, *argv)
    assert (done.returncode, done.stderr) == (code, stderr)
    assert done.stdout.splitlines()[-1] == "torch imported: False"
    if argv == ["--help"]:
        assert re.search(r'\n  algo\.loss  str \(one of: cispo, dual_clip, gspo, ppo_clip, sapo\) = "ppo_clip"\s+'  # wrapped to the width
                         r"\[env TOY_LOSS\]\n      the policy loss", done.stdout), done.stdout


def test_parse_run_returns_the_config_and_the_resume_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match="--resume: nothing to resume"):  # refused now, not after torch loads
        parse_run("toy", _Config, None, None, ["algo.loss=gspo", f"train.output_dir={tmp_path}", "--resume"])
    cfg, resume = parse_run("toy", _Config, None, None, ["algo.loss=gspo", f"train.output_dir={tmp_path}"])
    assert (cfg.algo.loss, cfg.train.output_dir, resume) == ("gspo", str(tmp_path), None)
    default = tmp_path / "default.toml"
    default.write_text('[algo]\nloss = "cispo"\n')
    assert parse_run("toy", _Config, default, None, [])[0].algo.loss == "cispo"  # no --config: the default file
    assert parse_run("toy", _Config, default, None, ["--help"]) is None
    assert "(defaults: default.toml (the embedded default))" in capsys.readouterr().out
    (tmp_path / "a" / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "checkpoint-1" / "meta.json").write_text("{}")
    with pytest.raises(UserError, match=r"--resume continues run 'a', but train\.run_name='b' names another run"):
        parse_run("toy", _Config, None, None, [f"train.output_dir={tmp_path}", "train.run_name=b", "--resume",
                                               str(tmp_path / "a")])
    assert parse_run("toy", _Config, None, None, [f"train.output_dir={tmp_path}", "--resume"])[1] == "latest"


def _typed_imports(package: ModuleType) -> dict[str, str]:
    """name -> module of the `if TYPE_CHECKING:` imports in a package's __init__.py."""
    tree = ast.parse(Path(str(package.__file__)).read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                found |= {alias.name: imp.module for alias in imp.names}
    return found


@pytest.mark.parametrize("package", [rl_core, rl_core.train], ids=["rl_core", "rl_core.train"])
def test_lazy_exports_are_what_type_checkers_see(package: ModuleType) -> None:
    """The names a package gives on first use, the imports type checkers and IDEs read, and
    `__all__` are one list; each name is the object of its module."""
    typed = _typed_imports(package)
    lazy = {name: f"{package.__name__}.{module}" for name, module in package._MODULE_OF.items()}
    assert typed == lazy and sorted(typed) == sorted(package.__all__)
    for name, module in typed.items():
        assert getattr(package, name) is getattr(importlib.import_module(module), name), name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018
