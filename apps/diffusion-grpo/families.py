"""The model families diffusion-grpo trains (`model.family`), one small strategy object each,
chosen once at setup: build the image engine and the LoRA model the optimizer steps through,
sample a step's images, say how the update replays them (`replay_update`'s callback) and sample
the eval images.

- `sd3`: Flow-GRPO on SD3/SD3.5. A unit is a stochastic denoising step: each (micro-batch,
  trained step) pair is one forward and backward (CFG recomputed, unconditional branch
  detached); KL = Flow-GRPO's flow KL to the LoRA-disabled model. `train.sharding = "fsdp2"`
  shards the transformer; the rollout, eval and exports then use an unsharded copy filled by one
  all-gather per phase (`FullWeights`, `time/weight_gather`). `rollout.workers > 0` samples on
  Ray actors holding the trainer's LoRA, pushed with its optimizer-step count before a rollout
  (a worker holding another version refuses). VRL's placements: `split` (actors on GPUs of their
  own), `colocated` (on the trainer's GPU, asleep during the update), or a running cluster
  (`rollout.ray_address`, env RAY_ADDRESS).
  With `train.method = "nft"` (DiffusionNFT, `nft.py`) an `OldPolicy` (a LoRA copy over the same
  frozen base) samples the rollouts, in process.
- `janus`: token-level GRPO on Janus-Pro image tokens (VRL's autoregressive trainer). A unit is
  an image token carrying its sample's advantage; KL = `algo.kl` per token to the LoRA-disabled
  model.

Asynchronous rollouts (`train.max_staleness >= 1`): `weight_channel` gives the loop the rollout's
weights by version (`FamilyWeights` counts their optimizer steps). In process (both families) the rollout thread samples with
an engine of its own over a copy of the LoRA model whose frozen base is the trainer's (shared
memory, `copy_sharing_frozen`); the trainer's engine keeps the eval. With Ray workers each
published LoRA is kept as a host copy and pushed to the workers, with its optimizer-step count,
by the rollout that needs it; colocated workers then stay awake (they sample during the update).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import torch
from grpo_config import (
    Config,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    compiles_blocks,
    first_replay_tolerance,
    janus_window,
)
from peft import PeftModel
from transformers import JanusForConditionalGeneration

from rl_core.flow import SDEStep, compute_ratio_guard, flow_kl
from rl_core.kl import compute_kl
from rl_core.train import (
    CopyChannel,
    CountedWeights,
    FullWeights,
    Replay,
    UserError,
    WeightChannel,
    copy_sharing_frozen,
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
from rl_models.lora import add_lora
from rl_rollout import ImageSamples, build_image_engine
from rl_rollout.diffusion import DiffusionEngine, PromptEmbeddings, SampleBatch, Trajectory
from rl_rollout.janus import ImageRollout, JanusEngine
from rl_rollout.ray_pool import EngineSpec, RolloutPool, connect, ship_module

Micro = tuple[int, torch.Tensor, float]  # (sampled batch, its rows [b], loss weight)


@dataclass(frozen=True)
class Chunk:
    """One sampled batch: a prompt and a seed per image, drawn alike in process or on a Ray worker."""

    prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    window: tuple[int, int] | None = None  # sd3: the stochastic steps [start, stop); None = all


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


class Family(Protocol):
    peft: PeftModel  # the LoRA model: its trainable weights, EMA and exports
    model: torch.nn.Module  # what the optimizer steps through (DDP-wrapped, or sharded in place)
    optimizer: torch.optim.Optimizer
    full: FullWeights | None = None  # a sharded model's whole copy, which the engine samples from
    channel: WeightChannel | None = None  # asynchronous runs: the rollout's weights by version
    old: OldPolicy | None = None  # train.method = "nft" (sd3): DiffusionNFT's old policy, which samples

    def weight_channel(self) -> WeightChannel:
        """Switch the rollout to weights of its own, changed only by version (asynchronous runs;
        see the module doc)."""

    def start(self) -> None:
        """Start rollout workers, once the starting weights are in place (none by default)."""

    def close(self) -> None:
        """Release them (also after an error)."""

    def collect(self, chunks: list[Chunk], version: int) -> Sequence[ImageSamples]:
        """One sampled batch per chunk; `version`: optimizer steps in the weights."""

    def replays(self, samples: Sequence[ImageSamples], adv: Sequence[torch.Tensor], plan: list[list[Micro]]) -> Replays:
        """The update over `samples` (advantages `[b_k]` per sampled batch) along `plan_micro_batches`'s plan."""

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        """`[B, 3, H, W]` from the current weights at fixed seeds."""


