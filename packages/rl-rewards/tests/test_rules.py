"""Rule rewards against hand-worked cases (docs/reference.md §1, §2, §3)."""

import math
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_rewards.rules import (
    ANSWER_PARSERS,
    TIMESTAMP_PATTERN,
    embedding_similarity_map,
    first_capital_letter,
    first_option_letter,
    json_field,
    length_reward,
    ocr_similarity,
    timestamp_format,
    whitespace_words,
)

pytestmark = pytest.mark.no_torch


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no brackets at all", 0.0),
        ("[00:05] a dog [00:10] a cat", 1.0),  # 2/2 valid, in order
        ("[00:10] a [00:05] b", 0.5),  # out of order: 0.5*1 + 0
        ("[00:30 - 00:10] a [00:40] b", 0.75),  # end < start invalid: 0.5*1/2 + 0.5
        ("[00:75] seconds out of range", 0.0),  # N_all=1, N_valid=0, no chrono
        ("[599:59] long video", 1.0),
        ("[600:00] past max minute", 0.0),
        ("[1:05] one-digit minute", 1.0),
        ("[00:5] one-digit second does not match", 0.0),
        ("[00:10-00:20] no spaces around the dash", 1.0),
        ("[00:10 - 00:30] a [00:20 - 00:40] b", 1.0),  # overlapping ranges are fine
        ("[00:20 - 00:40] a [00:10 - 00:30] b", 0.5),  # ...but start order is checked
        ("[00:10] a [00:10] b", 1.0),  # equal starts are non-decreasing
        ("[00:10] [00:99] [00:20]", 0.5 * 2 / 3 + 0.5),  # invalid match counts in N_all only
        ("[00:30] [00:10 - 00:05] [00:40]", 0.5 * 2 / 3 + 0.5),  # invalid one is out of the order check
    ],
)
def test_timestamp_format_hand_worked(text, expected):
    assert timestamp_format(text) == pytest.approx(expected)


def test_hh_mm_ss_is_not_a_match():
    # `\[(\d{1,3}):(\d{2})` must be followed by `]` or a range: `[01:02:03]` matches nowhere.
    assert timestamp_format("[01:02:03] the intro") == 0.0
    # so it neither counts as invalid nor breaks the order of the `[mm:ss]` stamps around it
    assert timestamp_format("[00:10] a [01:02:03] b [00:20] c") == 1.0
    assert timestamp_format("[00:10] a [00:00:05] b") == 1.0


def test_timestamp_max_minute_option():
    assert timestamp_format("[11:00]", max_minute=10) == 0.0
    assert timestamp_format("[10:00 - 11:00]", max_minute=10) == 0.0  # end minute checked too
    assert timestamp_format("[10:00]", max_minute=10) == 1.0


def _timestamp_format_reference(text: str, max_minute: int = 599) -> float:
    """docs/reference.md §1 read literally: every match, its validity, the valid starts, then R_fmt."""
    def seconds(m: str, s: str) -> int | None:
        return None if int(s) > 59 or int(m) > max_minute else 60 * int(m) + int(s)

    matches = list(TIMESTAMP_PATTERN.finditer(text))
    starts = []
    for match in matches:
        m1, s1, m2, s2 = match.groups()
        start = seconds(m1, s1)
        end = start if m2 is None else seconds(m2, s2)
        if start is not None and end is not None and end >= start:
            starts.append(start)
    if not matches:
        return 0.0
    chrono = bool(starts) and all(a <= b for a, b in pairwise(starts))
    return 0.5 * len(starts) / len(matches) + 0.5 * float(chrono)


_stamp = st.builds(
    lambda m, s, rng, close, gap: f"[{m}:{s:02d}{rng}{close}{gap}",
    st.integers(0, 700).map(str) | st.sampled_from(["0", "00", "000", "0000"]),
    st.integers(0, 99),
    st.none().map(lambda _: "") | st.builds(lambda sep, m, s: f"{sep}{m}:{s:02d}", st.sampled_from(["-", " - ", " -", "  -  "]),
                                            st.integers(0, 700), st.integers(0, 99)),
    st.sampled_from(["]", "", " ]", "]]"]),
    st.sampled_from(["", " ", " a dog ", "\n", ":05]"]),
)


# `\d` matches every Unicode decimal digit and `int` reads them: the digit tables' misses fall back to it
_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_stamp | _stamp.map(lambda s: s.translate(_ARABIC_INDIC)), max_size=8).map("".join),
    st.sampled_from([599, 10, 0]),
)
def test_timestamp_format_matches_the_reference(text, max_minute):
    assert timestamp_format(text, max_minute) == _timestamp_format_reference(text, max_minute)


