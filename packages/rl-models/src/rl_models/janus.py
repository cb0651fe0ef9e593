"""Janus / Janus-Pro (`JanusForConditionalGeneration`) for image-token generation (GRPO on the
image-token head, 576 tokens per 384x384 image, CFG 5) and image understanding.

Image generation (Janus-Pro, Chen et al. 2025; transformers' `generate(generation_mode="image")`)
samples each image token from classifier-free-guided logits: the conditional row sees the prompt,
the unconditional row the same prompt with every token but BOS and `<begin_of_image>` replaced by
the pad token (still attended), and the next token is drawn from

    softmax((u + s * (c - u)) / temperature)

with `c`, `u` the generation head's logits of the two rows and `s` the guidance scale. The
generation head is `Linear -> GELU -> Linear(V)`; its last layer is affine, so `u + s * (c - u)`
equals that layer applied to `f_u + s * (f_c - f_u)` (the GELU features `f`): the guidance is
mixed in the D-wide feature space and the `V = 16,384`-entry logits are formed chunk by chunk by
`rl_core.logprobs.token_logprobs_from_hidden` (its bias rides along as one extra feature column),
so `image_token_logprobs` never holds `[B, N, V]` logits, with or without gradients.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, cast

import torch
from peft import PeftModel
from torch import Tensor
from transformers import JanusForConditionalGeneration, JanusProcessor, JanusVQVAEConfig

from rl_core.logprobs import token_logprobs_from_hidden
from rl_models.loading import pretrained_kwargs
from rl_models.logprobs import unwrap_peft


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
    and `model.decode_image_tokens(ids)` the pixels; `rl_rollout.janus.JanusEngine` samples
    with per-token log-probs, and `image_token_logprobs` recomputes them for training.
    """
    model = JanusForConditionalGeneration.from_pretrained(
        str(path_or_id),
        **pretrained_kwargs(dtype=dtype, device=device, attn_implementation=attn_implementation),
    )
    model.eval()
    processor = JanusProcessor.from_pretrained(str(path_or_id))
    # The processor writes this many `<image_placeholder>` per image; the vision tower's config is
    # the truth. transformers < 5.13 hard-codes Janus-Pro's 576 whatever the processor config says.
    processor.num_image_tokens = num_image_tokens(model)
    return JanusModel(model, processor)


def generate_image_tokens(model: JanusForConditionalGeneration, **kwargs: object) -> Tensor:
    """transformers' own image sampler, `model.generate(**kwargs, generation_mode="image")` ->
    image-token ids `[B, N]` (the reference our `janus` engine is checked against). Works across
    transformers versions: the 5.17 Janus `generate` leaves out `_prepare_static_cache`'s
    `prefill_chunk_size` argument (a TypeError there), so it is filled in from the generation
    config for this call."""
    prepare = type(model)._prepare_static_cache
    if "prefill_chunk_size" not in inspect.signature(prepare).parameters:
        return cast(Tensor, model.generate(**kwargs, generation_mode="image"))  # type: ignore[arg-type]

    def with_chunk_size(*args: object, **kw: object) -> object:
        kw.setdefault("prefill_chunk_size", getattr(model.generation_config, "prefill_chunk_size", None))
        return prepare(model, *args, **kw)  # type: ignore[arg-type]

    vars(model)["_prepare_static_cache"] = with_chunk_size  # shadows the method, for this call only
    try:
        return cast(Tensor, model.generate(**kwargs, generation_mode="image"))  # type: ignore[arg-type]
    finally:
        vars(model).pop("_prepare_static_cache", None)


def janus_causal_lm(model: torch.nn.Module) -> JanusForConditionalGeneration:
    """The `JanusForConditionalGeneration` inside `model` (bare or peft-wrapped)."""
    base = unwrap_peft(model)
    if not isinstance(base, JanusForConditionalGeneration):
        raise TypeError(f"expected a JanusForConditionalGeneration (or a peft wrapper of one), got {type(base).__name__}")
    return base


