"""Hugging Face datasets through the readers: every published layout reads to the same records as
the equivalent JSONL, bad rows name split/row/field, sharding partitions, media stay lazy."""

import base64
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from rl_data.errors import RecordError
from rl_data.hf import shard_bounds, shard_by_rank
from rl_data.media import load_image
from rl_data.readers import (
    read_caption_qa,
    read_judge_records,
    read_ocr_prompts,
    read_preferences,
    read_prompts,
)

datasets = pytest.importorskip("datasets")
from datasets import (  # noqa: E402
    Dataset,
    DatasetDict,
    Features,
    Image,
    IterableDataset,
    List,
    Sequence,
    Value,
    Video,
)

QA = [{"question": "Colour?", "choices": ["A) red", "B) blue"], "answer": "B"},
      {"question": "Shape?", "choices": ["circle", "square", "star"], "answer": "C"}]


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (4, 3), colour).save(buf, format="PNG")
    return buf.getvalue()


def _json_default(value):
    if isinstance(value, bytes):  # JSON holds image bytes base64-encoded, as HF datasets dumps them
        return base64.b64encode(value).decode()
    raise TypeError(type(value))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
    return path


def _video_rows(n):
    """CapRL++'s published video layout (internlm/CapRL-Video-QA-20K)."""
    return [{"prompt": [{"role": "user", "content": f"<video>\nDescribe clip {i} in order."}],
             "videos": [f"videos/clip_{i}.mp4"], "data_source": "video_caption_rl",
             "reward_model": {"style": "model", "ground_truth": QA}, "extra_info": {"index": i}}
            for i in range(n)]


def _forms(rows, tmp_path, features=None):
    """The same rows as each kind of datasets source, with the split each one is read as."""
    ds = Dataset.from_list(rows, features=features)
    DatasetDict({"train": ds, "test": ds}).save_to_disk(tmp_path / "dict_dir")
    ds.save_to_disk(tmp_path / "ds_dir")
    return {
        "Dataset": (ds, None),
        "IterableDataset": (ds.to_iterable_dataset(num_shards=2), None),
        "DatasetDict": (DatasetDict({"train": ds, "test": ds}), "test"),
        "save_to_disk dict": (str(tmp_path / "dict_dir"), "train"),
        "save_to_disk dataset": (tmp_path / "ds_dir", None),
    }


def test_caprl_video_layout_reads_as_jsonl_from_every_source(tmp_path):
    rows = _video_rows(5)
    expected = list(read_caption_qa(_jsonl(tmp_path / "d.jsonl", rows), media_root="/media"))
    assert expected[0].videos == ["/media/videos/clip_0.mp4"]
    assert [q.answer_letter for q in expected[0].qa] == ["B", "C"]
    for name, (source, split) in _forms(rows, tmp_path).items():
        got = list(read_caption_qa(source, split=split, media_root="/media"))
        assert got == expected, name


def test_caprl_images_as_datasets_image_stay_bytes_and_decode_to_file_pixels(tmp_path):
    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]
    for i, colour in enumerate(colours):
        (tmp_path / f"img_{i}.png").write_bytes(_png(colour))
    rows = [{"prompt": "<image> Describe.", "images": [_png(c)], "image": f"img_{i}.png",
             "reward_model": {"ground_truth": QA}} for i, c in enumerate(colours)]
    features = Features({"prompt": Value("string"), "images": List(Image()), "image": Image(),
                         "reward_model": {"ground_truth": List({
                             "question": Value("string"), "choices": List(Value("string")),
                             "answer": Value("string")})}})
    ds = Dataset.from_list(rows, features=features)
    assert isinstance(ds.select_columns("images")[0]["images"][0], PILImage.Image)  # datasets decodes
    records = list(read_caption_qa(ds, media_root=tmp_path))
    for i, record in enumerate(records):
        by_path, by_bytes = record.images  # `image` first, then `images`
        assert by_bytes.bytes == _png(colours[i]) and by_bytes.path is None  # not decoded yet
        assert by_path.path == str(tmp_path / f"img_{i}.png") and by_path.bytes is None
        from_file = np.asarray(load_image(tmp_path / f"img_{i}.png"))
        assert np.array_equal(np.asarray(load_image(by_bytes)), from_file)
        assert np.array_equal(np.asarray(load_image(by_path)), from_file)
    jsonl_rows = [{**r, "images": [{"bytes": r["images"][0]}]} for r in rows]
    assert records == list(read_caption_qa(_jsonl(tmp_path / "d.jsonl", jsonl_rows), media_root=tmp_path))


