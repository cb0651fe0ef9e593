"""Metric logging: `metrics.csv` in the run directory plus Accelerate trackers, and phase timing.

    timer = PhaseTimer()
    logger = MetricsLogger(run_dir, accelerator=accelerator)
    with timer("generate"):
        ...
    logger.log(step, {"reward/mean": reward.mean(), **timer.pop()})
"""

from __future__ import annotations

import csv
import io
import numbers
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CompileWatch", "MetricsLogger", "PhaseTimer"]

Scalar = int | float | str


def _scalar(key: str, value: Any) -> Scalar:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got a tensor of shape "
                             f"{tuple(value.shape)}; reduce it first (e.g. .mean())")
        return value.item()
    if isinstance(value, bool | str | numbers.Integral):
        return value if isinstance(value, bool | str) else int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, string or 1-element tensor, "
                    f"got {type(value).__name__}")


class MetricsLogger:
    """Append one row per `log(step, metrics)` to `run_dir/metrics.csv` and forward the same
    values to `accelerator.log` (the trackers set up with `Accelerator(log_with=...)` and
    `accelerator.init_trackers`).

    Only the main process writes; values should already be reduced across processes. A key
    that first appears later widens the CSV: the file is rewritten with the union of columns
    (atomically: temp file + rename), earlier rows get empty cells. On resume, pass
    `start_step` (the checkpoint's step): rows logged after it by the interrupted run are
    dropped, so the CSV reads as one uninterrupted run.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, accelerator: Any = None,
                 start_step: int | None = None, filename: str = "metrics.csv") -> None:
        self.path = Path(run_dir) / filename
        self.accelerator = accelerator
        self.main = accelerator is None or accelerator.is_main_process
        self.columns = ["step"]
        self.earlier: list[dict[str, str]] = []  # resumed, main process: the rows kept, as read
        if self.main and self.path.exists():
            columns, rows = self._read()
            self.columns = columns or self.columns
            if start_step is not None:
                self.earlier = [r for r in rows if int(r["step"]) <= start_step]
                self._rewrite(self.earlier)

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        with self.path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows

    def _rewrite(self, rows: Sequence[Mapping[str, Any]]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(buffer.getvalue(), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (numbers, strings or 1-element tensors) at `step`."""
        values = {key: _scalar(key, value) for key, value in metrics.items()}
        if self.accelerator is not None:
            self.accelerator.log(values, step=step)
        if not self.main:
            return
        row = {"step": step, **values}
        new = [key for key in row if key not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            self._rewrite([*self._read()[1], row] if self.path.exists() else [row])
            return
        with self.path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.columns, lineterminator="\n").writerow(row)


def _cuda_sync() -> bool:
    """Synchronize CUDA if it is in use; returns whether it is."""
    # Kernels run asynchronously: without a sync, a phase would be charged for only the time
    # to launch its kernels and the next phase for the rest.
    # Only this thread's stream: an asynchronous rollout thread (`train.max_staleness`) keeps
    # its kernels running on a stream of its own meanwhile.
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
        return True
    return False


@dataclass
class _ThreadTimes:
    totals: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    prefix: str = ""
    running: list[float] = field(default_factory=list)  # the peak seen so far by each open phase, outermost first


