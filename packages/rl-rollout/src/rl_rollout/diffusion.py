"""SDE sampling over a Stable Diffusion 3 / 3.5 pipeline for Flow-GRPO (`rl-rollout[diffusers]`).

The engine holds a diffusers `StableDiffusion3Pipeline` (transformer, VAE, three text encoders,
flow-matching scheduler) and samples with `rl_core.flow.sde_step`, keeping what the trainer needs
to replay each step: prompt embeddings, the latents before and after every step, sigmas and the
per-step log-probs. Rollout and replay run the same float32 step function and the same batched
CFG forward, so the first on-policy replay gives an importance ratio of exactly 1.

Choose `kind="sde"` for Flow-GRPO (noise level 0.7), `kind="cps"` for coefficients-preserving
sampling (noise level 0.8), and an `sde_window` to sample only a few steps stochastically and the
rest with the deterministic Euler ODE (Flow-GRPO-Fast: fewer steps to replay, same reward).
Evaluation uses `kind="ode"` (deterministic, 40 steps in the VRL recipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rl_core.flow import SDEStep, sde_step
from rl_models.diffusion import load_sd3

try:  # the defining module: mypy reads `diffusers.StableDiffusion3Pipeline` as diffusers' dummy
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
        StableDiffusion3Pipeline,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'rl_rollout.diffusion needs diffusers: pip install "rl-rollout[diffusers]"; in a clone of the repository: uv sync --all-packages --extra diffusers'
    ) from error

__all__ = ["DiffusionEngine", "PromptEmbeddings", "Trajectory"]

SamplerKind = Literal["sde", "cps", "ode"]


@dataclass(frozen=True)
class PromptEmbeddings:
    """Text conditioning of a batch: `embeds` `[B, L, D]` (CLIP-L/G + T5 tokens), `pooled`
    `[B, P]` (pooled CLIP-L/G)."""

    embeds: Tensor
    pooled: Tensor

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def index(self, rows: Tensor | slice | Sequence[int]) -> PromptEmbeddings:
        return PromptEmbeddings(self.embeds[rows], self.pooled[rows])


@dataclass(frozen=True)
class Trajectory:
    """Everything a Flow-GRPO trainer replays. `S` = sampling steps, latents `[C, h, w]`.

    - `latents` `[B, S + 1, C, h, w]` float32: `latents[:, k]` is x at `sigmas[k]`
      (index 0 = initial noise, index S = final sample).
    - `sigmas` `[S + 1]` float32, from 1 down to 0; `timesteps` `[S]` = the transformer's input.
    - `log_probs` `[B, S]` float32: log-prob of each stochastic step (0 on ODE steps).
    - `sde_steps` `[S]` bool: which steps were stochastic (the trainable ones).
    - `images` `[B, 3, H, W]` float32 in [0, 1].
    """

    prompts: tuple[str, ...]
    conditioning: PromptEmbeddings
    latents: Tensor
    sigmas: Tensor
    timesteps: Tensor
    log_probs: Tensor
    sde_steps: Tensor
    images: Tensor
    guidance_scale: float
    noise_level: float
    kind: SamplerKind

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]


class DiffusionEngine:
    """Flow-GRPO sampling and replay over an SD3 pipeline's parts.

    `dtype` is the weights' dtype (bf16/fp16 on GPU, fp32 on CPU); the step maths and the stored
    latents are always float32.
    """

    def __init__(self, pipeline: StableDiffusion3Pipeline, *, device: str | torch.device = "cpu"):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.pipeline.to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        self._negative: dict[int, PromptEmbeddings] = {}
        self._asleep = False

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        text_encoder_dtype: str | torch.dtype | None = None,
    ) -> DiffusionEngine:
        """Load a diffusers SD3/SD3.5 folder or hub id (e.g. stabilityai/stable-diffusion-3.5-medium)
        through `rl_models.diffusion.load_sd3`; `text_encoder_dtype` keeps the encoders in another
        dtype (bf16 encoders next to an fp32 transformer)."""
        pipeline = load_sd3(path, dtype=dtype, text_encoder_dtype=text_encoder_dtype)
        return cls(pipeline, device=device)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def dtype(self) -> torch.dtype:
        return self.pipeline.transformer.dtype

    @property
    def _transformer_config(self) -> Any:
        """The transformer's diffusers config (`in_channels`, `patch_size`); a LoRA `PeftModel`
        forwards `.config` to its base, which `torch.nn.Module`'s typing cannot say."""
        return self.transformer.config

    # -- conditioning -------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, max_sequence_length: int = 128) -> PromptEmbeddings:
        """Encode prompts once (a group's n samples share them: index the result)."""
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            # diffusers annotates these `str | list[str]`; None reuses `prompt` for CLIP-G and T5
            prompt_2=None,  # type: ignore[arg-type]
            prompt_3=None,  # type: ignore[arg-type]
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return PromptEmbeddings(embeds, pooled)  # [B, L, D], [B, P]

    def negative(self, length: int) -> PromptEmbeddings:
        """Unconditional (empty prompt) embeddings `[1, L, D]`, `[1, P]` matching a conditioning
        of `length` tokens; cached per length."""
        if length not in self._negative:
            t5_length = length - self.pipeline.tokenizer_max_length
            negative = self.encode([""], max_sequence_length=t5_length)
            if negative.embeds.shape[1] != length:
                raise ValueError(
                    f"cannot build unconditional embeddings of {length} tokens "
                    f"(got {negative.embeds.shape[1]}); encode prompts with this engine's encode()"
                )
            self._negative[length] = negative
        return self._negative[length]

    # -- the model -----------------------------------------------------------------------------

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor,
        conditioning: PromptEmbeddings,
        *,
        guidance_scale: float,
        detach_uncond: bool = False,
        model: torch.nn.Module | None = None,
    ) -> Tensor:
        """Predicted velocity `[B, C, h, w]` (float32) at `sigma` `[B]`, with CFG in one batched
        forward over `[uncond; cond]`. In training pass `detach_uncond=True`: the unconditional
        branch then carries no gradient (Flow-GRPO), while the values equal the rollout's.

        `model` runs the forward through a wrapper of `pipeline.transformer` (a peft model, a
        DDP-wrapped one from `accelerator.prepare`) so gradients sync; default: the transformer.
        """
        batch = latents.shape[0]
        use_cfg = guidance_scale > 1.0
        model_in = latents.to(self.dtype)  # [B, C, h, w]
        embeds = conditioning.embeds.to(self.dtype)  # [B, L, D]
        pooled = conditioning.pooled.to(self.dtype)  # [B, P]
        if use_cfg:
            neg = self.negative(embeds.shape[1])
            model_in = torch.cat([model_in, model_in])  # [2B, C, h, w]
            embeds = torch.cat([neg.embeds.to(self.dtype).expand(batch, -1, -1), embeds])  # [2B, L, D]
            pooled = torch.cat([neg.pooled.to(self.dtype).expand(batch, -1), pooled])  # [2B, P]
            sigma = torch.cat([sigma, sigma])  # [2B]
        timestep = sigma.to(self.device, torch.float32) * self.pipeline.scheduler.config.num_train_timesteps
        out = (model or self.transformer)(
            hidden_states=model_in,
            timestep=timestep,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()  # [B or 2B, C, h, w]
        if not use_cfg:
            return out
        uncond, cond = out.chunk(2)  # [B, C, h, w] each
        if detach_uncond:
            uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)  # [B, C, h, w]

    # -- sampling ------------------------------------------------------------------------------

    def schedule(self, num_steps: int, image_seq_len: int) -> Tensor:
        """The scheduler's sigmas `[S + 1]` (float32, last = 0), shift/dynamic shift applied."""
        scheduler = self.pipeline.scheduler
        kwargs: dict[str, Any] = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
                calculate_shift,
            )

            kwargs["mu"] = calculate_shift(
                image_seq_len,
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()  # [S + 1]

    def initial_noise(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> Tensor:
        """Float32 noise `[B, C, h, w]`, one generator per sample (reproducible per seed)."""
        scale = self.pipeline.vae_scale_factor
        if height % (scale * 2) or width % (scale * 2):
            raise ValueError(
                f"height and width must be multiples of {scale * 2} (VAE scale x patch size), "
                f"got {height}x{width}"
            )
        shape = (self._transformer_config.in_channels, height // scale, width // scale)
        noise = [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
        return torch.stack(noise).to(self.device)  # [B, C, h, w]

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[str],
        *,
        conditioning: PromptEmbeddings | None = None,
        num_steps: int = 10,
        guidance_scale: float = 4.5,
        height: int = 512,
        width: int = 512,
        noise_level: float = 0.7,
        kind: SamplerKind = "sde",
        sde_window: tuple[int, int] | None = None,
        seeds: Sequence[int] | None = None,
        max_sequence_length: int = 128,
    ) -> Trajectory:
        """Sample one image per prompt and keep the trajectory.

        `sde_window=(start, stop)` samples steps `start <= k < stop` stochastically and the others
        with the ODE (default: every step when `kind` is `sde`/`cps`, none for `ode`). `seeds`
        gives one seed per prompt (default 0, 1, ...): the initial noise and every step's noise
        come from that sample's generator, so a sample is reproducible whatever the batch.
        """
        if not prompts:
            raise ValueError("sample() needs at least one prompt")
        batch = len(prompts)
        seeds = list(range(batch)) if seeds is None else list(seeds)
        if len(seeds) != batch:
            raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
        if conditioning is None:
            conditioning = self.encode(prompts, max_sequence_length=max_sequence_length)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        latents = self.initial_noise(batch, height, width, generators)  # [B, C, h, w]
        patch = self._transformer_config.patch_size
        seq_len = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
        sigmas = self.schedule(num_steps, seq_len)  # [S + 1]
        sde_steps = self._sde_mask(num_steps, kind, sde_window)  # [S]
        states, log_probs = [latents], []
        for k in range(num_steps):
            velocity = self.velocity(
                latents, sigmas[k].expand(batch), conditioning, guidance_scale=guidance_scale
            )  # [B, C, h, w]
            if sde_steps[k]:
                step = sde_step(
                    velocity=velocity,
                    latents=latents,
                    sigma=float(sigmas[k]),
                    sigma_next=float(sigmas[k + 1]),
                    noise_level=noise_level,
                    kind=kind,
                    generator=generators,
                )
                latents, log_prob = step.next_latents, step.log_prob  # [B, C, h, w], [B]
            else:
                latents = latents + velocity * (sigmas[k + 1] - sigmas[k])  # Euler ODE step
                log_prob = torch.zeros(batch, device=self.device)  # [B]
            states.append(latents)
            log_probs.append(log_prob)
        return Trajectory(
            prompts=tuple(prompts),
            conditioning=conditioning,
            latents=torch.stack(states, dim=1),  # [B, S + 1, C, h, w]
            sigmas=sigmas,
            timesteps=sigmas[:-1] * self.pipeline.scheduler.config.num_train_timesteps,
            log_probs=torch.stack(log_probs, dim=1),  # [B, S]
            sde_steps=sde_steps,
            images=self.decode(latents),
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            kind=kind,
        )

    @staticmethod
    def _sde_mask(num_steps: int, kind: SamplerKind, window: tuple[int, int] | None) -> Tensor:
        if kind not in ("sde", "cps", "ode"):
            raise ValueError(f"kind must be 'sde', 'cps' or 'ode', got {kind!r}")
        mask = torch.zeros(num_steps, dtype=torch.bool)  # [S]
        if kind == "ode":
            return mask
        start, stop = (0, num_steps) if window is None else window
        if not 0 <= start < stop <= num_steps:
            raise ValueError(f"sde_window must satisfy 0 <= start < stop <= {num_steps}, got {window}")
        mask[start:stop] = True
        return mask

    def replay(
        self,
        trajectory: Trajectory,
        step: int,
        *,
        rows: Tensor | None = None,
        model: torch.nn.Module | None = None,
    ) -> SDEStep:
        """Re-score stochastic step `step` of (a subset `rows` of) a trajectory under the current
        weights, with gradients (through `model`, see `velocity`). `log_prob` `[b]` equals
        `trajectory.log_probs[rows, step]` at unchanged weights when the rows form the batch they
        were sampled in (other batch shapes may differ in the last bits: BLAS blocking);
        `mean` feeds `rl_core.flow.flow_kl` against the reference."""
        if not bool(trajectory.sde_steps[step]):
            raise ValueError(f"step {step} was sampled with the ODE: it has no log-prob to replay")
        rows = torch.arange(trajectory.latents.shape[0]) if rows is None else rows
        latents = trajectory.latents[rows, step]  # [b, C, h, w]
        conditioning = trajectory.conditioning.index(rows)
        sigma = trajectory.sigmas[step].expand(latents.shape[0])  # [b]
        velocity = self.velocity(
            latents,
            sigma,
            conditioning,
            guidance_scale=trajectory.guidance_scale,
            detach_uncond=True,
            model=model,
        )  # [b, C, h, w]
        return sde_step(
            velocity=velocity,
            latents=latents,
            sigma=float(trajectory.sigmas[step]),
            sigma_next=float(trajectory.sigmas[step + 1]),
            noise_level=trajectory.noise_level,
            kind=trajectory.kind,
            next_latents=trajectory.latents[rows, step + 1],
        )

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode latents `[B, C, h, w]` to images `[B, 3, H, W]` float32 in [0, 1]."""
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor  # [B, C, h, w]
        images = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- memory --------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Move every part to CPU and free the accelerator's cache (no-op on CPU)."""
        self.pipeline.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        self.pipeline.to(self.device)
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        return self._asleep
