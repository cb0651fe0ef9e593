"""`ProcessState`: a checkpoint value that every process writes and reads itself.

`save_checkpoint` calls `save(folder)` on every process for each such value (after the
accelerator's state, before the checkpoint is published) and `load_checkpoint` calls
`load(folder)`; `folder` is `<checkpoint>/<name>`, shared by the processes. Examples: a sharded
policy and its optimizer (`rl_core.train.sharding.ShardedState`, each rank its own shards) and
an asynchronous run's rollouts in flight (`rl_core.train.pipeline`, each rank its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

__all__ = ["ProcessState"]


class ProcessState(ABC):
    """A checkpoint value saved and loaded by every process (see the module doc)."""

    @abstractmethod
    def save(self, folder: Path) -> None:
        """Write this process's part under `folder` (other processes write theirs too)."""

    @abstractmethod
    def load(self, folder: Path) -> None:
        """Read this process's part from `folder`."""
