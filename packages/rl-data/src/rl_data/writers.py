"""Records back to rows in our file formats: what ``rl-data convert`` writes.

A written file reads back through the readers to the same records (the normalized choice
letters are written as ``"A. text"`` with the answer as that letter; media paths are written
resolved). JSONL holds image bytes base64-encoded, as the reader expects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from rl_data.layouts import Kind
from rl_data.records import (
    CaptionQARecord,
    ImageSource,
    JudgeRecord,
    OCRPrompt,
    PreferenceRecord,
    PromptRecord,
)

__all__ = ["OUTPUT_SUFFIXES", "RecordWriter", "caption_qa_row", "judge_row", "preference_row", "prompt_row"]

# kind -> file suffixes it can be written to
OUTPUT_SUFFIXES: dict[Kind, tuple[str, ...]] = {
    "caption_qa": (".jsonl", ".parquet"),
    "judge": (".jsonl", ".parquet"),
    "prompts": (".jsonl", ".parquet"),
    "ocr": (".txt",),
    "preference": (".jsonl", ".parquet"),
}


def caption_qa_row(record: CaptionQARecord) -> dict[str, Any]:
    """A :class:`CaptionQARecord` as a CapRL row."""
    row: dict[str, Any] = {
        "prompt": msgspec.to_builtins(record.prompt),
        "reward_model": {"ground_truth": [
            {"question": q.question, "choices": [f"{c.letter}. {c.text}" for c in q.choices],
             "answer": q.answer_letter} for q in record.qa]},
        "data_source": record.data_source,
    }
    if record.images:
        row["images"] = [{"bytes": im.bytes, "path": im.path} for im in record.images]
    if record.videos:
        row["videos"] = list(record.videos)
    if record.extra_info:  # parquet cannot store a struct with no field
        row["extra_info"] = record.extra_info
    return row


def judge_row(record: JudgeRecord) -> dict[str, Any]:
    """A :class:`JudgeRecord` as a verl generative-judge row."""
    row: dict[str, Any] = {"prompt": msgspec.to_builtins(record.prompt)}
    row.update({f"rm_prompt_{i}": t for i, t in enumerate(record.rm_prompts)})
    row["reward_model"] = {"ground_truth": record.ground_truth}
    row["data_source"] = record.data_source
    if record.extra_info:
        row["extra_info"] = record.extra_info
    return row


def prompt_row(record: PromptRecord) -> dict[str, Any]:
    """A :class:`PromptRecord` as a prompt row (its other fields next to ``prompt``)."""
    return {"prompt": msgspec.to_builtins(record.prompt), **record.fields}


def _media_row(member: ImageSource | str) -> dict[str, Any]:
    """An image or a video path as ``{bytes, path}``: one struct type for a parquet column
    whatever the pair holds (the reader tells a video by its path's suffix)."""
    if isinstance(member, str):
        return {"bytes": None, "path": member}
    return {"bytes": member.bytes, "path": member.path}


def preference_row(record: PreferenceRecord) -> dict[str, Any]:
    """A :class:`PreferenceRecord` as a ``{prompt, chosen, rejected}`` row (its other fields
    after them)."""
    return {"prompt": record.prompt, "chosen": _media_row(record.chosen),
            "rejected": _media_row(record.rejected), **record.fields}


def ocr_line(record: Any) -> str:
    """An OCR manifest line: the prompt alone (a prompt that starts from a picture has no line)."""
    if record.media is not None:
        raise ValueError(f"{record.prompt!r} starts from {record.media}: a text manifest cannot hold it")
    return record.prompt


_ROWS: dict[Kind, Callable[[Any], Any]] = {
    "caption_qa": caption_qa_row,
    "judge": judge_row,
    "prompts": prompt_row,
    "ocr": ocr_line,
    "preference": preference_row,
}


class RecordWriter:
    """Writes records of ``kind`` to ``path``: JSONL line by line, an OCR manifest line by line,
    parquet at :meth:`close` (the table is held in memory until then — write JSONL for data
    larger than memory). Use as a context manager."""

    def __init__(self, path: str | Path, kind: Kind) -> None:
        self.path, self.kind = Path(path), kind
        suffix = self.path.suffix.lower()
        if suffix not in OUTPUT_SUFFIXES[kind]:
            raise ValueError(f"{self.path}: {kind} records are written to "
                             f"{' or '.join(OUTPUT_SUFFIXES[kind])} files, not {suffix or 'no suffix'!r}")
        self._to_row = _ROWS[kind]
        self._parquet: list[dict[str, Any]] | None = [] if suffix == ".parquet" else None
        self._file = None if self._parquet is not None else self.path.open("wb")
        self._encoder = msgspec.json.Encoder()
        self.written = 0

    def write(self, record: CaptionQARecord | JudgeRecord | PromptRecord | OCRPrompt | PreferenceRecord) -> None:
        row = self._to_row(record)
        if self._parquet is not None:
            self._parquet.append(row)
        else:
            assert self._file is not None
            self._file.write(row.encode() if isinstance(row, str) else self._encoder.encode(row))
            self._file.write(b"\n")
        self.written += 1

    def write_all(self, records: Iterable[Any]) -> int:
        for record in records:
            self.write(record)
        return self.written

    def close(self) -> None:
        if self._parquet is not None:
            pq.write_table(pa.Table.from_pylist(self._parquet), self.path)
            self._parquet = None
        elif self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
