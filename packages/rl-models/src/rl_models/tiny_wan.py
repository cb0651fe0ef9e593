"""Tiny Wan 2.1 text-to-video pipeline folder: the 3D transformer, the causal video VAE, a UMT5
text encoder, its tokenizer and the flow-matching Euler scheduler (diffusers' `WanPipeline`).

Shapes keep Wan's wiring at small scale: the VAE compresses 4x in time and 8x in space into 16
latent channels (Wan 2.1's `z_dim`), the transformer patches (1, 2, 2) and cross-attends to the
UMT5 hidden states (`text_dim` = the encoder's width). Frame counts are 4k + 1 (1, 5, 9, ...),
as Wan's: the first frame is encoded alone, every later 4 into one latent frame.
"""

from __future__ import annotations

from pathlib import Path

from transformers import UMT5Config, UMT5EncoderModel

from rl_models.diffusion import require_diffusers
from rl_models.tiny_families import round_vocab
from rl_models.tokenization import build_t5_tokenizer

TEXT_WIDTH = 32
Z_DIM = 16


def _umt5_encoder(tokenizer) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=round_vocab(len(tokenizer)),
        d_model=TEXT_WIDTH,
        d_kv=8,
        d_ff=2 * TEXT_WIDTH,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return UMT5EncoderModel(config)


def build_wan(out: Path) -> None:
    """Wan 2.1-style text-to-video pipeline; 32x32 frames, 16 latent channels."""
    diffusers = require_diffusers()
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=Z_DIM,
        out_channels=Z_DIM,
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    tokenizer = build_t5_tokenizer()
    pipeline = diffusers.WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_umt5_encoder(tokenizer),
        transformer=transformer,
        vae=tiny_wan_vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipeline.save_pretrained(out)


def tiny_wan_vae() -> object:
    """Wan 2.1's causal video VAE at 8 base channels (Cosmos-Predict2.5 decodes with it too)."""
    return require_diffusers().AutoencoderKLWan(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
