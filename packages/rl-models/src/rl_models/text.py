"""Text causal LMs (Qwen3 and any `AutoModelForCausalLM`) as policy, reference or judge."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rl_models.loading import pretrained_kwargs


class CausalLM(NamedTuple):
    """A loaded causal LM and its tokenizer; unpacks as `model, tokenizer = load_causal_lm(...)`."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def load_causal_lm(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    padding_side: str = "left",
) -> CausalLM:
    """Load a causal LM + tokenizer from a local folder or a hub id, in eval mode.

    `padding_side="left"` suits batched generation (the default for policies and judges);
    pass "right" for training-style batches. The tokenizer's pad token falls back to EOS when the
    checkpoint defines none.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path_or_id), padding_side=padding_side)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return CausalLM(model, tokenizer)
