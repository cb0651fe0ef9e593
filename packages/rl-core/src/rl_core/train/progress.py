"""Progress of a training loop on the main process: on a terminal a rich bar (step/total,
elapsed, ETA, chosen metrics and phase times); off a terminal (a log file, nohup, SLURM, CI) one
plain line per step with the same metrics, elapsed time and ETA.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["TrainProgress"]


class TrainProgress:
    """`with TrainProgress(total, initial=start_step) as bar: ... bar.update(step, metrics)`.

    Shows the metrics named in `show` that are present (e.g. `reward/mean`) and every
    `time/<phase>` value as `phase 1.2s` (off a terminal: `time/step` only).
    """

    def __init__(self, total: int, *, initial: int = 0, show: Sequence[str] = ("reward",),
                 accelerator: Any = None, console: Console | None = None) -> None:
        self.console = console or Console()
        main = accelerator is None or accelerator.is_main_process
        self.enabled = main and self.console.is_terminal
        self.lines = main and not self.console.is_terminal
        self.show, self.total, self.initial = tuple(show), total, initial
        self._began = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
            console=self.console, disable=not self.enabled,
        )
        self._task = self._progress.add_task("train", total=total, completed=initial, metrics="")

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move to `step` (completed steps) and show `metrics`."""
        metrics = metrics or {}
        parts = [f"{key}={float(metrics[key]):.4g}" for key in self.show if key in metrics]
        if self.lines:
            self._line(step, metrics, parts)
        parts += [f"{key.removeprefix('time/')} {float(v):.2f}s" for key, v in metrics.items()
                  if key.startswith("time/")]
        self._progress.update(self._task, completed=step, metrics="  ".join(parts))

    def _line(self, step: int, metrics: Mapping[str, Any], parts: list[str]) -> None:
        elapsed = time.perf_counter() - self._began
        done = step - self.initial
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        timing = f"{float(metrics['time/step']):.2f}s/step  " if "time/step" in metrics else ""
        print(f"step {step}/{self.total}  {'  '.join(parts)}  {timing}elapsed {_clock(elapsed)}  eta {_clock(eta)}",
              flush=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
