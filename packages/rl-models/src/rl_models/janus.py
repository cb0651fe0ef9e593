"""Janus / Janus-Pro (`JanusForConditionalGeneration`) for image-token generation (GRPO on the
image-token head, 576 tokens per 384x384 image, CFG 5) and image understanding."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from transformers import JanusForConditionalGeneration, JanusProcessor

from rl_models.loading import pretrained_kwargs


class JanusModel(NamedTuple):
    """A loaded Janus model and its processor (unpacks as `model, processor`)."""

    model: JanusForConditionalGeneration
    processor: JanusProcessor


def load_janus(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> JanusModel:
    """Load a Janus checkpoint in transformers format (e.g. `deepseek-community/Janus-Pro-1B`).

    Image generation: `processor(text=[prompt], generation_mode="image")`, then
    `model.generate(**inputs, generation_mode="image", do_sample=True)` returns image-token ids
    and `model.decode_image_tokens(ids)` the pixels.
    """
    model = JanusForConditionalGeneration.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    return JanusModel(model, JanusProcessor.from_pretrained(str(path_or_id)))
