"""Streaming readers over data files and Hugging Face datasets.

Every reader returns a :class:`Reader` — an iterable that converts one row at a time, so a
multi-GB file never sits in memory. Sources:

- a ``.jsonl`` / ``.parquet`` file (JSONL line by line, parquet by record batches), or a text
  manifest for OCR prompts;
- with ``rl-data[datasets]``: a ``datasets.Dataset``, ``IterableDataset``, a ``DatasetDict`` /
  ``IterableDatasetDict`` with ``split=``, or a directory written by ``save_to_disk``.

Every row, whatever its source, becomes the dict a JSONL line decodes to and goes through the
same converter (:mod:`rl_data.records`). A bad record raises :class:`~rl_data.errors.RecordError`
naming the file (or dataset and split), the line (JSONL/text, 1-based) or row (parquet and
datasets, 0-based) and the dotted field; with ``on_error="skip"`` it is counted in
``reader.stats`` instead (the first few are logged). Missing or unreadable *files* always raise.

>>> reader = read_caption_qa("examples/data/caption_qa_images.jsonl", on_error="skip")
>>> records = list(reader); reader.skipped
0
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import msgspec
import pyarrow.parquet as pq

from rl_data.errors import OnError, ReadStats, RecordError
from rl_data.layouts import ColumnMap, Kind, tidy_arrow_row
from rl_data.records import (
    CaptionQARecord,
    FieldError,
    JudgeRecord,
    OCRPrompt,
    PreferenceRecord,
    PromptRecord,
    caption_qa_from_row,
    judge_from_row,
    ocr_prompt_from_row,
    preference_from_row,
    prompt_from_row,
)

__all__ = [
    "FileRows",
    "Location",
    "Reader",
    "Rows",
    "make_reader",
    "read_caption_qa",
    "read_judge_records",
    "read_ocr_prompts",
    "read_preferences",
    "read_prompts",
]

T = TypeVar("T")
Format = Literal["jsonl", "parquet", "lines"]
_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_decoder = msgspec.json.Decoder()


class Rows(Protocol):
    """Where a :class:`Reader` gets its rows: a file (:class:`FileRows`) or a dataset
    (:class:`rl_data.hf.DatasetRows`). Iterating yields ``(number, raw)`` — the line or row number
    that errors name, and the raw row that :meth:`decode` turns into a dict."""

    # Read-only members (properties), so that an implementation may narrow them: a file's
    # `path` is never None, a dataset's `unit` is always "row".
    @property
    def path(self) -> Path | None: ...
    @property
    def source(self) -> str: ...
    @property
    def split(self) -> str | None: ...
    @property
    def unit(self) -> Literal["line", "row"]: ...
    @property
    def arrow(self) -> bool: ...  # rows come out of Arrow (parquet, datasets): tidy_arrow_row applies
    @property
    def shard(self) -> tuple[int, int]: ...  # (rank, world_size) this source was cut to
    @property
    def num_rows(self) -> int | None: ...  # rows one pass reads, where known without reading them (progress bars)

    def __iter__(self) -> Iterator[tuple[int, Any]]: ...
    def decode(self, raw: Any) -> Any: ...
    def set_epoch(self, epoch: int) -> None: ...


class FileRows:
    """The rows of one data file.

    Args:
        path: the file.
        fmt: ``"jsonl"`` (rows are JSON objects), ``"parquet"`` or ``"lines"`` (rows are
            stripped non-blank text lines).
        batch_size: parquet rows decoded at once.
    """

    split = None
    shard = (0, 1)

    def __init__(self, path: str | Path, fmt: Format, *, batch_size: int = 1024) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        self.fmt = fmt
        self.batch_size = batch_size
        self.source = str(self.path)
        self.unit: Literal["line", "row"] = "row" if fmt == "parquet" else "line"
        self.arrow = fmt == "parquet"
        self.num_rows = pq.ParquetFile(self.path).metadata.num_rows if fmt == "parquet" else None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self.fmt == "parquet":
            return self._parquet_rows()
        return self._jsonl_rows() if self.fmt == "jsonl" else self._text_rows()

    def decode(self, raw: Any) -> Any:
        if self.fmt == "lines":
            try:
                return raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise ValueError(f"not valid UTF-8 (byte {exc.start} of the line: {exc.reason}); "
                                 "save the file as UTF-8") from None
        if self.fmt != "jsonl":
            return raw
        try:
            return _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None

    def set_epoch(self, epoch: int) -> None:
        """Files are read in their order every epoch."""

    def _jsonl_rows(self) -> Iterator[tuple[int, Any]]:
        """(1-based line, raw line bytes) for every non-blank line."""
        with self.path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line

    def _parquet_rows(self) -> Iterator[tuple[int, Any]]:
        """(0-based row, row dict), one record batch in memory at a time."""
        row = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch_size):
            for item in batch.to_pylist():
                yield row, item
                row += 1

    def _text_rows(self) -> Iterator[tuple[int, Any]]:
        """(1-based line, raw line bytes) for every non-blank line: `decode` makes it text, so a
        line that is not UTF-8 is a bad record naming its line, not an error mid-file."""
        with self.path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                if line.decode("utf-8", errors="replace").strip():
                    yield number, line


class Location(NamedTuple):
    """Where a record came from (`path` is None for an in-memory dataset)."""

    path: Path | None
    line: int
    unit: Literal["line", "row"]


class Reader(Generic[T]):
    """An iterable over the records of one source. Each pass re-reads it and resets ``stats``.

    Args:
        rows: the source (:class:`FileRows` or :class:`rl_data.hf.DatasetRows`).
        convert: row -> record; raises FieldError (or ValueError) for a bad row.
        columns: moves the source's columns onto our field names (see :mod:`rl_data.layouts`).
        on_error: ``"raise"`` stops at the first bad record; ``"skip"`` counts it and goes on —
            pick skip for large scraped sets where a few bad rows are expected, raise otherwise.
    """

    def __init__(
        self,
        rows: Rows,
        convert: Callable[[Any], T],
        *,
        columns: ColumnMap,
        on_error: OnError = "raise",
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.rows = rows
        self.columns = columns
        self.on_error = on_error
        self._convert = convert
        self.stats = ReadStats()

    @property
    def path(self) -> Path | None:
        """The data file or dataset directory (None for a dataset object or a Hub id)."""
        return self.rows.path

    @property
    def skipped(self) -> int:
        """Bad records skipped in the current (or last) pass."""
        return self.stats.skipped

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to a shuffled ``IterableDataset`` (its order is seeded by
        ``seed + epoch``); files and map-style datasets keep their order."""
        self.rows.set_epoch(epoch)

    def _error(self, line: int, field: str | None, reason: str, raw_row: Any = None) -> RecordError:
        rows = self.rows
        return RecordError(rows.path, line, self.columns.source_field(field, raw_row), reason,
                           unit=rows.unit, split=rows.split, source=rows.source)

    def _record(self, line: int, raw: Any) -> T:
        try:
            row = self.rows.decode(raw)
        except ValueError as exc:
            raise self._error(line, None, str(exc)) from None
        mapped = self.columns.apply(row)
        if self.rows.arrow:
            mapped = tidy_arrow_row(mapped, self.columns.kind)
        try:
            return self._convert(mapped)
        except FieldError as exc:
            raise self._error(line, exc.field, exc.reason, row) from None

    def records(self, start: int = 0) -> Iterator[tuple[int, T]]:
        """``(ordinal, record)`` for the rows from ordinal ``start`` on (ordinals count every row
        read, good or bad, from 0). The rows before ``start`` are read but not converted — how
        :class:`~rl_data.sampler.GroupStream` resumes."""
        self.stats = ReadStats()
        for ordinal, (line, raw) in enumerate(itertools.islice(self.rows, start, None), start):
            try:
                record = self._record(line, raw)
            except RecordError as exc:
                if self.on_error == "raise":
                    raise
                self.stats.record_skip(exc)
                continue
            self.stats.read += 1
            yield ordinal, record

    def __iter__(self) -> Iterator[T]:
        for _, record in self.records():
            yield record

    def located(self) -> Iterator[tuple[Location, T]]:
        """Each record with where it came from, for a record that fails later (its media do not
        decode, say): `RecordError(loc.path, loc.line, None, reason, unit=loc.unit)` then names
        the same file and line as a record that fails to parse."""
        self.stats = ReadStats()
        for line, raw in self.rows:
            try:
                record = self._record(line, raw)
            except RecordError as exc:
                if self.on_error == "raise":
                    raise
                self.stats.record_skip(exc)
                continue
            self.stats.read += 1
            yield Location(self.rows.path, line, self.rows.unit), record


