"""Run directories: `root/<name>-<timestamp>/` holding config.toml, metrics.csv and
`checkpoints/checkpoint-<step>/`, with `root/latest` a symlink to the newest run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from rl_core.train.config import dump_config

__all__ = ["latest_run", "make_run_dir"]


def _create_unique(root: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (f"{name}-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory name for {name}-{stamp} under {root}")


def _point_latest(root: Path, run_dir: Path) -> None:
    """Re-point `root/latest` atomically (a new symlink renamed over the old one)."""
    tmp = root / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(tmp, root / "latest")


def make_run_dir(
    root: str | os.PathLike[str],
    name: str | None = None,
    *,
    config: msgspec.Struct | None = None,
    accelerator: Any = None,
) -> Path:
    """Create (main process) and return a run directory under `root`.

    `name=None` makes a fresh `run-YYYYmmdd-HHMMSS[-i]`; a given `name` is used as is and may
    already exist (resuming into the same run). `root/latest` points at it. With `config`,
    writes `config.toml` (`dump_config`). With an `accelerate.Accelerator`, only the main
    process touches the disk and every process gets the same path.
    """
    root = Path(root)
    main = accelerator is None or accelerator.is_main_process
    path = None
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if name is None:
            path = _create_unique(root, "run")
        else:
            path = root / name
            path.mkdir(exist_ok=True)
        _point_latest(root, path)
        if config is not None:
            (path / "config.toml").write_text(dump_config(config), encoding="utf-8")
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        path = broadcast_object_list([path])[0]
    assert path is not None
    return Path(path)


def latest_run(root: str | os.PathLike[str]) -> Path | None:
    """The run that `root/latest` points at, or None when there is none."""
    link = Path(root) / "latest"
    return link.resolve() if link.is_dir() else None
