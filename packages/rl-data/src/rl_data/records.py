"""Record Structs for every format the three replaced systems read, and row -> record converters.

A converter takes one decoded row (a dict from a JSONL line or a parquet row) and returns a
normalized, frozen record, or raises :class:`FieldError` naming the dotted field path. Readers
(:mod:`rl_data.readers`) add the file and line. Type checking is msgspec's (``msgspec.convert``
against a raw schema); the semantic checks (answer letter in range, ``rm_prompt_{i}`` numbering)
are ours.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from rl_data.choices import (
    Choice,
    answer_index,
    format_question_text,
    index_of,
    letter_of,
    normalize_choices,
    parse_question_text,
)

__all__ = [
    "CaptionQARecord",
    "ChatMessage",
    "FieldError",
    "ImageSource",
    "JudgeRecord",
    "OCRPrompt",
    "PreferenceRecord",
    "PromptRecord",
    "QAItem",
    "caption_qa_from_row",
    "judge_from_row",
    "ocr_prompt_from_line",
    "preference_from_row",
    "prompt_from_row",
    "qa_from_question_text",
]


class FieldError(ValueError):
    """A bad field in one row; ``field`` is a dotted path such as ``reward_model.ground_truth[0]``."""

    def __init__(self, field: str | None, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"field `{field}`: {reason}" if field else reason)


# ----------------------------------------------------------------------------- normalized records


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat turn. ``content`` is text or a list of content parts (``{"type": "text", ...}``)."""

    role: str
    content: str | list[dict[str, Any]]


class ImageSource(msgspec.Struct, frozen=True):
    """An image given by bytes, by path, or both (HF datasets' ``{bytes, path}``); bytes win.
    Relative paths are already resolved by the reader (against ``media_root``)."""

    path: str | None = None
    bytes: builtins.bytes | None = None


class QAItem(msgspec.Struct, frozen=True):
    """One multiple-choice question with normalized options; ``answer_letter`` indexes ``choices``."""

    question: str
    choices: list[Choice]
    answer_letter: str

    @property
    def answer_text(self) -> str:
        return self.choices[index_of(self.answer_letter)].text

    @property
    def question_text(self) -> str:
        """CapRL wire form (question, then ``   - X) option`` lines), as sent to ``/get_reward``."""
        return format_question_text(self.question, self.choices)


class CaptionQARecord(msgspec.Struct, frozen=True, kw_only=True):
    """A CapRL caption-QA row (docs/reference.md §1): the captioning prompt, its media, and the QA list
    the reward model answers from the caption. ``prompt`` is always chat messages (a string
    prompt becomes one user turn)."""

    prompt: list[ChatMessage]
    qa: list[QAItem]
    images: list[ImageSource] = []
    videos: list[str] = []
    data_source: str = ""
    extra_info: dict[str, Any] = {}

    @property
    def kind(self) -> str:
        """``"video"`` when the row has videos, else ``"image"``."""
        return "video" if self.videos else "image"


class JudgeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A verl-style row for generative-judge training (docs/reference.md §3): ``rm_prompts[i]`` is the
    ``rm_prompt_{i}`` template of judge i (``{response}`` placeholder; may be empty)."""

    prompt: list[ChatMessage]
    rm_prompts: list[str]
    ground_truth: Any = None
    extra_info: dict[str, Any] = {}
    data_source: str = ""


class OCRPrompt(msgspec.Struct, frozen=True):
    """One Flow-GRPO OCR prompt; ``target`` is the text between its first pair of double quotes.
    ``media``: the path of an image or a clip the sample starts from (a JSONL or parquet row's
    ``image`` or ``video``: Cosmos image/video to world), None for text alone."""

    prompt: str
    target: str
    media: str | None = None


class PromptRecord(msgspec.Struct, frozen=True):
    """A plain prompt (string or chat messages) plus the row's other fields, untouched."""

    prompt: str | list[ChatMessage]
    fields: dict[str, Any] = {}


class PreferenceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One preference pair for offline Diffusion-DPO (Wallace et al., 2023, "Diffusion Model
    Alignment Using Direct Preference Optimization"; Pick-a-Pic's layout): a text prompt, the
    generation people preferred (``chosen``) and the one they did not (``rejected``).

    Both members are images or both are videos, as caption QA holds them: an image is an
    :class:`ImageSource` (a resolved path, or bytes as ``datasets.Image`` stores them; decode with
    :func:`~rl_data.media.load_image`), a video is a resolved path (an animated GIF counts as a
    video; decode with :func:`~rl_data.media.sample_video`). ``fields`` holds the row's other
    columns, untouched.
    """

    prompt: str
    chosen: ImageSource | str
    rejected: ImageSource | str
    fields: dict[str, Any] = {}

    @property
    def media(self) -> Literal["image", "video"]:
        """``"video"`` for a pair of videos, ``"image"`` for a pair of images."""
        return "video" if isinstance(self.chosen, str) else "image"


# ----------------------------------------------------------------------------- raw schemas


class _RawQA(msgspec.Struct):
    question: str
    choices: list[str]
    answer: str


class _RawGroundTruth(msgspec.Struct):
    ground_truth: list[_RawQA]


class _RawImage(msgspec.Struct):
    """``{bytes, path}``: how ``datasets.Image`` and ``datasets.Video`` store media."""

    bytes: Any = None  # bytes (parquet) or a base64 str (JSON); checked in _image
    path: str | None = None


class _RawCaptionRow(msgspec.Struct):
    prompt: str | list[ChatMessage]
    reward_model: _RawGroundTruth
    image: str | _RawImage | None = None
    images: list[str | _RawImage] | None = None
    videos: list[str | _RawImage] | None = None
    data_source: str | None = None
    extra_info: dict[str, Any] | None = None


class _RawJudgeRow(msgspec.Struct):
    prompt: str | list[ChatMessage]
    reward_model: dict[str, Any]
    extra_info: dict[str, Any] | None = None
    data_source: str | None = None


class _RawPromptRow(msgspec.Struct):
    prompt: str | list[ChatMessage]


class _RawTextPromptRow(msgspec.Struct):
    prompt: str


_AT = re.compile(r"^(.*?)(?: - at `\$\.?(.*)`)?$", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def _convert(row: Any, schema: Any, prefix: str = "") -> Any:
    """``msgspec.convert`` whose ValidationError becomes a FieldError with a dotted path."""
    try:
        return msgspec.convert(row, schema)
    except msgspec.ValidationError as exc:
        reason, at = _AT.match(str(exc)).groups()  # type: ignore[union-attr]
        field = at or ""
        missing = _MISSING.match(reason)
        if missing:
            field = f"{field}.{missing.group(1)}" if field else missing.group(1)
        field = f"{prefix}{field}" if not field or field.startswith("[") or not prefix else f"{prefix}.{field}"
        raise FieldError(field or None, reason) from None


def _messages(prompt: str | list[ChatMessage]) -> list[ChatMessage]:
    if isinstance(prompt, str):
        return [ChatMessage("user", prompt)]
    if not prompt:
        raise FieldError("prompt", "empty message list")
    return prompt


def _resolve(path: str, media_root: Path | None) -> str:
    if media_root is None or Path(path).is_absolute():
        return path
    return str(media_root / path)


def _image(raw: str | _RawImage, field: str, media_root: Path | None) -> ImageSource:
    if isinstance(raw, str):
        return ImageSource(path=_resolve(raw, media_root))
    data = raw.bytes
    if data is not None and not isinstance(data, str | bytes | bytearray):
        raise FieldError(f"{field}.bytes", f"Expected `bytes | str | null`, got `{type(data).__name__}`")
    if isinstance(data, str):  # JSON cannot hold bytes: HF datasets dumps them base64-encoded
        try:
            data = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise FieldError(f"{field}.bytes", f"string is not valid base64: {exc}") from None
    if not data and not raw.path:
        raise FieldError(field, "image has neither bytes nor path")
    return ImageSource(path=_resolve(raw.path, media_root) if raw.path else None, bytes=bytes(data) if data else None)


def _video(raw: str | _RawImage, field: str, media_root: Path | None) -> str:
    if isinstance(raw, str):
        return _resolve(raw, media_root)
    if not raw.path:
        raise FieldError(field, "video has no path; rl-data decodes videos from files "
                                "(store paths, e.g. datasets.Video(decode=False) over files)")
    return _resolve(raw.path, media_root)


def _qa_item(raw: _RawQA, field: str) -> QAItem:
    if not raw.question.strip():
        raise FieldError(f"{field}.question", "empty question")
    try:
        choices = normalize_choices(raw.choices)
    except ValueError as exc:
        raise FieldError(f"{field}.choices", str(exc)) from None
    try:
        index = answer_index(raw.choices, raw.answer)
    except ValueError as exc:
        raise FieldError(f"{field}.answer", str(exc)) from None
    return QAItem(raw.question.strip(), choices, letter_of(index))


def qa_from_question_text(question_text: str, answer: str) -> QAItem:
    """One ``[question_text, answer_letter]`` pair of a CapRL ``/get_reward`` request -> QAItem.
    The answer must be one of the wire letters; raises ValueError otherwise (or on a malformed
    question, see :func:`~rl_data.choices.parse_question_text`)."""
    question, choices = parse_question_text(question_text)
    letter = answer.strip()
    if letter not in {c.letter for c in choices}:
        raise ValueError(f"answer {answer!r} is not one of the option letters "
                         f"{', '.join(c.letter for c in choices)}")
    return QAItem(question, choices, letter)


def caption_qa_from_row(row: Any, *, media_root: str | Path | None = None) -> CaptionQARecord:
    """Convert one CapRL row (image or video) into a :class:`CaptionQARecord`.

    ``image`` may be a path, raw bytes (parquet), or ``{bytes, path}``; ``images`` a list of those;
    ``videos`` a list of paths (or ``{path, bytes}`` holding a path, as ``datasets.Video`` stores
    them). Relative media paths are joined to ``media_root``. Each QA answer
    is read in the options' original labelling and mapped to the normalized letter. An empty QA
    list is an error (CapRL silently zeroed the whole batch on it).
    """
    if isinstance(row, dict) and isinstance(row.get("image"), bytes | bytearray):
        row = {**row, "image": {"bytes": bytes(row["image"])}}
    raw = _convert(row, _RawCaptionRow)
    root = Path(media_root) if media_root is not None else None
    images = [_image(raw.image, "image", root)] if raw.image is not None else []
    images += [_image(im, f"images[{i}]", root) for i, im in enumerate(raw.images or [])]
    videos = [_video(v, f"videos[{i}]", root) for i, v in enumerate(raw.videos or [])]
    if not images and not videos:
        raise FieldError("image", "row has no `image`, `images` or `videos`")
    gt = raw.reward_model.ground_truth
    if not gt:
        raise FieldError("reward_model.ground_truth", "empty QA list: nothing to score from")
    qa = [_qa_item(q, f"reward_model.ground_truth[{i}]") for i, q in enumerate(gt)]
    return CaptionQARecord(
        prompt=_messages(raw.prompt),
        qa=qa,
        images=images,
        videos=videos,
        data_source=raw.data_source or "",
        extra_info=raw.extra_info or {},
    )


_RM_PROMPT = re.compile(r"^rm_prompt_(\d+)$")


def judge_from_row(row: Any) -> JudgeRecord:
    """Convert one verl-style generative-judge row into a :class:`JudgeRecord`.

    Columns ``rm_prompt_0 … rm_prompt_{k-1}`` become ``rm_prompts`` in order; a gap in the
    numbering is an error, a null or empty template becomes ``""`` (the judge's ``rm_preprocess``
    builds its input itself). ``reward_model`` must hold ``ground_truth``.
    """
    if not isinstance(row, dict):
        raise FieldError(None, f"expected an object, got {type(row).__name__}")
    raw = _convert(row, _RawJudgeRow)
    if "ground_truth" not in raw.reward_model:
        raise FieldError("reward_model.ground_truth", "missing (verl puts the reference here)")
    numbered = {int(m.group(1)): k for k in row if (m := _RM_PROMPT.match(k))}
    rm_prompts = []
    for i in range(len(numbered)):
        if i not in numbered:
            raise FieldError(f"rm_prompt_{i}", f"missing; judge columns are {sorted(numbered)}")
        value = row[numbered[i]]
        if value is not None and not isinstance(value, str):
            raise FieldError(f"rm_prompt_{i}", f"Expected `str | null`, got `{type(value).__name__}`")
        rm_prompts.append(value or "")
    return JudgeRecord(
        prompt=_messages(raw.prompt),
        rm_prompts=rm_prompts,
        ground_truth=raw.reward_model["ground_truth"],
        extra_info=raw.extra_info or {},
        data_source=raw.data_source or "",
    )


def prompt_from_row(row: Any) -> PromptRecord:
    """Convert ``{"prompt": str | messages, ...}`` into a :class:`PromptRecord`; other fields are
    kept as they are in ``fields``."""
    raw = _convert(row, _RawPromptRow)
    if isinstance(raw.prompt, str) and not raw.prompt.strip():
        raise FieldError("prompt", "empty prompt")
    prompt = raw.prompt if isinstance(raw.prompt, str) else _messages(raw.prompt)
    return PromptRecord(prompt, {k: v for k, v in row.items() if k != "prompt"})


# A pair member whose path ends in one of these is a video (decoded by PyAV), any other an image.
VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".gif"})


def _pair_member(row: dict[str, Any], column: str, media_root: Path | None) -> ImageSource | str:
    """``row[column]`` as an image (:class:`ImageSource`) or a video path, by its path's suffix;
    bytes alone are an image (``datasets.Image``)."""
    if column not in row:
        raise FieldError(column, f"Object missing required field `{column}`")
    value = row[column]
    if isinstance(value, bytes | bytearray):  # a parquet binary column (Pick-a-Pic's jpg_0)
        value = {"bytes": bytes(value)}
    raw = _convert(value, str | _RawImage, prefix=column)
    path = raw if isinstance(raw, str) else raw.path
    if isinstance(raw, str) and not raw.strip():
        raise FieldError(column, "empty path")
    if path and Path(path).suffix.lower() in VIDEO_SUFFIXES:
        return _video(raw, column, media_root)
    image = _image(raw, column, media_root)
    if image.bytes is not None and _is_video_bytes(image.bytes):
        raise FieldError(column, "video given as bytes; rl-data decodes videos from files (store "
                                 "paths, e.g. datasets.Video(decode=False) over files)")
    return image


def _is_video_bytes(data: bytes) -> bool:
    """MP4/MOV (an ``ftyp`` box first), Matroska/WebM (an EBML header) or AVI (``RIFF....AVI ``):
    bytes that would otherwise be taken for an image and fail only when decoded."""
    return data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3" or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")


def _pickapic_columns(label: Any) -> tuple[str, str]:
    """(chosen, rejected) columns of a Pick-a-Pic row from its ``label_0``: 1 prefers ``jpg_0``,
    0 prefers ``jpg_1``; a tie (0.5) is refused, as Diffusion-DPO drops ties before training."""
    if label == 0.5:
        raise FieldError("label_0", "a tie (0.5): neither image is preferred; drop ties first, as "
                                    "Diffusion-DPO does (dataset.filter(lambda r: r['label_0'] != 0.5)), "
                                    "or read with on_error='skip'")
    if isinstance(label, bool) or not isinstance(label, int | float) or label not in (0, 1):
        raise FieldError("label_0", f"expected 1 (jpg_0 preferred), 0 (jpg_1 preferred) or 0.5 "
                                    f"(a tie), got {label!r}")
    return ("jpg_0", "jpg_1") if label == 1 else ("jpg_1", "jpg_0")


def preference_from_row(row: Any, *, media_root: str | Path | None = None) -> PreferenceRecord:
    """Convert one preference row into a :class:`PreferenceRecord`.

    Two layouts: ours, ``{prompt, chosen, rejected, ...}``, and Pick-a-Pic's, ``{prompt, jpg_0,
    jpg_1, label_0, ...}`` (read when the row has ``label_0`` and neither ``chosen`` nor
    ``rejected``; ``label_0`` and ``label_1`` are then dropped, ties refused). A member is a path
    (an image, or a video by its suffix: ``.mp4``, ``.gif``, ...), raw bytes, or ``{bytes, path}``
    (bytes in JSON are base64); relative paths are joined to ``media_root``. Refused: an empty
    prompt, a pair of an image and a video, and a pair whose two members are the same media.
    """
    if not isinstance(row, dict):
        raise FieldError(None, f"expected an object, got {type(row).__name__}")
    prompt = _convert(row, _RawTextPromptRow).prompt
    if not prompt.strip():
        raise FieldError("prompt", "empty prompt")
    pickapic = "chosen" not in row and "rejected" not in row and "label_0" in row
    win, lose = _pickapic_columns(row["label_0"]) if pickapic else ("chosen", "rejected")
    root = Path(media_root) if media_root is not None else None
    chosen, rejected = _pair_member(row, win, root), _pair_member(row, lose, root)
    kinds = ["a video" if isinstance(m, str) else "an image" for m in (chosen, rejected)]
    if kinds[0] != kinds[1]:
        raise FieldError(lose, f"{win} is {kinds[0]} and {lose} is {kinds[1]}: a pair is two "
                               "images or two videos")
    if chosen == rejected:
        raise FieldError(lose, f"the same media as {win}: a pair needs two different generations")
    consumed = {"prompt", win, lose, *(("label_0", "label_1") if pickapic else ())}
    return PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected,
                            fields={k: v for k, v in row.items() if k not in consumed})


def ocr_prompt_from_row(row: Any, *, media_root: str | Path | None = None) -> OCRPrompt:
    """A manifest line (``str``) or a row with ``prompt`` and at most one of ``image`` / ``video``
    (a path, joined to ``media_root`` when relative) as an :class:`OCRPrompt`."""
    if isinstance(row, str):
        return ocr_prompt_from_line(row)
    if not isinstance(row, Mapping) or "prompt" not in row:
        raise FieldError("prompt", "missing: an OCR prompt row needs a `prompt` (or `text`) column")
    if not isinstance(row["prompt"], str):
        raise FieldError("prompt", f"Expected `str`, got `{type(row['prompt']).__name__}`")
    given = [field for field in ("image", "video") if row.get(field) is not None]
    if len(given) > 1:
        raise FieldError("video", "a row starts from one image or one video, not both")
    media = row[given[0]] if given else None
    if media is not None and not isinstance(media, str):
        raise FieldError(given[0], f"Expected a path (`str`), got `{type(media).__name__}`")
    prompt = ocr_prompt_from_line(row["prompt"].strip())
    root = Path(media_root) if media_root is not None else None
    return prompt if media is None else OCRPrompt(prompt.prompt, prompt.target, _resolve(media, root))


def ocr_prompt_from_line(line: str) -> OCRPrompt:
    """``'A sign that says "OPEN"'`` -> ``OCRPrompt(prompt, target="OPEN")`` (Flow-GRPO's
    ``prompt.split('"')[1]``). No pair of double quotes, or an empty target, is an error."""
    parts = line.split('"')
    if len(parts) < 3:
        raise FieldError("prompt", f'no text between a pair of double quotes in {line!r}')
    if not parts[1].strip():
        raise FieldError("prompt", f'empty target between the first pair of double quotes in {line!r}')
    return OCRPrompt(line, parts[1])