# ----------------------------------------------------------------------------- sources


def _format_of(path: Path, allowed: tuple[Format, ...]) -> Format:
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt not in allowed:
        names = sorted(s for s, f in _SUFFIXES.items() if f in allowed)
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {names}")
    return fmt  # type: ignore[return-value]


def _is_dataset(source: Any) -> bool:
    """A ``datasets`` object, checked without importing ``datasets`` (it cannot be one unless
    its module was imported)."""
    return type(source).__module__.split(".")[0] == "datasets"


def _open_rows(
    source: Any,
    *,
    allowed: tuple[Format, ...],
    split: str | None,
    rank: int,
    world_size: int,
) -> tuple[Rows, Path | None]:
    """The rows of ``source`` and its default media root (a file's or dataset directory's)."""
    if _is_dataset(source) or (isinstance(source, str | Path) and Path(source).is_dir()):
        from rl_data.hf import dataset_rows

        rows = dataset_rows(source, split=split, rank=rank, world_size=world_size)
        return rows, rows.path.resolve() if rows.path is not None else None
    if not isinstance(source, str | Path):
        raise TypeError(f"expected a file path, a dataset directory or a datasets object, "
                        f"got {type(source).__name__}")
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if split is not None or world_size != 1:
        raise ValueError(f"{path}: split= and rank=/world_size= apply to datasets; a file has no "
                         f"splits, and GroupSampler(rank=, world_size=) shards its records")
    lines = "lines" in allowed and path.suffix.lower() not in _SUFFIXES
    fmt = "lines" if lines else _format_of(path, allowed)
    return FileRows(path, fmt), path.parent.resolve()


