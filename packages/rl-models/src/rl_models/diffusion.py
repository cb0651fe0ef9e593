"""Stable Diffusion 3 / 3.5 through diffusers (extra `[diffusers]`).

`load_sd3` returns the pipeline, whose parts (transformer, vae, text encoders 1-3, tokenizers
1-3, scheduler) a Flow-GRPO style trainer uses directly: LoRA on `pipeline.transformer`, prompt
embeddings from `pipeline.encode_prompt`, SDE steps on the scheduler's sigmas.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch

from rl_models.loading import resolve_dtype

INSTALL_HINT = 'pip install "rl-models[diffusers]"; in a clone of the repository: uv sync --all-packages --extra diffusers'


def require_diffusers() -> ModuleType:
    """Import diffusers or fail with the install command."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as err:
        raise ImportError(f"SD3 support needs diffusers: {INSTALL_HINT}") from err


def load_sd3(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    text_encoder_dtype: str | torch.dtype | None = None,
):
    """Load a `StableDiffusion3Pipeline` (SD3, SD3.5-Medium/Large) from a folder or hub id.

    `text_encoder_dtype` keeps the three text encoders in another dtype (e.g. bf16 encoders next to
    an fp32 transformer being trained); None uses `dtype`. The VAE follows `dtype`.
    """
    diffusers = require_diffusers()
    pipeline = diffusers.StableDiffusion3Pipeline.from_pretrained(
        str(path_or_id), dtype=resolve_dtype(dtype)
    )
    if text_encoder_dtype is not None:
        encoder_dtype = resolve_dtype(text_encoder_dtype)
        for encoder in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3):
            encoder.to(encoder_dtype)
    if device is not None:
        pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
