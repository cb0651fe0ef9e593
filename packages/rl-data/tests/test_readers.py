import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rl_data.errors import RecordError
from rl_data.media import load_image, sample_video
from rl_data.readers import (
    read_caption_qa,
    read_judge_records,
    read_ocr_prompts,
    read_preferences,
    read_prompts,
)

QA = [{"question": "Colour?", "choices": ["A. red", "B. blue"], "answer": "B"}]
GOOD = {"prompt": "<image> Describe.", "image": "img.png", "reward_model": {"ground_truth": QA}}


def _jsonl(path, lines):
    """Write lines; dicts are JSON-encoded, strings written verbatim (blank or broken lines)."""
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _error(reader) -> RecordError:
    with pytest.raises(RecordError) as info:
        list(reader)
    return info.value


def test_caption_reader_good_file_resolves_media_against_file_dir(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, "", {**GOOD, "image": "sub/b.png"}])
    records = list(read_caption_qa(path))
    assert [r.images[0].path for r in records] == [str(tmp_path / "img.png"),
                                                   str(tmp_path / "sub/b.png")]
    assert records[0].qa[0].answer_letter == "B"
    other = list(read_caption_qa(path, media_root="/media"))
    assert other[0].images[0].path == "/media/img.png"


BROKEN = [
    # (line content, field, words in the message)
    ('{"prompt": "x", "image": ', None, "not valid JSON"),
    ({"image": "a.png", "reward_model": {"ground_truth": QA}}, "prompt", "missing required field"),
    ({**GOOD, "reward_model": {"ground_truth": [{**QA[0], "question": 5}]}},
     "reward_model.ground_truth[0].question", "Expected `str`, got `int`"),
    ({**GOOD, "reward_model": {"ground_truth": [QA[0], {**QA[0], "answer": "C"}]}},
     "reward_model.ground_truth[1].answer", "matches no option"),
]


@pytest.mark.parametrize(("bad", "field", "words"), BROKEN)
def test_caption_reader_broken_record_names_file_line_field(tmp_path, bad, field, words):
    path = _jsonl(tmp_path / "broken.jsonl", [GOOD, "", bad, GOOD])
    error = _error(read_caption_qa(path))
    assert (error.path, error.line, error.field) == (path, 3, field)  # blank line 2 still counts
    message = str(error)
    assert f"{path}: line 3" in message and words in message
    if field:
        assert f"field `{field}`" in message


def test_reader_streams_records_before_the_bad_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, "{oops"])
    it = iter(read_caption_qa(path))
    assert next(it).qa[0].answer_letter == "B"
    with pytest.raises(RecordError, match="line 2"):
        next(it)


def test_skip_mode_counts_and_logs_first_errors(tmp_path, caplog):
    lines = [GOOD] + [b for b, _, _ in BROKEN] * 2 + [GOOD]
    path = _jsonl(tmp_path / "d.jsonl", lines)
    reader = read_caption_qa(path, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="rl_data"):
        records = list(reader)
    assert len(records) == 2
    assert (reader.skipped, reader.stats.read) == (8, 2)
    assert [e.line for e in reader.stats.errors] == [2, 3, 4, 5, 6]  # first five kept
    assert len([r for r in caplog.records if "skipping bad record" in r.message]) == 5
    list(reader)  # a second pass starts fresh
    assert reader.skipped == 8


def test_reader_rejects_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        read_caption_qa(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'"):
        read_caption_qa(tmp_path / "d.csv")
    path = _jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ValueError, match="on_error"):
        read_caption_qa(path, on_error="ignore")


def test_caption_reader_parquet_with_image_bytes(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buf, format="PNG")
    rows = [{**GOOD, "image": {"bytes": buf.getvalue(), "path": "orig.png"}} for _ in range(3)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records = list(read_caption_qa(path))
    assert len(records) == 3
    image = load_image(records[0].images[0])
    assert image.size == (4, 3) and image.getpixel((0, 0)) == (10, 20, 30)


def _judge_rows(n):
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "rm_prompt_0": "J0 {response}",
             "rm_prompt_1": "", "reward_model": {"ground_truth": f"g{i}"},
             "extra_info": {"index": i}, "data_source": "rider"} for i in range(n)]


