"""diffusion-grpo's reward, checkpoint and eval phases: the weighted reward (in process or a reward
server), scoring a batch of images, and the fixed-seed ODE eval with its contact sheet."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import janus_phases
import torch
from accelerate.utils import gather_object
from grpo_config import RewardConfig
from grpo_parts import LoraState, contact_sheet, image_stats, plot_reward_curve, to_pil
from grpo_sharding import whole_weights
from peft import PeftModel

from rl_core.advantages import group_ids_from_keys
from rl_core.train import (
    UserError,
    check_finite_parameters,
    load_checkpoint,
    save_checkpoint,
    sharded_state,
)
from rl_data import OCRPrompt
from rl_models import tiny
from rl_models.lora import export_lora
from rl_rewards import Component, RewardSpec, Sample, build_reward
from rl_rewards.client import RemoteScorer


def build_reward_scorer(cfg: RewardConfig, *, tiny_clip: bool = False) -> Any:
    """The weighted sum of `cfg.components`. `clip_score`/`aesthetic` without a `model` option get
    CLIP ViT-L/14 (the LAION aesthetic head's backbone), or the tiny CLIP with a tiny SD3."""
    if cfg.url is not None:
        return RemoteScorer(cfg.url, cfg.server_reward)
    clip = str(tiny.build("clip")) if tiny_clip else "openai/clip-vit-large-patch14"
    components = {name: Component(scorer=name, weight=w, options=(
        {"model": clip} if name in ("clip_score", "aesthetic") else {}) | cfg.kwargs.get(name, {}))
        for name, w in cfg.components.items() if w != 0}
    if not components:
        raise UserError(f"reward.components {cfg.components} has no non-zero weight")
    return build_reward(RewardSpec(components=components))


def score(run: Any, images: list, records: list[OCRPrompt], image_dir: Path) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards `[N]` (NaN where scoring failed) and mean per component (local scores)."""
    metadata = [{"image": image} for image in images]
    if run.cfg.reward.url is not None:  # a server reads files, not PIL objects
        image_dir.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(images):
            image.save(image_dir / f"{run.acc.process_index}_{i}.png")
            metadata[i] = {"image": str(image_dir / f"{run.acc.process_index}_{i}.png")}
    samples = [Sample(completion="", prompt=r.prompt, reference=r.target, metadata=md)
               for r, md in zip(records, metadata, strict=True)]
    results = run.reward.score(samples)
    rewards = torch.tensor([math.nan if r.score is None else r.score for r in results])  # [N]
    parts: dict[str, list[float]] = {}
    for r in results:
        for key, value in r.components.items():
            parts.setdefault(key, []).append(value)
    return rewards, {f"reward/{k}": sum(v) / len(v) for k, v in parts.items()}


@torch.no_grad()
def evaluate(run: Any, model: torch.nn.Module, epoch: int) -> dict[str, float]:
    """Fixed prompts, deterministic ODE sampling (janus: token sampling at fixed seeds), fixed
    seed, EMA weights (main process), from `model`, the PeftModel the engine samples from
    (`grpo_sharding.whole_weights`)."""
    cfg, e = run.cfg, run.cfg.eval
    out_dir = run.run_dir / f"eval_epoch_{epoch}"
    images, records = [], run.eval_prompts
    with run.ema.swapped(model) if e.use_ema else nullcontext():
        for start in range(0, len(records), e.batch_size):
            chunk = records[start:start + e.batch_size]
            prompts, seeds = [r.prompt for r in chunk], [e.seed + start + i for i in range(len(chunk))]
            if cfg.model.family == "janus":
                pixels = janus_phases.sample_images(run, prompts, seeds)
            else:
                pixels = run.engine.sample(
                    prompts, num_steps=e.num_steps, guidance_scale=e.guidance_scale,
                    height=cfg.sampling.resolution, width=cfg.sampling.resolution, kind="ode", seeds=seeds,
                    max_sequence_length=cfg.sampling.max_sequence_length).images
            images += to_pil(pixels)
    rewards, parts = score(run, images, records, out_dir / "images")
    for i, image in enumerate(images):
        (out_dir / "images").mkdir(parents=True, exist_ok=True)
        image.save(out_dir / "images" / f"{i:03d}.png")
    captions = [f"{r.prompt} | reward {v:.3f}" for r, v in zip(records, rewards.tolist(), strict=True)]
    contact_sheet(images, captions, out_dir / "contact_sheet.png")
    ok = rewards[torch.isfinite(rewards)]
    metrics = {"reward/mean": ok.mean().item() if ok.numel() else math.nan, **parts,
               "reward/failed": int((~torch.isfinite(rewards)).sum()), **image_stats(images)}
    if run.eval_log is not None:
        run.eval_log.log(epoch, {"epoch": epoch, **metrics})
    plot_reward_curve(run.run_dir)
    return metrics


def prompt_group_ids(prompts: list[str], acc: Any) -> torch.Tensor:
    """Group ids `[N]` of this process's samples, equal for equal prompt text on every process:
    the prompts of all processes are gathered and numbered together (`group_ids_from_keys`)."""
    parts = gather_object([prompts])  # one list per process, in rank order
    start = sum(len(part) for part in parts[: acc.process_index])
    return group_ids_from_keys([p for part in parts for p in part])[start:start + len(prompts)]


def checkpoint_state(run: Any) -> dict[str, Any]:
    # Without the accelerator for an unsharded policy: `accelerator.save_state` would write the
    # whole transformer (GBs); the LoRA, optimizer, EMA and sampler are all the state there is. A
    # sharded one saves its LoRA and optimizer shards on every process (DCP, frozen base left out).
    state = {"ema": run.ema, "sampler": run.sampler, "optimizer_steps": run.optimizer_steps}
    if run.full is None:
        return {"lora": LoraState(run.peft), "optimizer": run.optimizer, **state}
    return {**state, **sharded_state(run.peft, run.optimizer, trainable_only=True)}


def save(run: Any, epoch: int) -> Path:
    """Trainer state (`checkpoint-<epoch>`, resumable) + the LoRA in PEFT format, raw and EMA
    (written from whole weights: a sharded policy's are gathered on every process)."""
    root = run.run_dir / "checkpoints"
    ckpt = root / f"checkpoint-{epoch}"
    check_finite_parameters(run.peft, f"checkpoint at epoch {epoch}")
    sharded = run.full is not None
    with whole_weights(run) as model:
        if sharded or run.acc.is_main_process:  # the adapters are written before the checkpoint is published
            ckpt = save_checkpoint(root, epoch, state=checkpoint_state(run), keep_last=run.cfg.train.keep_last,
                                   accelerator=run.acc if sharded else None,
                                   write_files=lambda folder: export_adapters(run, model, folder))
    run.acc.wait_for_everyone()
    return ckpt


def load(run: Any, ckpt: Path) -> dict[str, Any]:
    """Restore what `save` wrote, on every process; returns its metadata."""
    return load_checkpoint(ckpt, state=checkpoint_state(run), accelerator=run.acc if run.full is not None else None)


def export_adapters(run: Any, model: PeftModel, out: Path) -> None:
    """`model`'s LoRA in PEFT format (`lora/`) and its EMA (`lora_ema/`); `model` holds whole
    weights (`grpo_sharding.whole_weights`)."""
    export_lora(model, out / "lora")
    with run.ema.swapped(model):
        export_lora(model, out / "lora_ema")
