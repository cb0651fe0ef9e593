"""Tiny Qwen-VL checkpoints (Qwen2.5-VL, Qwen3-VL) with real image + video processors.

The processors keep Qwen's patch/merge geometry (14/2 for Qwen2.5-VL, 16/2 for Qwen3-VL) but cap
the pixel budget so a test image or video frame becomes a handful of vision tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from rl_models.tiny_families import qwen_generation_config, round_vocab
from rl_models.tokenization import QWEN_CHAT_TEMPLATE, build_qwen_tokenizer

# Text tower shared by both families: hidden 64, 4 heads of 16, 2 KV heads. The M-RoPE sections
# (temporal, height, width) sum to head_dim / 2, as [16, 24, 24] does for head_dim 128.
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
_MROPE_SECTION = [2, 3, 3]


class VisionTokenIds(TypedDict):
    """The Qwen-VL config fields naming the vision tokens."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


class _SpecialIds(TypedDict):
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def vision_token_ids(tokenizer) -> VisionTokenIds:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _special_ids(tokenizer) -> _SpecialIds:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _pixels(factor: int) -> dict[str, int]:
    """Between 2x2 and 4x4 merged patches per image or frame."""
    return {"shortest_edge": (2 * factor) ** 2, "longest_edge": (4 * factor) ** 2}


def build_qwen2_5_vl(out: Path) -> None:
    """Qwen2.5-VL: windowed-attention ViT (patch 14, merge 2) + Qwen2 text tower with M-RoPE."""
    tokenizer = build_qwen_tokenizer()
    qwen2_5_vl_model(tokenizer).save_pretrained(out)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=_pixels(28), patch_size=14, merge_size=2),
        video_processor=Qwen2VLVideoProcessor(size=_pixels(28), patch_size=14, merge_size=2),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def qwen2_5_vl_model(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny Qwen2.5-VL model over `tokenizer` (`build_qwen2_5_vl`'s; Cosmos-Predict2.5's text encoder)."""
    config = Qwen2_5_VLConfig(
        text_config={
            **_TEXT,
            "vocab_size": round_vocab(len(tokenizer)),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": _MROPE_SECTION,
            },
            **_special_ids(tokenizer),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": _TEXT["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        tie_word_embeddings=False,
        **vision_token_ids(tokenizer),
        # extra top-level keys the config keeps (its signature lists only the declared fields)
        **_special_ids(tokenizer),  # type: ignore[misc]
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = qwen_generation_config(tokenizer)
    return model


def build_qwen3_vl(out: Path) -> None:
    """Qwen3-VL: ViT with DeepStack taps (patch 16, merge 2) + Qwen3 text tower, interleaved M-RoPE."""
    tokenizer = build_qwen_tokenizer()
    config = Qwen3VLConfig(
        text_config={
            **_TEXT,
            "vocab_size": round_vocab(len(tokenizer)),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": _MROPE_SECTION,
                "mrope_interleaved": True,
            },
            **_special_ids(tokenizer),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": _TEXT["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        tie_word_embeddings=True,
        **vision_token_ids(tokenizer),
    )
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config = qwen_generation_config(tokenizer)
    model.save_pretrained(out)
    qwen3_vl_processor(tokenizer, _pixels(32)).save_pretrained(out)


def qwen3_vl_processor(tokenizer, pixels: dict[str, int] | None = None) -> Qwen3VLProcessor:
    """Qwen3-VL processor (patch 16, merge 2, mean/std 0.5); `pixels` None keeps Qwen's budget."""
    size = {"size": pixels} if pixels is not None else {}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            **size, patch_size=16, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ),
        video_processor=Qwen3VLVideoProcessor(
            **size, patch_size=16, merge_size=2, fps=2, min_frames=2, max_frames=16
        ),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