@pytest.mark.parametrize(("text", "expected"), [("[٠٥:٣٠] a [٠٦:٠٠] b", 1.0), ("[٠٥:٧٠]", 0.0), ("[1:٥٩ - ٢:00]", 1.0)])
def test_timestamp_format_reads_non_ascii_digits(text, expected):
    assert timestamp_format(text) == expected == _timestamp_format_reference(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no brackets at all", 0.0),
        ("[00:01] x", 0.70),  # v = 1, coverage 1/3: 0.45/3 + 0.25 + 0.30 (README formula: 1.0)
        ("[00:05] a [00:10] b", 0.85),  # coverage 2/3: 0.30 + 0.25 + 0.30
        ("[00:05] a [00:10] b [00:15] c [00:20] d", 1.0),  # coverage saturates at 3
        ("[00:10] a [00:05] b [00:20] c", 0.70),  # out of order: 0.45 + 0.25 + 0
        ("[00:10] [00:99] [00:20]", 0.45 * (2 / 3) ** 2 + 0.55 * 2 / 3),  # v = coverage = 2/3
        ("[00:75] seconds out of range", 0.0),  # no valid stamp
        ("[00:30 - 00:10] a [00:40] b", 0.45 / 3 * 0.5 + 0.55 * 0.5),  # 1 of 2 valid
        ("   ", 0.0),
    ],
)
def test_timestamp_format_caprl_server_hand_worked(text, expected):
    assert timestamp_format(text, variant="caprl-server") == pytest.approx(expected, abs=1e-12)


def test_timestamp_format_caprl_server_min_brackets():
    assert timestamp_format("[00:01] x", variant="caprl-server", min_brackets=1) == 1.0
    assert timestamp_format("[00:01] x", variant="caprl-server", min_brackets=0) == 1.0  # max(0, 1)
    assert timestamp_format("[00:01] [00:02]", variant="caprl-server", min_brackets=4) == pytest.approx(0.45 / 2 + 0.55)
    assert timestamp_format("[00:01] x", min_brackets=1) == 1.0  # the README formula ignores it


def test_timestamp_format_unknown_variant_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \('readme', 'caprl-server'\), got 'server'"):
        timestamp_format("[00:01]", variant="server")


def _caprl_server_reference(text: str, max_minute: int = 599, min_brackets: int = 3) -> float:
    """CapRL++ serve_rm.py compute_format_reward, restated: per match (start, ok), then the
    weighted validity, coverage and order terms, clamped to [0, 1]."""
    if not text.strip():
        return 0.0
    matches = list(TIMESTAMP_PATTERN.finditer(text))
    starts = []
    for match in matches:
        m1, s1, m2, s2 = match.groups()
        if not 0 <= int(s1) <= 59 or int(m1) > max_minute:
            continue
        if m2 is not None and (not 0 <= int(s2) <= 59 or int(m2) > max_minute or 60 * int(m2) + int(s2) < 60 * int(m1) + int(s1)):
            continue
        starts.append(60 * int(m1) + int(s1))
    if not matches or not starts:
        return 0.0
    v = len(starts) / max(len(matches), 1)
    coverage = min(1.0, float(len(starts)) / float(max(min_brackets, 1)))
    order = 1.0 if len(starts) < 2 or all(a <= b for a, b in pairwise(starts)) else 0.0
    return float(max(0.0, min(1.0, 0.45 * coverage * v + 0.25 * v + 0.30 * order * v)))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_stamp | _stamp.map(lambda s: s.translate(_ARABIC_INDIC)), max_size=8).map("".join),
    st.sampled_from([599, 10]),
    st.sampled_from([3, 1, 0, 5]),
)
def test_timestamp_format_caprl_server_matches_the_reference(text, max_minute, min_brackets):
    got = timestamp_format(text, max_minute, variant="caprl-server", min_brackets=min_brackets)
    assert got == _caprl_server_reference(text, max_minute, min_brackets)


_words = st.lists(
    st.sampled_from([" ", "  ", "\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u3000", "a", "bc", "é", "[0"]),
    max_size=24,
).map("".join)


@settings(max_examples=600, deadline=None)
@given(_words | st.text(max_size=40))
def test_whitespace_words_is_len_of_split(text):
    assert whitespace_words(text) == len(text.split())


@pytest.mark.parametrize(
    ("text", "expected"), [("", 0), (" ", 0), ("a", 1), ("a b  c", 3), (" a b ", 2), ("a\nb c", 3), ("a\xa0b", 2)]
)
def test_whitespace_words_hand_worked(text, expected):
    assert whitespace_words(text) == expected


@pytest.mark.parametrize(
    ("n", "expected"), [(0, 1.0), (2048, 1.0), (2049, 1 - 1 / 1024), (2560, 0.5), (3072, 0.0), (3073, 0.0), (10**6, 0.0)]
)
def test_length_reward_piecewise(n, expected):
    assert length_reward(n, 2048, 3072) == pytest.approx(expected)


