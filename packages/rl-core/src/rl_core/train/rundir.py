"""Run directories: `root/<name>-<timestamp>/` holding config.toml, metrics.csv and
`checkpoints/checkpoint-<step>/`, with `root/latest` a symlink to the newest run that started
(the loop points it once the run's setup succeeded, so a failed start leaves it alone); the newest
complete checkpoint of a run, and the one an app's `--resume` continues (`resume_point`: no
torch, so a wrong `--resume` is refused before torch is imported; `rl_core.train.checkpoint`
gives the same names).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from rl_core.errors import UserError
from rl_core.train.config import dump_config

__all__ = ["checkpoints", "latest_checkpoint", "latest_run", "make_run_dir", "point_latest", "resolve_resume",
           "resume_point"]

_NAME = re.compile(r"checkpoint-(\d+)")


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
    latest: bool = True,
) -> Path:
    """Create (main process) and return a run directory under `root`.

    `name=None` makes a fresh `run-YYYYmmdd-HHMMSS[-i]`; a given `name` is used as is and may
    already exist (resuming into the same run). With `latest`, `root/latest` points at it now;
    the trainer loop passes False and calls `point_latest` once the run has started. With
    `config`, writes `config.toml` (`dump_config`). With an `accelerate.Accelerator`, only the
    main process touches the disk and every process gets the same path.
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
        if latest:
            _point_latest(root, path)
        if config is not None:
            (path / "config.toml").write_text(dump_config(config), encoding="utf-8")
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        path = broadcast_object_list([path])[0]
    assert path is not None
    return Path(path)


def point_latest(run_dir: Path, accelerator: Any = None) -> None:
    """Point `run_dir.parent/latest` at `run_dir` (the main process only)."""
    if accelerator is None or accelerator.is_main_process:
        _point_latest(run_dir.parent, run_dir)


def latest_run(root: str | os.PathLike[str]) -> Path | None:
    """The run that `root/latest` points at, or None when there is none."""
    link = Path(root) / "latest"
    return link.resolve() if link.is_dir() else None


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.fullmatch(p.name)) and (p / "meta.json").is_file()]
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete `checkpoint-<step>` with the highest step under `root`, or None."""
    found = checkpoints(Path(root))
    return found[-1][1] if found else None


def resolve_resume(spec: str | os.PathLike[str] | None, runs_root: str | os.PathLike[str]) -> Path | None:
    """Turn an app's `--resume` value into a checkpoint path.

    None -> None (fresh start). "latest" -> the newest checkpoint of the run under `runs_root`
    that saved one last (a run whose start failed, with no checkpoint, is passed over). A path
    may name a checkpoint, a run directory (uses its `checkpoints/`) or a checkpoints directory.
    Finding no checkpoint raises `FileNotFoundError`: a resume never quietly starts over.
    The run directory of a checkpoint is `ckpt.parent.parent`.
    """
    if spec is None:
        return None
    if str(spec) == "latest":
        root = Path(runs_root)
        saved = [c for run in (root.iterdir() if root.is_dir() else ()) if run.is_dir() and not run.is_symlink()
                 and (c := latest_checkpoint(run / "checkpoints")) is not None]
        if not saved:
            raise FileNotFoundError(f"--resume: nothing to resume: no run under {root.absolute()} has a checkpoint "
                                    "(start without --resume, or give a run directory)")
        return max(saved, key=lambda c: (c / "meta.json").stat().st_mtime_ns)
    path = Path(spec)
    if (path / "meta.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"--resume {spec}: no complete checkpoint-<step> there")
    return found


def resume_point(resume: str | None, output_dir: str, run_name: str | None) -> tuple[Path | None, str | None]:
    """The checkpoint an app's `--resume` continues (None: a fresh start) and the run's name; a
    path without a checkpoint, or a `train.run_name` naming another run, is a `UserError`."""
    try:
        ckpt = resolve_resume(resume, output_dir)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if ckpt is None:
        return None, run_name
    name = ckpt.parent.parent.name
    if run_name not in (None, name):
        raise UserError(f"--resume continues run {name!r}, but train.run_name={run_name!r} names another run: "
                        "drop train.run_name, or resume that run's directory")
    return ckpt, name