class SD3(Family):
    pool: RolloutPool | None = None  # the Ray rollout actors (rollout.workers > 0), started by `start`
    owns_ray = False  # this process started Ray (and stops it)

    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        m, t, s = cfg.model, cfg.train, cfg.sampling
        self.cfg, self.acc, self.path = cfg, acc, path
        # model.compile (None: on CUDA): blocks compiled for sampling and replay (first replay |log ratio|
        # ~4e-4 in bf16, inside the automatic algo.replay_tolerance)
        self.compiled = compiles_blocks(cfg, acc.device.type)
        self.tolerance = first_replay_tolerance(cfg, self.compiled)
        self.engine = cast(DiffusionEngine, build_image_engine(
            "sd3", path=path, dtype=m.dtype, device=acc.device, text_encoder_dtype=m.text_encoder_dtype,
            compile=self.compiled, **rollout_options(s)))
        self.engine.transformer.requires_grad_(False)
        self.peft = add_lora(self.engine.transformer, family="sd3", r=m.lora_rank, alpha=m.lora_alpha,
                             target_modules=m.lora_targets)
        optimizer = torch.optim.AdamW(trainable_parameters(self.peft).values(), lr=t.lr, weight_decay=t.weight_decay)
        plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision,
                                cpu_offload=t.fsdp_cpu_offload, activation_checkpointing=t.fsdp_activation_checkpointing)
        # made before sharding: a copy of the unsharded structure, empty outside `gathered()`
        self.full = FullWeights(self.peft, device=acc.device) if plan.sharded else None
        self.model, self.optimizer, _ = prepare_policy(acc, self.peft, optimizer, None, plan)
        if self.full is not None:  # the engine samples from the copy's LoRA-injected transformer
            self.engine.pipeline.transformer = cast(PeftModel, self.full.model).get_base_model()
        # train.method = "nft": the old policy samples (asynchronous rollouts: an engine of their own)
        self.old = OldPolicy(self.peft, self.engine) if t.method == "nft" else None
        self.rollout_engine = self.old.engine if self.old is not None else self.engine

    def start(self) -> None:
        if self.cfg.rollout.workers:
            self.pool, self.owns_ray = start_workers(self.cfg.rollout, self.cfg.model, self.path, self.acc,
                                                     self.cfg.sampling, compile=self.compiled)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            if self.owns_ray:
                import ray

                ray.shutdown()

    def weight_channel(self) -> WeightChannel:
        """The rollout thread samples with a copy of the LoRA model: sharing the frozen base with
        the trainer's, or, for a sharded policy (FSDP2), a whole copy of its own made from one
        gather on every process (budget the transformer once more per GPU); each version's LoRA
        is then all-gathered on the trainer's thread, where the collective belongs. Ray workers
        get each version's LoRA instead."""
        inner: WeightChannel
        if self.pool is not None:  # unsharded: check_config refuses Ray workers with a sharded LoRA
            if self.cfg.rollout.placement == "colocated":
                self.pool.wake()  # awake for the whole run: the workers sample while the trainer updates
            inner = LoraVersions(self.engine.transformer)
        else:
            if self.full is not None:
                with whole_weights(self) as whole:
                    twin = cast(torch.nn.Module, copy.deepcopy(whole)).requires_grad_(False)
            else:
                twin = copy_sharing_frozen(self.peft)
            self.rollout_engine = engine_over(self.engine, cast(PeftModel, twin).get_base_model())
            inner = CopyChannel(self.peft, twin)
        self.channel = inner
        return inner

    def collect(self, chunks: list[Chunk], version: int) -> Sequence[ImageSamples]:
        s, pool, channel = self.cfg.sampling, self.pool, self.channel
        colocated = self.cfg.rollout.placement == "colocated" and channel is None  # asynchronous: awake throughout
        kwargs: dict[str, Any] = {
            "num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "height": s.resolution, "width": s.resolution,
            "noise_level": s.noise_level, "kind": s.kind, "max_sequence_length": s.max_sequence_length,
            "keep_means": self.cfg.train.ratio_norm}  # GRPO-Guard's RatioNorm needs the rollout's step means
        # a sharded policy's weights gathered into the engine's copy (asynchronous: the rollout
        # thread's copy holds them already, and the gather, a collective, stays on the trainer's thread)
        with whole_weights(self) if channel is None else nullcontext():
            if pool is None:
                return sample_chunks(self.rollout_engine, chunks, **kwargs)
            if colocated:
                pool.wake()
            if pool.version != version:  # the workers' LoRA synced to this version (each refuses another)
                lora = (cast(LoraVersions, channel).loaded if channel is not None else
                        {n: p.detach() for n, p in lora_params(self.engine.transformer).items()})
                pool.load_weights(lora, version)
        rollout = pool.map(sample_chunk_to_cpu, chunks, **kwargs)
        if colocated:
            pool.sleep()  # VRL colocated: actors release the GPU before the update
        return [to_device(traj, self.acc.device) for traj in rollout.outputs]

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
                with torch.no_grad(), self.peft.disable_adapter():
                    ref = self.engine.replay(traj, step, rows=rows, model=self.peft)
                kl = flow_kl(out.mean, ref.mean, out.std)[:, None]  # [b, 1]
            old = traj.log_probs[rows, step][:, None]  # [b, 1]
            if not t.ratio_norm:
                return Replay(out.log_prob[:, None], old, advs[k][rows], weight, kl=kl)
            return Replay(out.log_prob[:, None], old, advs[k][rows], weight, kl=kl, **guarded(traj, step, rows, out))

        window = [[(k, rows, weight, step) for k, rows, weight in micro for step in sources[k][1]] for micro in packed]
        return Replays(window, replay, units=lambda m: float(len(m[1])) * m[2],
                       filler=(0, torch.tensor([0]), 0.0, steps[0][0]), tolerance=self.tolerance, steps=steps)

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        e, s = self.cfg.eval, self.cfg.sampling  # the deterministic ODE sampler, `eval.num_steps` steps
        return self.engine.sample(prompts, num_steps=e.num_steps, guidance_scale=e.guidance_scale, height=s.resolution,
                                  width=s.resolution, kind="ode", seeds=seeds,
                                  max_sequence_length=s.max_sequence_length).images


