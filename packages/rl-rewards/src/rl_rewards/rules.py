"""Rule rewards as plain functions: no model, no torch, exact reference semantics.

Each function reproduces one reward of the systems this project replaces (CapRL++'s format and
length rewards, Flow-GRPO's OCR score, VeRL-with-RMs' BGE mapping) plus the option-letter parser
that CapRL's QA reward needs, with CapRL's parser defect fixed.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from rapidfuzz.distance import Levenshtein

# CapRL++ video format reward: `[mm:ss]` or `[mm:ss - mm:ss]`; minutes 1-3 digits.
TIMESTAMP_PATTERN = re.compile(r"\[(\d{1,3}):(\d{2})(?:\s*-\s*(\d{1,3}):(\d{2}))?\]")


# Digit strings -> values for the loop below: a dict lookup costs a third of `int(str)`, and
# this runs for every stamp of every caption the server scores. Misses (seconds 60-99, and the
# non-ASCII digits `\d` also matches, which `int` reads) fall back to `int`.
_SECONDS = {f"{i:02d}": i for i in range(60)}
_MINUTES = {f"{i:0{width}d}": i for width in (1, 2, 3) for i in range(10**width)}


TIMESTAMP_VARIANTS = ("readme", "caprl-server")


def timestamp_format(
    text: str, max_minute: int = 599, *, variant: str = "readme", min_brackets: int = 3
) -> float:
    """CapRL++'s video format reward R_fmt, exactly, in one of its two published forms.

    Every match of `TIMESTAMP_PATTERN` counts towards N_all. A match is valid when all its
    seconds are 0-59, all its minutes are <= `max_minute`, and (for a range) end >= start.
    "In order" means the valid start times never decrease in text order. 0 with no match.

    - `variant="readme"` (default): the formula of the CapRL++ README,
      R_fmt = 0.5 * N_valid / max(N_all, 1) + 0.5 * I_chrono, with I_chrono = 1 iff there is a
      valid match and the valid starts are in order. One valid stamp scores 1.0.
    - `variant="caprl-server"`: what CapRL++'s reward server (`serve_rm.py`,
      `compute_format_reward`) actually computes and trains with: with v = N_valid / N_all,
      coverage = min(1, N_valid / max(min_brackets, 1)) and order = 1 when the valid starts
      are in order (or fewer than 2), R_fmt = 0.45 * coverage * v + 0.25 * v + 0.30 * order * v,
      0 when no match is valid. It also rewards density: `"[00:01] x"` scores 0.70 there
      (coverage 1/3), 1.0 under the README formula. Pick it to reproduce a CapRL++ run.
      `min_brackets` (its `FORMAT_MIN_BRACKETS`, default 3) is the number of valid stamps at
      which coverage saturates; it is ignored by the README formula.

    `[hh:mm:ss]` is not a match: the pattern needs `]` right after `mm:ss`, so `[01:02:03]`
    matches nowhere and counts neither as valid nor as invalid. A caption written only with
    `[hh:mm:ss]` stamps therefore scores 0, as in CapRL++ (the video prompt asks for `[mm:ss]`,
    and minutes up to 599 cover ten hours). Overlapping ranges are allowed; only start order is
    checked.
    """
    matches = TIMESTAMP_PATTERN.findall(text)  # [(m1, s1, m2, s2)]; m2 = s2 = "" without a range end
    if not matches:
        return 0.0
    valid = 0
    chrono = True
    last_start = -1
    seconds_of, minutes_of = _SECONDS.get, _MINUTES.get
    for m1, s1, m2, s2 in matches:  # inlined checks: this runs for every caption the server scores
        second = seconds_of(s1)
        if second is None:
            second = int(s1)
            if second > 59:
                continue
        minute = minutes_of(m1)
        if minute is None:
            minute = int(m1)
        if minute > max_minute:
            continue
        start = 60 * minute + second
        if m2:
            second = seconds_of(s2)
            if second is None:
                second = int(s2)
                if second > 59:
                    continue
            minute = minutes_of(m2)
            if minute is None:
                minute = int(m2)
            if minute > max_minute or 60 * minute + second < start:
                continue
        if start < last_start:
            chrono = False
        last_start = start
        valid += 1
    if variant == "readme":
        return 0.5 * valid / len(matches) + 0.5 * float(chrono and valid > 0)
    if variant == "caprl-server":
        return _caprl_server_format(valid, len(matches), chrono, min_brackets)
    raise ValueError(f"timestamp_format: variant must be one of {TIMESTAMP_VARIANTS}, got {variant!r}")


def _caprl_server_format(valid: int, total: int, chrono: bool, min_brackets: int) -> float:
    """CapRL++ serve_rm.py's weighting, term for term (same float operations, same clamp)."""
    if valid == 0:
        return 0.0
    validity = valid / max(total, 1)
    coverage = min(1.0, float(valid) / float(max(min_brackets, 1)))
    order = 1.0 if chrono else 0.0
    fmt = 0.45 * coverage * validity + 0.25 * validity + 0.30 * order * validity
    return float(max(0.0, min(1.0, fmt)))


