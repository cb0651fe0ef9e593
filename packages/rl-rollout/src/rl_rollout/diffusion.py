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

Speed: the sampling loop does not wait for the GPU between steps (sigmas are filled on the device;
each step's noise is drawn from the CPU generators into pinned memory while the GPU runs the
forward, then copied without blocking), the CFG text inputs are concatenated once per call, and
the VAE decodes the batch at once. `compile=True` (default on CUDA) compiles each transformer
block with `torch.compile(fullgraph=True, dynamic=False)`: regional compilation, the PyTorch
recipe that diffusers' `compile_repeated_blocks` follows (diffusers 0.42 lists no repeated blocks
for SD3, so the engine compiles `transformer_blocks` itself). The blocks share one compiled code
object, so compiling costs about one block per variant (SD3.5's dual-attention blocks, the last
block; no-grad sampling, replay with grad, the LoRA-off reference; each batch size) instead of
the whole model. Every forward of the transformer then runs the compiled blocks: sampling, and
replay whether it goes through the transformer, its peft model or a DDP wrapper of it. Compiled
and eager forwards agree within rounding, not bit for bit, and the compiled no-grad (sampling) and
grad (replay) graphs can round differently too: watch the first replay's log ratio
(diffusion-grpo's `algo.replay_tolerance`), or pass `compile=False` for a ratio of exactly 1.

Rollout options (each `None`/`"auto"` = the choice in `AUTO_ON_CUDA` on CUDA, off on CPU; each
compared alone with the compiled plain pipeline by benchmarks/diffusion_grpo.py):
- `cuda_graphs`: the CFG forward of each sampling step (every kernel of the transformer, one
  launch) is captured once per batch shape in a `torch.cuda.CUDAGraph` and replayed; the SDE
  step's few elementwise kernels stay outside (their noise comes from the host generators). Same
  kernels, same inputs: the images equal the ungraphed forward's. Only `sample`/`sample_many` use
  it (replay needs gradients). A graph reads the weights where they were at capture: the engine
  recaptures when the transformer's modules or parameter storage change (LoRA added, sleep/wake,
  an FSDP2 gather into new storage); in-place updates (optimizer steps, weight pushes) are seen.
  It cannot see a peft adapter switched off around `sample` (a Python branch inside the graph):
  call `reset_graphs()` after such a switch. CUDA only.
- `attention_backend`: the SDPA kernel of the joint attention, for sampling and replay alike (so
  the first replay's ratio stays 1): `default` (PyTorch's pick), `flash`, `cudnn` (cuDNN
  attention, Hopper), `efficient`, `math`. `cudnn` and `efficient` need CUDA. Compiled blocks bake
  the backend in at compile time (dynamo does not guard on it): changing the attribute after a
  compiled forward resets torch.compile's caches.
- `overlap_decode`: `sample_many` decodes batch k with the VAE on a side CUDA stream while batch
  k + 1 denoises; the last decode is waited for before it returns. CUDA only.
- `precision`: `"fp8"` samples with FP8 GEMMs in the transformer blocks' linear layers
  (`rl_rollout.fp8`: row-scaled e4m3 weights re-quantized when the weights change, activations
  quantized per token; CUDA needs compute capability 9.0 and bf16 weights, the CPU emulates it);
  `"bf16"` (the default) samples in the weights' own dtype. Replay always runs in the weights'
  dtype, so FP8 rollouts are off-policy by the quantization's gap: a trainer rescores the old
  log-probs and corrects the gap (diffusion-grpo's `rollout.precision`). Eval samples in the
  engine's precision too.
CFG needs no option: `[uncond; cond]` already run as one batched forward.

For the replay: `pack_rows` regroups a trainer's micro-batches across sampled batches of one
schedule (`same_schedule`), joining their rows into one trajectory (`join_rows`), so every
replay forward has the micro-batch's size.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from rl_core.flow import SDEStep, compute_ratio_guard, host_randn, sde_step
from rl_models.diffusion import load_sd3
from rl_rollout.fp8 import Fp8Sampling, Precision

try:  # the defining module: mypy reads `diffusers.StableDiffusion3Pipeline` as diffusers' dummy
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
        StableDiffusion3Pipeline,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'rl_rollout.diffusion needs diffusers: pip install "rl-rollout[diffusers]"; in a clone of the repository: uv sync --all-packages --extra diffusers'
    ) from error

__all__ = ["AUTO_ON_CUDA", "DiffusionEngine", "PromptEmbeddings", "SampleBatch", "Trajectory", "join_rows", "pack_rows",
           "same_schedule", "sample_to_cpu"]

SamplerKind = Literal["sde", "cps", "ode"]

# the SDPA kernels `attention_backend` names ("default": no restriction, PyTorch picks)
ATTENTION_BACKENDS: dict[str, SDPBackend | None] = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_CUDA_ONLY_BACKENDS = ("cudnn", "efficient")

