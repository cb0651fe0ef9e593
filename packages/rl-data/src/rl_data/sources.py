"""One entry point for every place a data set can come from: :func:`open_source`.

An app that takes ``--data FILE`` passes the string here and gets records, whether it names a
JSONL/parquet file or OCR manifest, a ``save_to_disk`` directory, a ``datasets`` object, or a Hub
dataset id already in the local Hugging Face cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rl_data.errors import OnError
from rl_data.layouts import KINDS, Kind
from rl_data.readers import (
    MEDIA_CONVERTERS,
    Reader,
    make_reader,
    read_caption_qa,
    read_judge_records,
    read_ocr_prompts,
    read_preferences,
    read_prompts,
)

__all__ = ["open_source"]

# the readers share the keyword arguments open_source passes (the media kinds add media_root)
_READERS: dict[str, Callable[..., Reader[Any]]] = {
    "caption_qa": read_caption_qa,
    "judge": read_judge_records,
    "prompts": read_prompts,
    "ocr": read_ocr_prompts,
    "preference": read_preferences,
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FILE_SUFFIXES = {".jsonl", ".ndjson", ".parquet", ".txt", ".json", ".csv"}


def _is_hub_id(source: Any) -> bool:
    """A string that names no local path, looks like ``owner/name`` (or ``name``) and has no data
    file suffix — a typo in a file name stays a FileNotFoundError, not a Hub lookup."""
    return (isinstance(source, str) and not Path(source).exists() and bool(_REPO_ID.match(source))
            and Path(source).suffix.lower() not in _FILE_SUFFIXES)


def open_source(
    source: Any,
    *,
    kind: Kind,
    split: str | None = None,
    mapping: Mapping[str, str] | None = None,
    media_root: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: OnError = "raise",
) -> Reader[Any]:
    """The records of ``source`` as a :class:`~rl_data.readers.Reader` of ``kind``.

    Args:
        source: a data file (``.jsonl``/``.parquet``; any text file for ``kind="ocr"``), a
            ``save_to_disk`` directory, a ``datasets`` object, or a Hub id (``owner/name``) present
            in the local Hugging Face cache. Set ``HF_DATASETS_OFFLINE=1`` on machines that must
            not reach the Hub: a Hub id is then read from the cache or fails naming it.
        kind: ``"caption_qa"`` (CapRL++), ``"judge"`` (verl generative-judge), ``"prompts"``
            (TRL prompt-only), ``"ocr"`` (Flow-GRPO manifests) or ``"preference"``
            (Diffusion-DPO pairs, Pick-a-Pic).
        split, mapping, rank, world_size, on_error: as in :func:`~rl_data.readers.read_prompts`.
        media_root: caption QA, preference pairs and OCR rows only: the directory relative media paths are
            resolved against.

    Files and directories need nothing beyond the base install; datasets and Hub ids need
    ``pip install "rl-data[datasets]"``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {list(KINDS)}")
    if _is_hub_id(source):
        from rl_data.hf import dataset_rows, load_hub_dataset

        rows = dataset_rows(load_hub_dataset(source, split=split), split=split, rank=rank,
                            world_size=world_size, name=source)
        return make_reader(kind, rows, mapping=mapping, media_root=media_root, on_error=on_error)
    read = _READERS[kind]
    options: dict[str, Any] = {"media_root": media_root} if kind in MEDIA_CONVERTERS else {}
    if media_root is not None and kind not in MEDIA_CONVERTERS:
        raise ValueError(f"media_root applies to {', '.join(MEDIA_CONVERTERS)} records, not {kind}")
    return read(source, split=split, mapping=mapping, rank=rank, world_size=world_size,
                on_error=on_error, **options)
