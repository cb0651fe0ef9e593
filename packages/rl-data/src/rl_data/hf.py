"""Hugging Face ``datasets`` as a row source for the readers (``pip install "rl-data[datasets]"``).

A ``Dataset``, ``IterableDataset``, one split of a ``DatasetDict`` / ``IterableDatasetDict``, or a
``save_to_disk`` directory is read row by row with media decoding turned off, so an
``datasets.Image`` column yields ``{bytes, path}`` and a ``datasets.Video`` column
``{path, bytes}``: pixels are decoded only when :func:`~rl_data.media.load_image` /
:func:`~rl_data.media.sample_video` is called on the record. Each row then takes the path a JSONL
line takes (:class:`~rl_data.readers.Reader`).

Sharding: :func:`shard_by_rank` gives rank r a contiguous slice of a ``Dataset`` (sizes differ by
at most one) and ``datasets.distributed.split_dataset_by_node`` of an ``IterableDataset`` (whole
shards when ``n_shards`` divides by the world size, else every ``world_size``-th example), so the
shards of all ranks partition the data.

``datasets`` is imported only when one of these is used; the base install does not have it.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "DatasetRows",
    "dataset_rows",
    "is_dataset_dir",
    "load_hub_dataset",
    "require_datasets",
    "shard_bounds",
    "shard_by_rank",
]

INSTALL = 'pip install "rl-data[datasets]"; in a clone of the repository: uv sync --all-packages --extra datasets'


def require_datasets() -> ModuleType:
    """The ``datasets`` module, or ImportError with the install command."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"reading Hugging Face datasets needs the `datasets` extra: {INSTALL}") from exc
    return datasets


def is_dataset_dir(path: str | Path) -> bool:
    """True for a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    p = Path(path)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def shard_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank's contiguous shard: the first ``num_rows % world_size`` ranks get
    one row more (the split ``datasets`` makes for a map-style dataset)."""
    _check_rank(rank, world_size)
    size, extra = divmod(num_rows, world_size)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")