_CONVERTERS: dict[Kind, Callable[[Any], Any]] = {
    "judge": judge_from_row,
    "prompts": prompt_from_row,
}
# kinds whose rows hold media paths, resolved against a media root
MEDIA_CONVERTERS: dict[Kind, Callable[..., Any]] = {
    "caption_qa": caption_qa_from_row,
    "preference": preference_from_row,
    "ocr": ocr_prompt_from_row,
}
ALLOWED: dict[Kind, tuple[Format, ...]] = {
    "caption_qa": ("jsonl", "parquet"),
    "judge": ("jsonl", "parquet"),
    "prompts": ("jsonl", "parquet"),
    "ocr": ("lines", "jsonl", "parquet"),  # any other file: a manifest of lines
    "preference": ("jsonl", "parquet"),
}


def make_reader(
    kind: Kind,
    rows: Rows,
    *,
    mapping: Mapping[str, str] | None = None,
    media_root: str | Path | None = None,
    on_error: OnError = "raise",
) -> Reader[Any]:
    """The :class:`Reader` of ``kind`` records over ``rows`` (``media_root`` is for the kinds
    with media: caption QA and preference pairs)."""
    columns = ColumnMap(kind, mapping)
    if mapping and isinstance(rows, FileRows) and rows.fmt == "lines":
        raise ValueError(f"{rows.path}: a text manifest has no columns to map")
    convert = _CONVERTERS.get(kind) or partial(MEDIA_CONVERTERS[kind], media_root=media_root)
    return Reader(rows, convert, columns=columns, on_error=on_error)


