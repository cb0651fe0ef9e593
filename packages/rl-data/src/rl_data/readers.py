"""Streaming readers: JSONL line by line, parquet by record batches, text manifests by line.

Every reader returns a :class:`Reader` — an iterable that converts one row at a time, so a
multi-GB file never sits in memory. A bad record raises :class:`~rl_data.errors.RecordError`
naming the file, the line (JSONL/text, 1-based) or row (parquet, 0-based) and the dotted field;
with ``on_error="skip"`` it is counted in ``reader.stats`` instead (the first few are logged).
Missing or unreadable *files* always raise.

>>> reader = read_caption_qa("examples/data/caption_qa_images.jsonl", on_error="skip")
>>> records = list(reader); reader.skipped
0
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import msgspec
import pyarrow.parquet as pq

from rl_data.errors import OnError, ReadStats, RecordError
from rl_data.records import (
    CaptionQARecord,
    FieldError,
    JudgeRecord,
    OCRPrompt,
    PromptRecord,
    caption_qa_from_row,
    judge_from_row,
    ocr_prompt_from_line,
    prompt_from_row,
)

__all__ = [
    "Location",
    "Reader",
    "read_caption_qa",
    "read_judge_records",
    "read_ocr_prompts",
    "read_prompts",
]

T = TypeVar("T")


class Location(NamedTuple):
    """Where a record came from: `RecordError(loc.path, loc.line, field, reason, unit=loc.unit)`."""

    path: Path
    line: int
    unit: Literal["line", "row"]

Format = Literal["jsonl", "parquet", "lines"]
_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_decoder = msgspec.json.Decoder()


def _format_of(path: Path, allowed: tuple[Format, ...]) -> Format:
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt not in allowed:
        names = sorted(s for s, f in _SUFFIXES.items() if f in allowed)
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {names}")
    return fmt  # type: ignore[return-value]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, raw line bytes) for every non-blank line."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def _parquet_rows(path: Path, batch_size: int) -> Iterator[tuple[int, Any]]:
    """(0-based row, row dict), one record batch in memory at a time."""
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for item in batch.to_pylist():
            yield row, item
            row += 1


def _text_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line.strip()


class Reader(Generic[T]):
    """An iterable over the records of one file. Each pass re-reads the file and resets ``stats``.

    Args:
        path: the data file.
        convert: row -> record; raises FieldError (or ValueError) for a bad row.
        fmt: ``"jsonl"`` (rows are JSON objects), ``"parquet"`` or ``"lines"`` (rows are stripped
            non-blank text lines).
        on_error: ``"raise"`` stops at the first bad record; ``"skip"`` counts it and goes on —
            pick skip for large scraped sets where a few bad rows are expected, raise otherwise.
        batch_size: parquet rows decoded at once.
    """

    def __init__(
        self,
        path: str | Path,
        convert: Callable[[Any], T],
        *,
        fmt: Format,
        on_error: OnError = "raise",
        batch_size: int = 1024,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        self.fmt = fmt
        self.on_error = on_error
        self._convert = convert
        self.batch_size = batch_size
        self.stats = ReadStats()

    @property
    def skipped(self) -> int:
        """Bad records skipped in the current (or last) pass."""
        return self.stats.skipped

    def _rows(self) -> Iterator[tuple[int, Any]]:
        if self.fmt == "parquet":
            return _parquet_rows(self.path, self.batch_size)
        return _jsonl_rows(self.path) if self.fmt == "jsonl" else _text_rows(self.path)

    def _record(self, line: int, raw: Any) -> T:
        unit: Literal["line", "row"] = "row" if self.fmt == "parquet" else "line"
        try:
            row = _decoder.decode(raw) if self.fmt == "jsonl" else raw
        except msgspec.DecodeError as exc:
            raise RecordError(self.path, line, None, f"not valid JSON: {exc}", unit=unit) from None
        try:
            return self._convert(row)
        except FieldError as exc:
            raise RecordError(self.path, line, exc.field, exc.reason, unit=unit) from None

    def __iter__(self) -> Iterator[T]:
        for _, record in self.located():
            yield record

    def located(self) -> Iterator[tuple[Location, T]]:
        """Each record with where it came from, for a record that fails later (its media do not
        decode, say): `RecordError(*location, reason)` then names the same file and line."""
        self.stats = ReadStats()
        unit: Literal["line", "row"] = "row" if self.fmt == "parquet" else "line"
        for line, raw in self._rows():
            try:
                record = self._record(line, raw)
            except RecordError as exc:
                if self.on_error == "raise":
                    raise
                self.stats.record_skip(exc)
                continue
            self.stats.read += 1
            yield Location(self.path, line, unit), record


def read_caption_qa(
    path: str | Path,
    *,
    media_root: str | Path | None = None,
    on_error: OnError = "raise",
) -> Reader[CaptionQARecord]:
    """CapRL caption-QA rows (``.jsonl`` or ``.parquet``) as :class:`CaptionQARecord`.

    Relative ``image`` / ``videos`` paths are resolved against ``media_root`` (default: the
    directory of ``path``), so a dataset directory can be moved as a whole.
    """
    path = Path(path)
    root = Path(media_root) if media_root is not None else path.parent.resolve()
    fmt = _format_of(path, ("jsonl", "parquet"))
    return Reader(path, lambda row: caption_qa_from_row(row, media_root=root), fmt=fmt,
                  on_error=on_error)


def read_judge_records(path: str | Path, *, on_error: OnError = "raise") -> Reader[JudgeRecord]:
    """verl-style generative-judge rows (``prompt``, ``rm_prompt_{i}``,
    ``reward_model.ground_truth``, ``extra_info``) from ``.parquet`` or ``.jsonl``."""
    path = Path(path)
    return Reader(path, judge_from_row, fmt=_format_of(path, ("jsonl", "parquet")),
                  on_error=on_error)


def read_ocr_prompts(path: str | Path, *, on_error: OnError = "raise") -> Reader[OCRPrompt]:
    """Flow-GRPO OCR prompt manifest: one prompt per line (any suffix, UTF-8), blank lines
    skipped; the target is the text between the first pair of double quotes."""
    return Reader(path, ocr_prompt_from_line, fmt="lines", on_error=on_error)


def read_prompts(path: str | Path, *, on_error: OnError = "raise") -> Reader[PromptRecord]:
    """Plain prompt rows ``{"prompt": str | messages, ...free fields}`` from ``.jsonl`` or
    ``.parquet``, for custom apps."""
    path = Path(path)
    return Reader(path, prompt_from_row, fmt=_format_of(path, ("jsonl", "parquet")),
                  on_error=on_error)