# ASCII characters `str.split()` splits on besides the space (`str.isspace`).
_ASCII_SPACES_BUT_SPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f"


def whitespace_words(text: str) -> int:
    """`len(text.split())`, without building the word list.

    Single-space-separated ASCII text (the usual caption) is counted with C-level scans, faster
    than splitting it; anything else (newlines, tabs, runs of spaces, non-ASCII) is
    split. Exactly `len(text.split())` for every string.
    """
    if not text.isascii() or "  " in text or text[:1] == " " or text[-1:] == " ":
        return len(text.split())
    for space in _ASCII_SPACES_BUT_SPACE:  # a loop of `in` (memchr) scans: any() over a genexpr is slower
        if space in text:
            return len(text.split())
    return text.count(" ") + 1 if text else 0


def length_reward(n_tokens: int, l1: int, l2: int) -> float:
    """CapRL++'s length reward R_len: 1 up to `l1` tokens, linear down to 0 at `l2`, 0 beyond.

    `n_tokens` is the caption's token count under the caption model's tokenizer, without special
    tokens (CapRL++ defaults: l1=2048, l2=3072).
    """
    if n_tokens < 0:
        raise ValueError(f"length_reward: n_tokens must be >= 0, got {n_tokens}")
    if not 0 <= l1 < l2:
        raise ValueError(f"length_reward: need 0 <= l1 < l2, got l1={l1}, l2={l2}")
    if n_tokens <= l1:
        return 1.0
    if n_tokens <= l2:
        return 1.0 - (n_tokens - l1) / (l2 - l1)
    return 0.0


_WORD = re.compile(r"[^\W\d_]{2,}")  # two or more letters, any script, nothing else


def word_variety(text: str, target: int) -> tuple[float, int, float]:
    """(reward, distinct words, clean share) of a text split on whitespace.

    A word counts when it is two or more letters and nothing else; distinct words are counted
    case-blind, up to `target`. reward = min(distinct, target) / target x clean share, where the
    clean share is the counted words' part of all whitespace-separated pieces. Repeating a word
    adds a piece but no distinct word, and junk pieces (digits, punctuation, one letter) lower
    the share: "a cat sat on the mat" with target 4 -> distinct {cat, sat, on, the, mat} = 5,
    clean 5/6, reward 1 x 5/6.
    """
    if target < 1:
        raise ValueError(f"word_variety: target must be >= 1, got {target}")
    pieces = text.split()
    words = [p for p in pieces if _WORD.fullmatch(p)]
    distinct = len({w.casefold() for w in words})
    clean = len(words) / len(pieces) if pieces else 0.0
    return min(distinct, target) / target * clean, distinct, clean


