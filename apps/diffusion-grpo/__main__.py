"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe, `experiment/diffusion/sd3_5/online_grpo_ocr`).

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/vrl.toml        # or flow_grpo.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU
    uv run apps/diffusion-grpo --resume                              # continue the latest run
    uv run apps/diffusion-grpo --help                                # every key and its default

One epoch: sample `rollout.groups_per_epoch` prompts x `rollout.n` images with the SDE sampler
(`rl_rollout.diffusion`, keeping latents and per-step log-probs) -> reward (in process or a
reward server) -> GRPO advantages (global std, clip 5; zero-advantage samples dropped, or refilled
as Flow-GRPO does) -> replay the stored steps through the current model (CFG recomputed, unconditional branch detached) ->
`ppo_clip` on the per-step log-probs + beta * flow KL to the LoRA-disabled model -> AdamW with
gradient accumulation -> EMA of the LoRA weights -> log -> checkpoint -> eval (ODE, EMA weights,
fixed seed, contact sheet). See README.md next to this file for the VRL knob mapping and the
presets reproducing Flow-GRPO and VRL (examples/diffusion-grpo/flow_grpo.toml, vrl.toml).
`model.family = "janus"` trains Janus-Pro image tokens on the same loop instead: its rollout and
update phases are janus_phases.py (configs/janus_tiny.toml, examples/diffusion-grpo/janus_pro_*.toml).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import janus_phases
import torch
from accelerate import Accelerator
from grpo_config import DEFAULT_CONFIG, Config, RewardConfig, parse_config
from grpo_parts import (
    BrightnessScorer,
    LoraEMA,
    image_stats,
    plot_reward_curve,
    to_pil,
    trainable,
)
from grpo_phases import (
    build_reward_scorer,
    evaluate,
    export_adapters,
    load,
    prompt_group_ids,
    save,
    score,
)
from grpo_plan import plan_micro_batches, trained_steps
from grpo_run import Batch, Run, epoch_samples, read_prompts
from grpo_sharding import gather_metrics, prepare_transformer, whole_weights
from ray_rollout import Chunk, sample_chunk, start_workers

from rl_core.flow import flow_kl
from rl_core.losses import compute_policy_loss
from rl_core.train import (
    FullWeights,
    MetricsLogger,
    NonFiniteGuard,
    ReplayCheck,
    TrainProgress,
    UpdateStats,
    UserError,
    accelerator_kwargs,
    end_training,
    gather_rows,
    group_advantages,
    make_run_dir,
    optimizer_step,
    resolve_resume,
    run_app,
    seed_everything,
)
from rl_data import GroupSampler
from rl_models import tiny
from rl_models.lora import add_lora
from rl_rewards import SCORERS, register_scorer
from rl_rollout.diffusion import DiffusionEngine
from rl_rollout.janus import JanusEngine

__all__ = ["DEFAULT_CONFIG", "Config", "RewardConfig", "build_reward_scorer", "main", "train"]  # tests use these too
if "brightness" not in SCORERS:  # the app module is imported once per process, tests included
    register_scorer("brightness", BrightnessScorer)


# ------------------------------------------------------------------------------------- setup


