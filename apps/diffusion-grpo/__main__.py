"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe, `experiment/diffusion/sd3_5/online_grpo_ocr`), on the shared trainer loop.

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/vrl.toml        # or flow_grpo.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU
    uv run apps/diffusion-grpo --resume                              # continue the latest run
    uv run apps/diffusion-grpo --help                                # every key and its default

One step of the loop is one epoch: sample `rollout.groups_per_epoch` prompts x `rollout.n` images
with the SDE sampler (`rl_rollout.diffusion`, keeping latents and per-step log-probs) -> reward
(in process or a reward server) -> GRPO advantages (global std, clip 5) -> the update: zero-
advantage samples dropped, or refilled as Flow-GRPO does (grpo_plan.py), the stored steps
replayed through the current model, `ppo_clip` on the per-step log-probs + beta * flow KL to
the LoRA-disabled model, AdamW with gradient accumulation, EMA of the LoRA weights -> log ->
checkpoint -> eval (ODE, EMA weights, fixed seed, contact sheet). `model.family = "janus"` trains
Janus-Pro image tokens instead (families.py: what differs between the two). See README.md for
the VRL knob mapping and the presets reproducing Flow-GRPO and VRL (examples/diffusion-grpo/).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from families import FAMILIES, Family, whole_weights
from grpo_config import DEFAULT_CONFIG, ENV, Config, check_config, read_prompts
from grpo_parts import (
    BrightnessScorer,
    LoraEMA,
    LoraState,
    contact_sheet,
    image_stats,
    to_pil,
    trainable,
)
from grpo_plan import plan_micro_batches
from grpo_reward import build_scorer, grpo_scores, means, reward_spec, score_images
from peft import PeftModel
from PIL import Image

from rl_core.train import (
    Checkpoint,
    GroupAdvantages,
    Recipe,
    RunContext,
    Schedule,
    Scores,
    run,
    run_app,
    sample_seed,
    sharded_state,
)
from rl_data import GroupSampler, OCRPrompt
from rl_models import tiny
from rl_models.lora import export_lora
from rl_rewards import SCORERS, Scorer, register_scorer
from rl_rollout import ImageSamples

if "brightness" not in SCORERS:  # the app module is imported once per process, tests included
    register_scorer("brightness", BrightnessScorer)


@dataclass
class State:
    cfg: Config
    run: RunContext
    family: Family  # the engine and the LoRA model it samples from; the optimizer
    ema: LoraEMA  # also counts the optimizer steps (the weights' version)
    reward: Scorer  # composed in process, or a RemoteScorer
    prompts: list[OCRPrompt]
    eval_prompts: list[OCRPrompt]
    sampler: GroupSampler


@dataclass(frozen=True)
class Batch:
    """One step's rollouts on this process, in sampled batches of `rollout.sample_batch_size`."""

    samples: Sequence[ImageSamples]  # sd3: `Trajectory`, janus: `ImageRollout`
    records: list[OCRPrompt]  # one per image, in sample order
    group_ids: torch.Tensor  # [N] global group index
    images: list[Image.Image]
    version: int  # optimizer steps in the weights that sampled them


