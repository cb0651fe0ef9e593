"""Tiny Stable Diffusion 3 / 3.5 pipeline folder: MMDiT transformer, VAE, two CLIP text encoders
with projection, a T5 encoder, their tokenizers and the flow-matching Euler scheduler.

Widths follow SD3's wiring at small scale: the CLIP hidden states (32 + 32) are zero-padded to
the T5 width (64 = `joint_attention_dim`), the pooled projections concatenate to 64
(`pooled_projection_dim`), exactly as 768 + 1280 -> 4096 and 2048 in SD3.5-Medium.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from rl_models.diffusion import require_diffusers
from rl_models.tiny_families import round_vocab
from rl_models.tokenization import build_clip_tokenizer, build_t5_tokenizer

CLIP_WIDTH = 32
T5_WIDTH = 64


def _clip_text_encoder(tokenizer) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=round_vocab(len(tokenizer)),
        hidden_size=CLIP_WIDTH,
        intermediate_size=2 * CLIP_WIDTH,
        projection_dim=CLIP_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def _t5_encoder(tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=round_vocab(len(tokenizer)),
        d_model=T5_WIDTH,
        d_kv=16,
        d_ff=2 * T5_WIDTH,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # an extra config key: transformers' config signatures list only the declared fields
        decoder_start_token_id=tokenizer.pad_token_id,  # type: ignore[call-arg]
    )
    return T5EncoderModel(config)


def _vae(diffusers, *, groups: int):
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=groups,
        sample_size=32,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_sd3(out: Path) -> None:
    """SD3.5-style pipeline (qk RMSNorm, one dual-attention layer); 32x32 images, 4 latent channels."""
    diffusers = require_diffusers()
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=T5_WIDTH,
        caption_projection_dim=32,
        pooled_projection_dim=2 * CLIP_WIDTH,
        pos_embed_max_size=32,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )
    _vae(diffusers, groups=4)  # v1's VAE, built and dropped: the text encoders keep their v1 weights
    with torch.random.fork_rng():
        torch.manual_seed(torch.initial_seed())  # the build's seed: this VAE's weights do not depend on the others'
        # 2 groups (v1: 4): a group of 4 channels normalised a latent's mean away, so no latent moved
        # an image's brightness by more than ~0.01 and a brightness reward did not show in the images
        vae = _vae(diffusers, groups=2)
    clip_tokenizer, t5_tokenizer = build_clip_tokenizer(), build_t5_tokenizer()
    pipeline = diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=_clip_text_encoder(clip_tokenizer),
        tokenizer=clip_tokenizer,
        text_encoder_2=_clip_text_encoder(clip_tokenizer),
        tokenizer_2=clip_tokenizer,
        text_encoder_3=_t5_encoder(t5_tokenizer),
        tokenizer_3=t5_tokenizer,
    )
    pipeline.save_pretrained(out)