class Janus(Family):
    def __init__(self, cfg: Config, acc: Any, path: str) -> None:
        m, j = cfg.model, cfg.janus
        self.cfg, self.acc = cfg, acc
        self.engine = cast(JanusEngine, build_image_engine(
            "janus", path=path, dtype=m.dtype, device=acc.device, compile=cfg.rollout.compile, logprobs=j.logprobs,
            max_batch_size=cfg.rollout.sample_batch_size))
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
        self.rollout_engine = self.engine  # an engine of its own when asynchronous

    def weight_channel(self) -> WeightChannel:
        """The rollout thread's engine decodes with a copy of the LoRA model (its own KV cache and
        processor). Its decode step compiles without CUDA graphs: captured from the rollout
        thread, which runs on a CUDA stream of its own, the graphs of "reduce-overhead" come out
        empty (torch 2.11)."""
        twin, e = copy_sharing_frozen(self.peft), self.engine
        mode = "default" if e.compile_mode == "reduce-overhead" else e.compile_mode
        self.rollout_engine = JanusEngine(cast(JanusForConditionalGeneration, cast(PeftModel, twin).get_base_model()),
                                          copy.deepcopy(e.processor), device=e.device, max_batch_size=e.max_batch_size,
                                          compile=e.compile, compile_mode=mode, logprobs=e.logprobs,
                                          chunk_size=e.chunk_size)
        self.channel = CopyChannel(self.peft, twin)
        return self.channel

    def collect(self, chunks: list[Chunk], version: int) -> Sequence[ImageSamples]:
        """Image tokens drawn with CFG (`sampling.guidance_scale`) at `rollout.temperature`; each
        sampled batch keeps its window of trained token positions (`sampling.sde_window*`)."""
        return [replace(self.rollout_engine.sample(list(c.prompts), guidance_scale=self.cfg.sampling.guidance_scale,
                                                   temperature=self.cfg.rollout.temperature, seeds=c.seeds), window=c.window)
                for c in chunks]

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
                       steps=trained)

    def eval_images(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        return self.engine.sample(prompts, guidance_scale=self.cfg.eval.guidance_scale,
                                  temperature=self.cfg.rollout.temperature, seeds=seeds).images


class OldPolicy:
    """DiffusionNFT's old policy (`train.method = "nft"`): a copy of the LoRA model whose frozen
    base is the trainer's (`copy_sharing_frozen`), starting at the trained LoRA. It samples the
    rollouts (`engine`, sharing the trainer's text encoders and VAE) and gives `v_old` in the loss;
    after each epoch `move_towards` pulls it towards the trained LoRA. A checkpoint `Stateful`."""

    def __init__(self, peft: PeftModel, engine: DiffusionEngine) -> None:
        self.model = cast(PeftModel, copy_sharing_frozen(peft))
        self.engine = engine_over(engine, self.model.get_base_model())
        self.trained, self.params = lora_params(peft), lora_params(self.model)  # the same names

    @torch.no_grad()
    def move_towards(self, decay: float) -> None:
        """`old <- decay old + (1 - decay) trained` (upstream's order of operations)."""
        for name, p in self.params.items():
            p.copy_(p * decay + self.trained[name].detach() * (1.0 - decay))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self.params):
            raise ValueError(f"its old-policy LoRA is not this model's ({len(state)} vs {len(self.params)} tensors): "
                             "another LoRA rank or target modules?")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])