def test_pil_images_from_a_generator_without_features_become_png_bytes(tmp_path):
    def gen():
        for colour in [(1, 2, 3), (250, 128, 0)]:
            yield {"prompt": "<image> Describe.", "images": [PILImage.new("RGB", (4, 3), colour)],
                   "reward_model": {"ground_truth": QA}}

    ids = IterableDataset.from_generator(gen)
    assert ids.features is None  # so decoding cannot be turned off: rl-data re-encodes losslessly
    records = list(read_caption_qa(ids))
    assert [load_image(r.images[0]).getpixel((3, 2)) for r in records] == [(1, 2, 3), (250, 128, 0)]
    assert records[0].images[0].bytes.startswith(b"\x89PNG")


def test_video_feature_columns_give_paths_resolved_against_media_root(tmp_path):
    rows = _video_rows(2)
    ds = Dataset.from_list(rows).cast_column("videos", List(Video()))
    got = list(read_caption_qa(ds, media_root=tmp_path))
    assert [r.videos for r in got] == [[str(tmp_path / f"videos/clip_{i}.mp4")] for i in range(2)]
    no_path = Dataset.from_list([{**rows[0], "videos": [{"bytes": b"\x00\x01", "path": None}]}])
    with pytest.raises(RecordError) as info:
        list(read_caption_qa(no_path))
    assert (info.value.line, info.value.field) == (0, "videos[0]")
    assert "no path" in info.value.reason


def test_preference_pairs_as_datasets_image_and_video_read_as_jsonl_from_every_source(tmp_path):
    rows = [{"prompt": f"a shade of red {i}", "chosen": _png((200, i, 0)), "rejected": _png((100, i, 0)),
             "id": i} for i in range(3)]
    features = Features({"prompt": Value("string"), "chosen": Image(), "rejected": Image(), "id": Value("int64")})
    jsonl_rows = [{**r, "chosen": {"bytes": r["chosen"]}, "rejected": {"bytes": r["rejected"]}} for r in rows]
    expected = list(read_preferences(_jsonl(tmp_path / "d.jsonl", jsonl_rows)))
    assert expected[1].chosen.bytes == _png((200, 1, 0)) and expected[1].fields == {"id": 1}
    for name, (source, split) in _forms(rows, tmp_path, features).items():
        assert list(read_preferences(source, split=split)) == expected, name
    clips = Dataset.from_list([{"prompt": "a clip", "chosen": "a.mp4", "rejected": "b.mp4"}])
    clips = clips.cast_column("chosen", Video()).cast_column("rejected", Video())
    [record] = read_preferences(clips, media_root=tmp_path)
    assert (record.media, record.chosen, record.rejected) == ("video", str(tmp_path / "a.mp4"), str(tmp_path / "b.mp4"))


def test_pickapic_layout_refuses_ties_naming_split_row_and_column():
    """yuvalkirstain/pickapic_v2's columns: caption, jpg_0/jpg_1 (binary), label_0/label_1."""
    rows = [{"caption": f"prompt {i}", "jpg_0": _png((10 * i + 10, 0, 0)), "jpg_1": _png((0, 10 * i + 10, 0)),
             "label_0": label, "label_1": 1 - label, "best_image_uid": f"uid{i}"}
            for i, label in enumerate([0.0, 1.0, 0.5])]
    pickapic = DatasetDict({"train": Dataset.from_list(rows)})
    with pytest.raises(RecordError) as info:
        list(read_preferences(pickapic, split="train"))
    assert str(info.value).startswith("Dataset: split train: row 2: field `label_0`: a tie (0.5)")
    no_ties = pickapic["train"].filter(lambda r: r["label_0"] != 0.5)
    first, second = read_preferences(no_ties)
    assert (first.prompt, first.fields) == ("prompt 0", {"best_image_uid": "uid0"})
    assert load_image(first.chosen).getpixel((0, 0)) == (0, 10, 0)  # label_0 = 0: jpg_1 won
    assert load_image(second.chosen).getpixel((0, 0)) == (20, 0, 0)  # label_0 = 1: jpg_0 won


