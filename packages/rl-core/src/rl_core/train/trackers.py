"""Experiment trackers (`train.log_with`, through Accelerate): checked installed with the config,
before torch loads or a directory is made, and kept inside the run directory."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rl_core.errors import UserError

__all__ = ["check_trackers", "mlflow_store", "tracker_dirs", "tracker_init_kwargs"]

# tracker -> (module Accelerate imports, the package to install)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio"), "aim": ("aim", "aim"),
                    "comet_ml": ("comet_ml", "comet-ml"), "dvclive": ("dvclive", "dvclive"),
                    "swanlab": ("swanlab", "swanlab"), "clearml": ("clearml", "clearml")}


def check_trackers(names: Sequence[str]) -> None:
    """A `UserError` naming each asked-for tracker that is not installed, with the command that
    adds it where the user is: `pip install` in an environment of one's own, `uv run --with` in a
    clone of this repository (uv sets `UV` for what it runs). `all`: whatever is installed."""
    missing = [TRACKER_PACKAGES[n][1] for n in names if n in TRACKER_PACKAGES
               and importlib.util.find_spec(TRACKER_PACKAGES[n][0]) is None]
    if not missing:
        return
    with_ = " ".join(f"--with {m}" for m in missing)
    how = (f"run the same command as uv run {with_} ..." if os.environ.get("UV")
           else f"pip install {' '.join(missing)}")
    raise UserError(f"train.log_with={list(names)}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                    f"not installed; {how}")


def tracker_init_kwargs(run_dir: Path) -> dict[str, dict[str, str]]:
    """`init_trackers` arguments that keep each tracker's files in the run directory (W&B writes
    `./wandb`, DVCLive `./dvclive`, SwanLab `./swanlog` by default)."""
    return {"wandb": {"dir": str(run_dir)}, "dvclive": {"dir": str(run_dir / "dvclive")},
            "swanlab": {"logdir": str(run_dir / "swanlog")}}


@contextmanager
def mlflow_store(run_dir: Path, names: Sequence[str]) -> Iterator[None]:
    """MLflow's store (`./mlruns` by default) in the run directory while the run lasts, unless
    `MLFLOW_TRACKING_URI` names one of the user's; unset again when the run ends, so the next run
    in the same process (a notebook, a test) gets a store of its own."""
    if not {"mlflow", "all"} & set(names) or "MLFLOW_TRACKING_URI" in os.environ:
        yield
        return
    os.environ["MLFLOW_TRACKING_URI"] = (run_dir / "mlruns").as_uri()
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)


def tracker_dirs(found: Iterable[str], run_dir: Path, project: str) -> dict[str, str]:
    """Where each tracker writes, for the run's summary."""
    where = {"tensorboard": run_dir / project, "wandb": run_dir / "wandb", "mlflow": run_dir / "mlruns",
             "aim": run_dir, "dvclive": run_dir / "dvclive", "swanlab": run_dir / "swanlog"}
    return {name: str(where.get(name, "its own store (see the tracker's docs)")) for name in sorted(found)}
