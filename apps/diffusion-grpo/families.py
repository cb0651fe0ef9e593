"""The model families diffusion-grpo trains (`model.family`): one small strategy object each,
chosen once at setup. A family builds its image engine (`rl_rollout.build_image_engine`) and
the LoRA model the optimizer steps through, samples a step's images, replays them in the update
(`rl_core.train.replay_update`, one replay callback per family) and samples the eval images.
Reward, advantages, plans, EMA, checkpoints and eval are the recipe's, the same for both.

- `sd3` (`SD3`): Flow-GRPO on SD3/SD3.5. A unit is a stochastic denoising step: each
  (micro-batch, trained step) pair is one forward and backward through the replayed step (CFG
  recomputed, unconditional branch detached); KL = Flow-GRPO's flow KL to the LoRA-disabled
  model. `train.sharding = "fsdp2"` shards the transformer (one unit per
  `JointTransformerBlock`); the rollout, eval and exports then use an unsharded copy filled by
  one all-gather per phase (`FullWeights`, `time/weight_gather`), and Ray workers get its LoRA.
- `janus` (`Janus`): token-level GRPO on Janus / Janus-Pro image tokens (VRL's autoregressive
  trainer). A unit is an image token: every token of a sample carries the sample's advantage;
  KL = the per-token `janus.kl` estimator to the LoRA-disabled model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from grpo_config import Config
from grpo_parts import trainable
from grpo_plan import Micro, trained_steps
from peft import PeftModel
from ray_rollout import Chunk, RayRollout, sample_chunk, start_workers

from rl_core.flow import flow_kl
from rl_core.kl import compute_kl
from rl_core.train import (
    FullWeights,
    NonFiniteGuard,
    Replay,
    UserError,
    gathered,
    prepare_policy,
    replay_update,
    resolve_sharding,
)
from rl_data import OCRPrompt
from rl_models.janus import JanusImagePolicy, image_size, reference_image_token_logprobs
from rl_models.lora import add_lora
from rl_rollout import ImageSamples, build_image_engine
from rl_rollout.diffusion import DiffusionEngine, Trajectory
from rl_rollout.janus import ImageRollout, JanusEngine

Plan = list[list[Micro]]  # optimizer steps of (sampled batch, its rows [b], loss weight)


class Family(Protocol):
    """What differs between model families (see the module doc)."""

    peft: PeftModel  # the LoRA model: its trainable weights, EMA and exports
    model: torch.nn.Module  # what the optimizer steps through (DDP-wrapped, or sharded in place)
    optimizer: torch.optim.Optimizer
    full: FullWeights | None  # a sharded model's whole copy, which the engine samples from

    def start(self) -> None:
        """Once the starting weights are in place (restored or initial): start rollout workers."""

    def close(self) -> None:
        """Release them (also after an error)."""

    def collect(self, records: Sequence[OCRPrompt], seeds: Sequence[int], version: int) -> Sequence[ImageSamples]:
        """This process's samples, `rollout.sample_batch_size` images per sampled batch; `version`
        counts the optimizer steps in the weights."""
        ...

    def update(self, samples: Sequence[ImageSamples], adv: torch.Tensor, plan: Plan, *, what: str,
               guard: NonFiniteGuard, after_step: Callable[[], None]) -> dict[str, float]:
        """The optimizer steps of `plan` (`grpo_plan`) over `samples`, advantages `[N]`."""
        ...

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        """`[B, 3, H, W]` from the current weights at fixed seeds."""
        ...


def _optimizer(cfg: Config, peft: PeftModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(trainable(peft).values(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def _replay_update(family: Family, cfg: Config, acc: Any, plan: Sequence[Sequence[Any]], replay: Callable[[Any], Replay],
                   *, units: Callable[[Any], float], filler: Any, tolerance: float | None, what: str,
                   guard: NonFiniteGuard, after_step: Callable[[], None]) -> dict[str, float]:
    t = cfg.train
    return replay_update(acc, family.model, family.optimizer, plan, replay, units=units, clip_range=t.clip_range,
                         kl_beta=t.kl_beta, grad_clip=t.max_grad_norm, guard=guard, filler=filler, tolerance=tolerance,
                         after_step=after_step, what=f"{what}: first replay, |log ratio| vs train.ratio_tolerance (bf16 "
                                                     "with micro_batch_size != sample_batch_size needs a looser tolerance)")


class SD3:
    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        self.cfg, self.acc = cfg, acc
        m, t = cfg.model, cfg.train
        # model.compile: blocks compiled for sampling and replay (first replay |log ratio| ~4e-4 in bf16)
        self.engine = cast(DiffusionEngine, build_image_engine(
            "sd3", path=path, dtype=m.dtype, device=acc.device, text_encoder_dtype=m.text_encoder_dtype,
            compile=m.compile))
        self.engine.transformer.requires_grad_(False)
        self.peft = add_lora(self.engine.transformer, family="sd3", r=m.lora_rank, alpha=m.lora_alpha,
                             target_modules=m.lora_targets)
        optimizer = _optimizer(cfg, self.peft)
        plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision,
                                cpu_offload=t.fsdp_cpu_offload, activation_checkpointing=t.fsdp_activation_checkpointing)
        # before sharding: a copy of the unsharded structure, empty outside `gathered()`
        self.full = FullWeights(self.peft, device=acc.device) if plan.sharded else None
        self.model, self.optimizer, _ = prepare_policy(acc, self.peft, optimizer, None, plan)
        if self.full is not None:  # the engine samples from the copy's LoRA-injected transformer
            self.engine.pipeline.transformer = cast(PeftModel, self.full.model).get_base_model()
        self.path = path
        self.workers: RayRollout | None = None  # Ray rollout actors (rollout.workers > 0), started by `start`

    def start(self) -> None:
        if self.cfg.rollout.workers:
            self.workers = start_workers(self.cfg.rollout, self.cfg.model, self.path, self.acc)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    def collect(self, records: Sequence[OCRPrompt], seeds: Sequence[int], version: int) -> Sequence[ImageSamples]:
        s, size = self.cfg.sampling, self.cfg.rollout.sample_batch_size
        chunks = [Chunk(tuple(r.prompt for r in records[i:i + size]), tuple(seeds[i:i + size]))
                  for i in range(0, len(records), size)]
        kwargs: dict[str, Any] = {
            "num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "height": s.resolution, "width": s.resolution,
            "noise_level": s.noise_level, "kind": s.kind, "sde_window": tuple(s.sde_window) if s.sde_window else None,
            "max_sequence_length": s.max_sequence_length}
        with whole_weights(self):  # a sharded policy's weights gathered into the engine's copy
            if self.workers is None:
                return [sample_chunk(self.engine, chunk, **kwargs) for chunk in chunks]
            # the workers' LoRA is synced to this version first, and each trajectory checked against it
            return self.workers.collect(chunks, version=version, transformer=self.engine.transformer,
                                        device=self.acc.device, **kwargs)

    def update(self, samples: Sequence[ImageSamples], adv: torch.Tensor, plan: Plan, *, what: str,
               guard: NonFiniteGuard, after_step: Callable[[], None]) -> dict[str, float]:
        """Each (micro-batch, trained step) pair is one forward and backward; every (sample,
        step) weighs the same in an optimizer step."""
        trajectories, t = cast(Sequence[Trajectory], samples), self.cfg.train
        offsets = [sum(len(traj.prompts) for traj in trajectories[:k]) for k in range(len(trajectories))]
        steps = trained_steps(trajectories[0], t.timestep_fraction)

        def replay(micro: tuple[int, torch.Tensor, float, int]) -> Replay:
            k, rows, weight, step = micro
            traj = trajectories[k]
            out = self.engine.replay(traj, step, rows=rows, model=self.model)
            kl = None
            if t.kl_beta > 0:
                with torch.no_grad(), self.peft.disable_adapter():
                    ref = self.engine.replay(traj, step, rows=rows, model=self.peft)
                kl = flow_kl(out.mean, ref.mean, out.std)[:, None]  # [b, 1]
            return Replay(out.log_prob[:, None], traj.log_probs[rows, step][:, None], adv[offsets[k] + rows], weight,
                          kl=kl)  # [b, 1] log-probs: one unit per (sample, step)

        window = [[(k, rows, weight, step) for k, rows, weight in micro_batches for step in steps]
                  for micro_batches in plan]
        return _replay_update(self, self.cfg, self.acc, window, replay, units=lambda m: float(len(m[1])) * m[2], guard=guard,
                                   filler=(0, torch.tensor([0]), 0.0, steps[0]), tolerance=t.ratio_tolerance,
                                   what=what, after_step=after_step)

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        """Deterministic ODE sampling with `eval.num_steps`."""
        e, s = self.cfg.eval, self.cfg.sampling
        return self.engine.sample(prompts, num_steps=e.num_steps, guidance_scale=e.guidance_scale, height=s.resolution,
                                  width=s.resolution, kind="ode", seeds=seeds,
                                  max_sequence_length=s.max_sequence_length).images


class Janus:
    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        self.cfg, self.acc = cfg, acc
        m, j = cfg.model, cfg.janus
        self.engine = cast(JanusEngine, build_image_engine(
            "janus", path=path, dtype=m.dtype, device=acc.device, compile=j.compile, logprobs=j.logprobs,
            max_batch_size=cfg.rollout.sample_batch_size))
        side = image_size(self.engine.model)
        if cfg.sampling.resolution != side:
            raise UserError(f"sampling.resolution={cfg.sampling.resolution}: this Janus checkpoint draws {side}x{side} "
                            f"images; set sampling.resolution={side}")
        if j.gradient_checkpointing:
            self.engine.model.model.language_model.gradient_checkpointing_enable()
        self.engine.model.requires_grad_(False)
        self.peft = add_lora(self.engine.model, family="janus", r=m.lora_rank, alpha=m.lora_alpha,
                             target_modules=m.lora_targets)
        self.model, self.optimizer = acc.prepare(JanusImagePolicy(self.peft), _optimizer(cfg, self.peft))
        self.full: FullWeights | None = None

    def start(self) -> None:
        """No rollout workers for Janus (`check_config` refuses them)."""

    def close(self) -> None:
        """Nothing to release."""

    def collect(self, records: Sequence[OCRPrompt], seeds: Sequence[int], version: int) -> Sequence[ImageSamples]:
        """Image tokens with CFG (`sampling.guidance_scale`, `janus.temperature`)."""
        size, scale, temperature = self.cfg.rollout.sample_batch_size, self.cfg.sampling.guidance_scale, self.cfg.janus.temperature
        return [self.engine.sample([r.prompt for r in records[i:i + size]], guidance_scale=scale,
                                   temperature=temperature, seeds=seeds[i:i + size])
                for i in range(0, len(records), size)]

    def update(self, samples: Sequence[ImageSamples], adv: torch.Tensor, plan: Plan, *, what: str,
               guard: NonFiniteGuard, after_step: Callable[[], None]) -> dict[str, float]:
        """Each micro-batch is one forward and backward over its images' N tokens."""
        rollouts, t, j = cast(Sequence[ImageRollout], samples), self.cfg.train, self.cfg.janus
        self.engine.release_cache()  # the KV cache is not needed until the next rollout
        scale = self.cfg.sampling.guidance_scale
        use_cfg = j.loss_logits == "cfg" and scale > 1
        with torch.no_grad():  # janus.loss_logits = "cond": old log-probs under the conditional logits
            old = [r.log_probs if use_cfg else self.engine.replay(
                r.tokens, guidance_scale=r.guidance_scale, temperature=j.temperature, use_cfg=False) for r in rollouts]
        offsets = [sum(len(r) for r in rollouts[:k]) for k in range(len(rollouts))]
        tokens = rollouts[0].tokens.image_ids.shape[1]

        def replay(micro: Micro) -> Replay:
            k, rows, weight = micro
            inputs = rollouts[k].tokens.index(rows).to(self.acc.device)
            logp = self.model(inputs, guidance_scale=scale, temperature=j.temperature, use_cfg=use_cfg)  # [b, N]
            kl = None
            if t.kl_beta > 0:
                ref = reference_image_token_logprobs(self.peft, inputs, guidance_scale=scale,
                                                     temperature=j.temperature, use_cfg=use_cfg)  # [b, N]
                kl = compute_kl(j.kl, logp, ref)  # [b, N]
            return Replay(logp, old[k][rows], adv[offsets[k] + rows], weight, kl=kl)

        return _replay_update(self, self.cfg, self.acc, plan, replay, units=lambda m: float(len(m[1]) * tokens) * m[2], guard=guard,
                                   filler=(0, torch.tensor([0]), 0.0), tolerance=t.ratio_tolerance if use_cfg else None,
                                   what=what, after_step=after_step)

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        return self.engine.sample(prompts, guidance_scale=self.cfg.eval.guidance_scale,
                                  temperature=self.cfg.janus.temperature, seeds=seeds).images


FAMILIES: dict[str, Callable[[Config, Any, str], Family]] = {"sd3": SD3, "janus": Janus}


def whole_weights(family: Family) -> Any:
    """The PeftModel with whole weights, which the engine samples from: the trained one, or a
    sharded policy's copy gathered for the block. Enter it on every process (the gather is a
    collective), also where only the main process uses it."""
    return gathered(family.full, family.peft)
