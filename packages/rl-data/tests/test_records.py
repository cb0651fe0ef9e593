import base64

import pytest

from rl_data.choices import Choice
from rl_data.records import (
    ChatMessage,
    FieldError,
    ImageSource,
    caption_qa_from_row,
    judge_from_row,
    ocr_prompt_from_line,
    preference_from_row,
    prompt_from_row,
    qa_from_question_text,
)

QA = [{"question": "Colour?", "choices": ["B) red", "C) blue", "D) green"], "answer": "C"}]


def _row(**overrides):
    return {"prompt": "<image> Describe.", "image": "a.png", "reward_model": {"ground_truth": QA},
            **overrides}


def test_caption_row_normalizes_prompt_choices_and_stale_answer_letter():
    record = caption_qa_from_row(_row(), media_root="/data")
    assert record.prompt == [ChatMessage("user", "<image> Describe.")]
    assert record.images == [ImageSource(path="/data/a.png")]
    assert record.kind == "image"
    (qa,) = record.qa
    assert qa.choices == [Choice("A", "red"), Choice("B", "blue"), Choice("C", "green")]
    # "C" in the original (stale) labelling is "blue", the second option -> normalized "B"
    assert qa.answer_letter == "B"
    assert qa.answer_text == "blue"


def test_caption_row_image_forms():
    png = b"\x89PNG fake"
    as_dict = caption_qa_from_row(_row(image={"bytes": None, "path": "x/y.png"}), media_root="/r")
    assert as_dict.images == [ImageSource(path="/r/x/y.png")]
    raw = caption_qa_from_row(_row(image=png))  # parquet binary column
    assert raw.images == [ImageSource(bytes=png)]
    b64 = caption_qa_from_row(_row(image={"bytes": base64.b64encode(png).decode(), "path": None}))
    assert b64.images == [ImageSource(bytes=png)]
    absolute = caption_qa_from_row(_row(image="/abs/a.png"), media_root="/r")
    assert absolute.images == [ImageSource(path="/abs/a.png")]
    many = caption_qa_from_row(_row(image=None, images=["p.png", {"path": "q.png"}]), media_root="/r")
    assert [im.path for im in many.images] == ["/r/p.png", "/r/q.png"]


def test_caption_video_row():
    row = {"prompt": [{"role": "user", "content": "<video>\nDescribe."}], "videos": ["v/1.mp4"],
           "data_source": "caprl", "reward_model": {"ground_truth": QA}, "extra_info": {"id": 3}}
    record = caption_qa_from_row(row, media_root="/m")
    assert (record.kind, record.videos, record.data_source) == ("video", ["/m/v/1.mp4"], "caprl")
    assert record.extra_info == {"id": 3}


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        (_row(image=None), "image", "no `image`"),
        (_row(reward_model={"ground_truth": []}), "reward_model.ground_truth", "empty QA list"),
        (_row(reward_model={}), "reward_model.ground_truth", "missing required field"),
        (_row(prompt=None), "prompt", "got `null`"),
        (_row(prompt=[]), "prompt", "empty message list"),
        (_row(image={"bytes": 5}), "image.bytes", "got `int`"),
        (_row(image={"bytes": "%%%"}), "image.bytes", "base64"),
        (_row(image={"bytes": None, "path": None}), "image", "neither bytes nor path"),
        (_row(videos="v.mp4"), "videos", "Expected `array | null`, got `str`"),
        (_row(reward_model={"ground_truth": [{**QA[0], "answer": "E"}]}),
         "reward_model.ground_truth[0].answer", "labelled B, C, D"),
        (_row(reward_model={"ground_truth": [QA[0], {**QA[0], "choices": 3}]}),
         "reward_model.ground_truth[1].choices", "got `int`"),
        (_row(reward_model={"ground_truth": [{**QA[0], "choices": []}]}),
         "reward_model.ground_truth[0].choices", "empty list"),
        (_row(reward_model={"ground_truth": [{**QA[0], "question": "  "}]}),
         "reward_model.ground_truth[0].question", "empty question"),
        ([1, 2], None, "Expected `object`, got `array`"),
    ],
)
def test_caption_row_errors_name_the_field(row, field, reason):
    with pytest.raises(FieldError) as info:
        caption_qa_from_row(row)
    assert info.value.field == field
    assert reason in info.value.reason


def test_judge_row_collects_numbered_rm_prompts():
    row = {"prompt": [{"role": "user", "content": "q"}], "rm_prompt_1": None,
           "rm_prompt_0": "Judge {response}", "rm_prompt_2": "", "reward_model": {"ground_truth": "g"},
           "extra_info": {"index": 1}, "data_source": "rider"}
    record = judge_from_row(row)
    assert record.rm_prompts == ["Judge {response}", "", ""]
    assert (record.ground_truth, record.extra_info, record.data_source) == ("g", {"index": 1}, "rider")
    assert judge_from_row({"prompt": "q", "reward_model": {"ground_truth": None}}).rm_prompts == []


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "q", "rm_prompt_1": "x", "reward_model": {"ground_truth": 1}}, "rm_prompt_0"),
        ({"prompt": "q", "rm_prompt_0": 7, "reward_model": {"ground_truth": 1}}, "rm_prompt_0"),
        ({"prompt": "q", "reward_model": {}}, "reward_model.ground_truth"),
        ({"prompt": "q"}, "reward_model"),
        ({"prompt": "q", "reward_model": {"ground_truth": 1}, "extra_info": "x"}, "extra_info"),
    ],
)
def test_judge_row_errors(row, field):
    with pytest.raises(FieldError) as info:
        judge_from_row(row)
    assert info.value.field == field


