"""Training plumbing every app needs once (install with `pip install "rl-core[train]"`):
config loading, run directories, metric logging, progress, atomic checkpoints, seeding, and
pinned-buffer offloading of weights or optimizer state.

Accelerate is imported only where an accelerator is used, never at import time.
"""

from rl_core.train.checkpoint import (
    Stateful,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from rl_core.train.config import (
    CliArgs,
    ConfigError,
    config_help,
    dump_config,
    load_config,
    parse_cli,
)
from rl_core.train.metrics import MetricsLogger, PhaseTimer
from rl_core.train.offload import OptimizerOffload, PinnedOffload
from rl_core.train.progress import TrainProgress
from rl_core.train.rundir import latest_run, make_run_dir
from rl_core.train.seeding import get_rng_state, seed_everything, set_rng_state

__all__ = [
    "CliArgs",
    "ConfigError",
    "MetricsLogger",
    "OptimizerOffload",
    "PhaseTimer",
    "PinnedOffload",
    "Stateful",
    "TrainProgress",
    "config_help",
    "dump_config",
    "get_rng_state",
    "latest_checkpoint",
    "latest_run",
    "load_checkpoint",
    "load_config",
    "make_run_dir",
    "parse_cli",
    "resolve_resume",
    "save_checkpoint",
    "seed_everything",
    "set_rng_state",
]
