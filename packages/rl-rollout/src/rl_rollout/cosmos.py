"""SDE sampling over a Cosmos-Predict2.5 text-to-world pipeline (`rl-rollout[diffusers]`): the
Flow-GRPO rollout of `rl_rollout.diffusion.DiffusionEngine` for NVIDIA's world model (VRL trains
Cosmos-Predict2.5 with DiffusionNFT; this engine gives the rollouts and per-step log-probs).

    engine = CosmosEngine.from_pretrained(path, num_frames=93)     # a Cosmos-Predict2.5 folder or `tiny:cosmos`'s
    traj = engine.sample(["a red bus moves"], num_steps=10, height=704, width=1280, seeds=[0],
                         max_sequence_length=512)
    traj.images      # [B, F, 3, H, W] frames in [0, 1]
    engine.replay(traj, step=3, model=trained)                      # the step's log-prob, with grad

Everything but the model's inputs and outputs is the image engine's: the same float32 SDE step
(`rl_core.flow.sde_step`, its log-prob a mean over every latent element), windows, seeds per
sample, CFG as one batched forward, compiled blocks (`transformer_blocks`), sleep and wake. What
differs, each as diffusers' `Cosmos2_5_PredictBasePipeline` does it:

- The prompt is every hidden layer of the Qwen2.5-VL encoder, each normalised and concatenated:
  `[B, L, layers x width]` (100,352 wide for the 7B encoder, ~200 KB a token in bf16; a
  trajectory keeps one copy per sample), after the pipeline's system turn, padded to
  `max_sequence_length`. Diffusers pads to 512; `sample` defaults to 128: pass 512 where the
  prompts are Cosmos's long scene descriptions, fewer to save memory with short ones.
- The unconditional branch is Cosmos's negative prompt (diffusers' `DEFAULT_NEGATIVE_PROMPT`,
  the pipeline's default); pass `negative_prompt=""` for the plain empty prompt.
- CFG is written `uncond + w (cond - uncond)` here as for every engine; diffusers' Cosmos
  computes `cond + w (cond - uncond)`, so its `guidance_scale=7` (its default) is 8 here.
- The transformer takes the noise level sigma in [0, 1] itself as its timestep (not sigma x 1000;
  `traj.timesteps` still records the scheduler's sigma x 1000), the condition-mask channel (zeros:
  no frame is given) and the padding mask (zeros, at the frames' size). With no frame given,
  one timestep per sample equals the pipeline's per-frame one.
- Latents are `[C, F', h, w]` with C = the transformer's `in_channels` - 1 (the mask channel) and
  F' = (num_frames - 1) / 4 + 1, decoded through Wan's VAE (`rl_rollout.wan.decode_video`).
  `num_frames` is the engine's (one value a run): 4k + 1, 93 for Cosmos-Predict2.5.

The sigmas are the folder's scheduler's (UniPC with flow sigmas); the steps are the engine's
SDE or Euler ODE steps, not UniPC's multistep solver, so an ODE sample is not the pipeline's
video at equal steps (with an Euler scheduler in the pipeline it is: tests/test_cosmos.py).

No guardrail runs. Diffusers' safety checker needs `cosmos_guardrail`; the engine loads the
pipeline with a placeholder in its place, which refuses to be called: `engine.pipeline(...)`
raises instead of generating unscreened videos. Diffusers' pipeline refuses to run without a
checker, saying that would violate the NVIDIA Open Model License: screen what you publish or
serve yourself (e.g. `cosmos_guardrail.CosmosSafetyChecker.check_video_safety` on the frames).

Video and image to world: `encode_world(prompts, frames)` gives a conditioning that holds the
first latent frames at the given frames' latents (the transformer sees them clean, with the
condition mask and `given_timestep`, as diffusers does); it travels in the trajectory, so the
replay holds them too, and their elements stay out of the log-probs. CUDA graphs are not offered
(as for Wan).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rl_models.loading import resolve_dtype
from rl_rollout.diffusion import DiffusionEngine, PromptEmbeddings
from rl_rollout.fp8 import Precision
from rl_rollout.wan import decode_video, encode_video, video_noise, video_tokens

GIVEN_VIDEO_FRAMES = 5  # frames of a clip to start from (`encode_world`): 2 latent frames, diffusers' default

try:  # the defining module: `diffusers.Cosmos2_5_PredictBasePipeline` reads as a dummy to mypy
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import (
        DEFAULT_NEGATIVE_PROMPT,
        Cosmos2_5_PredictBasePipeline,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'rl_rollout.cosmos needs diffusers: pip install "rl-rollout[diffusers]"; in a clone of the repository: '
        "uv sync --all-packages --extra diffusers"
    ) from error

__all__ = ["DEFAULT_NEGATIVE_PROMPT", "CosmosEngine", "NoGuardrail"]


class CosmosEngine(DiffusionEngine):
    """`DiffusionEngine` over a diffusers `Cosmos2_5_PredictBasePipeline`, text to world (see the
    module doc). `num_frames`: the frames of every sampled video (4k + 1); `negative_prompt`: the
    unconditional branch of CFG. CUDA graphs are not offered (`cuda_graphs=False`)."""

    def __init__(self, pipeline: Any, *, num_frames: int = 93, negative_prompt: str = DEFAULT_NEGATIVE_PROMPT,
                 device: str | torch.device = "cpu", compile: bool | None = None, attention_backend: str = "auto",
                 overlap_decode: bool | None = None, cuda_graphs: bool | None = None,
                 precision: Precision = "bf16") -> None:
        if num_frames < 1 or (num_frames - 1) % pipeline.vae_scale_factor_temporal:
            raise ValueError(f"num_frames={num_frames}: Cosmos' VAE (Wan's) takes {pipeline.vae_scale_factor_temporal}k"
                             " + 1 frames (1, 5, 9, ..., 93)")
        if cuda_graphs:
            raise ValueError("cuda_graphs: not offered for Cosmos (pass None or False)")
        super().__init__(pipeline, device=device, compile=compile, cuda_graphs=False,
                         attention_backend=attention_backend, overlap_decode=overlap_decode, precision=precision)
        self.num_frames = num_frames
        self.negative_prompt = negative_prompt
        self.given_timestep = 0.0001  # a given frame's timestep (diffusers' conditional_frame_timestep default)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = torch.float32,  # type: ignore[override]
                        device: str | torch.device = "cpu", num_frames: int = 93,
                        negative_prompt: str = DEFAULT_NEGATIVE_PROMPT, compile: bool | None = None,
                        attention_backend: str = "auto", overlap_decode: bool | None = None,
                        text_encoder_dtype: str | torch.dtype | None = None,
                        cuda_graphs: bool | None = None, precision: Precision = "bf16") -> CosmosEngine:
        """Load a diffusers Cosmos-Predict2.5 folder (nvidia/Cosmos-Predict2.5-2B's revision
        `diffusers/base/post-trained`, downloaded first) without its guardrail;
        `text_encoder_dtype` keeps the Qwen2.5-VL encoder in another dtype (bf16 beside an fp32
        transformer)."""
        with _quiet_guardrail_type_warning():
            pipeline = Cosmos2_5_PredictBasePipeline.from_pretrained(str(path), dtype=resolve_dtype(dtype),
                                                                     safety_checker=NoGuardrail())
        if text_encoder_dtype is not None:
            pipeline.text_encoder.to(resolve_dtype(text_encoder_dtype))
        return cls(pipeline, num_frames=num_frames, negative_prompt=negative_prompt, device=device, compile=compile,
                   attention_backend=attention_backend, overlap_decode=overlap_decode, cuda_graphs=cuda_graphs,
                   precision=precision)

    def _with_pipeline(self, pipeline: Any) -> CosmosEngine:
        return CosmosEngine(pipeline, num_frames=self.num_frames, negative_prompt=self.negative_prompt,
                            device=self.device, compile=self.compile, attention_backend=self.attention_backend,
                            overlap_decode=self.overlap_decode)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, max_sequence_length: int = 512) -> PromptEmbeddings:
        """The concatenated, normalised Qwen2.5-VL layers `[B, L, layers x width]` of each prompt
        after the pipeline's system turn, padded to `max_sequence_length` (Cosmos' 512 by default);
        `pooled` is empty (`[B, 0]`): Cosmos has none."""
        cosmos: Any = self.pipeline  # a Cosmos2_5_PredictBasePipeline (the base class types it as SD3's)
        embeds, _ = cosmos.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                         max_sequence_length=max_sequence_length, device=self.device)
        return PromptEmbeddings(embeds, embeds.new_zeros(embeds.shape[0], 0))  # [B, L, D], [B, 0]

    @torch.no_grad()
    def encode_world(self, prompts: Sequence[str], frames: Tensor | Sequence[Tensor], *,
                     max_sequence_length: int = 512) -> PromptEmbeddings:
        """Video (or image) to world: `encode`'s states plus the given frames `[B, F_in, 3, H, W]` in
        [0, 1] (1 frame: an image; 4k + 1: a clip), held as the first (F_in - 1) / 4 + 1 latent frames
        of every sample (as diffusers' pipeline: padded to `num_frames` with the last frame, encoded
        through the VAE's mode). Pass the result as `sample(conditioning=...)`: the sampler generates
        the rest, and the given frames stay out of the log-probs. `frames` may also be one
        `[F_in, 3, H, W]` tensor per prompt, F_in differing between them (an image beside a clip)."""
        if not isinstance(frames, Tensor):
            return self._encode_rows(prompts, frames, max_sequence_length)
        given = frames.shape[1]
        if frames.dim() != 5 or frames.shape[0] != len(prompts) or (given - 1) % 4 or given >= self.num_frames:
            raise ValueError(f"frames {tuple(frames.shape)}: need [B, F_in, 3, H, W] with a row per prompt "
                             f"({len(prompts)}) and F_in = 4k + 1 < num_frames={self.num_frames} (frames left to generate)")
        padded = torch.cat([frames, frames[:, -1:].expand(-1, self.num_frames - given, -1, -1, -1)], dim=1)  # [B, F, 3, H, W]
        held = self.encode_pixels(padded)  # [B, C, F', h, w]
        mask = torch.zeros(held.shape[0], 1, held.shape[2], 1, 1, device=held.device)  # [B, 1, F', 1, 1]
        mask[:, :, : (given - 1) // self.pipeline.vae_scale_factor_temporal + 1] = 1
        text = self.encode(prompts, max_sequence_length=max_sequence_length)
        return PromptEmbeddings(text.embeds, text.pooled, held, mask)

    def _encode_rows(self, prompts: Sequence[str], frames: Sequence[Tensor], length: int) -> PromptEmbeddings:
        """`encode_world` of rows with their own frame counts: the rows of each count together."""
        if len(frames) != len(prompts):
            raise ValueError(f"got {len(frames)} frame tensors for {len(prompts)} prompts")
        groups: dict[int, list[int]] = {}
        for row, given in enumerate(frames):
            groups.setdefault(given.shape[0], []).append(row)
        parts = [self.encode_world([prompts[r] for r in rows], torch.stack([frames[r] for r in rows]),
                                   max_sequence_length=length) for rows in groups.values()]
        merged = PromptEmbeddings(*(torch.cat([getattr(p, name) for p in parts])
                                    for name in ("embeds", "pooled", "held", "held_mask")))
        order = torch.tensor([r for rows in groups.values() for r in rows])  # merged row -> prompt
        return merged.index(torch.argsort(order).tolist())

    def negative(self, length: int) -> PromptEmbeddings:
        """`negative_prompt`'s states `[1, L, D]` at the conditioning's `length` (cached)."""
        if length not in self._negative:
            self._negative[length] = self.encode([self.negative_prompt], max_sequence_length=length)
        return self._negative[length]

    def _text_kwargs(self, embeds: Tensor, pooled: Tensor) -> dict[str, Tensor]:
        return {"encoder_hidden_states": embeds}

    def _latent_kwargs(self, latents: Tensor, sigma: Tensor, held: Tensor | None = None) -> dict[str, Tensor]:
        """The latents `[B, C, F', h, w]`, sigma `[B]` itself as the timestep, the condition mask
        `[B, 1, F', h, w]` and padding mask `[1, 1, H, W]`. Text to world: no frame given, the mask
        all zeros. `held` `[B, 1, F', 1, 1]` (video to world): the mask is 1 on the given latent
        frames, whose timestep is `given_timestep` (diffusers' `conditional_frame_timestep`)."""
        scale = self.pipeline.vae_scale_factor_spatial
        batch, _, frames, height, width = latents.shape
        padding = latents.new_zeros(1, 1, height * scale, width * scale)  # [1, 1, H, W]
        if held is None:
            return {"hidden_states": latents, "timestep": sigma, "padding_mask": padding,
                    "condition_mask": latents.new_zeros(batch, 1, frames, height, width)}  # [B, 1, F', h, w]
        timestep = held * self.given_timestep + (1 - held) * sigma.view(batch, 1, 1, 1, 1)  # [B, 1, F', 1, 1]
        return {"hidden_states": latents, "timestep": timestep, "padding_mask": padding,
                "condition_mask": held.to(latents.dtype).expand(-1, -1, -1, height, width)}  # [B, 1, F', h, w]

    def _sequence_length(self, latents: Tensor) -> int:
        return video_tokens(self._transformer_config.patch_size, latents)

    def initial_noise(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> Tensor:
        """Float32 noise `[B, C, F', h, w]` (C = `in_channels` - 1: the last input channel is the
        condition mask), one generator per sample."""
        return video_noise(self, generators, height, width, channels=self._transformer_config.in_channels - 1)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode latents `[B, C, F', h, w]` to frames `[B, F, 3, H, W]` float32 in [0, 1]."""
        return decode_video(self.pipeline.vae, latents)

    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """VAE-encode frames `[B, F, 3, H, W]` in [0, 1] to normalised latents `[B, C, F', h, w]`."""
        return encode_video(self.pipeline.vae, pixels.to(self.device))


class NoGuardrail:
    """The `safety_checker` a `CosmosEngine`'s pipeline holds in place of diffusers'
    `CosmosSafetyChecker` (which needs `cosmos_guardrail`): the engine never calls it, and calling
    the pipeline itself raises here rather than generating unscreened videos."""

    def to(self, *args: Any, **kwargs: Any) -> NoGuardrail:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        raise RuntimeError(_NO_GUARDRAIL)

    def check_video_safety(self, video: Any) -> Any:
        raise RuntimeError(_NO_GUARDRAIL)


_NO_GUARDRAIL = ("this Cosmos pipeline was loaded by CosmosEngine without a guardrail: sample with the engine, or "
                 "load the pipeline with cosmos_guardrail's CosmosSafetyChecker to call it")


@contextlib.contextmanager
def _quiet_guardrail_type_warning() -> Iterator[None]:
    """Drop diffusers' "Expected types for safety_checker" log line while loading: the placeholder
    is deliberate (the module doc says why), and the line would read as a loading fault."""
    logger = logging.getLogger("diffusers.pipelines.pipeline_utils")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Expected types for safety_checker")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
