"""open_source: the one call an app makes for a file, a save_to_disk directory or a cached Hub id."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_data.errors import RecordError
from rl_data.sources import open_source

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "rm_prompt_0": "Rate {response}",
         "reward_model": {"ground_truth": f"a{i}"}, "extra_info": {"index": i}} for i in range(4)]


def _cache_hub_dataset(cache, repo_id, splits):
    """Lay out ``splits`` in the datasets cache the way ``load_dataset(repo_id)`` leaves a Hub
    dataset there (``owner___name/default/0.0.0/<commit>/name-<split>.arrow``), without a network."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo_id.split("/")
    files = {}
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), cache / f"{split}.parquet")
        files[split] = [str(cache / f"{split}.parquet")]
    builder = Parquet(cache_dir=str(cache / "build"), dataset_name=name, hash="0" * 40,
                      data_files=DataFilesDict.from_patterns(files))
    builder.download_and_prepare()
    [built] = (cache / "build" / name).glob("default-*")
    (cache / f"{owner}___{name}").mkdir()
    built.rename(cache / f"{owner}___{name}" / "default")


def test_hub_id_is_read_from_the_offline_cache(tmp_path, monkeypatch):
    assert datasets.config.HF_HUB_OFFLINE  # HF_DATASETS_OFFLINE=1 (conftest): the cache only
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    bad = [*ROWS[:2], {**ROWS[2], "prompt": []}]
    _cache_hub_dataset(tmp_path, "rider/support-judge", {"train": ROWS, "test": bad})
    records = list(open_source("rider/support-judge", kind="judge", split="train"))
    assert [r.ground_truth for r in records] == ["a0", "a1", "a2", "a3"]
    with pytest.raises(RecordError) as info:
        list(open_source("rider/support-judge", kind="judge", split="test"))
    assert str(info.value) == "rider/support-judge: split test: row 2: field `prompt`: empty message list"
    with pytest.raises(FileNotFoundError, match=r"'rider/other' is not a file.*offline mode"):
        open_source("rider/other", kind="judge", split="train")


def test_files_directories_and_objects_give_the_same_records(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    expected = list(open_source(path, kind="judge"))
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(tmp_path / "train_dir")
    assert list(open_source(str(tmp_path / "train_dir"), kind="judge")) == expected
    assert list(open_source(ds, kind="judge", rank=0, world_size=1)) == expected
    halves = [list(open_source(ds, kind="judge", rank=r, world_size=2)) for r in range(2)]
    assert halves[0] + halves[1] == expected


def test_missing_files_are_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    called = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: called.append(a))
    with pytest.raises(FileNotFoundError, match=r"data file not found: train\.jsonl"):
        open_source("train.jsonl", kind="judge")
    with pytest.raises(FileNotFoundError, match="data file not found"):
        open_source(os.path.join("data", "train", "x"), kind="prompts")
    assert called == []


def test_open_source_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'captions'"):
        open_source("x.jsonl", kind="captions")  # type: ignore[arg-type]
    manifest = tmp_path / "ocr.txt"
    manifest.write_text('A sign that says "OPEN"\n')
    assert [p.target for p in open_source(manifest, kind="ocr")] == ["OPEN"]
    with pytest.raises(ValueError, match="media_root applies to caption_qa"):
        open_source(manifest, kind="prompts", media_root=tmp_path)
    with pytest.raises(ValueError, match="a text manifest has no columns to map"):
        open_source(manifest, kind="ocr", mapping={"prompt": "text"})


def test_open_source_reads_preference_pairs_with_a_media_root(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a cat", "chosen": "a.png", "rejected": "b.png"}) + "\n")
    [default] = open_source(path, kind="preference")
    [moved] = open_source(path, kind="preference", media_root="/media")
    assert (default.chosen.path, moved.chosen.path) == (str(tmp_path / "a.png"), "/media/a.png")
    with pytest.raises(ValueError, match="media_root applies to caption_qa, preference, ocr records, not judge"):
        open_source(path, kind="judge", media_root="/media")