def test_length_reward_rejects_bad_bounds():
    with pytest.raises(ValueError, match="l1 < l2"):
        length_reward(10, 100, 100)
    with pytest.raises(ValueError, match="n_tokens"):
        length_reward(-1, 1, 2)


@pytest.mark.parametrize(
    ("target", "ocr", "expected"),
    [
        ("Hello World", "helloworld", 1.0),  # case and spaces ignored
        ("hello", "xx HELLO yy", 1.0),  # substring -> distance 0
        ("hello", "hallo", 0.8),  # one substitution over 5 chars
        ("hello world", "helo wrld", 0.8),  # "helloworld" vs "helowrld": 2 deletions over 10
        ("abc", "xyzxyzxyz", 0.0),  # distance 9 capped at len(target)=3
        ("abcd", "", 0.0),
    ],
)
def test_ocr_similarity(target, ocr, expected):
    assert ocr_similarity(target, ocr) == pytest.approx(expected)


@pytest.mark.parametrize("target", ["", "   "])
def test_ocr_similarity_empty_target_is_an_error(target):
    with pytest.raises(ValueError, match="target text is empty"):
        ocr_similarity(target, "anything")


def test_embedding_similarity_map_boundaries():
    assert embedding_similarity_map(0.0) == 0.1
    assert embedding_similarity_map(0.65) == 0.1
    assert embedding_similarity_map(0.85) == 1.0
    assert embedding_similarity_map(0.99) == 1.0
    # 0.75: 0.1 + 1.69811 * (10**-0.6 - 0.1) = 0.1 + 1.69811 * 0.151189 = 0.356735
    assert embedding_similarity_map(0.75) == pytest.approx(0.356735, abs=1e-6)
    # continuous at the low end, and just over 1 right below 0.85 as in the original
    assert embedding_similarity_map(0.65 + 1e-9) == pytest.approx(0.1, abs=1e-7)
    assert embedding_similarity_map(0.85 - 1e-9) == pytest.approx(1.00163, abs=1e-5)
    assert not math.isnan(embedding_similarity_map(float("-inf")))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" B) the dog", "B"),
        (" (C)", "C"),
        ("D.", "D"),
        (" A", "A"),
        ("A\nbecause", "A"),
        (" I", "I"),  # the 9th option, alone
        ("I think the answer is B", "B"),  # CapRL read this as "I"
        ("I think it is unclear", None),
        ("A dog runs in the park", None),  # article, not an answer
        ("Hmm, maybe (E) fits best", "E"),
        ("The answer is: e", None),  # lowercase is not an option letter
        (" J", None),  # outside the letters
        ("", None),
    ],
)
def test_first_option_letter(text, expected):
    assert first_option_letter(text) == expected


def test_first_option_letter_custom_letters():
    assert first_option_letter(" J)", letters="ABCDEFGHIJ") == "J"
    assert first_option_letter(" C)", letters="AB") is None


@pytest.mark.parametrize(
    ("text", "strict", "caprl"),
    [
        (" C", "C", "C"),
        (" **C**", None, "C"),  # markdown bold: CapRL++ reads it, ours does not
        (" C is correct", None, "C"),
        ("Option C", None, "C"),  # "O" is not an option letter, so C is the first capital A-I
        ("answer: C", None, "C"),
        (" (B) because the caption says so", "B", "B"),
        ("I think B", None, "I"),  # CapRL++ answers I: wrong whenever the gold is B
        ("A dog is shown, so D", None, "A"),
        (" the caption does not say", None, None),
    ],
)
def test_answer_parsers_strict_and_caprl(text, strict, caprl):
    assert ANSWER_PARSERS["strict"](text) == first_option_letter(text) == strict
    assert ANSWER_PARSERS["caprl"](text) == first_capital_letter(text) == caprl


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"Response": "hi", "Solution": "x"}', "hi"),
        ('Assistant: \n{"Response": "hi"} trailing words', "hi"),
        ('{"Response": "hi"', "hi"),  # no closing brace: VeRL-with-RMs appends one
        ('a {"Response": "x {y}"} b', "x {y}"),  # first { to last }
    ],
)
def test_json_field_reads_like_verl_with_rms(text, expected):
    assert json_field(text, "Response") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plain text", "no JSON object"),
        ('{"Response": hi}', "does not parse"),
        ('{"Other": "hi"}', "no string field 'Response'"),
        ('{"Response": null}', "no string field 'Response'"),
        ("[1, 2] }", "no JSON object"),
    ],
)
def test_json_field_malformed_is_a_value_error(text, message):
    with pytest.raises(ValueError, match=message):
        json_field(text, "Response")
