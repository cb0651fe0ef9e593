"""Per-token log-probs of given completions, for text LMs and Qwen-VL models (LoRA or not).

The model body runs to its final hidden states only; `rl_core.logprobs.token_logprobs_from_hidden`
then projects through the LM head in chunks, so the `[B, T, V]` logits never exist at once (the
memory wall of naive RL log-prob code; benchmarks/RESULTS.md, "Token log-probs from hidden states:
naive vs chunked").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from rl_core.logprobs import token_logprobs_and_entropy_from_hidden, token_logprobs_from_hidden
from rl_models.vl import VL_MODEL_TYPES


@dataclass(frozen=True)
class TokenBatch:
    """Prompt + completion tokens, laid out as TRL/verl do: `input_ids = [prompt | completion]`.

    Prompts are left-padded to a common `prompt_length` P, completions right-padded to C, so
    T = P + C and completion token j of row b sits at column P + j.

    Fields:
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 on real tokens (prompt and completion), 0 on padding.
        prompt_length: P, the number of (left-padded) prompt columns.
        pixel_values, image_grid_thw: image inputs from a Qwen-VL processor (None for text).
        pixel_values_videos, video_grid_thw, second_per_grid_ts: video inputs (Qwen2.5-VL uses
            `second_per_grid_ts`; Qwen3-VL does not).
        mm_token_type_ids: `[B, T]` modality of each token (as the Qwen-VL processors return it).
    """

    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    prompt_length: int
    pixel_values: Tensor | None = None  # [N_patches, C*pt*p*p]
    image_grid_thw: Tensor | None = None  # [N_images, 3]
    pixel_values_videos: Tensor | None = None  # [N_patches, C*pt*p*p]
    video_grid_thw: Tensor | None = None  # [N_videos, 3]
    second_per_grid_ts: Tensor | None = None  # [N_videos]
    mm_token_type_ids: Tensor | None = field(default=None)  # [B, T]

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must both be [B, T], got "
                f"{tuple(self.input_ids.shape)} and {tuple(self.attention_mask.shape)}"
            )
        if not 1 <= self.prompt_length < self.input_ids.shape[1]:
            raise ValueError(
                f"prompt_length={self.prompt_length} must be in [1, T={self.input_ids.shape[1]})"
            )

    @property
    def completion_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_length :]  # [B, C]

    @property
    def completion_mask(self) -> Tensor:
        return self.attention_mask[:, self.prompt_length :]  # [B, C]

    @classmethod
    def from_prompt_completion(
        cls,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        **vision: Tensor | None,
    ) -> TokenBatch:
        """Concatenate left-padded prompts `[B, P]` and right-padded completions `[B, C]`.

        `vision` takes the processor outputs named like the fields; `mm_token_type_ids` may be
        the prompt's `[B, P]` (completion tokens are text, type 0).
        """
        mm = vision.pop("mm_token_type_ids", None)
        if mm is not None and mm.shape == prompt_ids.shape:
            mm = torch.cat([mm, torch.zeros_like(completion_ids, dtype=mm.dtype)], dim=1)  # [B, T]
        return cls(
            input_ids=torch.cat([prompt_ids, completion_ids], dim=1),  # [B, T]
            attention_mask=torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1),
            prompt_length=prompt_ids.shape[1],
            mm_token_type_ids=mm,
            **vision,
        )

    def vision_kwargs(self) -> dict[str, Tensor]:
        """The non-None pixel/grid inputs, named as the Qwen-VL forward expects them."""
        named = {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "pixel_values_videos": self.pixel_values_videos,
            "video_grid_thw": self.video_grid_thw,
            "second_per_grid_ts": self.second_per_grid_ts,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        return {name: value for name, value in named.items() if value is not None}


def unwrap_peft(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a `PeftModel` (its LoRA layers stay active), else `model`."""
    # callers pass a transformers model, bare or wrapped; peft types its base as a Module
    return cast(PreTrainedModel, model.get_base_model() if isinstance(model, PeftModel) else model)


def final_hidden_states(model: torch.nn.Module, batch: TokenBatch) -> Tensor:
    """Hidden states after the last norm `[B, T, H]`, without computing logits.

    Text models get positions from the attention mask (as `generate()` gives left-padded rows);
    Qwen-VL models compute their own M-RoPE positions from the vision grids.
    """
    causal_lm = unwrap_peft(model)
    kwargs: dict[str, Tensor | bool] = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,
    }
    vision = batch.vision_kwargs()
    is_vl = causal_lm.config.model_type in VL_MODEL_TYPES
    if vision and not is_vl:
        raise ValueError(
            f"batch carries {sorted(vision)} but {causal_lm.config.model_type!r} is a text model"
        )
    if is_vl and ("image_grid_thw" in vision or "video_grid_thw" in vision):
        kwargs.update(vision)
    else:
        positions = batch.attention_mask.long().cumsum(-1) - 1  # [B, T]
        kwargs["position_ids"] = positions.clamp_min(0)  # [B, T]
    hidden = causal_lm.model(**kwargs).last_hidden_state  # [B, T, H]
    if is_vl:
        # Qwen-VL's forward caches the batch's M-RoPE deltas for generate(); a scoring forward
        # must not leave them behind (a compiled decode step guards on them and recompiles)
        causal_lm.model.rope_deltas = None
    return hidden


def completion_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """Log-probs `[B, C]` (float32) of the completion tokens; 0 where `completion_mask` is 0.

    `temperature` divides the logits, matching the sampler's (use the rollout temperature so the
    importance ratio starts at 1). Works on plain and peft-wrapped models; differentiable.
    """
    scored, head = _scored_hidden(model, batch)  # [B, C, H], LM head
    logprobs = token_logprobs_from_hidden(
        scored, head.weight, batch.completion_ids, temperature=temperature, chunk_size=chunk_size
    )  # [B, C]
    return logprobs * batch.completion_mask.to(logprobs.dtype)  # [B, C]


def completion_logprobs_and_entropy(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """`completion_logprobs` plus the entropy `[B, C]` (float32, no gradient) of each completion
    position's distribution, from the same forward: pick it when the entropy is logged during
    the update, so no separate pass over the LM head is needed. Both are 0 on padding."""
    scored, head = _scored_hidden(model, batch)  # [B, C, H], LM head
    logprobs, ent = token_logprobs_and_entropy_from_hidden(
        scored, head.weight, batch.completion_ids, temperature=temperature, chunk_size=chunk_size
    )  # [B, C], [B, C]
    mask = batch.completion_mask.to(logprobs.dtype)  # [B, C]
    return logprobs * mask, ent * mask


def _scored_hidden(model: torch.nn.Module, batch: TokenBatch) -> tuple[Tensor, torch.nn.Linear]:
    """Hidden states `[B, C, H]` at the positions that predict the completion tokens, and the
    LM head that turns them into logits."""
    causal_lm = unwrap_peft(model)
    head = causal_lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"output embeddings are {type(head).__name__}, not nn.Linear: exclude lm_head from "
            "LoRA target_modules"
        )
    hidden = final_hidden_states(model, batch)  # [B, T, H]
    p = batch.prompt_length
    return hidden[:, p - 1 : -1], head  # [B, C, H]; position t predicts token t + 1
