"""Keyword arguments shared by every loader: dtype, device and attention implementation."""

from __future__ import annotations

from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """`torch.dtype`, one of `DTYPES`' names, or "auto" (the checkpoint's own dtype)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_device() -> str:
    """Where a model loaded for serving/scoring goes when the caller names no device: CUDA when
    available, else the CPU (`from_pretrained` alone would leave it on the CPU)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pretrained_kwargs(
    *,
    dtype: str | torch.dtype,
    device: str | torch.device | None,
    attn_implementation: str | None,
) -> dict[str, Any]:
    """`from_pretrained` kwargs: weights go straight to `device` (no CPU copy first)."""
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype)}
    if device is not None:
        kwargs["device_map"] = str(device)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs
