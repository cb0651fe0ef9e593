"""SDE sampling over a Wan 2.1 text-to-video pipeline (`rl-rollout[diffusers]`): the Flow-GRPO /
DanceGRPO rollout of `rl_rollout.diffusion.DiffusionEngine`, for videos.

    engine = WanEngine.from_pretrained(path, num_frames=33)     # a Wan 2.1 folder or `tiny:wan`'s
    traj = engine.sample(["a cat runs"], num_steps=10, height=480, width=832, seeds=[0])
    traj.images      # [B, F, 3, H, W] frames in [0, 1]
    engine.replay(traj, step=3, model=trained)                   # the step's log-prob, with grad

Everything but the model's inputs and outputs is the image engine's: the same float32 SDE step
(`rl_core.flow.sde_step`, its log-prob a mean over every latent element, frames included), the
same windows, seeds per sample, CFG as one batched forward, compiled blocks, sleep and wake.
What differs: the prompt is the UMT5 encoder's states (no pooled vector; Wan pads every prompt to
`max_sequence_length`, so the unconditional one is the empty prompt at that length), the latents
are `[C, F', h, w]` with F' = (num_frames - 1) / 4 + 1 (Wan's VAE encodes the first frame alone,
then 4 frames per latent frame), and decoding un-normalises them with the VAE's per-channel
mean and std. `num_frames` is the engine's (one value a run): 4k + 1, as Wan's VAE needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rl_core.flow import host_randn
from rl_models.diffusion import require_diffusers
from rl_models.loading import resolve_dtype
from rl_rollout.diffusion import DiffusionEngine, PromptEmbeddings
from rl_rollout.fp8 import Precision

__all__ = ["WanEngine", "decode_video", "video_noise", "video_tokens"]


class WanEngine(DiffusionEngine):
    """`DiffusionEngine` over a diffusers `WanPipeline` (see the module doc). `num_frames`: the
    frames of every sampled video (4k + 1). CUDA graphs are not offered (`cuda_graphs=False`)."""

    blocks_attribute = "blocks"

    def __init__(self, pipeline: Any, *, num_frames: int = 33, device: str | torch.device = "cpu",
                 compile: bool | None = None, attention_backend: str = "auto", overlap_decode: bool | None = None,
                 cuda_graphs: bool | None = None, precision: Precision = "bf16") -> None:
        if num_frames < 1 or (num_frames - 1) % pipeline.vae_scale_factor_temporal:
            raise ValueError(f"num_frames={num_frames}: Wan's VAE takes {pipeline.vae_scale_factor_temporal}k + 1 "
                             "frames (1, 5, 9, ..., 33, ..., 81)")
        if cuda_graphs:
            raise ValueError("cuda_graphs: not offered for Wan (pass None or False)")
        super().__init__(pipeline, device=device, compile=compile, cuda_graphs=False,
                         attention_backend=attention_backend, overlap_decode=overlap_decode, precision=precision)
        self.num_frames = num_frames

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = torch.float32,  # type: ignore[override]
                        device: str | torch.device = "cpu", num_frames: int = 33, compile: bool | None = None,
                        attention_backend: str = "auto", overlap_decode: bool | None = None,
                        text_encoder_dtype: str | torch.dtype | None = None, cuda_graphs: bool | None = None,
                        precision: Precision = "bf16") -> WanEngine:
        """Load a diffusers Wan 2.1 text-to-video folder or hub id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers);
        `text_encoder_dtype` keeps the UMT5 encoder in another dtype."""
        pipeline = require_diffusers().WanPipeline.from_pretrained(str(path), dtype=resolve_dtype(dtype))
        if text_encoder_dtype is not None:
            pipeline.text_encoder.to(resolve_dtype(text_encoder_dtype))
        return cls(pipeline, num_frames=num_frames, device=device, compile=compile,
                   attention_backend=attention_backend, overlap_decode=overlap_decode, cuda_graphs=cuda_graphs,
                   precision=precision)

    def _with_pipeline(self, pipeline: Any) -> WanEngine:
        return WanEngine(pipeline, num_frames=self.num_frames, device=self.device, compile=self.compile,
                         attention_backend=self.attention_backend, overlap_decode=self.overlap_decode)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, max_sequence_length: int = 226) -> PromptEmbeddings:
        """The UMT5 states `[B, L, D]` of each prompt, padded to `max_sequence_length` (Wan's 226
        by default); `pooled` is empty (`[B, 0]`): Wan has none."""
        wan: Any = self.pipeline  # a WanPipeline (the base class types it as SD3's)
        embeds, _ = wan.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                      max_sequence_length=max_sequence_length, device=self.device)
        return PromptEmbeddings(embeds, embeds.new_zeros(embeds.shape[0], 0))  # [B, L, D], [B, 0]

    def negative(self, length: int) -> PromptEmbeddings:
        """The empty prompt's states `[1, L, D]` at the conditioning's `length` (cached)."""
        if length not in self._negative:
            self._negative[length] = self.encode([""], max_sequence_length=length)
        return self._negative[length]

    def _text_kwargs(self, embeds: Tensor, pooled: Tensor) -> dict[str, Tensor]:
        return {"encoder_hidden_states": embeds}

    def _sequence_length(self, latents: Tensor) -> int:
        return video_tokens(self._transformer_config.patch_size, latents)

    def initial_noise(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> Tensor:
        """Float32 noise `[B, C, F', h, w]`, one generator per sample."""
        return video_noise(self, generators, height, width, channels=self._transformer_config.in_channels)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode latents `[B, C, F', h, w]` to frames `[B, F, 3, H, W]` float32 in [0, 1]."""
        return decode_video(self.pipeline.vae, latents)

    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """VAE-encode frames `[B, F, 3, H, W]` in [0, 1] to normalised latents `[B, C, F', h, w]`."""
        return encode_video(self.pipeline.vae, pixels.to(self.device))