def unconditional_prompt_ids(model: torch.nn.Module, prompt_ids: Tensor) -> Tensor:
    """The CFG unconditional prompts `[B, P]`: every token but BOS and `<begin_of_image>` replaced
    by the pad token, as transformers' image `generate()` and the Janus repository do (the
    attention mask stays the conditional prompt's). Ids come from the generation config."""
    config = janus_causal_lm(model).generation_config
    boi = config.generation_kwargs["boi_token_id"]  # type: ignore[attr-defined]  # Janus' own generation config key
    keep = (prompt_ids == config.bos_token_id) | (prompt_ids == boi)  # [B, P]
    return torch.where(keep, prompt_ids, torch.full_like(prompt_ids, config.pad_token_id))  # [B, P]


def num_image_tokens(model: torch.nn.Module) -> int:
    """Image tokens per generated image (576 for Janus-Pro's 384x384; 16 for the tiny model)."""
    return int(janus_causal_lm(model).model.vision_model.config.num_image_tokens)


def image_size(model: torch.nn.Module) -> int:
    """Side in pixels of a generated image: VQ code grid x the decoder's upsampling factor."""
    vq = cast(JanusVQVAEConfig, janus_causal_lm(model).config.vq_config)  # a dict only before __init__
    return int(vq.num_patches) * 2 ** (len(vq.channel_multiplier) - 1)


@dataclass(frozen=True)
class ImageTokenBatch:
    """Prompts and the image tokens sampled after them, as the Janus image mode lays them out.

    Fields:
        prompt_ids: `[B, P]` left-padded prompts, each ending with `<begin_of_image>`.
        prompt_mask: `[B, P]` 1 on real prompt tokens.
        image_ids: `[B, N]` sampled image tokens (VQ codebook indices).
        uncond_ids: `[B, P]` the unconditional prompts (`unconditional_prompt_ids`).
    """

    prompt_ids: Tensor  # [B, P]
    prompt_mask: Tensor  # [B, P]
    image_ids: Tensor  # [B, N]
    uncond_ids: Tensor  # [B, P]

    def __post_init__(self) -> None:
        shape = tuple(self.prompt_ids.shape)
        if len(shape) != 2 or tuple(self.prompt_mask.shape) != shape or tuple(self.uncond_ids.shape) != shape:
            raise ValueError(
                f"prompt_ids, prompt_mask and uncond_ids must all be [B, P], got {shape}, "
                f"{tuple(self.prompt_mask.shape)} and {tuple(self.uncond_ids.shape)}"
            )
        if self.image_ids.dim() != 2 or self.image_ids.shape[0] != shape[0]:
            raise ValueError(f"image_ids must be [B={shape[0]}, N], got {tuple(self.image_ids.shape)}")

    def index(self, rows: Tensor | slice) -> ImageTokenBatch:
        return ImageTokenBatch(self.prompt_ids[rows], self.prompt_mask[rows], self.image_ids[rows], self.uncond_ids[rows])

    def to(self, device: torch.device | str) -> ImageTokenBatch:
        return ImageTokenBatch(*(t.to(device) for t in (self.prompt_ids, self.prompt_mask, self.image_ids, self.uncond_ids)))


def image_token_hidden(model: torch.nn.Module, batch: ImageTokenBatch, *, use_cfg: bool) -> Tensor:
    """Final hidden states `[R, N, H]` at the positions that predict each image token, teacher
    forced over `[prompt | image tokens]`: R = 2B rows `[cond; uncond]` with `use_cfg`, else the
    B conditional rows. Positions count real tokens only (left padding does not shift them)."""
    causal = janus_causal_lm(model)
    ids = torch.cat([batch.prompt_ids, batch.uncond_ids]) if use_cfg else batch.prompt_ids  # [R, P]
    mask = batch.prompt_mask.repeat(2, 1) if use_cfg else batch.prompt_mask  # [R, P]
    images = batch.image_ids.repeat(2, 1) if use_cfg else batch.image_ids  # [R, N]
    text = causal.get_input_embeddings()(ids)  # [R, P, H]
    drawn = causal.prepare_embeddings_for_image_generation(images[:, :-1])  # [R, N - 1, H]
    full_mask = torch.cat([mask, torch.ones_like(images[:, :-1], dtype=mask.dtype)], dim=1)  # [R, P + N - 1]
    positions = (full_mask.long().cumsum(-1) - 1).clamp_min(0)  # [R, P + N - 1]
    hidden = causal.model.language_model(
        inputs_embeds=torch.cat([text, drawn.to(text.dtype)], dim=1),  # [R, P + N - 1, H]
        attention_mask=full_mask,
        position_ids=positions,
        use_cache=False,
    ).last_hidden_state  # [R, P + N - 1, H]
    return hidden[:, batch.prompt_ids.shape[1] - 1 :]  # [R, N, H]; position t predicts token t + 1