def setup(cfg: Config, resume: str | None) -> Run:
    t = cfg.train
    # cpu=True without CUDA: `accelerate launch --multi_gpu --num_processes N` then gives N gloo
    # processes on a CPU machine (its `--cpu` flag alone starts one process unless MPI is set up)
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=list(t.log_with) or None,
                      **accelerator_kwargs(sharding=t.sharding, cpu_offload=t.fsdp_cpu_offload))
    if cfg.rollout.groups_per_epoch % acc.num_processes:
        raise UserError(f"rollout.groups_per_epoch={cfg.rollout.groups_per_epoch} must divide by "
                         f"the {acc.num_processes} processes")
    images = cfg.rollout.groups_per_epoch // acc.num_processes * cfg.rollout.n  # per process
    if t.zero_adv == "flow_grpo" and (images % t.micro_batch_size or images // t.micro_batch_size % t.gradient_accumulation_steps):
        raise UserError(f"train.zero_adv='flow_grpo' trains equal batches: the {images} images per process must "
                        f"divide into batches of train.micro_batch_size={t.micro_batch_size}, and their number into "
                        f"optimizer steps of train.gradient_accumulation_steps={t.gradient_accumulation_steps}")
    ckpt = resolve_resume(resume, t.output_dir)
    run_dir = make_run_dir(t.output_dir, ckpt.parent.parent.name if ckpt else t.run_name,
                           config=cfg, accelerator=acc)
    # the LoRA init, the same on every process: FSDP2 shards each process's own copy (DDP would
    # broadcast rank 0's); sampling noise is seeded per sample
    seed_everything(t.seed)
    m = cfg.model
    path = tiny.resolve(m.path)
    wrapped: torch.nn.Module
    engine: DiffusionEngine | JanusEngine
    if m.family == "janus":
        engine, peft, wrapped = janus_phases.build(cfg, path, acc.device)
    else:
        # model.compile: blocks compiled for sampling and replay (first replay |log ratio| ~4e-4 in bf16)
        sd3 = DiffusionEngine.from_pretrained(path, dtype=m.dtype, device=acc.device,
                                              text_encoder_dtype=m.text_encoder_dtype, compile=m.compile)
        sd3.pipeline.transformer.requires_grad_(False)
        wrapped = peft = add_lora(sd3.pipeline.transformer, family="sd3", r=m.lora_rank, alpha=m.lora_alpha,
                                  target_modules=m.lora_targets)
        engine = sd3
    optimizer = torch.optim.AdamW(trainable(peft).values(), lr=t.lr, weight_decay=t.weight_decay)
    if m.family == "janus":
        if t.sharding != "none":
            raise UserError(f"train.sharding={t.sharding!r} shards the SD3 transformer; model.family='janus' "
                            "trains with DDP (FSDP2 for Janus is not done): set train.sharding='none'")
        model, optimizer = acc.prepare(wrapped, optimizer)
        full: FullWeights | None = None
    else:
        assert isinstance(engine, DiffusionEngine)
        model, optimizer, full = prepare_transformer(acc, t, engine, peft, optimizer)  # DDP, or FSDP2 (grpo_sharding.py)
    prompts = read_prompts(cfg.data.manifest, "data.manifest")
    eval_prompts = read_prompts(cfg.data.eval_manifest, "data.eval_manifest")[: cfg.eval.max_prompts]
    sampler = GroupSampler(len(prompts), cfg.rollout.n, seed=t.seed, rank=acc.process_index,
                           world_size=acc.num_processes)
    run = Run(cfg, acc, run_dir, engine, model, peft, optimizer,
              LoraEMA(trainable(peft), decay=t.ema_decay, interval=t.ema_interval),
              build_reward_scorer(cfg.reward, tiny_clip=m.path.startswith("tiny:")), prompts, eval_prompts, sampler, start_epoch=0,
              guard=NonFiniteGuard(t.max_nonfinite_steps), full=full)
    if ckpt is not None:
        meta = load(run, ckpt)
        run.start_epoch, run.optimizer_steps = meta["step"], meta["optimizer_steps"]
        acc.print(f"resumed from {ckpt} at epoch {run.start_epoch}")
    if cfg.rollout.workers:
        run.workers = start_workers(cfg.rollout, m, str(path), acc)
    if t.log_with:
        acc.init_trackers("diffusion-grpo")
    return run


# ------------------------------------------------------------------------------- collect


def collect(run: Run, epoch: int) -> Batch:
    if run.cfg.model.family == "janus":
        return janus_phases.collect(run, epoch)
    cfg, acc = run.cfg, run.acc
    s, size = cfg.sampling, cfg.rollout.sample_batch_size
    records, seeds, group_ids = epoch_samples(run, epoch)
    chunks = [Chunk(tuple(r.prompt for r in records[start:start + size]), tuple(seeds[start:start + size]))
              for start in range(0, len(records), size)]
    kwargs: dict[str, Any] = {"num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "height": s.resolution,
              "width": s.resolution, "noise_level": s.noise_level, "kind": s.kind,
              "sde_window": tuple(s.sde_window) if s.sde_window else None, "max_sequence_length": s.max_sequence_length}
    with whole_weights(run):  # a sharded policy's weights gathered into the engine's copy
        if run.workers is None:
            trajectories = [sample_chunk(run.engine, chunk, **kwargs) for chunk in chunks]
        else:  # the workers' LoRA is synced to this version first, and each trajectory checked against it
            trajectories = run.workers.collect(chunks, version=run.optimizer_steps, transformer=run.engine.transformer,
                                               device=acc.device, **kwargs)
    return Batch(trajectories, records, group_ids)


# ------------------------------------------------------------------------------ advantages


def advantages(run: Run, rewards: torch.Tensor, group_ids: torch.Tensor,
               prompts: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages `[N]` of this process's samples over every process's groups
    (`rl_core.train.group_advantages`: failed samples and groups left with one sample get 0 and
    are counted), normalised as `train.adv_*` say. `train.adv_group_by = "prompt"` groups by the
    prompt text instead of `group_ids` (Flow-GRPO)."""
    t = run.cfg.train
    if t.adv_group_by == "prompt":
        group_ids = prompt_group_ids(prompts, run.acc)
    options = {"scale": t.adv_scale, "eps": t.adv_eps, "clip": t.adv_clip, "std": t.adv_std, "eps_mode": t.adv_eps_mode}
    out = group_advantages("grpo", rewards, group_ids, accelerator=run.acc, options=options)
    everything, _ = gather_rows(rewards, run.acc)  # [N * world]
    groups, _ = gather_rows(group_ids, run.acc)  # [N * world]
    stds = [everything[(groups == g) & torch.isfinite(everything)].std().item() for g in groups.unique()
            if ((groups == g) & torch.isfinite(everything)).sum() > 1]
    return out.advantages, {**out.metrics, "reward/zero_std_group_fraction": sum(s == 0 for s in stds) / max(len(stds), 1)}


# ----------------------------------------------------------------------------------- train


def train_epoch(run: Run, batch: Batch, adv: torch.Tensor, epoch: int) -> dict[str, float]:
    """`gradient_accumulation_steps` micro-batches per optimizer step (`rl_core.train.optimizer_step`):
    each (micro-batch, trained timestep) pair is one forward/backward, and every (sample,
    timestep) weighs the same in the step, whatever the micro-batch split or process count.
    The janus family trains image tokens instead (`janus_phases.train_epoch`)."""
    if run.cfg.model.family == "janus":
        return janus_phases.train_epoch(run, batch, adv, epoch)
    acc, t = run.acc, run.cfg.train
    sizes = [len(traj.prompts) for traj in batch.trajectories]
    plan = plan_micro_batches(run, sizes, adv, epoch)
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    steps = trained_steps(batch.trajectories[0], t.timestep_fraction)
    stats, check = UpdateStats(), ReplayCheck()

    def loss_fn(micro: tuple[int, torch.Tensor, float, int], num_valid: torch.Tensor) -> tuple[torch.Tensor, dict]:
        k, rows, weight, step = micro
        traj, row_adv = batch.trajectories[k], adv[offsets[k] + rows].to(acc.device)  # [b]
        out = run.engine.replay(traj, step, rows=rows, model=run.model)
        old = traj.log_probs[rows, step]  # [b]
        if stats.steps == 0 and weight:  # on-policy: nothing was updated since this epoch's rollout
            check.add(out.log_prob.detach(), old)
        policy, metrics = compute_policy_loss(
            "ppo_clip", logp=out.log_prob[:, None], old_logp=old[:, None], advantages=row_adv[:, None],
            mask=torch.ones_like(old)[:, None], clip_low=t.clip_range, clip_high=t.clip_range, num_valid=num_valid)
        kl = torch.zeros((), device=acc.device)
        if t.kl_beta > 0:
            with torch.no_grad(), run.peft.disable_adapter():
                ref = run.engine.replay(traj, step, rows=rows, model=run.peft)
            kl = flow_kl(out.mean, ref.mean, out.std).sum() / num_valid
        loss = (policy + t.kl_beta * kl) * weight
        return loss, {"loss/total": float(loss.detach()), "loss/policy": float(policy.detach()),
                      "loss/kl": float(kl.detach()), **{f"policy/{n}": float(v) for n, v in metrics.items()}}

    def first_check() -> None:
        if stats.steps == 0:
            metrics = check.verify(acc, t.ratio_tolerance, f"epoch {epoch}: first replay, |log ratio| vs "
                                   "train.ratio_tolerance (dropout on? a different step function or dtype? bf16 with "
                                   "micro_batch_size != sample_batch_size needs a looser tolerance)")
            run.first_ratio = metrics["replay/engine_diff_max"]

    run.model.train()
    filler = (0, torch.tensor([0]), 0.0, steps[0])  # for a process with no image in a step
    for micro_batches in plan:
        window = [(k, rows, weight, step) for k, rows, weight in micro_batches for step in steps]
        stepped = optimizer_step(acc, run.model, run.optimizer, window, loss_fn,
                                 units=lambda m: float(len(m[1])) * m[2], grad_clip=t.max_grad_norm,
                                 guard=run.guard, stats=stats, before_step=first_check, filler=filler).stepped
        if stepped:
            run.optimizer_steps += 1
            run.ema.step(run.optimizer_steps)
    trained = sum(len(rows) * weight for micro_batches in plan for _, rows, weight in micro_batches)
    total = acc.reduce(torch.tensor(float(trained), device=acc.device), reduction="sum").item()
    return {**stats.reduce(acc), "adv/trained_samples": total}


# ------------------------------------------------------------------------------------ loop


def train(cfg: Config, resume: str | None = None) -> Path:
    """Run the recipe; returns the run directory."""
    run = setup(cfg, resume)
    try:
        return run_epochs(run)
    finally:
        if run.workers is not None:
            run.workers.close()


def run_epochs(run: Run) -> Path:
    cfg, acc, t = run.cfg, run.acc, run.cfg.train
    logger = MetricsLogger(run.run_dir, accelerator=acc, start_step=run.start_epoch)
    # evals are logged at the epoch they precede: a resumed run re-evaluates its start epoch
    if acc.is_main_process:  # evals run on the main process only
        run.eval_log = MetricsLogger(run.run_dir, filename="eval_metrics.csv", start_step=run.start_epoch - 1)
    with TrainProgress(t.epochs, initial=run.start_epoch, accelerator=acc) as bar:
        for epoch in range(run.start_epoch, t.epochs):
            if cfg.eval.every and epoch % cfg.eval.every == 0:
                with run.timer("eval"), whole_weights(run) as model:  # every process: a sharded policy gathers
                    if acc.is_main_process:  # evals run on the main process only
                        logger.log(epoch, {f"eval/{k}": v for k, v in evaluate(run, model, epoch).items()})
            acc.wait_for_everyone()
            metrics = one_epoch(run, epoch)
            logger.log(epoch + 1, metrics)
            bar.update(epoch + 1, metrics)
            if (epoch + 1) % t.save_freq == 0 or epoch + 1 == t.epochs:
                with run.timer("checkpoint"):
                    save(run, epoch + 1)
    with whole_weights(run) as model:
        if cfg.eval.every and acc.is_main_process:
            evaluate(run, model, t.epochs)
        if acc.is_main_process:
            export_adapters(run, model, run.run_dir / "checkpoint-final")
            plot_reward_curve(run.run_dir)
    acc.wait_for_everyone()
    # Drop the DDP wrapper while the process group is still registered: if its Reducer held the
    # group's last reference after end_training(), the gloo group's destructor would join its
    # worker threads holding the GIL, and a worker still freeing a finished collective's Python
    # tensors waits for the GIL: a deadlock seen once in the 2-process test (torch 2.13, gloo)
    run.model = run.peft
    acc.free_memory()  # the accelerator's own reference to the wrapper
    end_training(acc)
    return run.run_dir


def one_epoch(run: Run, epoch: int) -> dict[str, float]:
    run.model.eval()
    run.first_ratio, version = math.nan, run.optimizer_steps  # the weights this epoch samples with
    with run.timer("rollout"):
        batch = collect(run, epoch)
    images = [image for traj in batch.trajectories for image in to_pil(traj.images)]
    with run.timer("reward"):
        rewards, parts = score(run, images, batch.records, run.run_dir / "rollouts" / f"epoch_{epoch}")
    adv, metrics = advantages(run, rewards, batch.group_ids, [r.prompt for r in batch.records])
    kept = run.acc.gather(torch.tensor([int((adv != 0).sum())], device=run.acc.device)).sum().item()
    train_metrics: dict[str, float] = {}
    if kept:  # an epoch where every group has equal rewards carries no signal: skip the update
        with run.timer("train"):
            train_metrics = train_epoch(run, batch, adv, epoch)
    times = run.timer.pop()
    num_images = len(images) * run.acc.num_processes
    return {**metrics, **parts, **train_metrics, **times, **gather_metrics(run), "optimizer_steps": run.optimizer_steps,
            "diag/first_replay_max_abs_log_ratio": run.first_ratio,
            "images_per_s": num_images / times["time/rollout"], "epoch": epoch, "world_size": run.acc.num_processes,
            "rollout/weight_version": version,
            **image_stats(images)}


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_config(sys.argv[1:] if argv is None else argv)
    if parsed is None:
        return None
    run_dir = train(*parsed)
    print(f"run directory: {run_dir}")
    return run_dir


if __name__ == "__main__":
    sys.exit(run_app("diffusion-grpo", main))