def shard_by_rank(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's part of ``dataset``; the parts of ranks ``0 … world_size-1`` are disjoint and
    cover it.

    A ``Dataset`` is cut into contiguous slices (:func:`shard_bounds`; no rows are copied). An
    ``IterableDataset`` goes through ``datasets.distributed.split_dataset_by_node``: whole shards
    per rank when ``n_shards % world_size == 0`` (fast: each rank opens only its files), else each
    rank keeps every ``world_size``-th example (every rank reads everything). Shuffle an iterable
    dataset with a fixed ``seed`` *before* sharding so all ranks agree on the shard order.
    """
    datasets = require_datasets()
    _check_rank(rank, world_size)
    if isinstance(dataset, datasets.Dataset):
        start, end = shard_bounds(len(dataset), rank, world_size)
        return dataset.select(range(start, end) if end > start else [])  # datasets rejects range(n, n)
    if isinstance(dataset, datasets.IterableDataset):
        if world_size == 1:
            return dataset
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    raise TypeError(f"shard_by_rank takes a Dataset or an IterableDataset, got "
                    f"{type(dataset).__name__} (pick a split of a DatasetDict first)")


def _pick_split(obj: Any, split: str | None, source: str) -> tuple[Any, str | None]:
    """(dataset, split name) from a dataset or a dict of splits."""
    datasets = require_datasets()
    if isinstance(obj, datasets.DatasetDict | datasets.IterableDatasetDict):
        names = list(obj)
        if split is None and len(names) == 1:
            split = names[0]
        if split is None:
            raise ValueError(f"{source} holds the splits {names}: pass split= to pick one")
        if split not in obj:
            raise ValueError(f"{source} has no split {split!r}; its splits are {names}")
        return obj[split], split
    if not isinstance(obj, datasets.Dataset | datasets.IterableDataset):
        raise TypeError(f"expected a datasets Dataset, IterableDataset, DatasetDict or "
                        f"IterableDatasetDict, got {type(obj).__name__}")
    own = str(obj.split) if obj.split is not None else None
    if split is not None and own is not None and split != own:
        raise ValueError(f"{source} is the {own!r} split, not {split!r}")
    return obj, split or own


def _media_left_encoded(features: Any) -> Any:
    """``features`` with media decoding (``Image``, ``Video``, ``Audio``, …) turned off and
    ``Json`` decoding left on — ``IterableDataset.decode(False)`` would turn off both, and a
    ``Json`` column (what ``load_dataset("json")`` makes of mixed-type fields) would stay text."""
    datasets = require_datasets()
    features = copy.deepcopy(features)

    def visit(feature: Any) -> None:
        if isinstance(feature, dict):
            for value in feature.values():
                visit(value)
        elif isinstance(feature, list | tuple):
            for value in feature:
                visit(value)
        elif isinstance(feature, datasets.List | datasets.LargeList):
            visit(feature.feature)
        elif hasattr(feature, "decode") and not isinstance(feature, datasets.Json):
            feature.decode = False

    visit(features)
    return datasets.Features(dict(features))  # rebuilt: Features caches which columns decode


def _pil_to_media(value: Any) -> Any:
    """PIL images (in rows of an IterableDataset whose features are unknown, so decoding could
    not be turned off) -> ``{bytes, path}`` holding a lossless PNG, like ``datasets.Image``."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}
    if isinstance(value, dict):
        return {k: _pil_to_media(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_pil_to_media(v) for v in value]
    return value


class DatasetRows:
    """The rows of one dataset split (or this rank's shard of it), media left undecoded.

    Rows are numbered from 0 in the split for a ``Dataset`` (so rank 1's first row of a 10-row
    split over 2 ranks is row 5); for a sharded ``IterableDataset`` the number counts this rank's
    stream, and ``source`` says which rank.
    """

    unit: Literal["row"] = "row"
    arrow = True

    def __init__(
        self,
        dataset: Any,
        *,
        split: str | None,
        source: str,
        path: Path | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        datasets = require_datasets()
        _check_rank(rank, world_size)
        self.path, self.split, self.shard = path, split, (rank, world_size)
        self.offset, self.num_rows = 0, None
        if isinstance(dataset, datasets.Dataset):
            self.offset, end = shard_bounds(len(dataset), rank, world_size)
            self.num_rows = end - self.offset
            part = shard_by_rank(dataset, rank, world_size)
            self._iterable = part.to_iterable_dataset() if self.num_rows else None
        else:
            self._iterable = shard_by_rank(dataset, rank, world_size)
            if world_size > 1:
                source = f"{source} (rank {rank} of {world_size})"
        self.source = source
        self._raw = self._iterable is not None and self._iterable.features is None
        if self._iterable is not None and not self._raw:
            self._iterable = self._iterable.cast(_media_left_encoded(self._iterable.features))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._iterable is None:
            return iter(())
        return ((self.offset + i, row) for i, row in enumerate(self._iterable))

    def decode(self, raw: Any) -> Any:
        return _pil_to_media(raw) if self._raw else raw

    def set_epoch(self, epoch: int) -> None:
        """Reseeds a shuffled ``IterableDataset`` (``seed + epoch``); other orders are fixed."""
        if self._iterable is not None:
            self._iterable.set_epoch(epoch)


def dataset_rows(
    source: Any,
    *,
    split: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    name: str | None = None,
) -> DatasetRows:
    """:class:`DatasetRows` of a datasets object or a ``save_to_disk`` directory; ``name`` is what
    errors call an object (default: its type, e.g. ``Dataset``)."""
    datasets = require_datasets()
    path = None
    if isinstance(source, str | Path):
        path = Path(source)
        if not is_dataset_dir(path):
            raise FileNotFoundError(f"{path}: a directory, but not one written by save_to_disk "
                                    f"(no state.json or dataset_dict.json)")
        source, name = datasets.load_from_disk(str(path)), str(path)
    dataset, split = _pick_split(source, split, name or type(source).__name__)
    return DatasetRows(dataset, split=split, source=name or type(dataset).__name__, path=path,
                       rank=rank, world_size=world_size)


def load_hub_dataset(repo_id: str, *, split: str | None = None) -> Any:
    """``datasets.load_dataset(repo_id, split=split)``. With ``HF_DATASETS_OFFLINE=1`` (or
    ``HF_HUB_OFFLINE=1``) only a copy already in the local cache is used; a dataset that is not
    there raises FileNotFoundError naming the cache directory."""
    datasets = require_datasets()
    try:
        return datasets.load_dataset(repo_id, split=split)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        offline = " (offline mode: only the local cache is read)" if datasets.config.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"{repo_id!r} is not a file, not a save_to_disk directory, and could not be loaded as "
            f"a Hub dataset{offline}; cache: {datasets.config.HF_DATASETS_CACHE}. {exc}") from None