def test_judge_reader_parquet_streams_in_batches(tmp_path):
    path = tmp_path / "j.parquet"
    pq.write_table(pa.Table.from_pylist(_judge_rows(10)), path, row_group_size=3)
    reader = read_judge_records(path)
    reader.rows.batch_size = 4  # 3 batches across 4 row groups
    records = list(reader)
    assert [r.ground_truth for r in records] == [f"g{i}" for i in range(10)]
    assert records[0].rm_prompts == ["J0 {response}", ""]


def test_judge_reader_parquet_null_row_names_row_and_field(tmp_path):
    rows = _judge_rows(5)
    rows[3]["prompt"] = None
    path = tmp_path / "j.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    error = _error(read_judge_records(path))
    assert (error.line, error.unit, error.field) == (3, "row", "prompt")
    assert f"{path}: row 3: field `prompt`" in str(error)
    reader = read_judge_records(path, on_error="skip")
    assert len(list(reader)) == 4 and reader.skipped == 1


def test_judge_reader_parquet_wrong_column_type(tmp_path):
    rows = _judge_rows(2)
    for i, row in enumerate(rows):
        row["rm_prompt_1"] = i  # an int64 column where a template string belongs
    path = tmp_path / "j.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    error = _error(read_judge_records(path))
    assert (error.line, error.field) == (0, "rm_prompt_1")
    assert "got `int`" in str(error)


def test_judge_reader_jsonl(tmp_path):
    path = _jsonl(tmp_path / "j.jsonl", [*_judge_rows(2), {"prompt": "q", "reward_model": {}}])
    error = _error(read_judge_records(path))
    assert (error.line, error.field) == (3, "reward_model.ground_truth")


def test_ocr_manifest_good_and_broken(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('A sign that says "OPEN"\n\n  A mug with "TEA" on it  \n')
    assert [(p.prompt, p.target) for p in read_ocr_prompts(path)] == [
        ('A sign that says "OPEN"', "OPEN"), ('A mug with "TEA" on it', "TEA")]
    path.write_text('A sign that says "OPEN"\n\nA sign without a target\n')
    error = _error(read_ocr_prompts(path))
    assert (error.path, error.line, error.field) == (path, 3, "prompt")
    assert f"{path}: line 3" in str(error) and "double quotes" in str(error)
    reader = read_ocr_prompts(path, on_error="skip")
    assert len(list(reader)) == 1 and reader.skipped == 1


def test_ocr_manifest_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_bytes('A sign that says "OPEN"\n\nA caf\xe9 sign "CAF\xc9"\n'.encode("latin-1"))
    error = _error(read_ocr_prompts(path))
    assert (error.path, error.line) == (path, 3) and "not valid UTF-8" in str(error)
    reader = read_ocr_prompts(path, on_error="skip")
    assert [p.target for p in reader] == ["OPEN"] and reader.skipped == 1


def test_ocr_rows_with_the_picture_each_sample_starts_from(tmp_path):
    """JSONL rows give a prompt and at most one `image` / `video` path, joined to the file's
    directory; a row with both, or a path that is not a string, names its line and field."""
    path = _jsonl(tmp_path / "world.jsonl", [{"prompt": 'A sign "OPEN"', "image": "a.png"},
                                             {"text": 'A mug "TEA"', "video": "/clips/b.mp4"}, {"prompt": 'A "C"'}])
    assert [(p.target, p.media) for p in read_ocr_prompts(path)] == [
        ("OPEN", str(tmp_path / "a.png")), ("TEA", "/clips/b.mp4"), ("C", None)]
    _jsonl(path, [{"prompt": 'A "C"'}, {"prompt": 'A sign "OPEN"', "image": "a.png", "video": "b.mp4"}])
    error = _error(read_ocr_prompts(path))
    assert (error.line, error.field) == (2, "video") and "not both" in str(error)
    _jsonl(path, [{"prompt": 'A "C"', "image": 3}])
    error = _error(read_ocr_prompts(path))
    assert (error.line, error.field) == (1, "image") and "Expected a path" in str(error)


def test_prompt_reader(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "id": 1}, {"prompt": ["x"]}])
    error = _error(read_prompts(path))
    assert (error.line, error.field) == (2, "prompt[0]")
    reader = read_prompts(path, on_error="skip")
    assert [r.fields for r in reader] == [{"id": 1}] and reader.skipped == 1


