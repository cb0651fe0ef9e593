"""rl_core.train.rundir: unique timestamped runs, `latest` pointer, config.toml."""

from __future__ import annotations

from pathlib import Path

import msgspec

from rl_core.train.config import load_config
from rl_core.train.rundir import latest_run, make_run_dir


class Config(msgspec.Struct, kw_only=True, frozen=True):
    lr: float = 1e-3
    name: str = "x"


def test_fresh_runs_are_unique_and_latest_follows(tmp_path: Path) -> None:
    assert latest_run(tmp_path) is None
    first = make_run_dir(tmp_path)
    second = make_run_dir(tmp_path)  # same second: gets a -1 suffix
    assert first != second
    assert first.parent == second.parent == tmp_path
    assert first.name.startswith("run-") and second.name.startswith(first.name)
    assert latest_run(tmp_path) == second.resolve()
    assert (tmp_path / "latest").is_symlink()


def test_named_run_is_reused_and_config_written(tmp_path: Path) -> None:
    cfg = Config(lr=0.5, name="exp")
    run = make_run_dir(tmp_path / "runs", "exp", config=cfg)
    (run / "marker").write_text("kept")
    again = make_run_dir(tmp_path / "runs", "exp", config=cfg)
    assert again == run and (run / "marker").read_text() == "kept"
    assert load_config(Config, run / "config.toml") == cfg
    assert latest_run(tmp_path / "runs") == run.resolve()