class DiffusionGRPO(Recipe[Config, State, Batch]):
    name, config, default_config, env = "diffusion-grpo", Config, DEFAULT_CONFIG, ENV
    # the LoRA init is the same on every process (FSDP2 shards each process's own copy; DDP would
    # broadcast rank 0's); sampling noise is seeded per sample
    seed_by_rank = False

    def check(self, cfg: Config, world_size: int) -> None:
        check_config(cfg, world_size)
        reward_spec(cfg.reward, tiny=cfg.model.path.startswith("tiny:"))  # a bad spec file stops here

    def setup(self, cfg: Config, run: RunContext) -> State:
        prompts = read_prompts(cfg.data.manifest, "data.manifest")  # empty or bad data stops before any model loads
        eval_prompts = read_prompts(cfg.data.eval_manifest, "data.eval_manifest")[: cfg.eval.max_prompts]
        family = FAMILIES[cfg.model.family](cfg, run.accelerator, str(tiny.resolve(cfg.model.path)))
        t = cfg.train
        sampler = GroupSampler(len(prompts), cfg.rollout.n, seed=t.seed, rank=run.rank, world_size=run.world_size)
        ema = LoraEMA(trainable(family.peft), decay=t.ema_decay, interval=t.ema_interval)
        reward = build_scorer(cfg.reward, tiny=cfg.model.path.startswith("tiny:"))
        return State(cfg, run, family, ema, reward, prompts, eval_prompts, sampler)

    def start(self, state: State) -> None:
        state.family.start()  # Ray rollout workers, once the starting weights are in place

    def schedule(self, state: State) -> Schedule:
        every = state.cfg.eval.every
        return Schedule(state.cfg.train.epochs, eval_every=every, eval_at_start=every > 0, eval_at_end=every > 0)

    def checkpoint(self, state: State) -> Checkpoint:
        """An unsharded LoRA is saved without the accelerator (`save_state` would write the whole
        transformer, GBs): the LoRA, optimizer, EMA and sampler are all the state there is. A
        sharded one saves its LoRA and optimizer shards on every process (DCP, frozen base left
        out). The PEFT `lora/` and `lora_ema/` are written from whole weights inside it."""
        f, kept = state.family, {"ema": state.ema, "sampler": state.sampler}
        sharded = f.full is not None
        saved = {**kept, **sharded_state(f.peft, f.optimizer, trainable_only=True)} if sharded else {
            "lora": LoraState(f.peft), "optimizer": f.optimizer, **kept}
        whole = cast(PeftModel, f.full.model) if f.full is not None else f.peft  # filled inside `gather`
        return Checkpoint(state=saved, trained=f.peft, accelerator=sharded, gather=whole_weights(f),
                          write_files=lambda folder: export_adapters(whole, state.ema, folder))

    def rollout(self, state: State, step: int) -> Batch:
        """n copies of each of this process's prompts, one seed per sample: a sample's seed depends
        on its group's place in the epoch's prompt order (group g of rank r is the (g * world +
        r)-th prompt) and its index in the group, not on the process count."""
        cfg, run, epoch = state.cfg, state.run, step - 1
        n, groups, world = cfg.rollout.n, cfg.rollout.groups_per_epoch // run.world_size, run.world_size
        records = [state.prompts[next(iter(state.sampler))] for _ in range(groups * n)]
        seeds = [sample_seed(cfg.train.seed, epoch, ((i // n) * world + run.rank) * n + i % n) for i in range(len(records))]
        state.family.model.eval()
        samples = state.family.collect(records, seeds, state.ema.steps)
        images = [image for s in samples for image in to_pil(s.images)]
        return Batch(samples, records, torch.arange(len(records)) // n + run.rank * groups, images, state.ema.steps)

    def score(self, state: State, step: int, batch: Batch) -> Scores:
        run = state.run
        files = run.run_dir / "rollouts" / f"step_{step}" / f"rank_{run.rank}" if state.cfg.reward.url else None
        rewards, parts = score_images(state.reward, batch.images, batch.records, files=files)
        stats = {key: [value] for key, value in image_stats(batch.images).items()}  # equal image counts per process
        metrics = means({**parts, **stats}, run.accelerator)  # over every process
        return grpo_scores(state.cfg.train, run.accelerator, rewards, batch.group_ids,
                           [r.prompt for r in batch.records], metrics)

    def update(self, state: State, step: int, batch: Batch, advantages: GroupAdvantages) -> dict[str, float]:
        run, adv = state.run, advantages.advantages  # [N]
        acc, f = run.accelerator, state.family
        metrics = {"rollout/weight_version": batch.version, **(f.full.pop_metrics() if f.full else {})}
        kept = acc.reduce(torch.tensor(float((adv != 0).sum()), device=acc.device), reduction="sum").item()
        if not kept:  # a step where every group has equal rewards carries no signal: no update
            return metrics
        plan = plan_micro_batches(state.cfg.train, acc, [len(s.prompts) for s in batch.samples], adv, step - 1)
        metrics |= f.update(batch.samples, adv, plan, what=f"step {step}", guard=run.guard, after_step=state.ema.step)
        trained = sum(len(rows) * weight for micro_batches in plan for _, rows, weight in micro_batches)
        metrics["adv/trained_samples"] = acc.reduce(torch.tensor(float(trained), device=acc.device), reduction="sum").item()
        return metrics

    def evaluate(self, state: State, step: int) -> dict[str, float]:
        """Fixed prompts and seeds, EMA weights (`eval.use_ema`), on the main process; writes
        `eval_epoch_<step>/` (images and the contact sheet with each prompt and reward)."""
        e, out = state.cfg.eval, state.run.run_dir / f"eval_epoch_{step}"
        with whole_weights(state.family) as model:  # every process: a sharded policy gathers
            if not state.run.is_main:
                return {}
            images, records = [], state.eval_prompts
            with state.ema.swapped(model) if e.use_ema else nullcontext():
                for start in range(0, len(records), e.batch_size):
                    chunk = records[start:start + e.batch_size]
                    seeds = [e.seed + start + i for i in range(len(chunk))]
                    images += to_pil(state.family.eval_images([r.prompt for r in chunk], seeds))
        files = out / "images" if state.cfg.reward.url else None
        rewards, parts = score_images(state.reward, images, records, files=files)
        for i, image in enumerate(images):
            (out / "images").mkdir(parents=True, exist_ok=True)
            image.save(out / "images" / f"{i:03d}.png")
        contact_sheet(images, [f"{r.prompt} | reward {v:.3f}" for r, v in zip(records, rewards.tolist(), strict=True)],
                      out / "contact_sheet.png")
        ok = rewards[torch.isfinite(rewards)]  # [V]
        return {"reward/mean": ok.mean().item() if ok.numel() else float("nan"),
                "reward/failed": float((~torch.isfinite(rewards)).sum()), **means(parts), **image_stats(images)}

    def finish(self, state: State) -> dict[str, str]:
        out, f = state.run.run_dir / "checkpoint-final", state.family
        with whole_weights(f) as model:
            if state.run.is_main:
                export_adapters(model, state.ema, out)
        # Drop the DDP wrapper while the process group is still registered: if its Reducer held the
        # group's last reference after end_training(), the gloo group's destructor would join its
        # worker threads holding the GIL, and a worker still freeing a finished collective's Python
        # tensors waits for the GIL: a deadlock seen once in the 2-process test (torch 2.13, gloo)
        f.model = f.peft
        state.run.accelerator.free_memory()  # the accelerator's own reference to the wrapper
        return {"adapters": f"{out / 'lora'}, {out / 'lora_ema'}"}

    def close(self, state: State) -> None:
        state.family.close()


def export_adapters(model: PeftModel, ema: LoraEMA, out: Path) -> None:
    """`model`'s LoRA in PEFT format (`lora/`) and its EMA (`lora_ema/`); `model` holds whole
    weights (`families.whole_weights`)."""
    export_lora(model, out / "lora")
    with ema.swapped(model):
        export_lora(model, out / "lora_ema")


RECIPE = DiffusionGRPO()


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(run_app(RECIPE.name, main))