class PhaseTimer:
    """Wall time per training phase, reported as `time/<phase>` seconds, and on CUDA the peak
    memory allocated during it as `memory/<phase>_peak_gib`.

    `with timer("reward"): ...` adds to that phase's total (a phase entered twice in one step
    is summed; its memory peak is the larger one); `pop()` returns the totals and starts the
    next step from zero. CUDA is synchronized at both ends of a phase once CUDA is in use, and
    the allocator's peak counter is reset at the start of each phase, so the figures say which
    phase sets the run's peak (what limits batch size or sequence length).

    Phases nest: the trainer loop times `update`, a recipe times `logprob` inside it; the outer
    phase's time includes the inner one and its peak is the larger of both. `scope("eval/")`
    names the phases of a block with a prefix (`time/eval/rollout`), so an eval's rollout is not
    added to the training rollout's time. `peak_gib(phase)` reads a phase's peak of this step
    before `pop()` (rider-grm's swap plan decides from them).

    Each thread keeps its own totals: the rollout thread of an asynchronous run
    (`train.max_staleness`) times its phases apart from the trainer's, and `pop()` returns the
    calling thread's. Only the thread that made the timer reads memory peaks (the allocator's
    counters are per device).
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._owner = threading.get_ident()

    @property
    def _mine(self) -> _ThreadTimes:
        mine = getattr(self._local, "times", None)
        if mine is None:
            mine = self._local.times = _ThreadTimes()
        return mine

    @property
    def totals(self) -> dict[str, float]:
        return self._mine.totals

    @property
    def peaks(self) -> dict[str, float]:
        return self._mine.peaks

    @property
    def _prefix(self) -> str:
        return self._mine.prefix

    @_prefix.setter
    def _prefix(self, value: str) -> None:
        self._mine.prefix = value

    @property
    def _running(self) -> list[float]:
        return self._mine.running

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Name the phases entered inside the block `prefix + phase`."""
        before, self._prefix = self._prefix, self._prefix + prefix
        try:
            yield
        finally:
            self._prefix = before

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        phase = self._prefix + phase
        cuda = _cuda_sync() and threading.get_ident() == self._owner
        if cuda:
            if self._running:  # the enclosing phase's peak so far, before the counter is reset
                self._running[-1] = max(self._running[-1], torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        self._running.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            cuda = _cuda_sync() and threading.get_ident() == self._owner
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start
            inner = self._running.pop()
            if cuda:
                peak = max(inner, torch.cuda.max_memory_allocated() / 2**30)
                self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
                if self._running:
                    self._running[-1] = max(self._running[-1], peak)

    def peak_gib(self, phase: str) -> float | None:
        """The peak GiB of `phase` in this step so far (None: not entered, or no CUDA)."""
        return self.peaks.get(phase)

    def add(self, measured: Mapping[str, float]) -> None:
        """Add another thread's `pop()` (its `time/<phase>` seconds) to this thread's totals: the
        phases of a worker that scored while this thread sampled land in the step that used them."""
        for key, seconds in measured.items():
            if key.startswith("time/"):
                phase = key.removeprefix("time/")
                self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """`{"time/<phase>": seconds, "memory/<phase>_peak_gib": GiB}` since the last pop;
        resets the totals."""
        out = {f"time/{phase}": seconds for phase, seconds in self.totals.items()}
        out.update({f"memory/{phase}_peak_gib": gib for phase, gib in self.peaks.items()})
        self._mine.totals, self._mine.peaks = {}, {}
        return out


class CompileWatch:
    """What `torch.compile` did since the last `pop()`, in this whole process (every thread):
    `compile/graphs`, the graphs dynamo built (a first compile or a recompile: a new shape, a
    guard that failed), and `time/compile`, the seconds dynamo and inductor spent building them
    (inside whichever phase triggered it: update, logprob, rollout). A step much slower than its
    neighbours with `compile/graphs` > 0 recompiled; `TORCH_LOGS=recompiles` names the guard.
    Zeros until torch._dynamo is imported (nothing compiled)."""

    def __init__(self) -> None:
        self._last = self._totals()

    @staticmethod
    def _totals() -> tuple[int, float]:
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return 0, 0.0
        graphs = int(utils.counters["stats"]["unique_graphs"])
        seconds = float(sum(getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", ())))
        return graphs, seconds

    def pop(self) -> dict[str, float]:
        (graphs, seconds), (graphs0, seconds0) = self._totals(), self._last
        self._last = (graphs, seconds)
        return {"compile/graphs": float(graphs - graphs0), "time/compile": seconds - seconds0}
