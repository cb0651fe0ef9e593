"""Multiple-choice options: parse, normalize, relabel and format.

CapRL (docs/reference.md §1) stores options in several styles — ``"A. text"``, ``"A) text"``, bare
text — and its reward worker shuffles and relabels them A, B, … *without* stripping an existing
label, so ``"A. cat"`` becomes ``"C) A. cat"`` and the model sees two contradicting letters (the
"stale-letter" defect). Here a label is always split off first and the letter is re-assigned by
position, so a :class:`Choice` never carries a second letter inside its text.

Recognised label styles (uppercase letter, then a delimiter, then whitespace or end of text):
``"A. text"``, ``"A) text"``, ``"(A) text"``, ``"A: text"`` (also the full-width ``．`` / ``：``).
Anything else is bare text — ``"U.S. flag"`` and ``"A cat"`` keep their first letter because no
whitespace follows the delimiter, or no delimiter is present.

The CapRL wire format for one question (the first element of each ``[question_text, answer]`` pair
of a ``/get_reward`` request) is the question followed by one option per line::

    What colour is the circle?
       - A) red
       - B) blue

:func:`parse_question_text` reads it and :func:`format_question_text` writes it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import msgspec

__all__ = [
    "Choice",
    "answer_index",
    "format_options",
    "format_question_text",
    "index_of",
    "letter_of",
    "normalize_choices",
    "parse_question_text",
    "split_label",
]

LETTERS = string.ascii_uppercase
_LABEL = re.compile(r"^\s*(?:\(([A-Z])\)[.:：．]?|([A-Z])[.)．:：])(?:\s+|$)(.*)$", re.DOTALL)
_WIRE_OPTION = re.compile(r"^\s*-\s*([A-Z])\)(?:\s+|$)(.*)$")
_ANSWER = re.compile(r"^\s*\(?([A-Z])\s*[.)．:：]?\s*$")


class Choice(msgspec.Struct, frozen=True):
    """One option of a multiple-choice question: ``letter`` is its position label (A = first)."""

    letter: str
    text: str


def letter_of(index: int) -> str:
    """Position -> label: 0 -> "A", 1 -> "B", …; at most 26 options."""
    if not 0 <= index < len(LETTERS):
        raise ValueError(f"option index {index} out of range: at most {len(LETTERS)} options (A-Z)")
    return LETTERS[index]


def index_of(letter: str) -> int:
    """Label -> position: "A" -> 0. Accepts exactly one uppercase letter."""
    if len(letter) != 1 or letter not in LETTERS:
        raise ValueError(f"option letter must be one uppercase letter A-Z, got {letter!r}")
    return LETTERS.index(letter)


def split_label(option: str) -> tuple[str | None, str]:
    """``"B) dog"`` -> ``("B", "dog")``; bare ``"dog"`` -> ``(None, "dog")``. Text is stripped."""
    match = _LABEL.match(option)
    if match is None:
        return None, option.strip()
    return match.group(1) or match.group(2), match.group(3).strip()


def normalize_choices(choices: Sequence[str | Choice]) -> list[Choice]:
    """Strip any label from each option and re-letter them A, B, … by position.

    >>> normalize_choices(["A. red", "(B) blue", "green"])
    [Choice(letter='A', text='red'), Choice(letter='B', text='blue'), Choice(letter='C', text='green')]

    Raises ValueError on an empty list, an option with empty text, or more than 26 options.
    """
    if not choices:
        raise ValueError("a question needs at least one option, got an empty list")
    out = []
    for i, option in enumerate(choices):
        text = option.text if isinstance(option, Choice) else split_label(option)[1]
        if not text:
            raise ValueError(f"option {i} ({option!r}) has empty text")
        out.append(Choice(letter_of(i), text))
    return out


def answer_index(choices: Sequence[str], answer: str) -> int:
    """Position of the gold option, reading ``answer`` in the options' ORIGINAL labelling.

    Each option's original label is the one written in front of it (``"C) dog"`` -> C), or its
    positional letter when it is bare. ``answer`` may be a letter (``"B"``, ``"B)"``, ``"(B)"``) or
    the full text of one option (with or without its label). Raises ValueError naming the answer
    and the valid labels when it matches no option or more than one.
    """
    labels = [split_label(c)[0] or letter_of(i) for i, c in enumerate(choices)]
    texts = [split_label(c)[1] for c in choices]
    letter = _ANSWER.match(answer)
    if letter is not None:
        hits = [i for i, label in enumerate(labels) if label == letter.group(1)]
    else:
        wanted = split_label(answer)[1]
        hits = [i for i, text in enumerate(texts) if text == wanted]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise ValueError(
            f"answer {answer!r} matches no option; options are labelled {', '.join(labels)}"
        )
    raise ValueError(f"answer {answer!r} matches options {hits}: option labels are ambiguous")


def format_options(choices: Sequence[Choice]) -> str:
    """CapRL option lines: ``"   - A) red\\n   - B) blue"`` (inverse of the option part of
    :func:`parse_question_text`). Letters are taken by position, not from ``Choice.letter``."""
    return "\n".join(f"   - {letter_of(i)}) {c.text}" for i, c in enumerate(choices))


def format_question_text(question: str, choices: Sequence[Choice]) -> str:
    """CapRL ``question_text``: the question, a newline, then :func:`format_options`."""
    return f"{question.strip()}\n{format_options(choices)}"


def parse_question_text(question_text: str) -> tuple[str, list[Choice]]:
    """Split CapRL's ``question_text`` into the question and its options.

    Option lines are the trailing lines written ``- X) text`` (any indent); every line before the
    first option line is the question. Wire letters must run A, B, C, … in order (the gold
    answer letter sent alongside refers to them). A label left inside the option text by an old
    client (``"   - C) A. cat"``) is stripped, so the stale letter does not survive.

    Raises ValueError naming the offending line when there is no question, no option, a
    non-option line after the options, or letters out of order.
    """
    lines = [line for line in question_text.strip("\n").splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if _WIRE_OPTION.match(line)), None)
    if first is None:
        raise ValueError(f"no option lines ('   - A) text') in question text {question_text!r}")
    question = "\n".join(line.strip() for line in lines[:first])
    if not question:
        raise ValueError(f"question text has options but no question: {question_text!r}")
    texts = []
    for j, line in enumerate(lines[first:]):
        match = _WIRE_OPTION.match(line)
        if match is None:
            raise ValueError(f"line {first + j + 1} ({line!r}) follows the options but is not one")
        if match.group(1) != letter_of(j):
            raise ValueError(
                f"line {first + j + 1} ({line!r}): expected option letter {letter_of(j)}, "
                f"got {match.group(1)}"
            )
        texts.append(match.group(2))
    return question, normalize_choices(texts)
