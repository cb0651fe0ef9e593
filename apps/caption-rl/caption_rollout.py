"""Records -> model input for the rollout engine, with the bad-record rule: a record whose media
will not decode, whose `<image>`/`<video>` markers do not match its media, or that has no user
turn is skipped and counted with its file and line, exactly like a record that fails to parse;
a prompt over `rollout.max_prompt_length` tokens is dropped (counted in `rollout/dropped_long`)."""

from __future__ import annotations

from typing import Any

from caption_parts import to_messages

from rl_data import CaptionQARecord, GroupSampler, Location, RecordError
from rl_rollout.prompts import EncodedPrompt, encode_prompt


def take(sampler: GroupSampler, count: int) -> list[int]:
    """The next `count` sampler indices, crossing into the next epoch when one runs out."""
    out: list[int] = []
    while len(out) < count:
        for index in sampler:
            out.append(index)
            if len(out) == count:
                break
    return out


def encode_records(run: Any, records: list[CaptionQARecord], where: list[Location]
                   ) -> tuple[list[CaptionQARecord], list[EncodedPrompt], list[list[dict[str, Any]]], list[int]]:
    """(kept records, their prompts encoded exactly as the `hf` engine encodes them, their chat
    messages with decoded media, their positions in `records`). Skipped records are counted in
    `run.bad_records`, prompts over the length limit in `run.dropped_long`."""
    d, limit = run.cfg.data, run.cfg.rollout.max_prompt_length
    kept: list[CaptionQARecord] = []
    encoded: list[EncodedPrompt] = []
    messages: list[list[dict[str, Any]]] = []
    positions: list[int] = []
    for position, (record, loc) in enumerate(zip(records, where, strict=True)):
        try:
            message = to_messages(record, fps=d.video_fps, max_frames=d.video_max_frames, max_pixels=d.max_pixels)
            prompt = encode_prompt(message, run.processor.tokenizer, run.processor, len(kept))
        except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:  # unreadable media, marker mismatch
            run.bad_records.record_skip(RecordError(loc.path, loc.line, None, f"{type(e).__name__}: {e}", unit=loc.unit))
            continue
        if len(prompt.ids) > limit:
            run.dropped_long += 1
            continue
        kept.append(record)
        encoded.append(prompt)
        messages.append(message)
        positions.append(position)
    return kept, encoded, messages, positions