def _judge_rows(n):
    """verl's parquet layout with two judges (VeRL-with-RMs)."""
    return [{"data_source": "rider", "ability": "support",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
             "rm_prompt_0": "Rate {response}", "rm_prompt_1": "" if i % 2 else "Check {response}",
             "reward_model": {"style": "model", "ground_truth": f"answer {i}"},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_verl_parquet_layout_reads_as_the_parquet_file(tmp_path):
    rows = _judge_rows(6)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    expected = list(read_judge_records(tmp_path / "train.parquet"))
    assert expected[1].rm_prompts == ["Rate {response}", ""]
    assert expected == list(read_judge_records(_jsonl(tmp_path / "t.jsonl", rows)))
    for name, (source, split) in _forms(rows, tmp_path).items():
        assert list(read_judge_records(source, split=split)) == expected, name
    loaded = datasets.load_dataset("parquet", data_files={"train": str(tmp_path / "train.parquet")},
                                   cache_dir=str(tmp_path / "cache"))
    assert list(read_judge_records(loaded, split="train")) == expected


@pytest.mark.parametrize("prompt", ["Write a haiku.", [{"role": "user", "content": "Write a haiku."}]],
                         ids=["text", "messages"])
def test_trl_prompt_layouts_keep_their_other_columns(tmp_path, prompt):
    rows = [{"prompt": prompt, "solution": f"s{i}", "id": i} for i in range(3)]
    expected = list(read_prompts(_jsonl(tmp_path / "p.jsonl", rows)))
    assert expected[2].fields == {"solution": "s2", "id": 2}
    got = list(read_prompts(Dataset.from_list(rows)))
    assert got == expected


def test_flow_grpo_manifests_as_text_or_prompt_columns(tmp_path):
    manifest = tmp_path / "train.txt"
    manifest.write_text('A sign that says "OPEN"\n\nA mug with "TEA" on it\n')
    expected = list(read_ocr_prompts(manifest))
    text = datasets.load_dataset("text", data_files={"train": str(manifest)},
                                 cache_dir=str(tmp_path / "cache"))  # column `text`, one row per line
    assert list(read_ocr_prompts(text.filter(lambda r: r["text"].strip()), split="train")) == expected
    geneval_style = Dataset.from_list([{"prompt": p.prompt, "tag": "ocr"} for p in expected])
    assert list(read_ocr_prompts(geneval_style)) == expected
    bad = Dataset.from_list([{"text": "no quotes here"}])
    with pytest.raises(RecordError, match="row 0: field `text`: no text between"):
        list(read_ocr_prompts(bad))


def test_mapping_reads_other_column_names_and_errors_name_their_columns(tmp_path):
    rows = _video_rows(3)
    theirs = [{"instruction": r["prompt"], "clips": r["videos"],
               "meta": {"qa": r["reward_model"]["ground_truth"], "index": r["extra_info"]["index"]}}
              for r in rows]
    theirs[2]["meta"]["qa"] = [{**QA[0], "answer": "E"}]
    mapping = {"prompt": "instruction", "videos": "clips", "reward_model.ground_truth": "meta.qa"}
    reader = read_caption_qa(Dataset.from_list(theirs), mapping=mapping, media_root="/m", on_error="skip")
    got = list(reader)
    expected = list(read_caption_qa(_jsonl(tmp_path / "d.jsonl", rows[:2]), media_root="/m"))
    assert [(r.prompt, r.videos, r.qa) for r in got] == [(r.prompt, r.videos, r.qa) for r in expected]
    [error] = reader.stats.errors
    assert (error.line, error.field) == (2, "meta.qa[0].answer")
    with pytest.raises(ValueError, match=r"mapping target 'question' is not a caption_qa field"):
        read_caption_qa(Dataset.from_list(theirs), mapping={"question": "instruction"})


def test_arrow_artefacts_are_undone(tmp_path):
    """A legacy Sequence of structs comes back as a struct of lists, and Arrow gives every chat
    content part every key of every other part; both read as the JSONL does."""
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
             "images": ["a.png"], "reward_model": {"ground_truth": QA}}]
    expected = list(read_caption_qa(_jsonl(tmp_path / "d.jsonl", rows), media_root="/m"))
    assert expected[0].prompt[0].content == [{"type": "image"}, {"type": "text", "text": "Describe."}]
    legacy = Features({
        "prompt": List({"role": Value("string"),
                        "content": List({"type": Value("string"), "text": Value("string")})}),
        "images": List(Value("string")),
        "reward_model": {"ground_truth": Sequence({"question": Value("string"),
                                                   "choices": List(Value("string")),
                                                   "answer": Value("string")})}})
    stacked = {k: [q[k] for q in QA] for k in QA[0]}  # how a Sequence of structs is stored
    ds = Dataset.from_list([{**rows[0], "reward_model": {"ground_truth": stacked}}], features=legacy)
    assert ds[0]["reward_model"]["ground_truth"] == stacked
    assert ds[0]["prompt"][0]["content"][0] == {"type": "image", "text": None}
    assert list(read_caption_qa(ds, media_root="/m")) == expected


