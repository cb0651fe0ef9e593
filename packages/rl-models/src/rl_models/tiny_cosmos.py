"""Tiny Cosmos-Predict2.5 text/video-to-world pipeline folder (diffusers'
`Cosmos2_5_PredictBasePipeline`): the Cosmos 3D transformer, Wan's causal video VAE, a
Qwen2.5-VL text encoder with its tokenizer and the UniPC flow scheduler.

Cosmos-Predict2.5 conditions on every hidden layer of its Qwen2.5-VL encoder, each normalised
and concatenated (`crossattn_proj_in_channels` = layers x width, projected down in the
transformer), and feeds the transformer the latents plus a condition-mask channel (`in_channels`
= 16 + 1). The folder has no safety checker: diffusers' needs `cosmos_guardrail`, which loading
it with `safety_checker=` of the caller's choice replaces.
"""

from __future__ import annotations

from pathlib import Path

from rl_models.diffusion import require_diffusers
from rl_models.tiny_vl import _TEXT, qwen2_5_vl_model
from rl_models.tiny_wan import Z_DIM, tiny_wan_vae
from rl_models.tokenization import build_qwen_tokenizer

TEXT_STATES = _TEXT["num_hidden_layers"] * _TEXT["hidden_size"]  # the concatenated hidden layers' width


def build_cosmos(out: Path) -> None:
    """Cosmos-Predict2.5-style pipeline; 32x32 frames, 16 latent channels."""
    diffusers = require_diffusers()
    transformer = diffusers.CosmosTransformer3DModel(
        in_channels=Z_DIM + 1,
        out_channels=Z_DIM,
        num_attention_heads=2,
        attention_head_dim=16,  # the 3D RoPE splits a head's width over time, height and width
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=16,
        adaln_lora_dim=8,
        max_size=(16, 16, 16),
        patch_size=(1, 2, 2),
        rope_scale=(1.0, 3.0, 3.0),
        concat_padding_mask=True,
        extra_pos_embed_type=None,
        use_crossattn_projection=True,
        crossattn_proj_in_channels=TEXT_STATES,
        encoder_hidden_states_channels=16,
    )
    tokenizer = build_qwen_tokenizer()
    for part, value in {"tokenizer": tokenizer, "text_encoder": qwen2_5_vl_model(tokenizer), "transformer": transformer,
                        "vae": tiny_wan_vae(), "scheduler": diffusers.UniPCMultistepScheduler(
                            use_flow_sigmas=True, flow_shift=1.0, prediction_type="flow_prediction")}.items():
        value.save_pretrained(out / part)
    (out / "model_index.json").write_text(_model_index(diffusers.__version__))


def _model_index(version: str) -> str:
    """What `save_pretrained` writes for the pipeline, without the safety checker (see the module doc)."""
    import json

    parts = {"tokenizer": ["transformers", "Qwen2Tokenizer"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "transformer": ["diffusers", "CosmosTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "scheduler": ["diffusers", "UniPCMultistepScheduler"], "safety_checker": [None, None]}
    return json.dumps({"_class_name": "Cosmos2_5_PredictBasePipeline", "_diffusers_version": version, **parts}, indent=2)
