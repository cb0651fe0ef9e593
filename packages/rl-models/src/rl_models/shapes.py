"""Random-weight checkpoints at published full-size shapes, for GPU benchmarks with no download.

Config values are copied from the published `config.json` files (Qwen3-4B, Qwen3-1.7B,
Qwen3-VL-2B/4B-Instruct, SD3.5-Medium, Wan2.1-T2V-1.3B-Diffusers). The tokenizer is the tiny
trained one (its ids are all below the real vocabulary size), so the folders load through the
ordinary loaders. For SD3.5 the transformer and VAE are full size; the text encoders keep the
real embedding widths (CLIP-L 768, CLIP-G 1280, T5 4096) with a single layer each, since
benchmarks pass prompt embeddings; likewise Wan 2.1's UMT5 encoder keeps its width (4096) with
one layer, its transformer and VAE full size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    PreTrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from rl_models.diffusion import require_diffusers
from rl_models.loading import resolve_dtype
from rl_models.tiny_cosmos import TEXT_STATES, _model_index
from rl_models.tiny_families import round_vocab
from rl_models.tiny_janus import JANUS_CHAT_TEMPLATE, build_janus_tokenizer
from rl_models.tiny_vl import qwen2_5_vl_model, qwen3_vl_processor, vision_token_ids
from rl_models.tokenization import (
    build_clip_tokenizer,
    build_qwen_tokenizer,
    build_t5_tokenizer,
    token_id,
)

QWEN_VOCAB = 151936
# size -> (hidden, intermediate, layers, heads, kv heads); head_dim 128 throughout.
_QWEN3_TEXT = {"1.7b": (2048, 6144, 28, 16, 8), "4b": (2560, 9728, 36, 32, 8), "8b": (4096, 12288, 36, 32, 8)}
_QWEN3_VL_TEXT = {"2b": _QWEN3_TEXT["1.7b"], "4b": _QWEN3_TEXT["4b"], "8b": _QWEN3_TEXT["8b"]}
# size -> the ViT's (depth, width, MLP width, DeepStack taps): 2B and 4B share one, 8B's is larger
_QWEN3_VL_VISION = {"2b": (24, 1024, 4096, [5, 11, 17]), "4b": (24, 1024, 4096, [5, 11, 17]),
                    "8b": (27, 1152, 4304, [8, 16, 24])}


def _qwen3_text(size: str, table: Mapping[str, tuple[int, int, int, int, int]]) -> dict:
    hidden, inter, layers, heads, kv = table[size]
    return {
        "vocab_size": QWEN_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


def qwen3_config(size: str) -> Qwen3Config:
    """Qwen3-1.7B / Qwen3-4B (tied embeddings) / Qwen3-8B (untied), rope theta 1e6, 40960 positions."""
    return Qwen3Config(
        **_qwen3_text(size, _QWEN3_TEXT),
        max_position_embeddings=40960,
        rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
        tie_word_embeddings=size != "8b",
    )


def qwen3_vl_config(size: str) -> Qwen3VLConfig:
    """Qwen3-VL-2B/4B-Instruct (24-layer ViT, 1024 wide, DeepStack taps 5/11/17; tied embeddings)
    and 8B-Instruct (27 layers, 1152 wide, taps 8/16/24; untied) + Qwen3 text."""
    text = _qwen3_text(size, _QWEN3_VL_TEXT)
    depth, width, mlp, taps = _QWEN3_VL_VISION[size]
    return Qwen3VLConfig(
        text_config={
            **text,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": depth,
            "hidden_size": width,
            "intermediate_size": mlp,
            "num_heads": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "out_hidden_size": text["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": taps,
        },
        tie_word_embeddings=size != "8b",
        **vision_token_ids(build_qwen_tokenizer()),
    )


def sd3_5_medium_configs() -> dict[str, dict]:
    """Configs of SD3.5-Medium's transformer (MMDiT-X) and VAE, as published."""
    return {
        "transformer": {
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "qk_norm": "rms_norm",
            "dual_attention_layers": tuple(range(13)),
        },
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4,
            "block_out_channels": (128, 256, 512, 512),
            "layers_per_block": 2,
            "latent_channels": 16,
            "norm_num_groups": 32,
            "sample_size": 1024,
            "scaling_factor": 1.5305,
            "shift_factor": 0.0609,
            "use_quant_conv": False,
            "use_post_quant_conv": False,
        },
    }


def _save_transformers(
    config: PreTrainedConfig, cls, out: Path, *, config_only: bool, dtype, device
) -> None:
    tokenizer = build_qwen_tokenizer()
    if config_only:
        config.save_pretrained(out)
    else:
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
        model.save_pretrained(out)
    if cls is Qwen3ForCausalLM:
        tokenizer.save_pretrained(out)
    else:
        qwen3_vl_processor(tokenizer).save_pretrained(out)


def _text_encoder(kind: str, width: int, tokenizer):
    if kind == "t5":
        config = T5Config(
            vocab_size=32128,
            d_model=width,
            d_kv=64,
            d_ff=1024,
            num_layers=1,
            num_heads=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
        )
        return T5EncoderModel(config)
    clip_config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=width,
        intermediate_size=width,
        projection_dim=width,
        num_hidden_layers=1,
        num_attention_heads=width // 64,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(clip_config)


