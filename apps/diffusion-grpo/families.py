"""The model families diffusion-grpo trains (`model.family`), one small strategy object each,
chosen once at setup: build the image engine and the LoRA model the optimizer steps through,
sample a step's images, say how the update replays them (`replay_update`'s callback) and sample
the eval images.

- `sd3` (and the video families `wan`, `cosmos`): Flow-GRPO. A unit is a stochastic denoising
  step: each (micro-batch, trained step) pair is one forward and backward (CFG recomputed,
  unconditional branch detached); KL = the flow KL to the LoRA-disabled model. With
  `train.sharding = "fsdp2"` the rollout, eval and exports use an unsharded copy gathered once
  per phase (`FullWeights`); `rollout.workers > 0` samples on Ray actors (`rollout.placement`)
  holding the trainer's LoRA by version; `train.method = "nft"` samples with an `OldPolicy`.
- `janus`: token-level GRPO on Janus-Pro image tokens. A unit is an image token carrying its
  sample's advantage; KL = `algo.kl` per token to the LoRA-disabled model.

The loop moves the weights through each family's `weights` (`rl_policy.lora_weights`), which
also step the LoRA's EMA after each optimizer step; an asynchronous run samples on the rollout
thread with an engine of its own over the rollout's copy of the LoRA model (`on_copy`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import torch
from grpo_config import (
    Config,
    SamplingConfig,
    compiles_blocks,
    first_replay_tolerance,
    janus_window,
)
from peft import PeftModel
from transformers import JanusForConditionalGeneration

from rl_core.flow import flow_kl
from rl_core.kl import compute_kl
from rl_core.train import (
    FullWeights,
    Micro,
    ParameterEMA,
    Replay,
    UserError,
    gathered,
    prepare_policy,
    resolve_sharding,
    trainable_parameters,
)
from rl_models.janus import (
    ImageTokenBatch,
    JanusImagePolicy,
    image_size,
    num_image_tokens,
    reference_image_token_logprobs,
)
from rl_models.logprobs import unwrap_peft
from rl_models.lora import add_lora, full_finetune, reference_of
from rl_policy.lora_weights import LoraCopy, LoraPolicyWeights, lora_worker_spec, start_lora_workers
from rl_rollout import ImageSamples, build_image_engine
from rl_rollout.diffusion import (
    DiffusionEngine,
    PromptEmbeddings,
    SampleBatch,
    Trajectory,
    pack_rows,
    sample_to_cpu,
)
from rl_rollout.janus import ImageRollout, JanusEngine
from rl_rollout.janus import sample_to_cpu as janus_sample_to_cpu


@dataclass(frozen=True)
class Replays:
    """A step's update as `replay_update` runs it: the optimizer steps' micro-batches, the replay
    callback, units x weight of a micro-batch, the filler of a process with none, and the
    first-replay tolerance (None: the old log-probs are not the rollout's, no check)."""

    plan: Sequence[Sequence[Any]]
    replay: Callable[[Any], Replay]
    units: Callable[[Any], float]
    filler: Any
    tolerance: float | None
    steps: Sequence[Sequence[int]] = ()  # the replayed denoising steps (sd3) or trained token positions (janus windows) of each sampled batch
    rescore: Callable[[Any], torch.Tensor] | None = None  # rollout.precision = "fp8": the trainer's old log-probs


class Family(Protocol):
    peft: torch.nn.Module  # the LoRA model (PeftModel), or the transformer fully fine-tuned: its trained weights, EMA, exports
    model: torch.nn.Module  # what the optimizer steps through (DDP-wrapped, or sharded in place)
    optimizer: torch.optim.Optimizer
    full: FullWeights | None = None  # a sharded model's whole copy, which the engine samples from
    ema: ParameterEMA  # the LoRA's EMA (train.ema_*), stepped by `weights` after each optimizer step
    weights: LoraPolicyWeights  # the rollout side's weights, as the loop drives them
    old: OldPolicy | None = None  # train.method = "nft" (sd3, wan, cosmos): DiffusionNFT's old policy, which samples

    def collect(self, batches: list[SampleBatch]) -> Sequence[ImageSamples]:
        """The samples of each `SampleBatch` (its `sde_window`: sd3's stochastic steps, janus's
        trained token positions), drawn with the weights of `weights.weight_version`."""

    def replays(self, samples: Sequence[ImageSamples], adv: Sequence[torch.Tensor], plan: list[list[Micro]]) -> Replays:
        """The update over `samples` (advantages `[b_k]` per sampled batch) along `plan_micro_batches`'s plan."""

    def eval_images(self, prompts: list[str], seeds: list[int], given: PromptEmbeddings | None = None) -> torch.Tensor:
        """`[B, 3, H, W]` from the current weights at fixed seeds (`given`: cosmos's given frames)."""


class SD3(Family):
    kind = "sd3"  # the image engine (`rl_rollout.build_image_engine`) and LoRA layout (`rl_models.lora`)

    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        m, t, s = cfg.model, cfg.train, cfg.sampling
        self.cfg, self.acc = cfg, acc
        # model.compile (None: on CUDA): blocks compiled for sampling and replay (first replay |log ratio|
        # ~4e-4 in bf16, inside the automatic algo.replay_tolerance)
        self.compiled = compiles_blocks(cfg, acc.device.type)
        self.tolerance = first_replay_tolerance(cfg, self.compiled)
        options = dict(text_encoder_dtype=m.text_encoder_dtype, compile=self.compiled, precision=cfg.rollout.precision,
                       **rollout_options(s), **self.engine_options())  # the engine's, and its Ray workers'
        self.engine = cast(DiffusionEngine, build_image_engine(self.kind, path=path, dtype=m.dtype, device=acc.device, **options))
        self.engine.transformer.requires_grad_(False)
        self.peft = add_lora(self.engine.transformer, family=self.kind, r=m.lora_rank, alpha=m.lora_alpha,
                             target_modules=m.lora_targets) if m.lora_rank else full_finetune(
            self.engine.transformer, reference=cfg.algo.kl_coef > 0 or t.method == "dpo")  # full: a frozen copy for the KL
        optimizer = torch.optim.AdamW(trainable_parameters(self.peft).values(), lr=t.lr, weight_decay=t.weight_decay)
        plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision,
                                cpu_offload=t.fsdp_cpu_offload, activation_checkpointing=t.fsdp_activation_checkpointing)
        # made before sharding: a copy of the unsharded structure, empty outside `gathered()`
        self.full = FullWeights(self.peft, device=acc.device) if plan.sharded else None
        self.model, self.optimizer, _ = prepare_policy(acc, self.peft, optimizer, None, plan)
        if self.full is not None:  # the engine samples from the copy's LoRA-injected transformer
            self.engine.pipeline.transformer = unwrap_peft(self.full.model)
        # train.method = "nft": the old policy samples (asynchronous rollouts: an engine of their own)
        self.old = OldPolicy(self.peft, self.engine) if t.method == "nft" else None
        self.rollout_engine = self.old.engine if self.old is not None else self.engine
        r = cfg.rollout
        self.ema = ParameterEMA(self.peft, decay=t.ema_decay, interval=t.ema_interval)
        self.weights = LoraPolicyWeights(
            self.peft, sampler=self.engine.transformer, full=self.full, ema=self.ema, colocated=r.placement == "colocated",
            on_copy=lambda twin: setattr(self, "rollout_engine", self.engine.over(unwrap_peft(twin))),
            workers=workers(cfg, acc, path, options))

    def engine_options(self) -> dict[str, Any]:
        return {}

    def collect(self, batches: list[SampleBatch]) -> Sequence[ImageSamples]:
        s = self.cfg.sampling
        kwargs: dict[str, Any] = {
            "num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "height": s.resolution, "width": s.resolution,
            "noise_level": s.noise_level, "kind": s.kind, "max_sequence_length": s.max_sequence_length,
            "keep_means": self.cfg.train.ratio_norm}  # GRPO-Guard's RatioNorm needs the rollout's step means
        if self.weights.pool is not None:
            return [traj.to(self.acc.device) for traj in self.weights.on_workers(sample_to_cpu, batches, **kwargs)]
        # a sharded policy's weights gathered into the engine's copy (asynchronous: the rollout
        # thread's copy holds them already, and the gather, a collective, stays on the trainer's thread)
        with nullcontext() if self.weights.asynchronous else whole_weights(self):
            return self.rollout_engine.sample_many(batches, **kwargs)

    def replays(self, samples: Sequence[ImageSamples], adv: Sequence[torch.Tensor], plan: list[list[Micro]]) -> Replays:
        """Every (micro-batch, trained step) pair is one forward and backward, every (sample, step)
        one unit: Flow-GRPO trains the stochastic steps k < int(num_steps x train.timestep_fraction),
        each sampled batch its own (a random or sliding SDE window differs between batches). The
        plan's rows of an optimizer step are replayed in forwards of `train.micro_batch_size` rows
        across sampled batches of one schedule (`pack_rows`): Flow-GRPO's shuffled batches mix
        sampled batches, and a forward per sampled batch would run ragged, smaller forwards, each
        new size a new graph of the compiled blocks (a recompile in every epoch)."""
        trajectories, t = cast(Sequence[Trajectory], samples), self.cfg.train
        steps = [[k for k in range(max(1, int(traj.num_steps * t.timestep_fraction))) if bool(traj.sde_steps[k])]
                 for traj in trajectories]
        sources, advs, packed = pack_rows(trajectories, adv, steps, plan, t.micro_batch_size)

        def replay(micro: tuple[int, torch.Tensor, float, int]) -> Replay:
            k, rows, weight, step = micro
            traj = sources[k][0]
            out = self.engine.replay(traj, step, rows=rows, model=self.model)
            kl = None
            if self.cfg.algo.kl_coef > 0:
                with torch.no_grad(), reference_of(self.peft) as reference:
                    ref = self.engine.replay(traj, step, rows=rows, model=reference)
                kl = flow_kl(out.mean, ref.mean, out.std)[:, None]  # [b, 1]
            old = traj.log_probs[rows, step][:, None]  # [b, 1]
            if not t.ratio_norm:
                return Replay(out.log_prob[:, None], old, advs[k][rows], weight, kl=kl)
            return Replay(out.log_prob[:, None], old, advs[k][rows], weight, kl=kl, **traj.ratio_guard(step, rows, out))

        def logp(micro: tuple[int, torch.Tensor, float, int]) -> torch.Tensor:  # [b, 1] under the trainer's weights
            return self.engine.replay(sources[micro[0]][0], micro[3], rows=micro[1], model=self.model).log_prob[:, None]

        window = [[(k, rows, weight, step) for k, rows, weight in micro for step in sources[k][1]] for micro in packed]
        return Replays(window, replay, units=lambda m: float(len(m[1])) * m[2],
                       filler=(0, torch.tensor([0]), 0.0, steps[0][0]), tolerance=self.tolerance, steps=steps,
                       rescore=logp if self.cfg.rollout.precision == "fp8" else None)

    def eval_images(self, prompts: list[str], seeds: list[int], given: PromptEmbeddings | None = None) -> torch.Tensor:
        e, s = self.cfg.eval, self.cfg.sampling  # the deterministic ODE sampler, `eval.num_steps` steps
        return self.engine.sample(prompts, conditioning=given, num_steps=e.num_steps, guidance_scale=e.guidance_scale, height=s.resolution,
                                  width=s.resolution, kind="ode", seeds=seeds,
                                  max_sequence_length=s.max_sequence_length).images