def _pair_media(folder):
    """Two PNGs and two 3-frame GIF clips (4 fps) written by PIL, named by content."""
    (folder / "img").mkdir()
    for name, colour in (("red", (200, 0, 0)), ("blue", (0, 0, 200))):
        Image.new("RGB", (8, 8), colour).save(folder / "img" / f"{name}.png")
    for name, xs in (("right", (0, 3, 6)), ("left", (6, 3, 0))):
        frames = [Image.new("RGB", (8, 8), (255, 255, 255)) for _ in xs]
        for frame, x in zip(frames, xs, strict=True):
            frame.paste((0, 0, 0), (x, 0, x + 2, 8))
        frames[0].save(folder / f"{name}.gif", save_all=True, append_images=frames[1:], duration=250)


PAIRS = [
    {"prompt": "a red square", "chosen": "img/red.png", "rejected": "img/blue.png", "id": 0},
    {"caption": "a bar moving right", "chosen": "right.gif", "rejected": {"bytes": None, "path": "left.gif"}},
]


def test_preference_reader_images_and_gif_clips_resolved_against_the_file(tmp_path):
    _pair_media(tmp_path)
    records = list(read_preferences(_jsonl(tmp_path / "pairs.jsonl", PAIRS)))
    assert [(r.prompt, r.media, r.fields) for r in records] == [
        ("a red square", "image", {"id": 0}), ("a bar moving right", "video", {})]
    assert load_image(records[0].chosen).getpixel((0, 0)) == (200, 0, 0)
    assert load_image(records[0].rejected).getpixel((0, 0)) == (0, 0, 200)
    assert records[1].rejected == str(tmp_path / "left.gif")
    clip = sample_video(records[1].chosen, fps=4.0)
    assert clip.frames.shape == (3, 8, 8, 3) and clip.timestamps == [0.0, 0.25, 0.5]
    assert [int(f[4, :, 0].argmin()) for f in clip.frames] == [0, 3, 6]  # the bar moves right


BAD_PAIRS = [
    # (line content, field as the file names it, words in the message)
    ({"prompt": "a cat", "chosen": "img/red.png"}, "rejected", "missing required field"),
    ({**PAIRS[0], "prompt": " "}, "prompt", "empty prompt"),
    ({"caption": "", "chosen": "a.png", "rejected": "b.png"}, "caption", "empty prompt"),
    ({**PAIRS[0], "rejected": "right.gif"}, "rejected", "chosen is an image and rejected is a video"),
    ({"prompt": "a cat", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0.5}, "label_0", "a tie (0.5)"),
]


@pytest.mark.parametrize(("bad", "field", "words"), BAD_PAIRS)
def test_preference_reader_bad_pair_names_file_line_field(tmp_path, bad, field, words):
    path = _jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], "", bad])
    error = _error(read_preferences(path))
    assert (error.path, error.line, error.field) == (path, 3, field)
    assert f"{path}: line 3: field `{field}`: " in str(error) and words in str(error)


def test_preference_reader_pickapic_parquet_skips_ties_when_asked(tmp_path):
    pngs = []
    for colour in ((10, 0, 0), (20, 0, 0)):
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), colour).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    rows = [{"caption": f"prompt {i}", "jpg_0": pngs[0], "jpg_1": pngs[1], "label_0": label,
             "label_1": 1 - label, "ranking_id": i} for i, label in enumerate([1.0, 0.5, 0.0])]
    path = tmp_path / "pickapic.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    error = _error(read_preferences(path))
    assert (error.line, error.unit, error.field) == (1, "row", "label_0")
    reader = read_preferences(path, on_error="skip")
    first, last = list(reader)
    assert reader.skipped == 1 and (first.prompt, first.fields) == ("prompt 0", {"ranking_id": 0})
    assert load_image(first.chosen).getpixel((0, 0)) == (10, 0, 0)  # label_0 = 1: jpg_0 won
    assert load_image(last.chosen).getpixel((0, 0)) == (20, 0, 0)  # label_0 = 0: jpg_1 won