class FamilyWeights(CountedWeights):
    """A family's `PolicyWeights` for the trainer loop. Synchronous, the rollout samples with the
    trained LoRA itself (Ray workers take it at each `collect`): nothing to push; asynchronous,
    `channel` is the family's `weight_channel`."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self.family = family

    def channel(self) -> WeightChannel:
        return self.counted(self.family.weight_channel())


class LoraVersions:
    """The trained LoRA by loop step as host copies, for Ray workers: `load` picks the copy that
    the next rollout pushes (`SD3.collect`), so only the rollout thread talks to the workers."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def publish(self, version: int) -> None:
        with torch.no_grad():
            held = {n: p.detach().to("cpu", copy=True) for n, p in lora_params(self.transformer).items()}
        with self._lock:
            self.versions[version] = held

    def load(self, version: int, *, prune: bool = True) -> None:
        with self._lock:
            self.loaded = self.versions[version]
            if prune:
                self.versions = {v: w for v, w in self.versions.items() if v >= version}

    def close(self) -> None:
        with self._lock:
            self.versions.clear()


def engine_over(engine: DiffusionEngine, transformer: torch.nn.Module) -> DiffusionEngine:
    """An engine sampling with `transformer` that shares `engine`'s text encoders and VAE, for
    the rollout thread. Its scheduler and tokenizers are its own: sampling sets the scheduler's
    timesteps, and a fast tokenizer's call sets its padding and truncation, while the trainer's
    engine may encode (its unconditional embeddings, at the first replay)."""
    for block in getattr(transformer, "transformer_blocks", []):  # a copy made after a compiled forward
        block.__dict__.pop("forward", None)  # would call the original block's compiled forward
    pipeline = engine.pipeline
    own = {name: copy.deepcopy(part) for name, part in pipeline.components.items()
           if name == "scheduler" or name.startswith("tokenizer")}
    parts = {**pipeline.components, **own, "transformer": transformer}
    return DiffusionEngine(type(pipeline)(**parts), device=engine.device, compile=engine.compile,
                           cuda_graphs=engine.cuda_graphs, attention_backend=engine.attention_backend,
                           overlap_decode=engine.overlap_decode)


def pack_rows(trajectories: Sequence[Trajectory], adv: Sequence[torch.Tensor], steps: Sequence[Sequence[int]],
              plan: list[list[Micro]], size: int) -> tuple[list[tuple[Trajectory, Sequence[int]]],
                                                          list[torch.Tensor], list[list[Micro]]]:
    """`plan` with each optimizer step's rows regrouped into micro-batches of at most `size` rows
    that may span sampled batches: the rows of one weight and one schedule (the same trained
    `steps`, sigmas, guidance, noise level and sampler), in plan order, cut every `size` rows.
    Returns the replayed sources, (trajectory, its trained steps) each (the sampled batches,
    then one joined batch per micro-batch that spans several), their advantages `[b]` and the
    plan over them. The loss is unchanged (a micro-batch's loss is its units' sum over the step's
    unit count); only rounding differs. Filler micro-batches (weight 0) are kept as they are."""
    sources = [(traj, s) for traj, s in zip(trajectories, steps, strict=True)]
    advs = list(adv)

    def schedule(k: int) -> int:  # the first sampled batch replayed alike
        return next(j for j in range(k + 1) if same_schedule(trajectories[j], trajectories[k], steps[j], steps[k]))

    packed = []
    for micro_batches in plan:
        groups: dict[tuple[float, int], list[tuple[int, int]]] = {}
        kept: list[Micro] = []
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


