import pytest

from rl_data.layouts import ColumnMap, tidy_arrow_row


def test_mapping_renames_nests_and_keeps_the_rest():
    columns = ColumnMap("caption_qa", {"prompt": "question", "reward_model.ground_truth": "meta.qa",
                                       "videos": "clips"})
    row = {"question": "Describe.", "clips": ["a.mp4"], "meta": {"qa": [1], "id": 7},
           "reward_model": {"style": "model"}, "data_source": "x"}
    assert columns.apply(row) == {
        "prompt": "Describe.", "videos": ["a.mp4"], "meta": {"qa": [1], "id": 7},
        "reward_model": {"style": "model", "ground_truth": [1]}, "data_source": "x"}
    assert row["reward_model"] == {"style": "model"}  # the caller's row is not modified


def test_mapping_swaps_columns_and_drops_a_target_whose_column_is_missing():
    columns = ColumnMap("prompts", {"prompt": "instruction", "instruction_old": "prompt"})
    assert columns.apply({"prompt": "old", "instruction": "new"}) == {"prompt": "new", "instruction_old": "old"}
    # the mapped column is absent: our own `prompt` must not be used in its place
    assert columns.apply({"prompt": "stale"}) == {"instruction_old": "stale"}


def test_source_field_names_the_callers_column():
    columns = ColumnMap("caption_qa", {"reward_model.ground_truth": "qa", "reward_model": "rm"})
    assert columns.source_field("reward_model.ground_truth[2].answer") == "qa[2].answer"
    assert columns.source_field("reward_model.style") == "rm.style"
    assert columns.source_field("prompt") == "prompt"
    assert columns.source_field(None) is None
    ocr = ColumnMap("ocr")
    assert ocr.apply({"text": 'a "B"'}) == {"prompt": 'a "B"'}
    assert ocr.source_field("prompt", {"text": "x"}) == "text"
    assert ocr.source_field("prompt", {"prompt": "x", "text": "y"}) == "prompt"


def test_bad_mappings_raise_with_the_valid_targets():
    with pytest.raises(ValueError, match=r"'answer' is not a judge field; map onto one of \['prompt'"):
        ColumnMap("judge", {"answer": "gt"})
    assert ColumnMap("judge", {"rm_prompt_3": "quality_template"}).apply({"quality_template": "t"}) == {"rm_prompt_3": "t"}
    with pytest.raises(ValueError, match="must name a column"):
        ColumnMap("prompts", {"prompt": ""})
    with pytest.raises(ValueError, match="unknown kind 'captions'"):
        ColumnMap("captions")  # type: ignore[arg-type]


def test_tidy_arrow_row():
    row = {"prompt": {"role": ["user"], "content": [[{"type": "image", "text": None}, {"type": "text", "text": "Hi"}]]},
           "reward_model": {"ground_truth": {"question": ["q1", "q2"], "answer": ["A", "B"]}}}
    tidy = tidy_arrow_row(row, "caption_qa")
    assert tidy["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert tidy["reward_model"]["ground_truth"] == [{"question": "q1", "answer": "A"},
                                                    {"question": "q2", "answer": "B"}]
    # a judge's ground truth may be any value, a dict of lists included: left alone
    assert tidy_arrow_row(row, "judge")["reward_model"] == row["reward_model"]
    ragged = {"prompt": "x", "reward_model": {"ground_truth": {"a": [1], "b": [1, 2]}}}
    assert tidy_arrow_row(ragged, "caption_qa") == ragged


def test_preference_prompt_from_pickapic_caption_and_mappable_members():
    columns = ColumnMap("preference")
    assert columns.apply({"caption": "a cat", "jpg_0": b"x"}) == {"prompt": "a cat", "jpg_0": b"x"}
    assert columns.source_field("prompt", {"caption": ""}) == "caption"
    mapped = ColumnMap("preference", {"chosen": "win", "rejected": "lose"})
    assert mapped.apply({"prompt": "p", "win": "a.png", "lose": "b.png"}) == {
        "prompt": "p", "chosen": "a.png", "rejected": "b.png"}
    assert mapped.source_field("rejected.path") == "lose.path"
    with pytest.raises(ValueError, match=r"'label_0' is not a preference field; map onto one of \['prompt', 'chosen', 'rejected'\]"):
        ColumnMap("preference", {"label_0": "score"})