def test_prompt_row_keeps_free_fields():
    record = prompt_from_row({"prompt": "hi", "id": 3, "meta": {"a": 1}})
    assert record.prompt == "hi" and record.fields == {"id": 3, "meta": {"a": 1}}
    chat = prompt_from_row({"prompt": [{"role": "user", "content": "x"}]})
    assert chat.prompt == [ChatMessage("user", "x")]
    for bad, field in [({"prompt": "  "}, "prompt"), ({"id": 1}, "prompt"), ({"prompt": 3}, "prompt")]:
        with pytest.raises(FieldError) as info:
            prompt_from_row(bad)
        assert info.value.field == field


def test_ocr_prompt_target_is_first_quoted_span():
    assert ocr_prompt_from_line('A sign "OPEN LATE" and "other"').target == "OPEN LATE"
    for bad, reason in [("no quotes", "no text between"), ('one " only', "no text between"),
                        ('empty "" target', "empty target")]:
        with pytest.raises(FieldError, match=reason):
            ocr_prompt_from_line(bad)


def test_qa_wire_roundtrip():
    record = caption_qa_from_row(_row())
    (qa,) = record.qa
    assert qa.question_text == "Colour?\n   - A) red\n   - B) blue\n   - C) green"
    assert qa_from_question_text(qa.question_text, qa.answer_letter) == qa
    with pytest.raises(ValueError, match="not one of the option letters A, B, C"):
        qa_from_question_text(qa.question_text, "D")


PAIR = {"prompt": "a red circle", "chosen": "win.png", "rejected": "lose.png"}


def test_preference_row_images_videos_and_free_fields():
    record = preference_from_row({**PAIR, "id": 4}, media_root="/data")
    assert (record.chosen, record.rejected) == (ImageSource(path="/data/win.png"), ImageSource(path="/data/lose.png"))
    assert record.media == "image" and record.fields == {"id": 4}
    clips = preference_from_row({**PAIR, "chosen": "v/a.MP4", "rejected": {"bytes": None, "path": "/abs/b.gif"}},
                                media_root="/data")
    assert (clips.media, clips.chosen, clips.rejected) == ("video", "/data/v/a.MP4", "/abs/b.gif")
    png = b"\x89PNG fake"
    stored = preference_from_row({**PAIR, "chosen": png, "rejected": {"bytes": base64.b64encode(b"other").decode()}})
    assert (stored.chosen, stored.rejected) == (ImageSource(bytes=png), ImageSource(bytes=b"other"))


def test_pickapic_row_prefers_by_label_0_and_drops_the_labels():
    row = {"prompt": "a cat", "jpg_0": b"zero", "jpg_1": b"one", "label_0": 1.0, "label_1": 0.0, "ranking_id": 9}
    first = preference_from_row(row)
    assert (first.chosen.bytes, first.rejected.bytes, first.fields) == (b"zero", b"one", {"ranking_id": 9})
    second = preference_from_row({**row, "label_0": 0, "label_1": 1})
    assert (second.chosen.bytes, second.rejected.bytes) == (b"one", b"zero")


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ({k: v for k, v in PAIR.items() if k != "prompt"}, "prompt", "missing required field"),
        ({**PAIR, "prompt": "  "}, "prompt", "empty prompt"),
        ({**PAIR, "prompt": [{"role": "user", "content": "x"}]}, "prompt", "Expected `str`, got `array`"),
        ({"prompt": "p", "chosen": "a.png"}, "rejected", "missing required field `rejected`"),
        ({**PAIR, "chosen": 3}, "chosen", "Expected `str | object`, got `int`"),
        ({**PAIR, "chosen": None}, "chosen", "got `null`"),
        ({**PAIR, "chosen": ""}, "chosen", "empty path"),
        ({**PAIR, "rejected": {"bytes": None, "path": None}}, "rejected", "neither bytes nor path"),
        ({**PAIR, "rejected": {"path": 5}}, "rejected.path", "got `int`"),
        ({**PAIR, "chosen": {"bytes": "%%%"}}, "chosen.bytes", "base64"),
        ({**PAIR, "rejected": "clip.mp4"}, "rejected", "chosen is an image and rejected is a video"),
        ({**PAIR, "chosen": {"bytes": b"\x00\x00\x00\x18ftypisom", "path": None}}, "chosen", "video given as bytes"),
        ({**PAIR, "rejected": "win.png"}, "rejected", "the same media as chosen"),
        ({"prompt": "p", "jpg_0": b"a", "jpg_1": b"b", "label_0": 0.5}, "label_0", "a tie (0.5)"),
        ({"prompt": "p", "jpg_0": b"a", "jpg_1": b"b", "label_0": 2}, "label_0", "got 2"),
        ({"prompt": "p", "jpg_0": b"a", "jpg_1": b"b", "label_0": True}, "label_0", "got True"),
        ({"prompt": "p", "jpg_0": b"a", "label_0": 1}, "jpg_1", "missing required field `jpg_1`"),
        ({"prompt": "p", "jpg_0": b"a", "jpg_1": b"a", "label_0": 0}, "jpg_0", "the same media as jpg_1"),
        ("a line", None, "expected an object, got str"),
    ],
)
def test_preference_row_errors_name_the_field(row, field, reason):
    with pytest.raises(FieldError) as info:
        preference_from_row(row)
    assert info.value.field == field
    assert reason in info.value.reason
