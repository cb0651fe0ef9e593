"""The error every reader raises for a bad record, and the counters of a skipping reader."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["OnError", "ReadStats", "RecordError"]

OnError = Literal["raise", "skip"]
logger = logging.getLogger("rl_data")


class RecordError(ValueError):
    """A record that cannot be read, located exactly.

    Attributes:
        path: the data file, or the ``save_to_disk`` directory of a dataset; None for a dataset
            object held in memory or a Hub id (``source`` then names it).
        line: 1-based line number for text files (JSONL, manifests); 0-based row index for
            parquet and datasets (``unit == "row"``), as pyarrow / pandas / ``ds[i]`` number rows.
        field: dotted path of the bad field (``reward_model.ground_truth[2].answer``), or None when
            the whole record is bad (e.g. a line that is not JSON). With a column ``mapping`` it is
            the caller's column name (``qa[2].answer``), not ours.
        reason: what is wrong and, where it helps, how to fix it.
        split: the dataset split (``"train"``), when the source is a dataset that names one.
        source: the printable name that starts the message (the path, a Hub id, ``Dataset``).
    """

    def __init__(
        self,
        path: str | Path | None,
        line: int,
        field: str | None,
        reason: str,
        *,
        unit: Literal["line", "row"] = "line",
        split: str | None = None,
        source: str | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.line = line
        self.field = field
        self.reason = reason
        self.unit = unit
        self.split = split
        self.source = source if source is not None else str(self.path)
        where = f"{self.source}: split {split}" if split else self.source
        where = f"{where}: {unit} {line}"
        super().__init__(f"{where}: field `{field}`: {reason}" if field else f"{where}: {reason}")


@dataclass
class ReadStats:
    """Counters of one pass over a file: ``read`` records yielded, ``skipped`` bad records, and the
    first ``max_kept`` errors (all are counted; the first few are also logged at WARNING)."""

    read: int = 0
    skipped: int = 0
    errors: list[RecordError] = field(default_factory=list)
    max_kept: int = 5

    def record_skip(self, error: RecordError) -> None:
        self.skipped += 1
        if len(self.errors) < self.max_kept:
            self.errors.append(error)
            logger.warning("skipping bad record: %s", error)
