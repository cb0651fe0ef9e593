"""Turn engine requests (token ids, text, chat messages with images/videos) into one
left-padded model batch.

Each request is encoded on its own (so errors and lengths are per request), then rows are
left-padded together. Multimodal tensors from a Qwen-VL processor are merged the way the
processor merges a batch: sequence-aligned tensors (`mm_token_type_ids`, shape `[1, T]`) are
left-padded like `input_ids`; everything else (`pixel_values`, `image_grid_thw`,
`pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`) is concatenated along dim 0 in
row order.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from rl_rollout.protocol import Prompt, is_chat_messages, is_token_ids

_MEDIA_TYPES = ("image", "video")


@dataclass(frozen=True)
class EncodedPrompt:
    """One request after tokenization. `media` holds the processor's extra tensors (VL only)."""

    ids: list[int]
    media: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded rows ready for a prefill step.

    input_ids:      [B, T] left-padded with the pad token
    attention_mask: [B, T] 1 on real tokens
    lengths:        [B]    real prompt lengths
    media:          processor tensors for the prefill step only (pixel_values, grids, ...)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    media: dict[str, torch.Tensor]


def _has_media(messages: list[dict[str, Any]]) -> bool:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(part.get("type") in _MEDIA_TYPES for part in content):
            return True
    return False


def encode_prompt(
    prompt: Prompt, tokenizer: PreTrainedTokenizerBase, processor: ProcessorMixin | None, index: int
) -> EncodedPrompt:
    """Encode one request. Chat messages get the chat template with the generation prompt;
    messages holding images/videos go through the (VL) processor."""
    if isinstance(prompt, str):
        return EncodedPrompt(ids=tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not prompt:
        raise ValueError(f"request {index}: empty prompt")
    if is_token_ids(prompt):
        return EncodedPrompt(ids=list(prompt))
    if not is_chat_messages(prompt):
        raise TypeError(f"request {index}: a prompt is token ids, a string, or a list of chat messages")
    # apply_chat_template is typed with every return of every flag: tokenize=True and
    # return_dict=True give a BatchEncoding (tokenizer) or BatchFeature (processor)
    if not _has_media(prompt):
        ids = cast(Mapping[str, Any], tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True))
        return EncodedPrompt(ids=list(ids["input_ids"]))
    if processor is None:
        raise ValueError(f"request {index}: holds images/videos but the engine has no processor (pass an AutoProcessor)")
    encoded = cast(MutableMapping[str, Any], processor.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    ))
    ids = encoded.pop("input_ids")[0].tolist()
    encoded.pop("attention_mask", None)
    media = {key: torch.as_tensor(value) for key, value in encoded.items()}
    return EncodedPrompt(ids=ids, media=media)


def _merge_media(rows: Sequence[EncodedPrompt], width: int) -> dict[str, torch.Tensor]:
    keys = sorted({key for row in rows for key in row.media})
    merged: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [row.media.get(key) for row in rows]
        if any(p is not None and p.ndim == 2 and p.shape[0] == 1 and p.shape[1] == len(row.ids) for p, row in zip(parts, rows, strict=True)):
            # sequence-aligned ([1, T_i]): left-pad to the batch width; text-only rows get zeros
            padded = torch.zeros(len(rows), width, dtype=next(p for p in parts if p is not None).dtype)  # [B, T]
            for i, (p, row) in enumerate(zip(parts, rows, strict=True)):
                if p is not None:
                    padded[i, width - len(row.ids) :] = p[0]
            merged[key] = padded
        else:
            merged[key] = torch.cat([p for p in parts if p is not None], dim=0)
    return merged


def pad_batch(rows: Sequence[EncodedPrompt], pad_id: int) -> PromptBatch:
    """Left-pad encoded prompts into one batch."""
    width = max(len(row.ids) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    for i, row in enumerate(rows):
        input_ids[i, width - len(row.ids) :] = torch.tensor(row.ids, dtype=torch.long)
        attention_mask[i, width - len(row.ids) :] = 1
    lengths = torch.tensor([len(row.ids) for row in rows], dtype=torch.long)  # [B]
    return PromptBatch(input_ids, attention_mask, lengths, _merge_media(rows, width))
