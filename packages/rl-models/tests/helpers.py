"""Shared test inputs: a deterministic image and video clip, and the naive log-prob reference."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from rl_models.logprobs import TokenBatch


def image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (60, 80, 3), dtype=np.uint8))


def video(frames: int = 4) -> tuple[np.ndarray, VideoMetadata]:
    """`frames` frames `[N, H, W, 3]` sampled at 2 fps from a 4 fps source, plus metadata."""
    clip = np.random.default_rng(1).integers(0, 255, (frames, 48, 64, 3), dtype=np.uint8)
    meta = VideoMetadata(
        total_num_frames=2 * frames, fps=4.0, frames_indices=list(range(0, 2 * frames, 2))
    )
    return clip, meta


def naive_logprobs(model, batch: TokenBatch, temperature: float = 1.0, **forward) -> torch.Tensor:
    """Full `[B, T, V]` logits -> log_softmax -> gather: the reference `completion_logprobs` must equal."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, **forward
        ).logits  # [B, T, V]
    p = batch.prompt_length
    logp = torch.log_softmax(logits[:, p - 1 : -1].float() / temperature, dim=-1)  # [B, C, V]
    picked = logp.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # [B, C]
    return picked * batch.completion_mask
