"""Encoders for reward models: sentence embeddings (BGE-style) and CLIP (CLIPScore, PickScore).

Both load through plain transformers (`AutoModel` / `CLIPModel` + tokenizer / processor), so a
local tiny checkpoint and a hub id such as `BAAI/bge-large-en-v1.5` or
`openai/clip-vit-large-patch14` take the same path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

import torch
from transformers import AutoModel, AutoTokenizer, CLIPModel, CLIPProcessor, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rl_models.loading import pretrained_kwargs


class EmbeddingModel(NamedTuple):
    """A sentence encoder and its tokenizer (unpacks as `model, tokenizer`)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


class ClipModel(NamedTuple):
    """A CLIP model and its processor (unpacks as `model, processor`)."""

    model: CLIPModel
    processor: CLIPProcessor


def load_embedding_model(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> EmbeddingModel:
    """Load a BERT-like sentence encoder (`AutoModel`) and its tokenizer, in eval mode."""
    model = AutoModel.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    return EmbeddingModel(model, AutoTokenizer.from_pretrained(str(path_or_id)))


@torch.no_grad()
def compute_text_embeddings(
    encoder: EmbeddingModel,
    texts: list[str],
    *,
    pooling: Literal["cls", "mean"] = "cls",
    max_length: int = 512,
) -> torch.Tensor:
    """L2-normalized sentence embeddings `[N, H]` (float32).

    `pooling="cls"` is what BGE models are trained with (take the first token); pick "mean" for
    encoders trained with mean pooling (e.g. all-MiniLM, E5).
    """
    model, tokenizer = encoder
    enc = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    ).to(model.device)
    hidden = model(**enc).last_hidden_state.float()  # [N, T, H]
    if pooling == "cls":
        pooled = hidden[:, 0]  # [N, H]
    elif pooling == "mean":
        mask = enc["attention_mask"].unsqueeze(-1).float()  # [N, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # [N, H]
    else:
        raise ValueError(f"pooling={pooling!r} is not one of: cls, mean")
    return torch.nn.functional.normalize(pooled, dim=-1)  # [N, H]


def load_clip(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> ClipModel:
    """Load a `CLIPModel` and its `CLIPProcessor`, in eval mode."""
    model = CLIPModel.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    return ClipModel(model, CLIPProcessor.from_pretrained(str(path_or_id)))
