"""Tiny Janus / Janus-Pro checkpoint: SigLIP-style understanding tower, VQ image tokenizer with
its generation head, Llama text tower, and a `JanusProcessor` (32x32 images = 16 image tokens,
vs 384x384 = 576 in Janus-Pro)."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    GenerationConfig,
    JanusConfig,
    JanusForConditionalGeneration,
    JanusImageProcessor,
    JanusProcessor,
    PreTrainedTokenizerFast,
)

from rl_models.tiny_families import round_vocab
from rl_models.tokenization import build_qwen_tokenizer, token_id

NUM_IMAGE_TOKENS = 16  # (32 / 8)^2
JANUS_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|User|>: ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|Assistant|>: ' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image_placeholder>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|Assistant|>:' -}}{%- endif -%}"
)


def build_janus_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE with Janus' (DeepSeek) special and image tokens."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_qwen_tokenizer().backend_tokenizer,
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜▁pad▁｜>",
        extra_special_tokens={
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
        padding_side="left",
    )
    tokenizer.chat_template = JANUS_CHAT_TEMPLATE
    return tokenizer


def build_janus(out: Path) -> None:
    """`JanusForConditionalGeneration` + `JanusProcessor`; generation config set for image mode."""
    tokenizer = build_janus_tokenizer()
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = JanusConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": round_vocab(len(tokenizer)),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            **special,
        },
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
            "projection_dim": 64,
            "depth": 2,
            "num_image_tokens": NUM_IMAGE_TOKENS,
            "mlp_ratio": 2.0,
        },
        vq_config={
            "embed_dim": 8,
            "num_embeddings": 64,
            "latent_channels": 32,
            "base_channels": 32,  # the VQ ResNet blocks use GroupNorm(32)
            "channel_multiplier": [1, 1, 1, 1],  # 3 downsamplings: 32 px -> 4x4 codes
            "num_res_blocks": 1,
            "projection_dim": 64,
            "image_token_embed_dim": 64,
            "num_hidden_layers": 2,
        },
        image_token_id=token_id(tokenizer, "<image_placeholder>"),
    )
    model = JanusForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        **special,
        generation_kwargs={
            "boi_token_id": tokenizer.boi_token_id,
            "num_image_tokens": NUM_IMAGE_TOKENS,
        },
    )
    model.save_pretrained(out)
    JanusProcessor(
        image_processor=JanusImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        num_image_tokens=NUM_IMAGE_TOKENS,
        chat_template=JANUS_CHAT_TEMPLATE,
    ).save_pretrained(out)
