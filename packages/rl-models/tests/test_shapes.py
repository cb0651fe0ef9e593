from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

from rl_models.shapes import build_shape


def _meta_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("family", "size", "auto", "billions"),
    [
        ("qwen3", "4b", AutoModelForCausalLM, 4.022),  # Qwen3-4B: 4.0B
        ("qwen3", "1.7b", AutoModelForCausalLM, 1.721),  # Qwen3-1.7B: 1.7B
        ("qwen3_vl", "2b", AutoModelForImageTextToText, 2.128),  # Qwen3-VL-2B: 2.1B
        ("qwen3_vl", "4b", AutoModelForImageTextToText, 4.438),  # Qwen3-VL-4B: 4.4B
        ("qwen3_vl", "8b", AutoModelForImageTextToText, 8.767),  # Qwen3-VL-8B: 8,767,123,696 published
    ],
)
def test_qwen_config_only_matches_published_size(tmp_path, family, size, auto, billions):
    out = build_shape(family, size, tmp_path, config_only=True)
    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = auto.from_config(config)
    assert _meta_params(model) / 1e9 == pytest.approx(billions, abs=1e-3)
    assert not list(out.glob("*.safetensors"))
    if family == "qwen3_vl":
        processor = AutoProcessor.from_pretrained(out)
        assert processor.image_processor.patch_size == config.vision_config.patch_size == 16


def test_sd3_5_medium_config_only(tmp_path):
    import diffusers

    out = build_shape("sd3", "3.5-medium", tmp_path, config_only=True)
    with torch.device("meta"):
        transformer = diffusers.SD3Transformer2DModel.from_config(
            diffusers.SD3Transformer2DModel.load_config(out / "transformer")
        )
        vae = diffusers.AutoencoderKL.from_config(diffusers.AutoencoderKL.load_config(out / "vae"))
    assert _meta_params(transformer) / 1e9 == pytest.approx(2.243, abs=1e-3)  # MMDiT-X 2.2B
    assert _meta_params(vae) / 1e6 == pytest.approx(83.8, abs=0.1)
    assert transformer.config.joint_attention_dim == 4096


def test_wan2_1_t2v_1_3b_config_only(tmp_path):
    import diffusers

    out = build_shape("wan", "2.1-1.3b", tmp_path, config_only=True)
    with torch.device("meta"):
        transformer = diffusers.WanTransformer3DModel.from_config(
            diffusers.WanTransformer3DModel.load_config(out / "transformer")
        )
        vae = diffusers.AutoencoderKLWan.from_config(diffusers.AutoencoderKLWan.load_config(out / "vae"))
    assert _meta_params(transformer) == 1_418_996_800  # Wan2.1-T2V-1.3B's transformer: 1.42B
    assert _meta_params(vae) / 1e6 == pytest.approx(126.9, abs=0.1)
    assert (transformer.config.num_layers, transformer.config.text_dim, vae.config.z_dim) == (30, 4096, 16)
    assert not list(out.rglob("*.safetensors"))


@pytest.mark.parametrize(("size", "billions"), [("pro-1b", 2.077), ("pro-7b", 7.408)])
def test_janus_pro_config_only(tmp_path, size, billions):
    """Janus-Pro-1B/7B: the published 2.09B/7.42B less ~12.6M of SigLIP's attention-pooling head,
    which transformers' Janus does not build (it is unused)."""
    from transformers import AutoProcessor, JanusForConditionalGeneration

    out = build_shape("janus", size, tmp_path, config_only=True)
    with torch.device("meta"):
        model = JanusForConditionalGeneration(AutoConfig.from_pretrained(out))
    assert _meta_params(model) / 1e9 == pytest.approx(billions, abs=1e-3)
    assert model.config.vq_config.num_patches ** 2 == model.config.vision_config.num_image_tokens == 576
    assert AutoProcessor.from_pretrained(out).num_image_tokens == 576


def test_unknown_shape_lists_valid(tmp_path):
    with pytest.raises(KeyError, match=r"unknown shape 'qwen3' '70b'; valid: .*qwen3 4b"):
        build_shape("qwen3", "70b", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_4b_random_weights_on_gpu(tmp_path):
    out = build_shape("qwen3", "4b", tmp_path, device="cuda")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map="cuda")
    assert _meta_params(model) / 1e9 == pytest.approx(4.022, abs=1e-3)


def test_cosmos_predict2_5_2b_config_only(tmp_path):
    """Cosmos-Predict2.5-2B's transformer: 2.06B with the real encoder's 100,352-wide projection
    input; the shape's is the tiny encoder's 128 (102.6M fewer weights, all in that projection)."""
    import diffusers

    from rl_models.shapes import cosmos_predict2_5_2b_transformer

    out = build_shape("cosmos", "2.5-2b", tmp_path, config_only=True)
    with torch.device("meta"):
        transformer = diffusers.CosmosTransformer3DModel.from_config(
            diffusers.CosmosTransformer3DModel.load_config(out / "transformer"))
        published = diffusers.CosmosTransformer3DModel(**cosmos_predict2_5_2b_transformer(100_352))
    assert _meta_params(published) == 2_059_174_912
    assert _meta_params(transformer) == 2_059_174_912 - (100_352 - 128) * 1024
    assert (transformer.config.num_layers, transformer.config.in_channels) == (28, 17)
    assert not list(out.rglob("*.safetensors"))
