"""Qwen-VL captioners (Qwen2.5-VL, Qwen3-VL) through `AutoModelForImageTextToText` + `AutoProcessor`.

Videos: pass frames already sampled (e.g. by `rl_data.media.sample_video`) together with their
`video_metadata` (source fps and frame indices) and `do_sample_frames=False`, so Qwen3-VL's
`<t seconds>` stamps and Qwen2.5-VL's `second_per_grid_ts` come out right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, PreTrainedModel, ProcessorMixin

from rl_models.loading import pretrained_kwargs

# config.model_type of the models whose forward takes pixel inputs and computes M-RoPE positions.
VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


class VisionLanguageModel(NamedTuple):
    """A loaded VL model and its processor (unpacks as `model, processor`)."""

    model: PreTrainedModel
    processor: ProcessorMixin


def load_vl_model(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    padding_side: str = "left",
) -> VisionLanguageModel:
    """Load a Qwen2.5-VL / Qwen3-VL model and its processor (image + video), in eval mode."""
    model = AutoModelForImageTextToText.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    processor = AutoProcessor.from_pretrained(str(path_or_id), padding_side=padding_side)
    return VisionLanguageModel(model, processor)


def placeholder_ids(config: Any) -> frozenset[int]:
    """A Qwen-VL model's vision placeholder tokens (image, video, vision start). A completion that
    samples one (a random or badly drifted policy can) would be read as an image slot by the
    model's forward: trainers drop such rollouts from the update and count them."""
    values = config.to_dict()
    return frozenset(values[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id")
                     if values.get(k) is not None)