class Janus(Family):
    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        m, j = cfg.model, cfg.janus
        self.cfg, self.acc = cfg, acc
        options = dict(compile=cfg.rollout.compile, logprobs=j.logprobs, max_batch_size=cfg.rollout.sample_batch_size,
                       precision=cfg.rollout.precision)  # the engine's, and its Ray workers'
        self.engine = cast(JanusEngine, build_image_engine("janus", path=path, dtype=m.dtype, device=acc.device, **options))
        side = image_size(self.engine.model)
        if cfg.sampling.resolution != side:
            raise UserError(f"sampling.resolution={cfg.sampling.resolution}: this Janus checkpoint draws {side}x{side} "
                            f"images; set sampling.resolution={side}")
        tokens = num_image_tokens(self.engine.model)
        name, window = janus_window(cfg.sampling)
        if window is not None and window[1] > tokens:
            raise UserError(f"sampling.{name}={window}: this Janus checkpoint draws {tokens} image tokens an image; "
                            f"keep the window's stop <= {tokens}")
        if m.gradient_checkpointing:
            self.engine.model.model.language_model.gradient_checkpointing_enable()
        self.engine.model.requires_grad_(False)
        self.peft = add_lora(self.engine.model, family="janus", r=m.lora_rank, alpha=m.lora_alpha,
                             target_modules=m.lora_targets)
        optimizer = torch.optim.AdamW(trainable_parameters(self.peft).values(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay)
        self.model, self.optimizer = acc.prepare(JanusImagePolicy(self.peft), optimizer)
        self.rollout_engine = self.engine  # asynchronous: an engine of its own over the rollout's copy
        self.ema = ParameterEMA(self.peft, decay=cfg.train.ema_decay, interval=cfg.train.ema_interval)
        self.weights = LoraPolicyWeights(
            self.peft, sampler=self.engine.model, ema=self.ema, colocated=cfg.rollout.placement == "colocated",
            on_copy=lambda twin: setattr(self, "rollout_engine", self.engine.over(cast(
                JanusForConditionalGeneration, cast(PeftModel, twin).get_base_model()))), workers=workers(cfg, acc, path, options))

    def collect(self, batches: list[SampleBatch]) -> Sequence[ImageSamples]:
        """Image tokens drawn with CFG (`sampling.guidance_scale`) at `rollout.temperature`; each
        sampled batch keeps its window of trained token positions (`sampling.sde_window*`); on Ray workers too."""
        if self.weights.pool is not None:
            return [rollout.to(self.acc.device) for rollout in self.weights.on_workers(
                janus_sample_to_cpu, batches, guidance_scale=self.cfg.sampling.guidance_scale, temperature=self.cfg.rollout.temperature)]
        return [replace(self.rollout_engine.sample(list(b.prompts), guidance_scale=self.cfg.sampling.guidance_scale,
                                                   temperature=self.cfg.rollout.temperature, seeds=b.seeds),
                        window=b.sde_window) for b in batches]

    def replays(self, samples: Sequence[ImageSamples], adv: Sequence[torch.Tensor], plan: list[list[Micro]]) -> Replays:
        """Each micro-batch is one forward and backward over its images' N tokens, or, with a window
        [start, stop) of token positions, over the first `stop` tokens (causal: the later ones
        cannot change them), training the window's `stop - start`."""
        rollouts, j, a = cast(Sequence[ImageRollout], samples), self.cfg.janus, self.cfg.algo
        temperature = self.cfg.rollout.temperature
        tokens = rollouts[0].tokens.image_ids.shape[1]
        windows = [r.window or (0, tokens) for r in rollouts]
        self.engine.release_cache()  # the KV cache is not needed until the next rollout
        scale = self.cfg.sampling.guidance_scale
        use_cfg = j.loss_logits == "cfg" and scale > 1
        with torch.no_grad():  # janus.loss_logits = "cond": old log-probs under the conditional logits
            old = [r.log_probs if use_cfg else self.engine.replay(
                r.tokens, guidance_scale=r.guidance_scale, temperature=temperature, use_cfg=False) for r in rollouts]

        def replay(micro: Micro) -> Replay:
            k, rows, weight = micro
            start, stop = windows[k]
            batch = rollouts[k].tokens.index(rows)
            inputs = ImageTokenBatch(batch.prompt_ids, batch.prompt_mask, batch.image_ids[:, :stop],
                                     batch.uncond_ids).to(self.acc.device)  # the tokens up to the window's end
            logp = self.model(inputs, guidance_scale=scale, temperature=temperature,
                              use_cfg=use_cfg)[:, start:]  # [b, W]
            kl = None
            if a.kl_coef > 0:
                ref = reference_image_token_logprobs(self.peft, inputs, guidance_scale=scale,
                                                     temperature=temperature, use_cfg=use_cfg)[:, start:]  # [b, W]
                kl = compute_kl(a.kl, logp, ref)  # [b, W]
            return Replay(logp, old[k][rows][:, start:stop], adv[k][rows], weight, kl=kl)

        trained = [range(*w) for w in windows] if any(r.window for r in rollouts) else []
        return Replays(plan, replay, units=lambda m: float(len(m[1]) * (windows[m[0]][1] - windows[m[0]][0])) * m[2],
                       filler=(0, torch.tensor([0]), 0.0), tolerance=first_replay_tolerance(self.cfg, False) if use_cfg else None,
                       steps=trained, rescore=(lambda m: replay(m).logp) if self.cfg.rollout.precision == "fp8" else None)

    def eval_images(self, prompts: list[str], seeds: list[int], given: PromptEmbeddings | None = None) -> torch.Tensor:
        return self.engine.sample(prompts, guidance_scale=self.cfg.eval.guidance_scale,
                                  temperature=self.cfg.rollout.temperature, seeds=seeds).images


class OldPolicy(LoraCopy):
    """DiffusionNFT's old policy (`train.method = "nft"`): a `LoraCopy` of the trained LoRA model
    that samples the rollouts (`engine`, sharing the trainer's text encoders and VAE) and gives
    `v_old` in the loss; after each epoch `move_towards` pulls it towards the trained LoRA."""

    def __init__(self, peft: torch.nn.Module, engine: DiffusionEngine) -> None:
        super().__init__(peft)
        self.engine = engine.over(unwrap_peft(self.model))


def rollout_options(sampling: SamplingConfig) -> dict[str, Any]:
    """The engine's rollout options from the [sampling] table (rl_rollout.diffusion's docstring)."""
    return {"cuda_graphs": sampling.cuda_graphs, "attention_backend": sampling.attention_backend,
            "overlap_decode": sampling.overlap_decode}


def workers(cfg: Config, acc: Any, path: str, options: dict[str, Any]) -> Callable[[], Any] | None:
    """`rollout.workers` Ray actors, each building the family's engine with the trainer's LoRA
    layout and engine `options` (so a worker samples with the blocks the trainer replays with)."""
    m, r = cfg.model, cfg.rollout
    spec = lora_worker_spec(path, m.family, dtype=m.dtype, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                            lora_targets=m.lora_targets, **options)
    return (lambda: start_lora_workers(spec, r.workers, placement=r.placement, device=acc.device,
                                       gpus_per_worker=r.gpus_per_worker, address=r.ray_address)) if r.workers else None


class Wan(SD3):
    """Flow-GRPO on a video family, Wan 2.1 text-to-video or Cosmos-Predict2.5 text-to-world: SD3's
    sampling, replay, KL and EMA over `rl_rollout.wan.WanEngine` or `rl_rollout.cosmos.CosmosEngine`
    (`model.family`), whose samples' `images` are frames `[B, F, 3, H, W]`."""

    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        self.kind = cfg.model.family
        super().__init__(cfg, acc, path)

    def engine_options(self) -> dict[str, Any]:
        return {"num_frames": self.cfg.sampling.num_frames}


FAMILIES: dict[str, Callable[[Config, Any, str], Family]] = {"sd3": SD3, "wan": Wan, "cosmos": Wan, "janus": Janus}


def whole_weights(family: Family) -> Any:
    """The PeftModel with whole weights the engine samples from: the trained one, or a sharded
    policy's copy, gathered for the block. Enter it on every process (the gather is a collective)."""
    return gathered(family.full, family.peft)
