import pytest

from rl_data.choices import (
    Choice,
    answer_index,
    format_options,
    format_question_text,
    index_of,
    letter_of,
    normalize_choices,
    parse_question_text,
    split_label,
)


@pytest.mark.parametrize(
    ("option", "label", "text"),
    [
        ("A. red", "A", "red"),
        ("B) blue square", "B", "blue square"),
        ("(C) green", "C", "green"),
        ("(C). green", "C", "green"),
        ("D: two", "D", "two"),
        ("E． full-width", "E", "full-width"),
        ("  F)   padded  ", "F", "padded"),
        ("plain text", None, "plain text"),
        ("U.S. flag", None, "U.S. flag"),  # no space after the delimiter: not a label
        ("A cat on a mat", None, "A cat on a mat"),
        ("a) lowercase is text", None, "a) lowercase is text"),
        ("3. numbered", None, "3. numbered"),
    ],
)
def test_split_label_every_style(option, label, text):
    assert split_label(option) == (label, text)


def test_normalize_mixed_styles_reletters_by_position():
    out = normalize_choices(["C. red", "(A) blue", "green", "B: two"])
    assert out == [Choice("A", "red"), Choice("B", "blue"), Choice("C", "green"), Choice("D", "two")]


def test_normalize_rejects_empty_list_empty_text_and_too_many():
    with pytest.raises(ValueError, match="empty list"):
        normalize_choices([])
    with pytest.raises(ValueError, match=r"option 1 .* empty text"):
        normalize_choices(["A. x", "B. "])
    with pytest.raises(ValueError, match="at most 26"):
        normalize_choices([f"opt {i}" for i in range(27)])


def test_stale_letter_cannot_survive_relabelling():
    # CapRL's defect: shuffling "A. cat" to third place printed "C) A. cat".
    shuffled = [Choice("?", "dog"), Choice("?", "bird"), *normalize_choices(["A. cat"])]
    text = format_options(normalize_choices(shuffled))
    assert text == "   - A) dog\n   - B) bird\n   - C) cat"


@pytest.mark.parametrize(
    ("choices", "answer", "index"),
    [
        (["A. red", "B. blue"], "B", 1),
        (["red", "blue", "green"], "C", 2),  # bare: positional letters
        (["B) red", "C) blue"], "C", 1),  # stale labels: the ORIGINAL labelling wins
        (["(A) red", "(B) blue"], "(B)", 1),
        (["A. red", "B. blue"], "B)", 1),
        (["A. red", "B. blue"], " a ".upper(), 0),
        (["A. red", "B. blue"], "blue", 1),  # answer given as the option text
        (["A. red", "B. blue"], "B. blue", 1),
    ],
)
def test_answer_index_maps_original_labels(choices, answer, index):
    assert answer_index(choices, answer) == index


def test_answer_index_errors_name_answer_and_labels():
    with pytest.raises(ValueError, match=r"answer 'E' matches no option; options are labelled A, B, C"):
        answer_index(["x", "y", "z"], "E")
    with pytest.raises(ValueError, match="ambiguous"):
        answer_index(["A. x", "A. y"], "A")
    with pytest.raises(ValueError, match="matches no option"):
        answer_index(["A. x", "B. y"], "purple")


def test_letters():
    assert [letter_of(i) for i in (0, 1, 25)] == ["A", "B", "Z"]
    assert index_of("C") == 2
    with pytest.raises(ValueError):
        letter_of(26)
    with pytest.raises(ValueError):
        index_of("c")


def test_parse_question_text_roundtrip():
    choices = normalize_choices(["A) red", "blue", "(C) green"])
    wire = format_question_text("What colour is\nthe circle?", choices)
    assert wire == "What colour is\nthe circle?\n   - A) red\n   - B) blue\n   - C) green"
    assert parse_question_text(wire) == ("What colour is\nthe circle?", choices)


def test_parse_question_text_strips_inner_stale_label():
    question, choices = parse_question_text("Q?\n   - A) B. cat\n   - B) A. dog")
    assert question == "Q?"
    assert choices == [Choice("A", "cat"), Choice("B", "dog")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Just a question", "no option lines"),
        ("   - A) red\n   - B) blue", "no question"),
        ("Q?\n   - A) red\n   - C) blue", r"line 3 .*expected option letter B, got C"),
        ("Q?\n   - A) red\nstray line", "line 3 .*not one"),
        ("Q?\n   - A) red\n   - B) ", "option 1"),
    ],
)
def test_parse_question_text_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_question_text(text)
