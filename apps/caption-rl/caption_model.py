"""caption-rl's model: the captioner (LoRA, gradient checkpointing, compiled layers, shared
media) and the KL reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from caption_config import ModelConfig
from peft import PeftModel
from transformers import PreTrainedModel

from rl_models import tiny
from rl_models.compiled import compile_decoder_layers
from rl_models.lora import add_lora, disabled_adapter
from rl_models.shared_media import share_identical_media
from rl_models.vl import load_vl_model


def load_policy(cfg: ModelConfig, *, trainable: bool = True) -> tuple[torch.nn.Module, Any, str]:
    """The captioner with LoRA / gradient checkpointing / compiled layers as configured; with
    `trainable=False` a frozen copy of the initial policy (the full fine-tuning KL reference)."""
    path = tiny.resolve(cfg.path, key="model.path / CAPTION_MODEL")
    model: PreTrainedModel | PeftModel
    model, processor = load_vl_model(path, dtype=cfg.dtype)
    if cfg.share_media:
        share_identical_media(model)
    if not trainable:
        return model.eval().requires_grad_(False), processor, path
    if cfg.lora_rank > 0:
        model = add_lora(model, r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.compile_layers == "on" or (cfg.compile_layers == "auto" and torch.cuda.is_available()):
        compile_decoder_layers(model)
    return model, processor, path


@contextmanager
def reference_model(policy: torch.nn.Module, model: torch.nn.Module, frozen: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The KL reference: the trained `Policy` with its LoRA adapter disabled (no second copy of
    the weights; sharded or not), or `frozen`, a copy of the initial policy for full fine-tuning."""
    if frozen is not None:
        yield frozen
        return
    with disabled_adapter(cast(PeftModel, model)):  # no frozen copy: the policy has a LoRA adapter
        yield policy