def _save_sd3(out: Path, *, config_only: bool, dtype, device) -> None:
    diffusers = require_diffusers()
    configs = sd3_5_medium_configs()
    if config_only:  # build on the meta device: validates the config, allocates nothing
        classes = {"transformer": diffusers.SD3Transformer2DModel, "vae": diffusers.AutoencoderKL}
        for name, config in configs.items():
            with torch.device("meta"):
                classes[name](**config).save_config(out / name)
        return
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    with torch.device(device):
        parts = {
            "transformer": diffusers.SD3Transformer2DModel(**configs["transformer"]),
            "vae": diffusers.AutoencoderKL(**configs["vae"]),
            "text_encoder": _text_encoder("clip", 768, clip),
            "text_encoder_2": _text_encoder("clip", 1280, clip),
            "text_encoder_3": _text_encoder("t5", 4096, t5),
        }
    pipeline = diffusers.StableDiffusion3Pipeline(
        **parts,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        tokenizer=clip,
        tokenizer_2=clip,
        tokenizer_3=t5,
    )
    pipeline.to(dtype=dtype)
    pipeline.save_pretrained(out)


def wan2_1_t2v_1_3b_configs() -> dict[str, dict]:
    """Configs of Wan 2.1 T2V-1.3B's transformer and VAE, as published (the VAE: diffusers'
    `AutoencoderKLWan` defaults, which are Wan 2.1's: z_dim 16, 4x time and 8x space)."""
    return {
        "transformer": {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 12,
            "attention_head_dim": 128,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "ffn_dim": 8960,
            "num_layers": 30,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "rope_max_seq_len": 1024,
        },
        "vae": {},
    }