# What `None` / "auto" resolves to on CUDA (on CPU every option is off / "default"). An option is
# on here only where benchmarks/diffusion_grpo.py finds it faster than without it, with the images
# and log-probs inside the stated tolerance. None is: at SD3.5-M shape the compiled transformer is
# compute-bound, and no option alone speeds it up (benchmarks/RESULTS.md, "diffusion-grpo (a):
# rollout variants vs the compiled plain pipeline").
AUTO_ON_CUDA: dict[str, Any] = {"cuda_graphs": False, "attention_backend": "default", "overlap_decode": False}

# Graphs of the compiled block code (torch._dynamo's recompile limit, 8 by default, counts them per
# code object, so over all blocks): up to 3 block kinds (plain, SD3.5 dual-attention, the last) x
# sampling / replay with grad / reference with LoRA off x the batch sizes in use. Past the limit a
# fullgraph compile raises instead of running eagerly.
_RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class PromptEmbeddings:
    """Conditioning of a batch: `embeds` `[B, L, D]` (CLIP-L/G + T5 tokens), `pooled` `[B, P]`
    (pooled CLIP-L/G), and, for a world model given its first frames (`CosmosEngine.encode_world`),
    `held` `[B, C, F', h, w]`: clean latents the sampler holds where `held_mask` `[B, 1, F', 1, 1]`
    is 1 (those latent frames are given, not generated, and stay out of every log-prob)."""

    embeds: Tensor
    pooled: Tensor
    held: Tensor | None = None
    held_mask: Tensor | None = None

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def index(self, rows: Tensor | slice | Sequence[int]) -> PromptEmbeddings:
        if self.held is None or self.held_mask is None:
            return PromptEmbeddings(self.embeds[rows], self.pooled[rows])
        return PromptEmbeddings(self.embeds[rows], self.pooled[rows], self.held[rows], self.held_mask[rows])

    def to(self, device: str | torch.device) -> PromptEmbeddings:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return PromptEmbeddings(self.embeds.to(device), self.pooled.to(device), move(self.held), move(self.held_mask))

    def hold(self, latents: Tensor) -> Tensor:
        """`latents` `[B, C, ...]` with the given frames set to `held` (unchanged without them)."""
        if self.held is None or self.held_mask is None:
            return latents
        mask = self.held_mask.to(latents)
        return mask * self.held.to(latents) + (1 - mask) * latents

    @property
    def free_mask(self) -> Tensor | None:
        """`[B, 1, F', 1, 1]`, 1 on the latent frames the sampler generates; None: every frame."""
        return None if self.held_mask is None else 1 - self.held_mask


@dataclass(frozen=True)
class Trajectory:
    """Everything a Flow-GRPO trainer replays. `S` = sampling steps, latents `[C, h, w]`.

    - `latents` `[B, S + 1, C, h, w]` float32: `latents[:, k]` is x at `sigmas[k]`
      (index 0 = initial noise, index S = final sample).
    - `sigmas` `[S + 1]` float32, from 1 down to 0; `timesteps` `[S]` = the transformer's input.
    - `log_probs` `[B, S]` float32: log-prob of each stochastic step (0 on ODE steps).
    - `sde_steps` `[S]` bool: which steps were stochastic (the trainable ones).
    - `images` `[B, 3, H, W]` float32 in [0, 1].
    - `means` `[B, S, C, h, w]` float32 or None: each step's transition mean (an ODE step's is
      its result), kept only when `sample(keep_means=True)`: GRPO-Guard's RatioNorm
      (`rl_core.flow.compute_ratio_guard`) needs the rollout's mean of every replayed step.
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
    means: Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    def ratio_guard(self, step: int, rows: Tensor, out: SDEStep) -> dict[str, Any]:
        """GRPO-Guard's RatioNorm of replayed step `step` of `rows` (`out`: its replay; the
        trajectory sampled with `keep_means`): the re-centred, re-scaled log ratio `[b, 1]` and the
        policy loss's scale 1 / |dt|, upstream's `policy_loss / sqrt_dt.mean() ** 2`
        (`rl_core.flow.compute_ratio_guard`), as `Replay`'s keyword arguments."""
        if self.means is None:
            raise ValueError("ratio_guard needs the rollout's step means: sample with keep_means=True")
        sigma, sigma_next = float(self.sigmas[step]), float(self.sigmas[step + 1])
        old_mean = self.means[rows.to(self.means.device), step]  # [b, C, h, w]
        log_ratio, _ = compute_ratio_guard(logp=out.log_prob, old_logp=self.log_probs[rows, step], mean=out.mean,
                                           old_mean=old_mean, step_std=out.std * math.sqrt(sigma - sigma_next),
                                           dt=sigma_next - sigma)  # [b]
        return {"log_ratio": log_ratio[:, None], "policy_scale": 1 / (sigma - sigma_next)}

    def to(self, device: str | torch.device) -> Trajectory:
        """The per-sample tensors on `device` (the schedule stays on CPU, as the engine returns it)."""
        return replace(self, conditioning=self.conditioning.to(device), latents=self.latents.to(device), log_probs=self.log_probs.to(device),
                       images=self.images.to(device), means=None if self.means is None else self.means.to(device))


@dataclass(frozen=True)
class SampleBatch:
    """One sampling batch of `DiffusionEngine.sample_many`: `sample`'s per-batch arguments."""

    prompts: Sequence[str]
    conditioning: PromptEmbeddings | None = None
    seeds: Sequence[int] | None = None
    sde_window: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Graph:
    """A captured CFG forward: copy into `inputs`, replay `graph`, read `output` (static buffers)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    output: Tensor


def resolve_options(
    device: torch.device, *, cuda_graphs: bool | None, attention_backend: str, overlap_decode: bool | None
) -> tuple[bool, str, bool]:
    """`(cuda_graphs, attention_backend, overlap_decode)` with `None`/"auto" resolved for `device`
    (`AUTO_ON_CUDA` on CUDA, off on CPU); a CUDA-only choice on another device is refused."""
    cuda = device.type == "cuda"
    if attention_backend != "auto" and attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend={attention_backend!r} is not one of: auto, {', '.join(ATTENTION_BACKENDS)}"
        )
    for name, value in (("cuda_graphs", cuda_graphs), ("overlap_decode", overlap_decode)):
        if value and not cuda:
            raise ValueError(f"{name}=True needs a CUDA device (got {device}); pass None (auto) or False")
    if attention_backend in _CUDA_ONLY_BACKENDS and not cuda:
        raise ValueError(
            f"attention_backend={attention_backend!r} needs a CUDA device (got {device}); "
            "use 'auto', 'default', 'flash' or 'math'"
        )
    auto: dict[str, Any] = AUTO_ON_CUDA if cuda else {"cuda_graphs": False, "attention_backend": "default",
                                                      "overlap_decode": False}
    return (
        auto["cuda_graphs"] if cuda_graphs is None else cuda_graphs,
        auto["attention_backend"] if attention_backend == "auto" else attention_backend,
        auto["overlap_decode"] if overlap_decode is None else overlap_decode,
    )


class DiffusionEngine(Fp8Sampling):
    """Flow-GRPO sampling and replay over an SD3 pipeline's parts.

    `dtype` is the weights' dtype (bf16/fp16 on GPU, fp32 on CPU); the step maths and the stored
    latents are always float32.

    `compile` compiles each transformer block at the first forward (default: on CUDA only; see the
    module docstring); set the attribute to switch later: at the next forward the blocks of the
    current `pipeline.transformer` are compiled, or restored. Weights are read at each call, so
    in-place updates (optimizer steps, `load_state_dict`, a gathered FSDP2 copy) need no
    recompile; a new module structure (LoRA added after the first forward) or a new batch size
    compiles a new graph once. Deep-copy the transformer (FSDP2's `FullWeights`) before the first
    forward: a copy's blocks would keep calling the original blocks' compiled forward. If
    compiling a forward fails, the engine warns and runs eagerly from then on (a backward graph
    compiles inside `loss.backward()`, outside the engine: its errors are not caught).

    `cuda_graphs`, `attention_backend`, `overlap_decode` and `precision` are the rollout options of
    the module docstring (`None`/"auto": `AUTO_ON_CUDA` on CUDA, off on CPU); set the attributes to
    switch.
    Another flow-matching family subclasses it by its model's inputs and outputs
    (`rl_rollout.wan.WanEngine`, `rl_rollout.cosmos.CosmosEngine`): `encode`, `negative`,
    `_text_kwargs`, `_latent_kwargs`, `_sequence_length`, `initial_noise`, `decode` and
    `blocks_attribute`.
    """

    blocks_attribute = "transformer_blocks"  # the transformer's repeated blocks, compiled one by one

    def __init__(
        self,
        pipeline: StableDiffusion3Pipeline,
        *,
        device: str | torch.device = "cpu",
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        attention_backend: str = "auto",
        overlap_decode: bool | None = None,
        precision: Precision = "bf16",
    ):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.cuda_graphs, self.attention_backend, self.overlap_decode = resolve_options(
            self.device, cuda_graphs=cuda_graphs, attention_backend=attention_backend, overlap_decode=overlap_decode
        )
        self.pipeline.to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self._compiled: list[torch.nn.Module] = []  # the blocks whose forward is compiled now
        self._compiled_backend = self.attention_backend  # the SDPA backend the compiled graphs baked in
        self._graphs: dict[tuple[Any, ...], _Graph] = {}  # captured CFG forwards, by shapes and weights
        self._negative: dict[int, PromptEmbeddings] = {}
        self._asleep = False
        self.precision = precision  # sampling in FP8: the blocks' linear layers (`Fp8Sampling`)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        text_encoder_dtype: str | torch.dtype | None = None,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        attention_backend: str = "auto",
        overlap_decode: bool | None = None,
        precision: Precision = "bf16",
    ) -> DiffusionEngine:
        """Load a diffusers SD3/SD3.5 folder or hub id (e.g. stabilityai/stable-diffusion-3.5-medium)
        through `rl_models.diffusion.load_sd3`; `text_encoder_dtype` keeps the encoders in another
        dtype (bf16 encoders next to an fp32 transformer)."""
        pipeline = load_sd3(path, dtype=dtype, text_encoder_dtype=text_encoder_dtype)
        return cls(pipeline, device=device, compile=compile, cuda_graphs=cuda_graphs,
                   attention_backend=attention_backend, overlap_decode=overlap_decode, precision=precision)

    def over(self, transformer: torch.nn.Module) -> DiffusionEngine:
        """An engine sampling with `transformer` (a copy of this one's, e.g. an asynchronous
        rollout's weights) that shares this engine's text encoders and VAE, with the same options.
        Its scheduler and tokenizers are its own: sampling sets the scheduler's timesteps, and a
        fast tokenizer's call sets its padding and truncation, while this engine may encode on
        another thread."""
        for block in getattr(transformer, self.blocks_attribute, []):  # a copy made after a compiled forward
            block.__dict__.pop("forward", None)  # would call the original block's compiled forward
        pipeline = self.pipeline
        own = {name: copy.deepcopy(part) for name, part in pipeline.components.items()
               if name == "scheduler" or name.startswith("tokenizer")}
        parts = {**pipeline.components, **own, "transformer": transformer}
        engine = self._with_pipeline(type(pipeline)(**parts))
        engine.precision = self.precision
        return engine

    def _with_pipeline(self, pipeline: Any) -> DiffusionEngine:
        """An engine of this one's kind and options over `pipeline` (`over`'s last step; a
        subclass adds its own options)."""
        return DiffusionEngine(pipeline, device=self.device, compile=self.compile, cuda_graphs=self.cuda_graphs,
                               attention_backend=self.attention_backend, overlap_decode=self.overlap_decode)

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
        embeds, pooled = self._text_inputs(conditioning, guidance_scale)
        return self._velocity(latents, sigma, embeds, pooled, guidance_scale, detach_uncond=detach_uncond, model=model,
                              held=conditioning.held_mask)

    def _text_inputs(self, conditioning: PromptEmbeddings, guidance_scale: float) -> tuple[Tensor, Tensor]:
        """The transformer's text inputs in the weights' dtype: `[uncond; cond]` rows with CFG
        (`[2B, L, D]`, `[2B, P]`), else the conditioning's (`[B, L, D]`, `[B, P]`)."""
        embeds = conditioning.embeds.to(self.dtype)  # [B, L, D]
        pooled = conditioning.pooled.to(self.dtype)  # [B, P]
        if guidance_scale <= 1.0:
            return embeds, pooled
        batch, neg = embeds.shape[0], self.negative(embeds.shape[1])
        embeds = torch.cat([neg.embeds.to(self.dtype).expand(batch, -1, -1), embeds])  # [2B, L, D]
        pooled = torch.cat([neg.pooled.to(self.dtype).expand(batch, -1), pooled])  # [2B, P]
        return embeds, pooled

    def _velocity(
        self,
        latents: Tensor,
        sigma: Tensor,
        embeds: Tensor,
        pooled: Tensor,
        guidance_scale: float,
        *,
        detach_uncond: bool = False,
        model: torch.nn.Module | None = None,
        held: Tensor | None = None,
    ) -> Tensor:
        """`velocity` from `_text_inputs` (built once per sampling call, not once per step);
        `held` `[B, 1, F', 1, 1]`: the given latent frames (`PromptEmbeddings.held_mask`), whose
        velocity is 0 (the sampler holds them)."""
        use_cfg = guidance_scale > 1.0
        model_in = latents.to(self.dtype)  # [B, C, h, w]
        held_in = held.to(self.device, torch.float32) if held is not None else None  # [B, 1, F', 1, 1]
        if use_cfg:
            model_in = torch.cat([model_in, model_in])  # [2B, C, h, w]
            sigma = torch.cat([sigma, sigma])  # [2B]
            held_in = torch.cat([held_in, held_in]) if held_in is not None else None  # [2B, 1, F', 1, 1]
        out = self._forward(
            model or self.transformer,
            return_dict=False,
            **self._latent_kwargs(model_in, sigma.to(self.device, torch.float32), held_in),
            **self._text_kwargs(embeds, pooled),
        ).float()  # [B or 2B, C, h, w]
        if use_cfg:
            uncond, cond = out.chunk(2)  # [B, C, h, w] each
            if detach_uncond:
                uncond = uncond.detach()
            out = uncond + guidance_scale * (cond - uncond)  # [B, C, h, w]
        return out if held is None else out * (1 - held.to(out))

    def _text_kwargs(self, embeds: Tensor, pooled: Tensor) -> dict[str, Tensor]:
        """The transformer's text keyword arguments (SD3: the token states and the pooled vector)."""
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def _latent_kwargs(self, latents: Tensor, sigma: Tensor, held: Tensor | None = None) -> dict[str, Tensor]:
        """The transformer's other keyword arguments for `latents` `[B, C, h, w]` (the weights'
        dtype) at noise level `sigma` `[B]` float32 (SD3, Wan: the latents and the timestep
        sigma x the scheduler's `num_train_timesteps`); `held`: given frames, which only a
        world model takes (`CosmosEngine`)."""
        if held is not None:
            raise ValueError(f"{type(self).__name__} samples from text alone: given frames (held latents) are "
                             "CosmosEngine's (encode_world)")
        timestep = sigma * self.pipeline.scheduler.config.num_train_timesteps  # [B]
        return {"hidden_states": latents, "timestep": timestep}

    # -- compilation ---------------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, **inputs: Any) -> Tensor:
        """`model(**inputs)[0]` with the transformer's blocks compiled as `self.compile` says. A
        compilation error (raised at the first call of each new graph) warns, turns compilation
        off and reruns the forward eagerly."""
        self._sync_compiled()
        if not self._compiled:
            with self._attention():
                return model(**inputs)[0]
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), self._attention():
                return model(**inputs)[0]
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(
                f"DiffusionEngine: torch.compile of the transformer blocks failed ({type(error).__name__}: "
                f"{first_line}); running eagerly from now on (pass compile=False to skip compiling)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.compile = False
            self._sync_compiled()
            with self._attention():
                return model(**inputs)[0]

    def _attention(self) -> contextlib.AbstractContextManager[None]:
        """The SDPA backend restriction of `attention_backend` (none for "default")."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of: {', '.join(ATTENTION_BACKENDS)}")
        backend = ATTENTION_BACKENDS[self.attention_backend]
        return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])

    def _sync_compiled(self) -> None:
        """Compile the blocks of the current transformer if `self.compile`, else restore them.
        Each block's `forward` is replaced by its compiled self (module hooks, e.g. FSDP2's, stay
        outside the graph); all blocks share the compiled code and its cache of graphs."""
        blocks = list(getattr(self.pipeline.transformer, self.blocks_attribute)) if self.compile else []
        if self._compiled and self._compiled_backend != self.attention_backend:
            torch.compiler.reset()  # the compiled graphs call the old backend's kernel, unguarded
            self._graphs.clear()
        self._compiled_backend = self.attention_backend
        if len(blocks) == len(self._compiled) and all(a is b for a, b in zip(blocks, self._compiled, strict=True)):
            return
        for block in self._compiled:
            del block.forward  # the instance attribute: back to the class's forward
        for block in blocks:
            block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
        self._compiled = blocks

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

    def noise_schedule(self, num_steps: int, latents: Tensor) -> Tensor:
        """The sigmas `[S + 1]` the sampler steps through on latents shaped like `latents`."""
        return self.schedule(num_steps, self._sequence_length(latents))

    def _sequence_length(self, latents: Tensor) -> int:
        """Tokens of the latents `[B, C, h, w]` once patched (the dynamic shift's input)."""
        patch = self._transformer_config.patch_size
        return (latents.shape[-2] // patch) * (latents.shape[-1] // patch)

    def initial_noise(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> Tensor:
        """Float32 noise `[B, C, h, w]`, one generator per sample (reproducible per seed)."""
        scale = self.pipeline.vae_scale_factor
        if height % (scale * 2) or width % (scale * 2):
            raise ValueError(
                f"height and width must be multiples of {scale * 2} (VAE scale x patch size), "
                f"got {height}x{width}"
            )
        shape = (len(generators), self._transformer_config.in_channels, height // scale, width // scale)
        return host_randn(shape, generators, self.device)  # [B, C, h, w]

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
        keep_means: bool = False,
    ) -> Trajectory:
        """Sample one image per prompt and keep the trajectory (with `keep_means`, also each
        step's transition mean: one more latent-sized float32 tensor per step, for GRPO-Guard).

        `sde_window=(start, stop)` samples steps `start <= k < stop` stochastically and the others
        with the ODE (default: every step when `kind` is `sde`/`cps`, none for `ode`). `seeds`
        gives one seed per prompt (default 0, 1, ...): the initial noise and every step's noise
        come from that sample's generator, so a sample is reproducible whatever the batch.
        """
        batch = SampleBatch(prompts, conditioning=conditioning, seeds=seeds, sde_window=sde_window)
        return self.sample_many([batch], num_steps=num_steps, guidance_scale=guidance_scale, height=height,
                                width=width, noise_level=noise_level, kind=kind,
                                max_sequence_length=max_sequence_length, keep_means=keep_means)[0]

    @torch.no_grad()
    def sample_many(
        self,
        batches: Sequence[SampleBatch],
        *,
        num_steps: int = 10,
        guidance_scale: float = 4.5,
        height: int = 512,
        width: int = 512,
        noise_level: float = 0.7,
        kind: SamplerKind = "sde",
        max_sequence_length: int = 128,
        keep_means: bool = False,
    ) -> list[Trajectory]:
        """`sample` for each batch in turn, with the shared arguments; one trajectory per batch,
        each equal to its own `sample` call. Choose it over a loop of `sample` calls where a
        rollout has several batches: with `overlap_decode` the VAE decode of batch k runs on a
        side CUDA stream while batch k + 1 denoises (the images are ready when this returns). A
        batch without `conditioning` has each of its distinct prompts encoded once."""
        side = torch.cuda.Stream(self.device) if self.overlap_decode else None
        main = torch.cuda.current_stream(self.device) if side is not None else None
        out: list[Trajectory] = []
        for batch in batches:
            if batch.conditioning is None:  # a group's n samples share their prompt: each distinct one encoded once
                distinct = list(dict.fromkeys(batch.prompts))
                encoded = self.encode(distinct, max_sequence_length=max_sequence_length)
                batch = replace(batch, conditioning=encoded.index([distinct.index(p) for p in batch.prompts]))
            with self._sampling_precision(getattr(self.transformer, self.blocks_attribute)):
                traj = self._denoise(batch, num_steps=num_steps, guidance_scale=guidance_scale, height=height,
                                     width=width, noise_level=noise_level, kind=kind,
                                     max_sequence_length=max_sequence_length, keep_means=keep_means)
            final = traj.latents[:, -1]  # [B, C, h, w]
            if side is None or main is None:
                out.append(replace(traj, images=self.decode(final)))
                continue
            side.wait_stream(main)  # the decode reads this batch's last latents
            with torch.cuda.stream(side):
                images = self.decode(final)  # [B, 3, H, W], made on the side stream
            traj.latents.record_stream(side)  # the allocator keeps them until the decode is done
            out.append(replace(traj, images=images))
        if side is not None and main is not None:
            main.wait_stream(side)  # every image is ready for the caller's stream
            for traj in out:
                traj.images.record_stream(main)
        return out

    def _denoise(
        self,
        batch: SampleBatch,
        *,
        num_steps: int,
        guidance_scale: float,
        height: int,
        width: int,
        noise_level: float,
        kind: SamplerKind,
        max_sequence_length: int,
        keep_means: bool,
    ) -> Trajectory:
        """The sampling loop of one batch; `images` is left empty (`sample_many` decodes)."""
        prompts = batch.prompts
        if not prompts:
            raise ValueError("sample() needs at least one prompt")
        size = len(prompts)
        seeds = list(range(size)) if batch.seeds is None else list(batch.seeds)
        if len(seeds) != size:
            raise ValueError(f"got {len(seeds)} seeds for {size} prompts")
        # a given conditioning (a Ray worker's: encoded by the trainer) on this engine's device
        conditioning = batch.conditioning.to(self.device) if batch.conditioning is not None else None
        if conditioning is None:
            conditioning = self.encode(prompts, max_sequence_length=max_sequence_length)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        latents = conditioning.hold(self.initial_noise(size, height, width, generators))  # [B, C, h, w]
        sigmas = self.schedule(num_steps, self._sequence_length(latents))  # [S + 1]
        sde_steps = self._sde_mask(num_steps, kind, batch.sde_window)  # [S]
        embeds, pooled = self._text_inputs(conditioning, guidance_scale)
        if self.cuda_graphs and conditioning.held is not None:
            raise ValueError("cuda_graphs: not with given frames (held latents)")
        graph = self._graph(latents, embeds, pooled, guidance_scale) if self.cuda_graphs else None
        states, log_probs, means = [latents], [], []
        # nothing in the loop waits for the device: sigmas are host numbers, filled on the device
        for k, stochastic in enumerate(sde_steps.tolist()):
            if graph is None:
                sigma = torch.full((size,), float(sigmas[k]), device=self.device)  # [B]
                velocity = self._velocity(latents, sigma, embeds, pooled, guidance_scale,
                                          held=conditioning.held_mask)  # [B, C, h, w]
            else:
                graph.inputs["latents"].copy_(latents)
                graph.inputs["sigma"].fill_(float(sigmas[k]))
                graph.graph.replay()
                velocity = graph.output  # [B, C, h, w], overwritten by the next replay (after this step)
            if stochastic:
                step = sde_step(
                    velocity=velocity,
                    latents=latents,
                    sigma=float(sigmas[k]),
                    sigma_next=float(sigmas[k + 1]),
                    noise_level=noise_level,
                    kind=kind,
                    generator=generators,
                    mask=conditioning.free_mask,
                )
                latents, log_prob, mean = step.next_latents, step.log_prob, step.mean  # [B, C, h, w], [B], [B, C, h, w]
            else:
                latents = mean = latents + velocity * (sigmas[k + 1] - sigmas[k])  # Euler ODE step
                log_prob = torch.zeros(size, device=self.device)  # [B]
            latents = conditioning.hold(latents)  # given frames stay what they were given as
            states.append(latents)
            log_probs.append(log_prob)
            if keep_means:
                means.append(mean)
        return Trajectory(
            prompts=tuple(prompts),
            conditioning=conditioning,
            latents=torch.stack(states, dim=1),  # [B, S + 1, C, h, w]
            sigmas=sigmas,
            timesteps=sigmas[:-1] * self.pipeline.scheduler.config.num_train_timesteps,
            log_probs=torch.stack(log_probs, dim=1),  # [B, S]
            sde_steps=sde_steps,
            images=torch.empty(0),
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            kind=kind,
            means=torch.stack(means, dim=1) if keep_means else None,  # [B, S, C, h, w]
        )

    # -- CUDA graphs ---------------------------------------------------------------------------

    def _graph(self, latents: Tensor, embeds: Tensor, pooled: Tensor, guidance_scale: float) -> _Graph:
        """The captured CFG forward for these shapes and the current weights, its text inputs set
        to `embeds` `[B or 2B, L, D]`, `pooled` `[B or 2B, P]`. Captured at the first use: two
        warm-up forwards on a side stream (compiling, cuBLAS handles), then the capture."""
        self._sync_compiled()  # compiled or not is part of what the graph recorded
        transformer = self.transformer
        weights = tuple(t.data_ptr() for t in (*transformer.parameters(), *transformer.buffers()))
        key = (tuple(latents.shape), tuple(embeds.shape), tuple(pooled.shape), embeds.dtype, guidance_scale,
               tuple(map(id, transformer.modules())), weights, self.compile, self.attention_backend, self.precision)
        if key not in self._graphs:
            if any(k[5:7] != key[5:7] for k in self._graphs):
                self._graphs.clear()  # other modules or storage: those graphs would read stale weights
            self._graphs[key] = self._capture(latents, embeds, pooled, guidance_scale)
        graph = self._graphs[key]
        graph.inputs["embeds"].copy_(embeds)
        graph.inputs["pooled"].copy_(pooled)
        return graph

    def _capture(self, latents: Tensor, embeds: Tensor, pooled: Tensor, guidance_scale: float) -> _Graph:
        inputs = {"latents": latents.clone(), "sigma": torch.ones(latents.shape[0], device=self.device),
                  "embeds": embeds.clone(), "pooled": pooled.clone()}  # static: [B, C, h, w], [B], text

        def forward() -> Tensor:
            return self._velocity(inputs["latents"], inputs["sigma"], inputs["embeds"], inputs["pooled"],
                                  guidance_scale)  # [B, C, h, w]

        main, side = torch.cuda.current_stream(self.device), torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a rollout thread beside training
            output = forward()
        return _Graph(graph, inputs, output)

    def reset_graphs(self) -> None:
        """Drop the captured forwards (and their memory); the next `sample` captures again."""
        self._graphs.clear()

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
        rows = rows.to(trajectory.latents.device)  # [b]; one copy instead of one per indexed tensor
        latents = trajectory.latents[rows, step]  # [b, C, h, w]
        conditioning = trajectory.conditioning.index(rows)
        sigma = torch.full((latents.shape[0],), float(trajectory.sigmas[step]), device=self.device)  # [b]
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
            mask=conditioning.free_mask,
        )

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode latents `[B, C, h, w]` to images `[B, 3, H, W]` float32 in [0, 1]."""
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor  # [B, C, h, w]
        images = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """VAE-encode images `[B, 3, H, W]` in [0, 1] to the latents `[B, C, h, w]` the sampler ends
        at (the inverse of `decode`): the posterior's mode, so one image always gives one latent
        (Diffusion-DPO's pairs, any trainer on given images)."""
        vae = self.pipeline.vae
        posterior = vae.encode((pixels * 2 - 1).to(device=self.device, dtype=vae.dtype)).latent_dist
        return (posterior.mode().float() - vae.config.shift_factor) * vae.config.scaling_factor  # [B, C, h, w]

    # -- memory --------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Move every part to CPU and free the accelerator's cache (no-op on CPU)."""
        self.pipeline.to("cpu")
        self._graphs.clear()  # their memory; the weights come back elsewhere anyway
        self._drop_fp8()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        self.pipeline.to(self.device)
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        return self._asleep


def sample_to_cpu(engine: DiffusionEngine, batch: SampleBatch, **sampling: Any) -> Trajectory:
    """`engine.sample_many([batch], **sampling)` with its tensors on CPU: the sampling call of a
    Ray worker (`rl_rollout.ray_pool.RolloutPool.map`), whose caller moves them to its device."""
    return engine.sample_many([batch], **sampling)[0].to("cpu")


RowBatch = tuple[int, Tensor, float]  # (sampled batch, its rows [b], loss weight): `rl_core.train.Micro`


def pack_rows(trajectories: Sequence[Trajectory], adv: Sequence[Tensor], steps: Sequence[Sequence[int]],
              plan: Sequence[Sequence[RowBatch]], size: int) -> tuple[list[tuple[Trajectory, Sequence[int]]],
                                                                    list[Tensor], list[list[RowBatch]]]:
    """`plan` (a trainer's optimizer steps of micro-batches over `trajectories`, advantages `adv`
    `[b_k]` and trained `steps` each) with each optimizer step's rows regrouped into micro-batches
    of at most `size` rows that may span sampled batches: the rows of one weight and one schedule
    (`same_schedule`), in plan order, cut every `size` rows. Returns the replayed sources,
    (trajectory, its trained steps) each (the sampled batches, then one joined batch per
    micro-batch that spans several), their advantages `[b]` and the plan over them. The loss is
    unchanged (a micro-batch's loss is its units' sum over the step's unit count); only rounding
    differs. Filler micro-batches (weight 0) are kept as they are. Pick it where ragged
    per-batch forwards cost more than the join (compiled blocks: each new batch size recompiles)."""
    sources = [(traj, s) for traj, s in zip(trajectories, steps, strict=True)]
    advs = list(adv)

    def schedule(k: int) -> int:  # the first sampled batch replayed alike
        return next(j for j in range(k + 1) if same_schedule(trajectories[j], trajectories[k], steps[j], steps[k]))

    packed = []
    for micro_batches in plan:
        groups: dict[tuple[float, int], list[tuple[int, int]]] = {}
        kept: list[RowBatch] = []
        for k, rows, weight in micro_batches:
            if not weight:
                kept.append((k, rows, weight))
                continue
            groups.setdefault((weight, schedule(k)), []).extend((k, int(r)) for r in rows)
        for (weight, _), pairs in groups.items():
            for start in range(0, len(pairs), size):
                chunk = pairs[start:start + size]
                ks = list(dict.fromkeys(k for k, _ in chunk))
                parts = [(k, torch.tensor([r for j, r in chunk if j == k])) for k in ks]  # [b_k] rows each
                if len(parts) == 1:
                    kept.append((parts[0][0], parts[0][1], weight))
                    continue
                sources.append((join_rows([(trajectories[k], rows) for k, rows in parts]), steps[ks[0]]))
                advs.append(torch.cat([adv[k][rows.to(adv[k].device)] for k, rows in parts]))  # [b]
                kept.append((len(sources) - 1, torch.arange(len(chunk)), weight))
        packed.append(kept)
    return sources, advs, packed


def same_schedule(a: Trajectory, b: Trajectory, steps_a: Sequence[int], steps_b: Sequence[int]) -> bool:
    """Whether rows of `a` and `b` can be replayed in one forward: the same trained steps at the
    same noise levels, guidance, noise level and sampler."""
    return (list(steps_a) == list(steps_b) and torch.equal(a.sigmas, b.sigmas)
            and (a.guidance_scale, a.noise_level, a.kind, a.means is None) == (b.guidance_scale, b.noise_level, b.kind,
                                                                               b.means is None))


def join_rows(parts: Sequence[tuple[Trajectory, Tensor]]) -> Trajectory:
    """One trajectory of the rows `[b_i]` of each of `parts`' trajectories (of one schedule:
    `same_schedule`), in order: what a sampled batch of those images would have kept."""
    def cat(field: Callable[[Trajectory], Tensor]) -> Tensor:
        return torch.cat([field(traj)[rows.to(field(traj).device)] for traj, rows in parts])  # [b, ...]

    first = parts[0][0]
    held = None if first.conditioning.held is None else (cat(lambda x: cast(Tensor, x.conditioning.held)),
                                                         cat(lambda x: cast(Tensor, x.conditioning.held_mask)))
    return replace(first, prompts=tuple(traj.prompts[r] for traj, rows in parts for r in rows.tolist()),
                   conditioning=PromptEmbeddings(cat(lambda x: x.conditioning.embeds), cat(lambda x: x.conditioning.pooled),
                                                 *(held or ())),
                   latents=cat(lambda x: x.latents), log_probs=cat(lambda x: x.log_probs), images=cat(lambda x: x.images),
                   means=None if first.means is None else cat(lambda x: cast(Tensor, x.means)))
