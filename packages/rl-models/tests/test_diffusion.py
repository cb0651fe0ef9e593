from __future__ import annotations

import builtins

import pytest
import torch

from rl_models import diffusion
from rl_models.lora import add_lora, disabled_adapter


def _denoise_once(pipe, generator_seed: int = 0) -> torch.Tensor:
    """One transformer step on fixed latents and prompt embeddings: `[1, 4, 16, 16]` velocity."""
    prompt_embeds, _, pooled, _ = pipe.encode_prompt(
        prompt='a sign that says "hello"',
        prompt_2=None,
        prompt_3=None,
        do_classifier_free_guidance=False,
    )
    g = torch.Generator().manual_seed(generator_seed)
    latents = torch.randn(1, 4, 16, 16, generator=g)  # [1, C, h, w]
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=latents,
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
        ).sample


def test_pipeline_loads_every_part_and_samples(sd3_path):
    pipe = diffusion.load_sd3(sd3_path, dtype="float32")
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.text_encoder_3.config.d_model == pipe.transformer.config.joint_attention_dim
    out = pipe(
        prompt=["a cat", 'a sign that says "open"'],
        num_inference_steps=2,
        guidance_scale=4.5,
        height=32,
        width=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images.shape == (2, 3, 32, 32)
    assert torch.isfinite(out.images).all()


def test_text_encoder_dtype(sd3_path):
    pipe = diffusion.load_sd3(sd3_path, dtype="float32", text_encoder_dtype="bf16")
    assert pipe.text_encoder_3.dtype == torch.bfloat16
    assert pipe.transformer.dtype == torch.float32


def test_sd3_lora_targets_and_reference(sd3_path):
    pipe = diffusion.load_sd3(sd3_path, dtype="float32")
    base = _denoise_once(pipe)
    pipe.transformer = add_lora(
        pipe.transformer, family="sd3", r=2, alpha=4, init_lora_weights=False
    )
    lora_names = {
        n.split(".lora_A")[0].split("attn.")[-1]
        for n, _ in pipe.transformer.named_parameters()
        if ".lora_A" in n
    }
    assert {
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    } <= lora_names
    on = _denoise_once(pipe)
    assert (on - base).abs().max() > 1e-4
    with disabled_adapter(pipe.transformer):
        torch.testing.assert_close(_denoise_once(pipe), base)


def test_missing_diffusers_names_install_command(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "diffusers":
            raise ImportError("No module named 'diffusers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(diffusion.importlib, "import_module", lambda name: fake_import(name))
    with pytest.raises(ImportError, match=r'pip install "rl-models\[diffusers\]"'):
        diffusion.require_diffusers()


def test_tiny_wan_is_a_wan_pipeline_that_samples_videos(wan_path):
    """`tiny:wan` loads through diffusers' own `WanPipeline`: a prompt's UMT5 states reach the
    transformer (another prompt, another velocity), the VAE keeps Wan's 4x temporal compression
    (5 frames <-> 2 latent frames), and a seeded call gives the same frames again."""
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(wan_path)
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim
    embeds = {p: pipe.encode_prompt(p, do_classifier_free_guidance=False, max_sequence_length=16)[0]
              for p in ("a red sign", "a cat")}
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))  # [B, C, F', h, w]
    with torch.no_grad():
        velocity = {p: pipe.transformer(latents, timestep=torch.tensor([500.0]), encoder_hidden_states=e).sample
                    for p, e in embeds.items()}
    assert velocity["a cat"].shape == latents.shape
    assert not torch.allclose(velocity["a cat"], velocity["a red sign"])

    def sample() -> torch.Tensor:
        return pipe("a red sign", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="pt",
                    max_sequence_length=16, generator=torch.Generator().manual_seed(0)).frames

    video = sample()
    assert video.shape == (1, 5, 3, 32, 32)  # [B, F, 3, H, W]
    assert torch.isfinite(video).all() and torch.equal(video, sample())


class _NoSafetyCheck:
    """Diffusers' Cosmos safety checker needs `cosmos_guardrail`; a caller passes its own."""

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video):
        return video

    def to(self, *args, **kwargs):
        return self


def test_tiny_cosmos_is_a_cosmos_predict2_5_pipeline_that_samples_videos(cosmos_path):
    """`tiny:cosmos` loads through diffusers' own `Cosmos2_5_PredictBasePipeline` (safety checker
    of the caller's choice): the prompt embeddings are every hidden layer of the Qwen2.5-VL
    encoder, concatenated, and another prompt gives another velocity; a seeded call gives the
    same 5 frames again. (The pipeline's system turn comes first, ~46 tokens of the tiny tokenizer: 96 keep the prompt.)"""
    import diffusers

    pipe = diffusers.Cosmos2_5_PredictBasePipeline.from_pretrained(cosmos_path, safety_checker=_NoSafetyCheck())
    text = pipe.text_encoder.config.text_config
    embeds = {p: pipe._get_prompt_embeds(p, max_sequence_length=96) for p in ("a red sign", "a cat")}
    assert embeds["a cat"].shape == (1, 96, text.num_hidden_layers * text.hidden_size)
    assert pipe.transformer.config.crossattn_proj_in_channels == embeds["a cat"].shape[-1]
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))  # [B, C, F', h, w]
    mask = torch.zeros(1, 1, 2, 4, 4)  # the condition-mask channel: nothing given
    with torch.no_grad():
        velocity = {p: pipe.transformer(latents, timestep=torch.tensor([0.5]), encoder_hidden_states=e,
                                        condition_mask=mask, padding_mask=torch.zeros(1, 1, 32, 32)).sample
                    for p, e in embeds.items()}
    assert velocity["a cat"].shape == latents.shape
    assert not torch.allclose(velocity["a cat"], velocity["a red sign"])

    def sample() -> torch.Tensor:
        return pipe(prompt="a red sign", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="pt",
                    max_sequence_length=96, generator=torch.Generator().manual_seed(0)).frames

    video = sample()
    assert video.shape == (1, 5, 3, 32, 32)  # [B, F, 3, H, W]
    assert torch.isfinite(video).all() and torch.equal(video, sample())