@torch.no_grad()
def video_tokens(patch_size: Sequence[int], latents: Tensor) -> int:
    """Tokens of a video's latents `[B, C, F', h, w]` once patched by `patch_size` (t, h, w)."""
    t, h, w = patch_size
    return (latents.shape[-3] // t) * (latents.shape[-2] // h) * (latents.shape[-1] // w)


def video_noise(engine: DiffusionEngine, generators: list[torch.Generator], height: int, width: int, *,
                channels: int) -> Tensor:
    """Float32 noise `[B, channels, F', h, w]` of a Wan-VAE video engine (Wan, Cosmos), one generator
    per sample: F' = (num_frames - 1) / the VAE's temporal factor + 1, h and w the frame over its
    spatial factor (which, times the patch size, must divide the frame)."""
    pipeline, patch = engine.pipeline, engine._transformer_config.patch_size[1]
    scale = pipeline.vae_scale_factor_spatial
    if height % (scale * patch) or width % (scale * patch):
        raise ValueError(f"height and width must be multiples of {scale * patch} (VAE scale x patch size), "
                         f"got {height}x{width}")
    frames = (engine.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1  # type: ignore[attr-defined]
    shape = (len(generators), channels, frames, height // scale, width // scale)
    return host_randn(shape, generators, engine.device)  # [B, C, F', h, w]


def decode_video(vae: Any, latents: Tensor) -> Tensor:
    """Frames `[B, F, 3, H, W]` float32 in [0, 1] of normalised latents `[B, C, F', h, w]` through
    Wan's VAE (`AutoencoderKLWan`, Cosmos-Predict2.5's too): un-normalised with its per-channel
    mean and std first, as both pipelines do."""
    mean, std = latent_stats(vae, latents.device)
    video = vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2)  # [B, F, 3, H, W]


@torch.no_grad()
def encode_video(vae: Any, frames: Tensor) -> Tensor:
    """Normalised latents `[B, C, F', h, w]` of frames `[B, F, 3, H, W]` in [0, 1] through Wan's VAE
    (the inverse of `decode_video`): the posterior's mode, normalised with the per-channel mean and std."""
    mean, std = latent_stats(vae, frames.device)
    video = (frames * 2 - 1).transpose(1, 2).to(vae.dtype)  # [B, 3, F, H, W] in [-1, 1]
    return (vae.encode(video).latent_dist.mode().float() - mean) / std  # [B, C, F', h, w]


def latent_stats(vae: Any, device: torch.device) -> tuple[Tensor, Tensor]:
    """Wan's VAE's per-channel latent mean and std, each `[1, C, 1, 1, 1]`: what normalises its latents."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean, device=device).view(shape),
            torch.tensor(vae.config.latents_std, device=device).view(shape))
