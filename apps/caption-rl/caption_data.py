"""caption-rl's data: CapRL caption-QA records -> chat messages with decoded media -> the prompts
the engine decodes, with the bad-record rule: a record whose media will not decode, whose
`<image>`/`<video>` markers do not match its media, or that has no user turn is skipped and
counted with its file and line, exactly like a record that fails to parse; a prompt over
`rollout.max_prompt_length` tokens is dropped (counted in `rollout/dropped_long`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from caption_config import DataConfig

from rl_core.train import UserError
from rl_data import (
    CaptionQARecord,
    Location,
    ReadStats,
    RecordError,
    chat_messages,
    format_question_text,
    open_source,
)
from rl_data.media import MEDIA_MARKER
from rl_rewards import Sample
from rl_rollout.prompts import EncodedPrompt, encode_prompt


@dataclass(frozen=True)
class Dataset:
    train: list[CaptionQARecord]
    eval: list[CaptionQARecord]
    skipped: int  # records without QA / malformed, skipped and counted
    train_where: list[Location]  # file and line of each train record (for errors found later)
    eval_where: list[Location]


def load_records(
    train_files: Sequence[str], eval_files: Sequence[str], *, eval_size: int, task: str, seed: int
) -> Dataset:
    """Read every source — a JSONL/parquet file, a `save_to_disk` directory or a Hub id in the
    local cache (bad records skipped and counted, with file and line or dataset and row in the
    log) — keep the rows of `task`, and hold out `eval_size` train records when no eval source is given."""
    if not train_files:
        raise UserError("data.train_files is empty: name at least one CapRL caption-QA file or dataset (or set DATASET)")
    skipped = 0

    def read(files: Sequence[str]) -> list[tuple[Location, CaptionQARecord]]:
        nonlocal skipped
        out = []
        for file in files:
            try:
                reader = open_source(file, kind="caption_qa", on_error="skip")
            except FileNotFoundError as e:
                detail = "" if str(e).startswith("data file not found") else f": {e}"  # why a dir / Hub id failed
                raise UserError(f"dataset file not found: {file} (data.train_files / data.val_files / DATASET){detail}") from None
            except ValueError as e:  # an unsupported file type, a dataset with several splits
                raise UserError(f"{e} (data.train_files / data.val_files / DATASET)") from None
            for where, r in reader.located():
                if task == "auto" or r.kind == task:
                    # a Hub id has no path: name it, so errors found later (media) still say where
                    out.append((where if where.path is not None else where._replace(path=Path(file)), r))
            skipped += reader.skipped
        return out

    train, held = read(train_files), read(eval_files)
    if not train:
        kind = f"{task} " if task != "auto" else ""
        raise UserError(f"no usable {kind}training records in {list(train_files)} ({skipped} skipped as malformed "
                        "or without QA; data.task selects image or video rows)")
    if not held and eval_size > 0:
        if eval_size >= len(train):
            raise UserError(f"data.eval_size={eval_size} would hold out all {len(train)} training records of "
                            f"{list(train_files)}: lower data.eval_size or give held-out files in data.val_files")
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        picked = set(order[:eval_size])
        held = [r for i, r in enumerate(train) if i in picked]
        train = [r for i, r in enumerate(train) if i not in picked]
    return Dataset([r for _, r in train], [r for _, r in held], skipped, [w for w, _ in train], [w for w, _ in held])


def prompt_text(record: CaptionQARecord) -> str:
    text = " ".join(m.content for m in record.prompt if isinstance(m.content, str))
    return MEDIA_MARKER.sub("", text).strip()


def qa_pairs(record: CaptionQARecord) -> list[tuple[str, str]]:
    """CapRL wire QA: `[(question_text with "   - A) ..." options, gold letter), ...]`."""
    return [(format_question_text(q.question, q.choices), q.answer_letter) for q in record.qa]


def make_sample(record: CaptionQARecord, caption: str, tokens: int | None = None) -> Sample:
    """The reward's view of one caption; `tokens` (its length in tokens) feeds the `overlong` scorer."""
    media = {"video": record.videos[0]} if record.videos else {"image": record.images[0].path or ""}
    counted = {"completion_tokens": tokens} if tokens is not None else {}
    return Sample(completion=caption, prompt=prompt_text(record), reference=qa_pairs(record),
                  metadata={"task": record.kind, "data_source": record.data_source, **media, **counted})


@dataclass(frozen=True)
class Encoded:
    """Records turned into model input: the kept records, their prompts encoded exactly as the
    `hf` engine encodes them, their chat messages with decoded media, and their positions in
    the input; `too_long` prompts were dropped."""

    records: list[CaptionQARecord]
    prompts: list[EncodedPrompt]
    messages: list[list[dict[str, Any]]]
    positions: list[int]
    too_long: int


def encode_records(records: Sequence[CaptionQARecord], where: Sequence[Location], processor: Any, d: DataConfig,
                   max_prompt_length: int, bad: ReadStats) -> Encoded:
    """Encode `records` for the engine (media decoded as `data.*` say); a record that cannot
    become model input is recorded in `bad` (logged with its file and line) and skipped."""
    kept: list[CaptionQARecord] = []
    prompts: list[EncodedPrompt] = []
    messages: list[list[dict[str, Any]]] = []
    positions: list[int] = []
    too_long = 0
    for position, (record, loc) in enumerate(zip(records, where, strict=True)):
        try:
            message = chat_messages(record.prompt, record.images, record.videos, fps=d.video_fps,
                                    max_frames=d.video_max_frames, max_pixels=d.max_pixels)
            prompt = encode_prompt(message, processor.tokenizer, processor, len(kept))
        except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:  # unreadable media, marker mismatch
            bad.record_skip(RecordError(loc.path, loc.line, None, f"{type(e).__name__}: {e}", unit=loc.unit))
            continue
        if len(prompt.ids) > max_prompt_length:
            too_long += 1
            continue
        kept.append(record)
        prompts.append(prompt)
        messages.append(message)
        positions.append(position)
    return Encoded(kept, prompts, messages, positions, too_long)
