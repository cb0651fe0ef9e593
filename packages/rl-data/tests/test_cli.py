"""`rl-data convert`: any supported source to our files, which read back to the same records."""

import io
import json
from importlib.metadata import entry_points

import pytest
from PIL import Image as PILImage
from typer.testing import CliRunner

from rl_data.cli import app
from rl_data.media import load_image
from rl_data.readers import (
    read_caption_qa,
    read_judge_records,
    read_ocr_prompts,
    read_preferences,
    read_prompts,
)

datasets = pytest.importorskip("datasets")

QA = [{"question": "Colour?", "choices": ["(A) red", "(B) blue"], "answer": "B"}]


def _png(colour):
    buf = io.BytesIO()
    PILImage.new("RGB", (4, 3), colour).save(buf, format="PNG")
    return buf.getvalue()


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_console_script_is_the_typer_app():
    [script] = entry_points(group="console_scripts", name="rl-data")
    assert script.load() is app


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_convert_caption_dataset_dir_skips_bad_rows_and_reads_back_the_same(tmp_path, suffix):
    rows = [{"prompt": "<image> Describe.", "images": [_png((i * 40, 0, 0))], "videos": [],
             "reward_model": {"ground_truth": QA}, "extra_info": {"index": i}} for i in range(5)]
    rows[3]["reward_model"] = {"ground_truth": [{**QA[0], "answer": "C"}]}
    features = datasets.Features({
        "prompt": datasets.Value("string"), "images": datasets.List(datasets.Image()),
        "videos": datasets.List(datasets.Value("string")), "extra_info": {"index": datasets.Value("int64")},
        "reward_model": {"ground_truth": datasets.List({
            "question": datasets.Value("string"), "choices": datasets.List(datasets.Value("string")),
            "answer": datasets.Value("string")})}})
    src = tmp_path / "caprl"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows, features=features)}).save_to_disk(src)
    dst = tmp_path / f"out{suffix}"
    result = _run("convert", src, dst, "--kind", "caption_qa", "--split", "train")
    assert result.exit_code == 0, result.output
    assert f"wrote 4 records to {dst}; skipped 1 bad rows" in result.output
    assert "split train: row 3: field `reward_model.ground_truth[0].answer`" in result.output
    expected = list(read_caption_qa(src, split="train", on_error="skip"))
    back = list(read_caption_qa(dst))
    assert back == expected and len(back) == 4
    assert load_image(back[1].images[0]).getpixel((0, 0)) == (40, 0, 0)


def test_convert_strict_stops_at_the_first_bad_row(tmp_path):
    rows = [{"prompt": "a", "id": 0}, {"prompt": "", "id": 1}]
    src = tmp_path / "p"
    datasets.Dataset.from_list(rows).save_to_disk(src)
    result = _run("convert", src, tmp_path / "p.jsonl", "--kind", "prompts", "--strict")
    assert result.exit_code == 1
    assert "row 1: field `prompt`: empty prompt" in result.output


def test_convert_with_mapping_from_a_jsonl_file_to_parquet(tmp_path):
    src = tmp_path / "verl.jsonl"
    src.write_text("".join(json.dumps({"question": [{"role": "user", "content": f"q{i}"}],
                                       "rm_prompt_0": "Rate {response}", "gt": f"a{i}"}) + "\n"
                           for i in range(3)))
    dst = tmp_path / "verl.parquet"
    result = _run("convert", src, dst, "-k", "judge", "-m", "prompt=question",
                  "--map", "reward_model.ground_truth=gt")
    assert result.exit_code == 0, result.output
    back = list(read_judge_records(dst))
    assert [(r.prompt[0].content, r.rm_prompts, r.ground_truth) for r in back] == [
        (f"q{i}", ["Rate {response}"], f"a{i}") for i in range(3)]
    assert list(read_judge_records(src, mapping={"prompt": "question",
                                                 "reward_model.ground_truth": "gt"})) == back


def test_convert_prompts_and_ocr(tmp_path):
    src = tmp_path / "trl"
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "id": 3}]).save_to_disk(src)
    assert _run("convert", src, tmp_path / "p.jsonl", "--kind", "prompts").exit_code == 0
    assert list(read_prompts(tmp_path / "p.jsonl")) == list(read_prompts(src))
    ocr = tmp_path / "ocr"
    datasets.Dataset.from_list([{"text": 'A sign "OPEN"'}, {"text": 'A mug "TEA"'}]).save_to_disk(ocr)
    assert _run("convert", ocr, tmp_path / "train.txt", "--kind", "ocr").exit_code == 0
    assert [p.target for p in read_ocr_prompts(tmp_path / "train.txt")] == ["OPEN", "TEA"]


def test_convert_argument_errors(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n')
    result = _run("convert", src, tmp_path / "out.txt", "--kind", "prompts")
    assert result.exit_code == 1 and "prompts records are written to .jsonl or .parquet" in result.output
    assert _run("convert", src, tmp_path / "o.jsonl", "--kind", "captions").exit_code == 2
    assert _run("convert", src, tmp_path / "o.jsonl", "--kind", "prompts", "--map", "prompt").exit_code == 2
    result = _run("convert", tmp_path / "nope.jsonl", tmp_path / "o.jsonl", "--kind", "prompts")
    assert result.exit_code == 1 and "data file not found" in result.output


def test_convert_pickapic_dataset_skips_ties_and_writes_chosen_rejected(tmp_path):
    rows = [{"caption": f"p{i}", "jpg_0": _png((i * 40 + 40, 0, 0)), "jpg_1": _png((0, 0, i * 40 + 40)),
             "label_0": label, "label_1": 1 - label} for i, label in enumerate([1.0, 0.5, 0.0])]
    src = tmp_path / "pickapic"
    datasets.Dataset.from_list(rows).save_to_disk(src)
    dst = tmp_path / "pairs.jsonl"
    result = _run("convert", src, dst, "--kind", "preference")
    assert result.exit_code == 0, result.output
    assert f"wrote 2 records to {dst}; skipped 1 bad rows" in result.output
    assert "row 1: field `label_0`: a tie (0.5)" in result.output
    written = dst.read_text()
    assert '"chosen":{"bytes":' in written and "jpg_0" not in written and "label_0" not in written
    back = list(read_preferences(dst))
    assert back == list(read_preferences(src, on_error="skip"))
    assert [load_image(r.chosen).getpixel((0, 0)) for r in back] == [(40, 0, 0), (0, 0, 120)]