def _read(kind: Kind, source: Any, split: str | None, mapping: Mapping[str, str] | None,
          media_root: str | Path | None, rank: int, world_size: int, on_error: OnError) -> Reader[Any]:
    ColumnMap(kind, mapping)  # a bad mapping fails before any data is opened
    rows, root = _open_rows(source, allowed=ALLOWED[kind], split=split, rank=rank,
                            world_size=world_size)
    return make_reader(kind, rows, mapping=mapping, on_error=on_error,
                       media_root=media_root if media_root is not None else root)


def read_caption_qa(
    source: Any,
    *,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    media_root: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[CaptionQARecord]:
    """CapRL caption-QA rows (``.jsonl``, ``.parquet`` or a dataset) as :class:`CaptionQARecord`.

    Relative ``image`` / ``videos`` paths are resolved against ``media_root`` (default: the
    directory of the file, or the ``save_to_disk`` directory; a dataset object keeps its paths
    as they are), so a dataset directory can be moved as a whole. Images stored as bytes stay
    bytes until :func:`~rl_data.media.load_image` decodes them. ``split``, ``mapping``, ``rank``
    and ``world_size`` are as in :func:`read_prompts`.
    """
    return _read("caption_qa", source, split, mapping, media_root, rank, world_size, on_error)


def read_preferences(
    source: Any,
    *,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    media_root: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[PreferenceRecord]:
    """Preference pairs for offline Diffusion-DPO as :class:`PreferenceRecord` (``prompt``,
    ``chosen``, ``rejected``: two images or two videos), from ``.jsonl``, ``.parquet`` or a
    dataset; Pick-a-Pic's layout (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``) is read as it
    is, with ties refused (see :func:`~rl_data.records.preference_from_row`).

    Relative media paths resolve against ``media_root`` as in :func:`read_caption_qa`; images
    stored as bytes stay bytes. ``split``, ``mapping`` (onto ``prompt``, ``chosen``,
    ``rejected``), ``rank`` and ``world_size`` are as in :func:`read_prompts`.
    """
    return _read("preference", source, split, mapping, media_root, rank, world_size, on_error)


def read_judge_records(
    source: Any,
    *,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[JudgeRecord]:
    """verl-style generative-judge rows (``prompt``, ``rm_prompt_{i}``,
    ``reward_model.ground_truth``, ``extra_info``) from ``.parquet``, ``.jsonl`` or a dataset.
    Arguments as in :func:`read_prompts`."""
    return _read("judge", source, split, mapping, None, rank, world_size, on_error)


def read_ocr_prompts(
    source: Any,
    *,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    media_root: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[OCRPrompt]:
    """Flow-GRPO OCR prompts: a manifest file (one prompt per line, any suffix but ``.jsonl`` /
    ``.parquet``, UTF-8, blank lines skipped), or rows (``.jsonl``, ``.parquet``, a dataset) with a
    ``prompt`` or ``text`` column and at most one of ``image`` / ``video``: the path of the picture
    the sample starts from (relative paths joined to ``media_root``, default the file's directory).
    The target is the text between the first pair of double quotes. Arguments as in
    :func:`read_prompts`."""
    return _read("ocr", source, split, mapping, media_root, rank, world_size, on_error)


def read_prompts(
    source: Any,
    *,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[PromptRecord]:
    """Plain prompt rows ``{"prompt": str | messages, ...free fields}`` (TRL's prompt-only
    layout) from ``.jsonl``, ``.parquet`` or a dataset.

    Args:
        source: a file, a ``save_to_disk`` directory, or a ``datasets`` object.
        split: which split of a ``DatasetDict`` (or a directory holding one) to read.
        mapping: ``{our_field: their_column}`` for datasets that name columns differently.
        rank / world_size: read only this rank's shard of a dataset (contiguous rows of a
            ``Dataset``, ``split_dataset_by_node`` of an ``IterableDataset``); pick it when each
            process should read only its part. Files are not sharded: use
            ``GroupSampler(rank=, world_size=)`` over their records.
        on_error: ``"raise"`` or ``"skip"`` (see :class:`Reader`).
    """
    return _read("prompts", source, split, mapping, None, rank, world_size, on_error)