@pytest.mark.parametrize("form", ["Dataset", "IterableDataset", "DatasetDict", "save_to_disk dict"])
def test_bad_rows_name_split_row_and_field(tmp_path, form):
    rows = _video_rows(5)
    rows[3]["reward_model"] = {"ground_truth": [QA[0], {**QA[1], "answer": "D"}]}
    source, split = _forms(rows, tmp_path)[form]
    with pytest.raises(RecordError) as info:
        list(read_caption_qa(source, split=split))
    error = info.value
    assert (error.split, error.line, error.unit) == (split, 3, "row")
    assert error.field == "reward_model.ground_truth[1].answer"
    message = str(error)
    assert f"split {split}: row 3" in message if split else "row 3: field" in message
    assert "field `reward_model.ground_truth[1].answer`: answer 'D' matches no option" in message
    if form == "save_to_disk dict":
        assert error.path == tmp_path / "dict_dir" and message.startswith(f"{tmp_path / 'dict_dir'}: split train")
    reader = read_caption_qa(source, split=split, on_error="skip")
    assert len(list(reader)) == 4 and reader.skipped == 1 and reader.stats.errors[0].line == 3


def test_dataset_source_errors(tmp_path):
    ds = Dataset.from_list(_video_rows(2))
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]: pass split="):
        read_caption_qa(DatasetDict({"train": ds, "test": ds}))
    with pytest.raises(ValueError, match=r"has no split 'dev'; its splits are \['train'\]"):
        read_caption_qa(DatasetDict({"train": ds}), split="dev")
    with pytest.raises(ValueError, match="is the 'train' split, not 'test'"):
        read_caption_qa(Dataset.from_list(_video_rows(2), split="train"), split="test")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="not one written by save_to_disk"):
        read_caption_qa(tmp_path / "plain")
    path = _jsonl(tmp_path / "d.jsonl", _video_rows(2))
    with pytest.raises(ValueError, match="split= and rank=/world_size= apply to datasets"):
        read_caption_qa(path, split="train")


def _shard_prompts(source, world_size):
    return [[r.fields["id"] for r in read_prompts(source, rank=r, world_size=world_size)]
            for r in range(world_size)]


@pytest.mark.parametrize("form", ["Dataset", "IterableDataset 1 shard", "IterableDataset 2 shards"])
def test_two_ranks_partition_the_data_exactly(form):
    rows = [{"prompt": f"p{i}", "id": i} for i in range(7)]
    ds = Dataset.from_list(rows)
    source = {"Dataset": ds,
              "IterableDataset 1 shard": IterableDataset.from_generator(lambda: iter(rows)),
              "IterableDataset 2 shards": ds.to_iterable_dataset(num_shards=2)}[form]
    rank0, rank1 = _shard_prompts(source, 2)
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == list(range(7))
    assert abs(len(rank0) - len(rank1)) <= 1
    if form == "Dataset":
        assert (rank0, rank1) == ([0, 1, 2, 3], [4, 5, 6])  # contiguous, first rank one longer


def test_dataset_shards_name_rows_of_the_whole_split():
    rows = [{"prompt": f"p{i}", "id": i} for i in range(7)]
    rows[5]["prompt"] = ""
    with pytest.raises(RecordError, match="row 5: field `prompt`: empty prompt"):
        list(read_prompts(Dataset.from_list(rows), rank=1, world_size=2))
    ids = Dataset.from_list(rows).to_iterable_dataset()
    with pytest.raises(RecordError, match=r"IterableDataset \(rank 1 of 2\): row 2: field `prompt`"):
        list(read_prompts(ids, rank=1, world_size=2))  # the third row of rank 1's stream


def test_shard_by_rank_and_bounds():
    ds = Dataset.from_list([{"x": i} for i in range(5)])
    assert [shard_bounds(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert shard_by_rank(ds, 2, 3)["x"] == [4]
    assert [r["x"] for r in shard_by_rank(ds.to_iterable_dataset(), 1, 2)] == [1, 3]
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        shard_by_rank(ds, 3, 3)
    with pytest.raises(TypeError, match="pick a split of a DatasetDict first"):
        shard_by_rank(DatasetDict({"train": ds}), 0, 2)
    assert list(read_prompts(Dataset.from_list([{"prompt": "a"}]), rank=1, world_size=2)) == []