def join_rows(parts: Sequence[tuple[Trajectory, torch.Tensor]]) -> Trajectory:
    """One trajectory of the rows `[b_i]` of each of `parts`' trajectories (of one schedule:
    `same_schedule`), in order: what a sampled batch of those images would have kept."""
    def cat(field: Callable[[Trajectory], torch.Tensor]) -> torch.Tensor:
        return torch.cat([field(traj)[rows.to(field(traj).device)] for traj, rows in parts])  # [b, ...]

    first = parts[0][0]
    return replace(first, prompts=tuple(traj.prompts[r] for traj, rows in parts for r in rows.tolist()),
                   conditioning=PromptEmbeddings(cat(lambda x: x.conditioning.embeds), cat(lambda x: x.conditioning.pooled)),
                   latents=cat(lambda x: x.latents), log_probs=cat(lambda x: x.log_probs), images=cat(lambda x: x.images),
                   means=None if first.means is None else cat(lambda x: cast(torch.Tensor, x.means)))


def guarded(traj: Trajectory, step: int, rows: torch.Tensor, out: SDEStep) -> dict[str, Any]:
    """GRPO-Guard's RatioNorm of replayed step `step` of `rows` (`out`: its replay): the
    re-centred, re-scaled log ratio `[b, 1]` and the policy loss's scale 1 / |dt|, upstream's
    `policy_loss / sqrt_dt.mean() ** 2` (`rl_core.flow.compute_ratio_guard`)."""
    means = cast(torch.Tensor, traj.means)  # kept: SD3.collect samples with keep_means under train.ratio_norm
    sigma, sigma_next = float(traj.sigmas[step]), float(traj.sigmas[step + 1])
    old_mean = means[rows.to(means.device), step]  # [b, C, h, w]
    log_ratio, _ = compute_ratio_guard(logp=out.log_prob, old_logp=traj.log_probs[rows, step], mean=out.mean,
                                       old_mean=old_mean, step_std=out.std * math.sqrt(sigma - sigma_next),
                                       dt=sigma_next - sigma)  # [b]
    return {"log_ratio": log_ratio[:, None], "policy_scale": 1 / (sigma - sigma_next)}


def sample_chunk(engine: DiffusionEngine, chunk: Chunk, *, max_sequence_length: int, **sampling: Any) -> Trajectory:
    """Encode the chunk's distinct prompts once, then sample one image per row with its seed."""
    unique = list(dict.fromkeys(chunk.prompts))
    conditioning = engine.encode(unique, max_sequence_length=max_sequence_length)
    rows = [unique.index(p) for p in chunk.prompts]
    return engine.sample(list(chunk.prompts), conditioning=conditioning.index(rows), seeds=list(chunk.seeds),
                         sde_window=chunk.window, **sampling)


def sample_chunks(engine: DiffusionEngine, chunks: list[Chunk], *, max_sequence_length: int,
                  **sampling: Any) -> list[Trajectory]:
    """`sample_chunk` for each chunk, through `sample_many` (sampling.overlap_decode overlaps each
    chunk's VAE decode with the next chunk's denoising)."""
    batches = []
    for chunk in chunks:
        unique = list(dict.fromkeys(chunk.prompts))
        conditioning = engine.encode(unique, max_sequence_length=max_sequence_length)
        batches.append(SampleBatch(chunk.prompts, conditioning=conditioning.index([unique.index(p) for p in chunk.prompts]),
                                   seeds=chunk.seeds, sde_window=chunk.window))
    return engine.sample_many(batches, max_sequence_length=max_sequence_length, **sampling)


def rollout_options(sampling: SamplingConfig) -> dict[str, Any]:
    """The engine's rollout options from the [sampling] table (rl_rollout.diffusion's docstring)."""
    return {"cuda_graphs": sampling.cuda_graphs, "attention_backend": sampling.attention_backend,
            "overlap_decode": sampling.overlap_decode}


