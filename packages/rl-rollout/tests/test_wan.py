"""WanEngine on the tiny random Wan 2.1 pipeline of rl_models.tiny (real from_pretrained)."""

from __future__ import annotations

import copy

import pytest
import torch

from rl_models import tiny
from rl_models.lora import add_lora
from rl_rollout.wan import WanEngine

PROMPTS = ["a red sign waving", "a cat runs"]
SIZE, FRAMES = 32, 5  # 5 frames: 2 latent frames (the first alone, then 4)


@pytest.fixture(scope="module")
def engine() -> WanEngine:
    torch.manual_seed(0)
    return WanEngine.from_pretrained(str(tiny.build("wan")), num_frames=FRAMES)


def _sample(engine: WanEngine, **kwargs):
    options = dict(num_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE, seeds=[1, 2], max_sequence_length=16)
    options.update(kwargs)
    return engine.sample(PROMPTS, **options)


def test_a_video_trajectory_replays_with_ratio_exactly_one(engine: WanEngine) -> None:
    traj = _sample(engine)
    assert traj.latents.shape == (2, 4, 16, 2, SIZE // 8, SIZE // 8)  # [B, S + 1, C, F', h, w]
    assert traj.images.shape == (2, FRAMES, 3, SIZE, SIZE)  # [B, F, 3, H, W]
    assert float(traj.images.min()) >= 0.0 and float(traj.images.max()) <= 1.0
    assert traj.conditioning.embeds.shape == (2, 16, engine.pipeline.text_encoder.config.d_model)
    assert traj.log_probs.shape == (2, 3) and bool(torch.isfinite(traj.log_probs).all())
    for step in range(traj.num_steps):  # the same float32 step and CFG forward as the rollout's
        assert torch.equal(engine.replay(traj, step).log_prob, traj.log_probs[:, step]), step


def test_seeds_prompts_and_windows(engine: WanEngine) -> None:
    """A seed gives the same video again and another seed another; the prompt steers the video
    (the UMT5 states reach the transformer); outside an SDE window the steps are ODE steps."""
    first, again = _sample(engine), _sample(engine)
    assert torch.equal(first.latents, again.latents) and torch.equal(first.images, again.images)
    assert not torch.allclose(first.latents[0, -1], _sample(engine, seeds=[3, 2]).latents[0, -1])
    swapped = engine.sample(PROMPTS[::-1], num_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE, seeds=[1, 2],
                            max_sequence_length=16)
    assert not torch.allclose(first.latents[0, -1], swapped.latents[0, -1])
    windowed = _sample(engine, sde_window=(1, 2))
    assert windowed.sde_steps.tolist() == [False, True, False]
    assert windowed.log_probs[:, 0].eq(0).all() and windowed.log_probs[:, 2].eq(0).all()


def test_a_lora_replay_carries_gradient_and_a_copy_samples_alike(engine: WanEngine) -> None:
    """A LoRA on the transformer gets gradients from a replayed step's log-prob; `over` (an
    asynchronous rollout's engine over a copy of the transformer) samples the same video."""
    fresh = WanEngine.from_pretrained(str(tiny.build("wan")), num_frames=FRAMES)
    fresh.transformer.requires_grad_(False)
    peft = add_lora(fresh.transformer, family="wan", r=2, alpha=4, init_lora_weights=False)
    traj = _sample(fresh, guidance_scale=1.0)
    fresh.replay(traj, 1, model=peft).log_prob.sum().backward()
    grads = [p.grad for name, p in peft.named_parameters() if "lora_" in name]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    twin = fresh.over(copy.deepcopy(fresh.transformer))
    assert torch.equal(_sample(twin, guidance_scale=1.0).latents, traj.latents)


def test_bad_frame_counts_and_sizes_are_named() -> None:
    path = str(tiny.build("wan"))
    with pytest.raises(ValueError, match=r"num_frames=6: Wan's VAE takes 4k \+ 1 frames"):
        WanEngine.from_pretrained(path, num_frames=6)
    with pytest.raises(ValueError, match="multiples of 16"):
        WanEngine.from_pretrained(path, num_frames=1).sample(["x"], height=24, width=32, num_steps=1)


def test_encoded_frames_are_the_latents_decode_reads(engine: WanEngine) -> None:
    """`encode_pixels` of frames `[B, F, 3, H, W]` gives normalised latents of the sampler's shape
    whose decode is the Wan VAE's own round trip (its per-channel mean and std cancel)."""
    frames = _sample(engine, num_steps=2, kind="ode").images  # [2, F, 3, H, W]
    latents = engine.encode_pixels(frames)
    assert latents.shape == engine.initial_noise(2, SIZE, SIZE, [torch.Generator()] * 2).shape
    vae = engine.pipeline.vae
    with torch.no_grad():
        raw = vae.decode(vae.encode(frames.transpose(1, 2) * 2 - 1).latent_dist.mode()).sample  # [2, 3, F, H, W]
    torch.testing.assert_close(engine.decode(latents), (raw / 2 + 0.5).clamp(0, 1).transpose(1, 2), atol=1e-5, rtol=0)
