"""Sample logs (`samples/*.jsonl` in a run directory): one JSON object per line, each with the
`step` it belongs to, written by the main process only.

On resume, `SampleLog(path, start_step=k)` first drops the lines an interrupted run wrote after
step k (the checkpoint it resumes from), so the file reads as one uninterrupted run, like
`metrics.csv` (`MetricsLogger`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["SampleLog", "trim_jsonl"]


def trim_jsonl(path: Path, start_step: int) -> None:
    """Keep the lines of `path` whose `step` is at most `start_step` (atomically rewritten)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= start_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class SampleLog:
    """Appends `{"step": step, **row}` lines to `run_dir/samples/<name>.jsonl`.

    `start_step` (resume): every existing `samples/*.jsonl` of the run is cut back to it first,
    and files named for a later step (`eval-step-000012.jsonl`) are removed."""

    def __init__(self, run_dir: str | os.PathLike[str], *, main: bool = True, start_step: int = 0) -> None:
        self.dir = Path(run_dir) / "samples"
        self.main = main
        self.pending: dict[str, list[dict[str, Any]]] = {}  # rows written since the last `pop`, by file name
        if main and self.dir.is_dir():
            for path in self.dir.glob("*.jsonl"):
                stamp = path.stem.rpartition("-step-")[2]
                if stamp.isdigit() and int(stamp) > start_step:
                    path.unlink()
                else:
                    trim_jsonl(path, start_step)

    def write(self, name: str, step: int, rows: Iterable[Mapping[str, Any]], *, track: bool = True) -> None:
        """Append `rows` to `samples/<name>.jsonl`; `track=False`: the file only, not the
        trackers' tables (`pop`)."""
        if not self.main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        written = self.pending.setdefault(name, []) if track else []
        with (self.dir / f"{name}.jsonl").open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False, default=str) + "\n")
                written.append(dict(row))

    def pop(self) -> dict[str, list[dict[str, Any]]]:
        """The rows written since the last call, by file name (the trainer loop sends them to the
        trackers that show tables: wandb's tables, tensorboard's text tab)."""
        rows, self.pending = self.pending, {}
        return rows