def guided_features(model: torch.nn.Module, hidden: Tensor, *, guidance_scale: float, use_cfg: bool) -> Tensor:
    """Generation-head features `[B, ..., D]` (before its last Linear) whose logits are the CFG
    logits `u + s * (c - u)`: `hidden` is `[2B, ..., H]` `[cond; uncond]` with `use_cfg`, else
    `[B, ..., H]` (conditional logits only)."""
    head = janus_causal_lm(model).model.generation_head
    features = head.activation_fn(head.proj_out(hidden))  # [R, ..., D]
    if not use_cfg:
        return features
    cond, uncond = features.chunk(2)  # [B, ..., D] each
    return uncond + (cond - uncond) * guidance_scale  # [B, ..., D]


def image_head(model: torch.nn.Module) -> Tensor:
    """The generation head's last layer as one `[V, D + 1]` matrix (weight | bias), to be applied
    to features with a column of ones appended (`with_bias_column`)."""
    last = janus_causal_lm(model).model.generation_head.vision_head
    if not isinstance(last, torch.nn.Linear):
        raise ValueError(f"generation_head.vision_head is {type(last).__name__}, not nn.Linear: exclude it from "
                         "LoRA target_modules (the chunked log-probs read its weight directly)")
    return torch.cat([last.weight, last.bias[:, None]], dim=1)  # [V, D + 1]


def with_bias_column(features: Tensor) -> Tensor:
    """`[..., D]` -> `[..., D + 1]` with a trailing 1: `with_bias_column(f) @ W_aug.T = f @ W.T + b`."""
    return torch.cat([features, torch.ones_like(features[..., :1])], dim=-1)  # [..., D + 1]


def image_token_logprobs(
    model: torch.nn.Module,
    batch: ImageTokenBatch,
    *,
    guidance_scale: float,
    temperature: float = 1.0,
    use_cfg: bool = True,
    chunk_size: int = 1024,
) -> Tensor:
    """Log-probs `[B, N]` (float32) of the image tokens under `softmax(logits / temperature)`,
    `logits = u + s * (c - u)` at guidance `s` (see the module docstring), teacher forced.

    `use_cfg=False` scores under the conditional logits alone (one forward of B rows): pick it
    when the loss should not see the unconditional branch. Differentiable (LoRA included); the
    `[B, N, V]` logits are never formed (`chunk_size` tokens' logits at a time).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    hidden = image_token_hidden(model, batch, use_cfg=use_cfg)  # [R, N, H]
    features = guided_features(model, hidden, guidance_scale=guidance_scale, use_cfg=use_cfg)  # [B, N, D]
    weight = image_head(model)  # [V, D + 1]
    return token_logprobs_from_hidden(
        with_bias_column(features), weight.to(features.dtype), batch.image_ids,
        temperature=temperature, chunk_size=chunk_size,
    )  # [B, N]


@torch.no_grad()
def reference_image_token_logprobs(
    model: PeftModel,
    batch: ImageTokenBatch,
    *,
    guidance_scale: float,
    temperature: float = 1.0,
    use_cfg: bool = True,
    chunk_size: int = 1024,
) -> Tensor:
    """`image_token_logprobs` `[B, N]` of the reference policy: the LoRA model, adapters off."""
    with model.disable_adapter():
        return image_token_logprobs(model, batch, guidance_scale=guidance_scale, temperature=temperature,
                                    use_cfg=use_cfg, chunk_size=chunk_size)


class JanusImagePolicy(torch.nn.Module):
    """The trained Janus model behind one forward returning image-token log-probs `[B, N]`
    (`image_token_logprobs`). Hand this module to `accelerator.prepare`, so DDP wraps the whole
    computation and synchronizes its gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: ImageTokenBatch, *, guidance_scale: float, temperature: float = 1.0,
                use_cfg: bool = True) -> Tensor:
        return image_token_logprobs(self.model, batch, guidance_scale=guidance_scale, temperature=temperature,
                                    use_cfg=use_cfg)  # [B, N]