def _save_wan(out: Path, *, config_only: bool, dtype, device) -> None:
    """Wan 2.1 T2V-1.3B: full-size transformer and VAE; a one-layer UMT5 encoder at the real
    width (4096) and the tiny trained T5 tokenizer; flow-matching Euler scheduler with Wan's
    shift 3.0 (Wan ships UniPC with flow_shift 3.0; `WanEngine` reads only the sigmas)."""
    diffusers = require_diffusers()
    configs = wan2_1_t2v_1_3b_configs()
    classes = {"transformer": diffusers.WanTransformer3DModel, "vae": diffusers.AutoencoderKLWan}
    if config_only:  # build on the meta device: validates the config, allocates nothing
        for name, config in configs.items():
            with torch.device("meta"):
                classes[name](**config).save_config(out / name)
        return
    tokenizer = build_t5_tokenizer()
    text = UMT5Config(vocab_size=round_vocab(len(tokenizer)), d_model=4096, d_kv=64, d_ff=1024, num_layers=1,
                      num_heads=8, feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    with torch.device(device):
        parts = {name: cls(**configs[name]) for name, cls in classes.items()}
        parts["text_encoder"] = UMT5EncoderModel(text)
    pipeline = diffusers.WanPipeline(**parts, tokenizer=tokenizer,
                                     scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipeline.to(dtype=dtype)
    pipeline.save_pretrained(out)


def cosmos_predict2_5_2b_transformer(text_states: int) -> dict:
    """Cosmos-Predict2.5-2B's transformer config as published (28 blocks, 2048 wide, 16 latent
    channels + the condition mask), except `crossattn_proj_in_channels`: the width of the text
    encoder's concatenated layers it projects (100,352 for the real Qwen2.5-VL-7B encoder)."""
    return {"in_channels": 17, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
            "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
            "max_size": (128, 240, 240), "patch_size": (1, 2, 2), "rope_scale": (1.0, 3.0, 3.0),
            "concat_padding_mask": True, "extra_pos_embed_type": None, "use_crossattn_projection": True,
            "crossattn_proj_in_channels": text_states, "encoder_hidden_states_channels": 1024}


def _save_cosmos(out: Path, *, config_only: bool, dtype, device) -> None:
    """Cosmos-Predict2.5-2B: full-size transformer and Wan 2.1's VAE (diffusers' `AutoencoderKLWan`
    defaults); the tiny Qwen2.5-VL text encoder (its 2 layers x 64 wide are what the transformer's
    cross-attention projection takes in: 128 inputs instead of 100,352, 0.25% of a forward's
    FLOPs at 33 frames 480x480); UniPC flow scheduler, shift 1.0 (`CosmosEngine` reads only the sigmas)."""
    diffusers = require_diffusers()
    transformer = cosmos_predict2_5_2b_transformer(TEXT_STATES)
    if config_only:
        with torch.device("meta"):
            diffusers.CosmosTransformer3DModel(**transformer).save_config(out / "transformer")
            diffusers.AutoencoderKLWan().save_config(out / "vae")
        return
    tokenizer = build_qwen_tokenizer()
    with torch.device(device):
        parts = {"transformer": diffusers.CosmosTransformer3DModel(**transformer), "vae": diffusers.AutoencoderKLWan()}
    for name, model in parts.items():
        model.to(dtype=dtype).save_pretrained(out / name)
    qwen2_5_vl_model(tokenizer).save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=1.0,
                                      prediction_type="flow_prediction").save_pretrained(out / "scheduler")
    (out / "model_index.json").write_text(_model_index(diffusers.__version__))


# Janus-Pro language models (DeepSeek-LLM): size -> (hidden, intermediate, layers, heads); MHA.
_JANUS_PRO_TEXT = {"pro-1b": (2048, 5632, 24, 16), "pro-7b": (4096, 11008, 30, 32)}


def janus_pro_config(size: str):
    """Janus-Pro-1B/7B as published: Llama-style language model (vocab 102,400, 16,384
    positions), SigLIP-L/16 at 384 px for understanding, the 16,384-code VQ tokenizer (24 x 24
    codes of 16 px), and the generation aligner/head at the language model's width."""
    from transformers import JanusConfig

    hidden, inter, layers, heads = _JANUS_PRO_TEXT[size]
    tokenizer = build_janus_tokenizer()
    return JanusConfig(
        text_config={"model_type": "llama", "vocab_size": 102400, "hidden_size": hidden, "intermediate_size": inter,
                     "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
                     "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 384,
                       "patch_size": 16, "mlp_ratio": 4.0, "projection_dim": hidden, "depth": 2,
                       "num_image_tokens": 576},
        vq_config={"embed_dim": 8, "num_embeddings": 16384, "latent_channels": 256, "base_channels": 128,
                   "channel_multiplier": [1, 1, 2, 2, 4], "num_res_blocks": 2, "projection_dim": hidden,
                   "image_token_embed_dim": hidden, "num_hidden_layers": 2},
        image_token_id=token_id(tokenizer, "<image_placeholder>"),
        tie_word_embeddings=False,  # DeepSeek-LLM's output head is its own matrix
    )


def _save_janus(size: str, out: Path, *, config_only: bool, dtype, device) -> None:
    from transformers import (
        GenerationConfig,
        JanusForConditionalGeneration,
        JanusImageProcessor,
        JanusProcessor,
    )

    config = janus_pro_config(size)
    tokenizer = build_janus_tokenizer()
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    generation = GenerationConfig(**special, generation_kwargs={"boi_token_id": tokenizer.boi_token_id,
                                                                "num_image_tokens": 576})
    if config_only:
        config.save_pretrained(out)
        generation.save_pretrained(out)
    else:
        with torch.device(device):
            model = JanusForConditionalGeneration._from_config(config, dtype=dtype)
        model.generation_config = generation
        model.save_pretrained(out)
    JanusProcessor(image_processor=JanusImageProcessor(size={"height": 384, "width": 384}), tokenizer=tokenizer,
                   num_image_tokens=576, chat_template=JANUS_CHAT_TEMPLATE).save_pretrained(out)


Builder = Callable[..., None]
SHAPES: dict[tuple[str, str], Builder] = {
    ("qwen3", "1.7b"): lambda out, **kw: _save_transformers(
        qwen3_config("1.7b"), Qwen3ForCausalLM, out, **kw
    ),
    ("qwen3", "4b"): lambda out, **kw: _save_transformers(
        qwen3_config("4b"), Qwen3ForCausalLM, out, **kw
    ),
    ("qwen3_vl", "2b"): lambda out, **kw: _save_transformers(
        qwen3_vl_config("2b"), Qwen3VLForConditionalGeneration, out, **kw
    ),
    ("qwen3_vl", "4b"): lambda out, **kw: _save_transformers(
        qwen3_vl_config("4b"), Qwen3VLForConditionalGeneration, out, **kw
    ),
    ("qwen3_vl", "8b"): lambda out, **kw: _save_transformers(
        qwen3_vl_config("8b"), Qwen3VLForConditionalGeneration, out, **kw
    ),
    ("sd3", "3.5-medium"): _save_sd3,
    ("wan", "2.1-1.3b"): _save_wan,
    ("cosmos", "2.5-2b"): _save_cosmos,
    ("janus", "pro-1b"): lambda out, **kw: _save_janus("pro-1b", out, **kw),
    ("janus", "pro-7b"): lambda out, **kw: _save_janus("pro-7b", out, **kw),
}


def build_shape(
    family: str,
    size: str,
    out_dir: str | Path,
    *,
    config_only: bool = False,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device | None = None,
) -> Path:
    """Write a random-weight checkpoint of `family` at published `size` into `out_dir`.

    `device` defaults to CUDA when available (random init of billions of weights is slow on a
    CPU). `config_only=True` writes only the configs (and tokenizer/processor), for a quick check.
    """
    key = (family, size.lower())
    if key not in SHAPES:
        valid = ", ".join(f"{f} {s}" for f, s in sorted(SHAPES))
        raise KeyError(f"unknown shape {family!r} {size!r}; valid: {valid}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    SHAPES[key](out, config_only=config_only, dtype=resolve_dtype(dtype), device=device)
    return out