def overlong_punishment(n_tokens: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), as TRL's
    `get_soft_overlong_punishment`: 0 up to `max_length - cache` tokens, linear down to -1 at
    `max_length`, -1 beyond.

    R(n) = 0 if n <= L_max - L_cache; ((L_max - L_cache) - n) / L_cache if L_max - L_cache < n <= L_max;
    -1 if n > L_max. With `cache = 0` the ramp is empty: 0 up to `max_length`, -1 beyond.
    """
    if n_tokens < 0:
        raise ValueError(f"overlong_punishment: n_tokens must be >= 0, got {n_tokens}")
    if max_length <= 0 or not 0 <= cache <= max_length:
        raise ValueError(f"overlong_punishment: need max_length > 0 and 0 <= cache <= max_length, "
                         f"got max_length={max_length}, cache={cache}")
    start = max_length - cache
    if n_tokens <= start:
        return 0.0
    if n_tokens <= max_length:
        return (start - n_tokens) / cache  # same float operation as TRL: one int division
    return -1.0


def ocr_similarity(target: str, ocr_text: str) -> float:
    """Flow-GRPO's OCR reward given the recognized text.

    Both strings are lowercased and stripped of spaces. The distance is 0 when the target is a
    substring of the OCR text, else the Levenshtein distance capped at len(target);
    reward = 1 - distance / len(target), in [0, 1].

    An empty target (after removing spaces) has nothing to measure — Flow-GRPO divides by zero
    there — so it raises ValueError; a scorer turns that into the sample's error.
    """
    target = target.replace(" ", "").lower()
    ocr_text = ocr_text.replace(" ", "").lower()
    if not target:
        raise ValueError("ocr_similarity: the target text is empty (nothing between the prompt's double quotes?)")
    if target in ocr_text:
        return 1.0
    distance = min(Levenshtein.distance(ocr_text, target), len(target))
    return 1.0 - distance / len(target)


def embedding_similarity_map(s: float) -> float:
    """VeRL-with-RMs' mapping of a BGE cosine similarity `s` to a reward in [0.1, ~1].

    s <= 0.65 -> 0.1; s >= 0.85 -> 1.0; otherwise 0.1 + 1.69811 * (10 ** (4 * (s - 0.9)) - 0.1)
    (continuous at 0.65; reaches 1.0016 just below 0.85, as in the original).
    """
    if s <= 0.65:
        return 0.1
    if s >= 0.85:
        return 1.0
    return 0.1 + 1.69811 * (10 ** (4 * (s - 0.9)) - 0.1)


def json_field(text: str, field: str) -> str:
    """The string value of `field` in the JSON object a completion ends with, as VeRL-with-RMs
    reads it (its judges' `rm_preprocess` and its BGE reward, field `"Response"`).

    The object is the text from the first `{` to the last `}`; a completion with a `{` but no
    `}` is closed with one (as there: `'{"Response": "hi"'` reads as `hi`). ValueError (the
    sample is "malformed") when there is no `{`, the text is not JSON, or `field` is missing or
    not a string.
    """
    body = text.rsplit("}", 1)[0] + "}"
    if "{" not in body:
        raise ValueError(f"no JSON object in the completion (looking for field {field!r})")
    body = "{" + body.split("{", 1)[1]
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError as e:
        raise ValueError(f"the completion's JSON object does not parse: {e}") from None
    if not isinstance(value, dict) or not isinstance(value.get(field), str):
        raise ValueError(f"the completion's JSON object has no string field {field!r}")
    return value[field]


def first_option_letter(text: str, letters: str = "ABCDEFGHI") -> str | None:
    """The option letter a judge answered with, or None.

    CapRL++ took the first capital in [A-I] anywhere in the output, so "I think B" read as "I"
    and "A dog..." as "A". Here a letter counts only as a standalone answer token, tried in order:
      1. the output starts with it: `B`, ` B`, `(B)`, `B)`, `B.`, `B:`, `B,` or `B` then a line end;
      2. after "answer is" anywhere: `... the answer is (C)`;
      3. anywhere as `X)` or `(X)` not glued to a word.
    The judge's prompt is pre-filled with "The answer is", so rule 1 reads the usual output.
    """
    patterns = _letter_patterns(letters)
    for pattern in patterns:
        match = pattern.search(text)
        if match:
            return match.group(1)
    return None


def first_capital_letter(text: str, letters: str = "ABCDEFGHI") -> str | None:
    """CapRL++'s reading of a sampled judge answer (`parse_easy`): the first character of
    `letters` anywhere in the text, or None.

    Lenient where `first_option_letter` is strict — `" **C**"`, `" C is correct"`,
    `"Option C"` and `"answer: C"` all read as C — and wrong where a capital starts a word:
    `"I think B"` reads as I and `"A dog is shown"` as A.
    """
    match = _capital_pattern(letters).search(text)
    return match.group(0) if match else None


@lru_cache(maxsize=16)
def _capital_pattern(letters: str) -> re.Pattern[str]:
    return re.compile("[" + re.escape(letters) + "]")


ANSWER_PARSERS = {"strict": first_option_letter, "caprl": first_capital_letter}
"""How a sampled judge answer is read: `strict` (ours, `first_option_letter`) or `caprl`
(CapRL++'s first capital, `first_capital_letter`)."""


@lru_cache(maxsize=16)
def _letter_patterns(letters: str) -> tuple[re.Pattern[str], ...]:
    cls = "[" + re.escape(letters) + "]"
    return (
        re.compile(rf"^\s*\(?({cls})(?:[).:,]|[ \t]*(?:\n|$))"),
        re.compile(rf"(?i:answer is)\s*:?\s*\(?({cls})(?![A-Za-z])"),
        re.compile(rf"(?<![A-Za-z])\(?({cls})\)"),
    )
