"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe, `experiment/diffusion/sd3_5/online_grpo_ocr`), on the shared trainer loop.

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/vrl.toml        # or flow_grpo.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU

A step is an epoch: `rollout.groups_per_epoch` prompts x `rollout.n` images (SDE sampler, per-step
log-probs kept) -> reward -> GRPO advantages -> update (`plan_micro_batches`; the stored steps
replayed: `ppo_clip` + beta x flow KL to the LoRA-disabled model, AdamW, EMA) -> log ->
checkpoint -> eval (ODE, EMA weights, fixed seeds, contact sheet). The families (sd3, wan,
cosmos, janus) are families.py's; `train.method = "nft"` and `"dpo"` (a step is
`rollout.groups_per_epoch` preference pairs, not samples) are `rl_policy.flow_update`'s updates.
`__main__.py` reads the command line and the config (`grpo_config.py`) before this module and torch load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from families import FAMILIES, SD3, Family, OldPolicy, whole_weights
from grpo_config import (
    DEFAULT_CONFIG,
    ENV,
    NAME,
    VIDEO,
    Config,
    TrainConfig,
    check_config,
    read_pairs,
    read_prompts,
    reward_spec,
    window_range,
)
from peft import PeftModel

from rl_core.flow import compute_nft_decay, compute_sde_window
from rl_core.train import (
    Checkpoint,
    GroupAdvantages,
    Media,
    Micro,
    ParameterEMA,
    Recipe,
    RolloutCorrection,
    RunContext,
    Schedule,
    Scores,
    TrainableState,
    UserError,
    all_frames,
    chunked_steps,
    component_means,
    component_weights,
    contact_sheet,
    gathered_group_ids,
    image_stats,
    replay_plan,
    replay_update,
    sample_seed,
    save_media,
    sharded_state,
    to_media,
    zero_std_fraction,
)
from rl_data import GroupSampler, OCRPrompt, PreferenceRecord, load_frames, load_pixels
from rl_models import tiny
from rl_policy.flow_update import PreferenceBatch, dpo_update, encode_pairs, nft_update
from rl_policy.lora_weights import LoraPolicyWeights, export_adapters
from rl_rewards import Sample, Scorer, build_reward
from rl_rewards.client import RemoteScorer
from rl_rollout import ImageSamples
from rl_rollout.cosmos import GIVEN_VIDEO_FRAMES, CosmosEngine
from rl_rollout.diffusion import PromptEmbeddings, SampleBatch, Trajectory


@dataclass
class State:
    cfg: Config
    run: RunContext
    family: Family  # the engine, the LoRA model it samples from and the optimizer
    ema: ParameterEMA  # the family's, stepped by its `weights` after each optimizer step
    reward: Scorer  # composed in process, or a RemoteScorer
    weights: dict[str, float]  # the reward's component weights, for algo.reward_aggregation=normalize_then_sum
    prompts: list[OCRPrompt]
    eval_prompts: list[OCRPrompt]
    sampler: GroupSampler  # over the prompts, or (train.method = "dpo") the pairs
    pairs: list[PreferenceRecord]  # train.method = "dpo": data.preferences


@dataclass(frozen=True)
class Batch:
    """One step's rollouts on this process, in sampled batches of `rollout.sample_batch_size`."""

    samples: Sequence[ImageSamples] | Sequence[PreferenceBatch]  # sd3: `Trajectory`, janus: `ImageRollout`
    records: list[OCRPrompt]  # one per image, in sample order
    group_ids: torch.Tensor  # [N] global group index
    images: list[Media]  # one per sample: an image, or a video's frames (model.family = "wan")
    on_policy: bool = True  # sampled by the weights the trainer holds: the first replay's ratio is checked