def sample_chunk_to_cpu(engine: DiffusionEngine, chunk: Chunk, **kwargs: Any) -> Trajectory:
    """`sample_chunk` in a worker: tensors come back on CPU (the trainer moves them to its device)."""
    return to_device(sample_chunk(engine, chunk, **kwargs), torch.device("cpu"))


def to_device(traj: Trajectory, device: torch.device) -> Trajectory:
    """The per-sample tensors on `device` (the schedule stays on CPU, as the engine returns it)."""
    cond = PromptEmbeddings(traj.conditioning.embeds.to(device), traj.conditioning.pooled.to(device))
    return replace(traj, conditioning=cond, latents=traj.latents.to(device), log_probs=traj.log_probs.to(device),
                   images=traj.images.to(device), means=None if traj.means is None else traj.means.to(device))


def lora_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA weights of a peft-injected transformer, by name (the same names in every process)."""
    return {name: p for name, p in module.named_parameters() if ".lora_" in name}


def build_lora_engine(path: str, *, dtype: str, text_encoder_dtype: str | None, lora_rank: int,
                      lora_alpha: float, lora_targets: list[str] | None, compile: bool = False,
                      **options: Any) -> DiffusionEngine:
    """A worker's pipeline with the trainer's LoRA layout (weights by `load_lora`), on its GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = DiffusionEngine.from_pretrained(path, dtype=dtype, device=device, text_encoder_dtype=text_encoder_dtype,
                                             compile=compile, **options)  # as the trainer's engine
    engine.transformer.requires_grad_(False)
    add_lora(engine.transformer, family="sd3", r=lora_rank, alpha=lora_alpha, target_modules=lora_targets)
    return engine


def load_lora(engine: DiffusionEngine, state: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():  # the worker's adapters are the trainer's (the same model.lora_* settings)
        for name, p in lora_params(engine.transformer).items():
            p.copy_(state[name])


def start_workers(rollout: RolloutConfig, model: ModelConfig, path: str, acc: Any,
                  sampling: SamplingConfig, *, compile: bool) -> tuple[RolloutPool, bool]:
    """`rollout.workers` actors per trainer process, placed as `rollout.placement` says, and
    whether this process started Ray (and stops it). `compile`: the trainer's resolved
    model.compile, so a worker samples with the blocks the trainer replays with."""
    address, colocated = rollout.ray_address, rollout.placement == "colocated"
    gpus = rollout.gpus_per_worker
    if gpus is None:  # split 1, colocated 1 / workers, 0 without CUDA
        gpus = 0.0 if not torch.cuda.is_available() else 1.0 / rollout.workers if colocated else 1.0
    gpu_ids = None
    if torch.cuda.is_available() and not address:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        ids = visible.split(",")
        mine = ids[acc.device.index or 0]
        gpu_ids = [mine] if colocated else [g for g in ids if g != mine]
        if gpus * rollout.workers > len(gpu_ids):
            raise UserError(f"rollout.placement={rollout.placement!r}: {rollout.workers} workers x {gpus} GPUs "
                            f"do not fit on GPUs {gpu_ids} (the trainer has GPU {mine}); lower rollout.workers "
                            "or rollout.gpus_per_worker, or use placement 'colocated'")
    owns = connect(address, num_cpus=max(os.cpu_count() or 1, rollout.workers), gpu_ids=gpu_ids)
    ship_module(sys.modules[__name__])  # workers cannot import the app folder: send this module by value
    spec = EngineSpec(factory=build_lora_engine, load_weights=load_lora, kwargs={
        "path": path, "dtype": model.dtype, "text_encoder_dtype": model.text_encoder_dtype,
        "lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha, "lora_targets": model.lora_targets,
        "compile": compile, **rollout_options(sampling)})
    pool = RolloutPool(spec, rollout.workers, num_cpus=1.0, num_gpus=gpus, address=address)
    if colocated:
        pool.sleep()
    return pool, owns


FAMILIES: dict[str, Callable[[Config, Any, str], Family]] = {"sd3": SD3, "janus": Janus}


def whole_weights(family: Family) -> Any:
    """The PeftModel with whole weights the engine samples from: the trained one, or a sharded
    policy's copy, gathered for the block. Enter it on every process (the gather is a collective)."""
    return gathered(family.full, family.peft)