class DiffusionGRPO(Recipe[Config, State, Batch]):
    name, config, default_config, env = NAME, Config, DEFAULT_CONFIG, ENV
    # the LoRA init is the same on every process (FSDP2 shards each process's own copy; DDP would
    # broadcast rank 0's); sampling noise is seeded per sample
    seed_by_rank = False

    def check(self, cfg: Config, world_size: int) -> None:
        check_config(cfg, world_size)

    def setup(self, cfg: Config, run: RunContext) -> State:
        dpo = cfg.train.method == "dpo"  # empty or bad data: stopped before any model loads
        prompts = [] if dpo else read_prompts(cfg.data.manifest, "data.manifest", cfg.model.family)
        pairs = read_pairs(cfg.data.preferences, video=cfg.model.family in VIDEO) if dpo else []
        eval_prompts = read_prompts(cfg.data.eval_manifest, "data.eval_manifest", cfg.model.family)[: cfg.eval.max_prompts]
        family = FAMILIES[cfg.model.family](cfg, run.accelerator, str(tiny.resolve(cfg.model.path)))
        sampler = GroupSampler(len(pairs) if dpo else len(prompts), 1 if dpo else cfg.rollout.n, seed=cfg.train.seed,
                               rank=run.rank, world_size=run.world_size)
        reward = RemoteScorer(cfg.reward.url, cfg.reward.server_reward) if cfg.reward.url else build_reward(
            reward_spec(cfg.reward, tiny=cfg.model.path.startswith("tiny:"), video=cfg.model.family in VIDEO))
        weights = component_weights(reward, cfg.algo.reward_aggregation)
        return State(cfg, run, family, family.ema, reward, weights, prompts, eval_prompts, sampler, pairs)

    def policy(self, state: State) -> LoraPolicyWeights:
        return state.family.weights

    def schedule(self, state: State) -> Schedule:
        return Schedule.periodic(state.cfg.train.epochs, state.cfg.train.eval_freq)

    def checkpoint(self, state: State) -> Checkpoint:
        """An unsharded LoRA is saved without the accelerator (`save_state` would write the whole
        transformer, GBs): the LoRA, optimizer, EMA and sampler are all the state there is. A
        sharded one saves its LoRA and optimizer shards on every process (DCP, frozen base left
        out). The PEFT `lora/` and `lora_ema/` are written from whole weights inside it (a fully
        fine-tuned transformer is exported at the end only: its state holds every weight already)."""
        f = state.family
        kept: dict[str, Any] = {"ema": state.ema, "sampler": state.sampler}
        if f.old is not None:  # train.method = "nft"
            kept["nft_old"] = f.old
        saved = {**kept, **sharded_state(f.peft, f.optimizer, trainable_only=True)} if f.full else {
            "lora": TrainableState(f.peft), "optimizer": f.optimizer, **kept}
        whole = cast(PeftModel, f.full.model) if f.full else f.peft  # whole inside `gather`
        return Checkpoint(state=saved, trained=f.peft, accelerator=f.full is not None, gather=whole_weights(f),
                          write_files=(lambda folder: export_adapters(whole, state.ema, folder)) if state.cfg.model.lora_rank else None)

    def rollout(self, state: State, step: int) -> Batch:
        state.family.model.eval()
        return self.sample(state, step)

    def sample(self, state: State, step: int) -> Batch:
        """n copies of each of this process's prompts, one seed per sample: it depends on the
        group's place in the epoch's prompt order (group g of rank r is the (g * world + r)-th
        prompt) and the index in the group, not on the process count. `train.max_staleness >= 1`:
        on the rollout thread, with the rollout's own weights (`LoraPolicyWeights.channel`)."""
        cfg, run, epoch = state.cfg, state.run, step - 1
        n, size, world = cfg.rollout.n, cfg.rollout.sample_batch_size, run.world_size
        groups = cfg.rollout.groups_per_epoch // world
        if cfg.train.method == "dpo":
            return self.encoded_pairs(state, groups)
        records = [state.prompts[next(iter(state.sampler))] for _ in range(groups * n)]
        seeds = [sample_seed(cfg.train.seed, epoch, sample_index(i, n, world, run.rank)) for i in range(len(records))]
        batches = [SampleBatch(tuple(r.prompt for r in records[i:i + size]), given_frames(state, records[i:i + size]),
                               tuple(seeds[i:i + size]), sde_window(cfg, epoch, sample_index(i, n, world, run.rank)))
                   for i in range(0, len(records), size)]
        samples = state.family.collect(batches)
        images = [image for s in samples for image in to_media(s.images)]
        return Batch(samples, records, torch.arange(len(records)) // n + run.rank * groups, images)

    def encoded_pairs(self, state: State, count: int) -> Batch:
        """train.method = "dpo": this process's `count` pairs of the step, decoded at the sampling
        size (a video family: `sampling.num_frames` frames) and VAE-encoded; pair p of rank r is
        the (p x world + r)-th of the step (its noise)."""
        s, run, video = state.cfg.sampling, state.run, state.cfg.model.family in VIDEO
        records = [state.pairs[next(iter(state.sampler))] for _ in range(count)]
        places = torch.tensor([sample_index(p, 1, run.world_size, run.rank) for p in range(count)])  # [count]

        def pixels(sources: list[Any]) -> torch.Tensor:  # [b, 3, H, W] or [b, F, 3, H, W] in [0, 1]
            try:
                arrays = [load_pixels(x, size=s.resolution, num_frames=s.num_frames if video else None) for x in sources]
            except (OSError, ValueError) as e:  # unreadable, or a clip shorter than sampling.num_frames
                raise UserError(f"data.preferences: {e}") from None
            return torch.from_numpy(np.stack(arrays)).movedim(-1, -3).float() / 255

        size, engine = state.cfg.rollout.sample_batch_size, cast(SD3, state.family).engine
        batches = [encode_pairs(engine, [r.prompt for r in part], pixels([r.chosen for r in part]),
                                pixels([r.rejected for r in part]), places[i:i + size],
                                max_sequence_length=s.max_sequence_length)
                   for i in range(0, count, size) for part in [records[i:i + size]]]
        return Batch(batches, [], torch.arange(count) + run.rank * count, [])

    def prepare(self, state: State, step: int, sampled: Batch) -> Batch:
        """The trajectories need nothing more: their log-probs, the sampling weights', are the PPO
        ratio's old ones (Flow-GRPO's), so the ratio corrects the staleness. The first replay is
        checked against them only where the trainer's weights sampled them (`RunContext.first_step`)."""
        return dataclasses.replace(sampled, on_policy=state.run.first_step(step))

    def score(self, state: State, step: int, batch: Batch) -> Scores:
        run = state.run
        if state.cfg.train.method == "dpo":  # a pair's rewards are its labels: 1 chosen, 0 rejected
            return Scores(torch.tensor([1.0, 0.0]).repeat(len(batch.group_ids)), batch.group_ids.repeat_interleave(2),
                          "grpo")
        files = run.run_dir / "rollouts" / f"step_{step}" / f"rank_{run.rank}" if state.cfg.reward.url else None
        rewards, components = score_images(state.reward, batch.images, batch.records, files=files, send_paths=True)
        run.samples.write("train", step, [{"prompt": r.prompt, "target": r.target, "reward": v}
                                          for r, v in zip(batch.records, rewards.tolist(), strict=True)])
        # one row per process (equal image counts); the loop averages the reward's `components`
        stats = component_means([image_stats(all_frames(batch.images))], run.accelerator, prefix="")
        return grpo_scores(state.cfg, run.accelerator, rewards, batch.group_ids, [r.prompt for r in batch.records],
                           stats, components=components, weights=state.weights)

    def update(self, state: State, step: int, batch: Batch, advantages: GroupAdvantages) -> dict[str, float]:
        t, run, f, adv, acc = state.cfg.train, state.run, state.family, advantages.advantages, state.run.accelerator
        metrics = {**(f.full.pop_metrics() if f.full else {})}
        sizes = [len(s) if isinstance(s, PreferenceBatch) else len(s.prompts) for s in batch.samples]
        if t.method != "grpo":  # nft: every scored image trains, whatever its advantage (0 is r = 1/2); dpo: every pair
            return metrics | self.flow_update(state, step, batch, advantages, sizes)
        if not acc.reduce(torch.tensor(float((adv != 0).sum()), device=acc.device), reduction="sum").item():
            return metrics  # every group scored its images alike: no signal, no update
        plan = plan_micro_batches(t, acc, sizes, adv, step - 1)
        job = f.replays(cast(Sequence[ImageSamples], batch.samples), adv.split(sizes), plan)
        # stale rollouts (older weights sampled them): the first replay's |log ratio| is logged, not checked
        tolerance = job.tolerance if batch.on_policy or job.tolerance is None else math.inf
        metrics |= replay_update(
            acc, f.model, f.optimizer, job.plan, job.replay, units=job.units, clip_range=t.clip_range,
            kl_beta=state.cfg.algo.kl_coef, grad_clip=t.grad_clip, guard=run.guard, filler=job.filler,
            tolerance=tolerance, rescore=job.rescore, correction=RolloutCorrection(
                state.cfg.algo.rollout_correction, state.cfg.algo.rollout_clip_min, state.cfg.algo.rollout_clip_max),
            what=f"step {step}: first replay, |log ratio| vs algo.replay_tolerance (bf16 "
                 "with micro_batch_size != sample_batch_size needs a looser tolerance)")
        if job.steps:  # how many denoising steps (sd3) or token positions (janus) a sampled batch trains, and which
            every = [k for steps in job.steps for k in steps]
            metrics |= {"replay/steps_per_batch": len(every) / len(job.steps), "replay/first_step": min(every),
                        "replay/last_step": max(every)}
        return metrics | {"adv/trained_samples": replay_plan.trained_samples(plan, acc)}

    def flow_update(self, state: State, step: int, batch: Batch, advantages: GroupAdvantages,
            sizes: list[int]) -> dict[str, float]:
        """DiffusionNFT's update over the scored images, or Diffusion-DPO's over the pairs
        (`rl_policy.flow_update`), in micro-batches as `drop` plans them."""
        cfg, run, t, f = state.cfg, state.run, state.cfg.train, cast(SD3, state.family)
        rows = torch.arange(sum(sizes)) if t.method == "dpo" else advantages.valid.nonzero().flatten()
        plan = chunked_steps(run.accelerator, sizes, rows, micro_batch_size=t.micro_batch_size,
                             accumulation=t.gradient_accumulation_steps)
        count, options = int(cfg.sampling.num_steps * t.timestep_fraction), {"seed": t.seed, "epoch": step - 1}
        trained = {"adv/trained_samples": replay_plan.trained_samples(plan, run.accelerator)}
        if t.method == "dpo":
            return trained | dpo_update(run.accelerator, run.guard, f, cast(Sequence[PreferenceBatch], batch.samples),
                                        plan, num_steps=cfg.sampling.num_steps, count=count, beta=cfg.dpo.beta,
                                        grad_clip=t.grad_clip, **options)
        n, world, old = cfg.rollout.n, run.world_size, cast(OldPolicy, f.old)  # built by SD3 for train.method = "nft"
        places = torch.tensor([sample_index(i, n, world, run.rank) for i in range(sum(sizes))])  # [N]
        metrics = nft_update(run.accelerator, run.guard, f, old.engine, cast(Sequence[Trajectory], batch.samples),
                             advantages.advantages.split(sizes), places.split(sizes), plan, count=count,
                             beta=cfg.nft.beta, adv_clip=t.adv_clip, kl_beta=cfg.algo.kl_coef, grad_clip=t.grad_clip,
                             **options)
        decay = compute_nft_decay(f.weights.steps, start=cfg.nft.old_decay_start, rate=cfg.nft.old_decay_rate,
                                  limit=cfg.nft.old_decay_max)  # scheduled by the optimizer steps taken so far
        old.move_towards(decay)
        return trained | metrics | {"nft/old_decay": decay}

    def evaluate(self, state: State, step: int) -> dict[str, float]:
        """Fixed prompts and seeds, EMA weights (`eval.use_ema`), on the main process; writes
        `eval_epoch_<step>/` (the images, and a contact sheet with each prompt and reward), also sent to the trackers."""
        e, out = state.cfg.eval, state.run.run_dir / f"eval_epoch_{step}"
        with whole_weights(state.family) as model:  # every process: a sharded policy gathers
            if not state.run.is_main:
                return {}
            images, records = [], state.eval_prompts
            with state.ema.swapped(model) if e.use_ema else nullcontext():
                for i in range(0, len(records), e.batch_size):
                    part = records[i:i + e.batch_size]  # seeds: eval.seed + the prompt's place
                    seeds = [e.seed + i + k for k in range(len(part))]
                    images += to_media(state.family.eval_images([r.prompt for r in part], seeds, given_frames(state, part)))
        rewards, components = score_images(state.reward, images, records, files=out / "images",
                                           send_paths=state.cfg.reward.url is not None)
        contact_sheet([m[0] if isinstance(m, list) else m for m in images],  # a video: its first frame
                      [f"{r.prompt} | reward {v:.3f}" for r, v in zip(records, rewards.tolist(), strict=True)],
                      out / "contact_sheet.png")
        state.run.log_media(step, out)  # the contact sheet and any videos, to train.log_with's trackers
        ok = rewards[torch.isfinite(rewards)]  # [V]
        return {"reward/mean": ok.mean().item() if ok.numel() else math.nan,
                "reward/failed": float((~torch.isfinite(rewards)).sum()), **component_means(components),
                **image_stats(all_frames(images))}

    def finish(self, state: State) -> dict[str, str]:
        out, f, folders = state.run.run_dir / "checkpoint-final", state.family, []
        with whole_weights(f) as model:
            if state.run.is_main:  # the LoRA (lora/, lora_ema/) or a fully fine-tuned transformer (transformer/, ...)
                folders = export_adapters(model, state.ema, out)
        # Drop the DDP wrapper while the process group is still registered: if its Reducer held the
        # group's last reference after end_training(), the gloo group's destructor would join its
        # worker threads holding the GIL, and a worker still freeing a finished collective's Python
        # tensors waits for the GIL: a deadlock seen once in the 2-process test (torch 2.13, gloo)
        f.model = f.peft
        state.run.accelerator.free_memory()  # the accelerator's own reference to the wrapper
        return {"exports": ", ".join(map(str, folders))}

    def close(self, state: State) -> None:
        state.family.weights.close()
        if isinstance(state.reward, RemoteScorer):  # its HTTP connections to the reward server
            state.reward.close()


def given_frames(state: State, records: list[OCRPrompt]) -> PromptEmbeddings | None:
    """cosmos image/video to world: the rows' pictures as first frames (a clip's `GIVEN_VIDEO_FRAMES`), or None."""
    if not records or records[0].media is None:
        return None
    try:  # a picture unreadable, a clip too short, or one leaving no frame to generate: the error names it
        s = state.cfg.sampling
        pixels = [torch.from_numpy(load_frames(str(r.media), size=s.resolution, video_frames=GIVEN_VIDEO_FRAMES))
                  .movedim(-1, -3).float() / 255 for r in records]  # [F, 3, H, W] each
        return cast(CosmosEngine, cast(SD3, state.family).engine).encode_world(
            [r.prompt for r in records], pixels, max_sequence_length=s.max_sequence_length)
    except (OSError, ValueError) as e:
        raise UserError(f"data.manifest: {e}") from None


def sample_index(i: int, n: int, world: int, rank: int) -> int:
    """Local image i's place in the epoch: group g of rank r is the (g x world + r)-th prompt."""
    return ((i // n) * world + rank) * n + i % n


def sde_window(cfg: Config, epoch: int, first: int) -> tuple[int, int] | None:
    """The stochastic steps of the sampled batch whose first image is sample `first` of the epoch
    (`sampling.sde_window_mode`); a random window is drawn from (train.seed, epoch, first), so it
    does not depend on the process count and a resumed run draws it again."""
    s = cfg.sampling  # sd3: denoising steps; janus: image-token positions (every token is sampled, a window trains)
    if s.sde_window_mode == "fixed":
        return (s.sde_window[0], s.sde_window[1]) if s.sde_window else None
    start, limit = window_range(cfg)
    generator = torch.Generator().manual_seed(sample_seed(cfg.train.seed, epoch, first, 1))
    return compute_sde_window(s.sde_window_mode, epoch=epoch, limit=limit, size=s.sde_window_size, start=start,
                              shift_interval=s.shift_interval, stride=s.window_stride, generator=generator)


def plan_micro_batches(t: TrainConfig, acc: Any, sizes: list[int], adv: torch.Tensor, epoch: int) -> list[list[Micro]]:
    """The epoch's optimizer steps of micro-batches (`rl_core.train.plan_micro_batches`) as
    `train.zero_adv`, `train.micro_batch_size` and `train.gradient_accumulation_steps` say."""
    return replay_plan.plan_micro_batches(acc, sizes, adv, zero_adv=t.zero_adv, micro_batch_size=t.micro_batch_size,
                                          accumulation=t.gradient_accumulation_steps, seed=t.seed, epoch=epoch)


def score_images(scorer: Scorer, images: list[Media], records: list[OCRPrompt], *, files: Path | None = None,
                 send_paths: bool = False) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Rewards `[N]` (NaN where scoring failed) and each sample's components; a video's frames go
    to the reward as `metadata["video"]`. `files`: the images are saved there as PNGs (videos as
    MP4s, `save_media`), and with `send_paths` they are sent as paths (a reward server reads files)."""
    paths = save_media(images, files) if files is not None else [None] * len(images)
    sent = [str(p) if p and send_paths else m for p, m in zip(paths, images, strict=True)]
    results = scorer.score([Sample(completion="", prompt=r.prompt, reference=r.target,
                                   metadata={"video" if isinstance(m, list) else "image": x})
                            for r, m, x in zip(records, images, sent, strict=True)])
    rewards = torch.tensor([math.nan if r.score is None else r.score for r in results])  # [N]
    return rewards, [dict(r.components) for r in results]


def grpo_scores(cfg: Config, acc: Any, rewards: torch.Tensor, group_ids: torch.Tensor, prompts: list[str],
                metrics: Mapping[str, float], *, components: Sequence[Mapping[str, float]] = (),
                weights: Mapping[str, float] | None = None) -> Scores:
    """GRPO over every process's groups, normalised as `train.adv_*` say; `train.adv_group_by =
    "prompt"` groups by prompt text instead (Flow-GRPO's per-prompt stat tracker: the prompts of
    every process are gathered and numbered together). `algo.reward_aggregation =
    "normalize_then_sum"` normalises each of the images' `components` by its `weights` instead."""
    t = cfg.train
    if t.adv_group_by == "prompt":
        group_ids = gathered_group_ids(prompts, acc)  # [N]
    options = {"scale": t.adv_scale, "eps": t.adv_eps, "clip": t.adv_clip, "std": t.adv_std, "eps_mode": t.adv_eps_mode}
    return Scores(rewards, group_ids, "grpo", options=options, components=components,
                  metrics={**metrics, "reward/zero_std_group_fraction": zero_std_fraction(rewards, group_ids, acc)},
                  aggregation=cfg.algo.reward_aggregation, weights=weights or {})


RECIPE = DiffusionGRPO()
