"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe, `experiment/diffusion/sd3_5/online_grpo_ocr`).

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/sd3_5_ocr.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU
    uv run apps/diffusion-grpo --resume                              # continue the latest run
    uv run apps/diffusion-grpo --help                                # every key and its default

One epoch: sample `rollout.groups_per_epoch` prompts x `rollout.n` images with the SDE sampler
(`rl_rollout.diffusion`, keeping latents and per-step log-probs) -> reward (in process or a
reward server) -> GRPO advantages (global std, clip 5; zero-advantage samples dropped) -> replay
the stored steps through the current model (CFG recomputed, unconditional branch detached) ->
`ppo_clip` on the per-step log-probs + beta * flow KL to the LoRA-disabled model -> AdamW with
gradient accumulation -> EMA of the LoRA weights -> log -> checkpoint -> eval (ODE, EMA weights,
fixed seed, contact sheet). See README.md next to this file for the VRL knob mapping.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch
from accelerate import Accelerator
from grpo_parts import (
    BrightnessScorer,
    LoraEMA,
    LoraState,
    append_csv,
    contact_sheet,
    image_stats,
    plot_reward_curve,
    to_pil,
    trainable,
)
from peft import PeftModel
from ray_rollout import Chunk, RayRollout, sample_chunk, start_workers

from rl_core.flow import flow_kl
from rl_core.losses import compute_policy_loss
from rl_core.train import (
    ConfigError,
    MetricsLogger,
    NonFiniteGuard,
    NonNegative,
    NonNegativeFloat,
    PhaseTimer,
    Positive,
    PositiveFloat,
    ReplayCheck,
    TrainProgress,
    UnitInterval,
    UpdateStats,
    UserError,
    check_finite_parameters,
    config_help,
    gather_rows,
    group_advantages,
    load_checkpoint,
    load_config,
    make_run_dir,
    optimizer_step,
    parse_cli,
    resolve_resume,
    run_app,
    sample_seed,
    save_checkpoint,
    seed_everything,
)
from rl_data import GroupSampler, OCRPrompt, read_ocr_prompts
from rl_models import tiny
from rl_models.lora import add_lora, export_lora
from rl_rewards import SCORERS, Component, RewardSpec, Sample, build_reward, register_scorer
from rl_rewards.client import RemoteScorer
from rl_rollout.diffusion import DiffusionEngine, Trajectory

APP = Path(__file__).resolve().parent
REPO = APP.parents[1]
DEFAULT_CONFIG = APP / "configs" / "default.toml"
if "brightness" not in SCORERS:  # the app module is imported once per process, tests included
    register_scorer("brightness", BrightnessScorer)


# ----------------------------------------------------------------------------------- config


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "stabilityai/stable-diffusion-3.5-medium"
    """diffusers SD3/SD3.5 folder or hub id; `tiny:sd3` builds a tiny random pipeline."""
    dtype: str = "bfloat16"  # transformer + VAE weights; step maths is always float32
    text_encoder_dtype: str | None = None  # None = dtype
    lora_rank: Positive = 32
    lora_alpha: float = 64
    lora_targets: list[str] | None = None  # None = rl_models' sd3 default (attention projections)


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    manifest: str = "examples/data/ocr/train.txt"  # OCR prompts, one per line (Flow-GRPO format)
    eval_manifest: str = "examples/data/ocr/test.txt"


class SamplingConfig(msgspec.Struct, kw_only=True, frozen=True):
    resolution: Positive = 512  # square images
    num_steps: Positive = 10  # training rollout steps
    guidance_scale: NonNegativeFloat = 4.5
    noise_level: PositiveFloat = 0.7  # SDE `a` (0.7 Flow-GRPO sde; 0.8 for cps)
    kind: Literal["sde", "cps"] = "sde"
    sde_window: list[int] | None = None
    """[start, stop): stochastic steps (Flow-GRPO-Fast); other steps use the ODE. None = all."""
    max_sequence_length: Positive = 128  # T5 tokens


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    n: Positive = 8  # images per prompt (group size)
    groups_per_epoch: Positive = 8  # prompts per epoch, all processes together
    sample_batch_size: Positive = 8  # images per sampling forward
    workers: NonNegative = 0
    """0 = sample in the trainer's engine; N = N Ray actors per trainer process (ray_rollout.py)."""
    placement: Literal["split", "colocated"] = "split"
    """VRL presets: `split` = actors on their own GPUs; `colocated` = on the trainer's, asleep during training."""
    gpus_per_worker: float | None = None  # None: split 1, colocated 1/workers, 0 without CUDA
    ray_address: str | None = None  # join this Ray cluster (env RAY_ADDRESS); None starts a local one


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    components: dict[str, float] = msgspec.field(default_factory=lambda: {"ocr": 1.0})
    """scorer name -> weight (weighted sum); 0 disables one: `reward.components.aesthetic=1.0`."""
    kwargs: dict[str, dict[str, Any]] = {}  # scorer name -> its build options
    url: str | None = None  # a running `rl-rewards serve`; images go as PNG paths
    server_reward: str = ""  # reward name on the server ("" = its default)


class TrainConfig(msgspec.Struct, kw_only=True, frozen=True):
    epochs: Positive = 100_000
    lr: PositiveFloat = 3e-4
    weight_decay: NonNegativeFloat = 1e-4
    max_grad_norm: PositiveFloat = 1.0
    clip_range: UnitInterval = 1e-4  # PPO ratio clip (SD3: 1e-4; log-probs are per-element means)
    kl_beta: NonNegativeFloat = 0.04  # flow KL to the LoRA-disabled model; 0 skips the reference forward
    adv_scale: Literal["batch", "group"] = "batch"  # std over the whole batch (Flow-GRPO global std)
    adv_clip: PositiveFloat = 5.0
    adv_eps: NonNegativeFloat = 1e-4
    micro_batch_size: Positive = 8  # images per replay forward (= sample_batch_size keeps ratio bit-exact)
    gradient_accumulation_steps: Positive = 4  # micro-batches per optimizer step
    timestep_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.99  # train the stochastic steps k < int(S * fraction): 9 of 10
    ema_decay: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    ema_interval: Positive = 8  # optimizer steps between EMA updates
    ratio_tolerance: NonNegativeFloat = 1e-5
    """Max |log ratio| on the first replay of an epoch; above it the run stops (rollout and replay
    disagree). Raise it for bf16 with micro_batch_size != sample_batch_size."""
    seed: int = 42
    save_freq: Positive = 60  # epochs between checkpoints (and at the end)
    keep_last: Positive = 2
    output_dir: str = "runs/diffusion-grpo"
    run_name: str | None = None
    log_with: list[str] = []  # accelerate trackers: tensorboard, wandb, ...
    max_nonfinite_steps: Positive = 3
    """Consecutive optimizer steps with a non-finite loss or gradient (each skipped: LoRA,
    optimizer and EMA untouched) after which the run stops with an error."""


class EvalConfig(msgspec.Struct, kw_only=True, frozen=True):
    every: int = 60  # epochs between evals (0 = never); also after the last epoch
    max_prompts: Positive = 16
    num_steps: Positive = 40  # deterministic ODE steps
    guidance_scale: float = 4.5
    seed: int = 20260504
    use_ema: bool = True
    batch_size: Positive = 8


class Config(msgspec.Struct, kw_only=True, frozen=True):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()


# VRL's deployment inputs stay environment variables (its README's table).
ENV = {"VRL_OUTPUT_DIR": "train.output_dir", "REWARD_URL": "reward.url", "RAY_ADDRESS": "rollout.ray_address"}


def parse_config(argv: list[str]) -> tuple[Config, str | None] | None:
    """argv -> (config, resume spec); None after printing --help. No `--config`: the tiny default."""
    cli = parse_cli(argv)
    if cli.help:
        print(config_help(Config, env=ENV, prog="diffusion-grpo", defaults=load_config(Config, DEFAULT_CONFIG),
                          defaults_from="the embedded tiny default (configs/default.toml)"))
        return None
    cfg = load_config(Config, cli.config or DEFAULT_CONFIG, cli.overrides, env=ENV)
    if cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n}: GRPO compares the images of one prompt with each other and "
                          "needs rollout.n >= 2")
    if int(cfg.sampling.num_steps * cfg.train.timestep_fraction) == 0:
        raise ConfigError(f"train.timestep_fraction={cfg.train.timestep_fraction} x sampling.num_steps="
                          f"{cfg.sampling.num_steps} trains no step (Flow-GRPO trains int(steps x fraction)); raise it")
    return cfg, cli.resume


def resolve_path(path: str) -> Path:
    """A data path as given, else relative to the repository root (examples/...)."""
    return Path(path) if Path(path).exists() else REPO / path


# ------------------------------------------------------------------------------------- setup


@dataclass
class Run:
    cfg: Config
    acc: Accelerator
    run_dir: Path
    engine: DiffusionEngine
    model: torch.nn.Module  # the peft transformer, prepared (DDP-wrapped with several processes)
    peft: PeftModel
    optimizer: torch.optim.Optimizer
    ema: LoraEMA
    reward: Any  # a rl_rewards Scorer (composed in process, or RemoteScorer)
    prompts: list[OCRPrompt]
    eval_prompts: list[OCRPrompt]
    sampler: GroupSampler
    start_epoch: int
    optimizer_steps: int = 0
    first_ratio: float = math.nan  # max |log ratio| on this epoch's first replay (diagnostic)
    workers: RayRollout | None = None  # Ray rollout actors (rollout.workers > 0)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)


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


def setup(cfg: Config, resume: str | None) -> Run:
    t = cfg.train
    # cpu=True without CUDA: `accelerate launch --multi_gpu --num_processes N` then gives N gloo
    # processes on a CPU machine (its `--cpu` flag alone starts one process unless MPI is set up)
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=list(t.log_with) or None)
    if cfg.rollout.groups_per_epoch % acc.num_processes:
        raise UserError(f"rollout.groups_per_epoch={cfg.rollout.groups_per_epoch} must divide by "
                         f"the {acc.num_processes} processes")
    ckpt = resolve_resume(resume, t.output_dir)
    run_dir = make_run_dir(t.output_dir, ckpt.parent.parent.name if ckpt else t.run_name,
                           config=cfg, accelerator=acc)
    seed_everything(t.seed, rank=acc.process_index)  # LoRA init; sampling noise is seeded per sample
    m = cfg.model
    path = tiny.build(m.path.removeprefix("tiny:")) if m.path.startswith("tiny:") else m.path
    engine = DiffusionEngine.from_pretrained(path, dtype=m.dtype, device=acc.device,
                                             text_encoder_dtype=m.text_encoder_dtype)
    engine.pipeline.transformer.requires_grad_(False)
    peft = add_lora(engine.pipeline.transformer, family="sd3", r=m.lora_rank, alpha=m.lora_alpha,
                    target_modules=m.lora_targets)
    optimizer = torch.optim.AdamW(trainable(peft).values(), lr=t.lr, weight_decay=t.weight_decay)
    model, optimizer = acc.prepare(peft, optimizer)
    prompts = list(read_ocr_prompts(resolve_path(cfg.data.manifest)))
    eval_prompts = list(read_ocr_prompts(resolve_path(cfg.data.eval_manifest)))[: cfg.eval.max_prompts]
    sampler = GroupSampler(len(prompts), cfg.rollout.n, seed=t.seed, rank=acc.process_index,
                           world_size=acc.num_processes)
    run = Run(cfg, acc, run_dir, engine, model, peft, optimizer,
              LoraEMA(trainable(peft), decay=t.ema_decay, interval=t.ema_interval),
              build_reward_scorer(cfg.reward, tiny_clip=m.path.startswith("tiny:")), prompts, eval_prompts, sampler, start_epoch=0,
              guard=NonFiniteGuard(t.max_nonfinite_steps))
    if ckpt is not None:
        meta = load_checkpoint(ckpt, state=checkpoint_state(run))
        run.start_epoch, run.optimizer_steps = meta["step"], meta["optimizer_steps"]
        acc.print(f"resumed from {ckpt} at epoch {run.start_epoch}")
    if cfg.rollout.workers:
        run.workers = start_workers(cfg.rollout, m, str(path), acc)
    if t.log_with:
        acc.init_trackers("diffusion-grpo")
    return run


def checkpoint_state(run: Run) -> dict[str, Any]:
    # Saved by the main process without the accelerator: `accelerator.save_state` would write the
    # whole transformer (GBs); the LoRA, optimizer, EMA and sampler are all the state there is.
    return {"lora": LoraState(run.peft), "optimizer": run.optimizer, "ema": run.ema,
            "sampler": run.sampler, "optimizer_steps": run.optimizer_steps}


# ------------------------------------------------------------------------------- collect


@dataclass(frozen=True)
class Batch:
    """One epoch's rollouts on this process: trajectories of `sample_batch_size` images each."""

    trajectories: list[Trajectory]
    records: list[OCRPrompt]  # one per image, in trajectory order
    group_ids: torch.Tensor  # [N] global group index


def collect(run: Run, epoch: int) -> Batch:
    cfg, acc = run.cfg, run.acc
    n, s, size = cfg.rollout.n, cfg.sampling, cfg.rollout.sample_batch_size
    groups = cfg.rollout.groups_per_epoch // acc.num_processes
    indices = [next(iter(run.sampler)) for _ in range(groups * n)]  # n copies of each prompt
    records = [run.prompts[i] for i in indices]
    # a sample's noise depends on its group's place in the epoch's prompt order (group g of rank r
    # is the (g * world + r)-th prompt) and its index in the group: not on the process count
    world, rank = acc.num_processes, acc.process_index
    seeds = [sample_seed(cfg.train.seed, epoch, ((i // n) * world + rank) * n + i % n) for i in range(len(records))]
    chunks = [Chunk(tuple(r.prompt for r in records[start:start + size]), tuple(seeds[start:start + size]))
              for start in range(0, len(records), size)]
    kwargs = {"num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "height": s.resolution,
              "width": s.resolution, "noise_level": s.noise_level, "kind": s.kind,
              "sde_window": tuple(s.sde_window) if s.sde_window else None, "max_sequence_length": s.max_sequence_length}
    if run.workers is None:
        trajectories = [sample_chunk(run.engine, chunk, **kwargs) for chunk in chunks]
    else:  # the workers' LoRA is synced to this version first, and each trajectory checked against it
        trajectories = run.workers.collect(chunks, version=run.optimizer_steps, transformer=run.engine.transformer,
                                           device=acc.device, **kwargs)
    group_ids = torch.arange(len(records)) // n + acc.process_index * groups  # [N]
    return Batch(trajectories, records, group_ids)


def score(run: Run, images: list, records: list[OCRPrompt], image_dir: Path) -> tuple[torch.Tensor, dict[str, float]]:
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


# ------------------------------------------------------------------------------ advantages


def advantages(run: Run, rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages `[N]` of this process's samples over every process's groups
    (`rl_core.train.group_advantages`: failed samples and groups left with one sample get 0 and
    are counted); Flow-GRPO's global std, eps and clip."""
    t = run.cfg.train
    out = group_advantages("grpo", rewards, group_ids, accelerator=run.acc,
                           options={"scale": t.adv_scale, "eps": t.adv_eps, "clip": t.adv_clip})
    everything, _ = gather_rows(rewards, run.acc)  # [N * world]
    groups, _ = gather_rows(group_ids, run.acc)  # [N * world]
    stds = [everything[(groups == g) & torch.isfinite(everything)].std().item() for g in groups.unique()
            if ((groups == g) & torch.isfinite(everything)).sum() > 1]
    return out.advantages, {**out.metrics, "reward/zero_std_group_fraction": sum(s == 0 for s in stds) / max(len(stds), 1)}


# ----------------------------------------------------------------------------------- train


def plan_micro_batches(run: Run, batch: Batch, adv: torch.Tensor) -> list[tuple[int, torch.Tensor, float]]:
    """(trajectory index, rows, weight) per micro-batch: the kept (non-zero advantage) rows of each
    trajectory in chunks. Every process plans the same number of micro-batches, so the optimizer
    steps line up: short processes repeat their last one with weight 0."""
    size, plan, offset = run.cfg.train.micro_batch_size, [], 0
    for k, traj in enumerate(batch.trajectories):
        rows = (adv[offset:offset + len(traj.prompts)] != 0).nonzero().flatten()  # [kept]
        plan += [(k, chunk, 1.0) for chunk in rows.split(size)]
        offset += len(traj.prompts)
    count = run.acc.gather(torch.tensor([len(plan)], device=run.acc.device)).max().item()
    filler = (plan[-1][0], plan[-1][1], 0.0) if plan else (0, torch.tensor([0]), 0.0)
    return plan + [filler] * (count - len(plan))


def trained_steps(traj: Trajectory, fraction: float) -> list[int]:
    limit = max(1, int(traj.num_steps * fraction))
    return [k for k in range(limit) if bool(traj.sde_steps[k])]


def train_epoch(run: Run, batch: Batch, adv: torch.Tensor, epoch: int) -> dict[str, float]:
    """`gradient_accumulation_steps` micro-batches per optimizer step (`rl_core.train.optimizer_step`):
    each (micro-batch, trained timestep) pair is one forward/backward, and every (sample,
    timestep) weighs the same in the step, whatever the micro-batch split or process count."""
    acc, t = run.acc, run.cfg.train
    plan = plan_micro_batches(run, batch, adv)
    offsets = [0]
    for traj in batch.trajectories:
        offsets.append(offsets[-1] + len(traj.prompts))
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
    accum = t.gradient_accumulation_steps
    for start in range(0, len(plan), accum):
        window = [(k, rows, weight, step) for k, rows, weight in plan[start:start + accum] for step in steps]
        stepped = optimizer_step(acc, run.model, run.optimizer, window, loss_fn,
                                 units=lambda m: float(len(m[1])) * m[2], grad_clip=t.max_grad_norm,
                                 guard=run.guard, stats=stats, before_step=first_check).stepped
        if stepped:
            run.optimizer_steps += 1
            run.ema.step(run.optimizer_steps)
    return stats.reduce(acc)


# ------------------------------------------------------------------------------------ eval


@torch.no_grad()
def evaluate(run: Run, epoch: int) -> dict[str, float]:
    """Fixed prompts, deterministic ODE sampling, fixed seed, EMA weights (main process)."""
    cfg, e = run.cfg, run.cfg.eval
    out_dir = run.run_dir / f"eval_epoch_{epoch}"
    images, records = [], run.eval_prompts
    with run.ema.swapped() if e.use_ema else nullcontext():
        for start in range(0, len(records), e.batch_size):
            chunk = records[start:start + e.batch_size]
            traj = run.engine.sample(
                [r.prompt for r in chunk], num_steps=e.num_steps, guidance_scale=e.guidance_scale,
                height=cfg.sampling.resolution, width=cfg.sampling.resolution, kind="ode",
                seeds=[e.seed + start + i for i in range(len(chunk))],
                max_sequence_length=cfg.sampling.max_sequence_length)
            images += to_pil(traj.images)
    rewards, parts = score(run, images, records, out_dir / "images")
    for i, image in enumerate(images):
        (out_dir / "images").mkdir(parents=True, exist_ok=True)
        image.save(out_dir / "images" / f"{i:03d}.png")
    captions = [f"{r.prompt} | reward {v:.3f}" for r, v in zip(records, rewards.tolist(), strict=True)]
    contact_sheet(images, captions, out_dir / "contact_sheet.png")
    ok = rewards[torch.isfinite(rewards)]
    metrics = {"reward/mean": ok.mean().item() if ok.numel() else math.nan, **parts,
               "reward/failed": int((~torch.isfinite(rewards)).sum()), **image_stats(images)}
    append_csv(run.run_dir / "eval_metrics.csv", {"epoch": epoch, **metrics}, keep_upto=epoch - 1)
    plot_reward_curve(run.run_dir)
    return metrics


# ------------------------------------------------------------------------------------ loop


def save(run: Run, epoch: int) -> Path:
    """Trainer state (`checkpoint-<epoch>`, resumable) + the LoRA in PEFT format, raw and EMA."""
    root = run.run_dir / "checkpoints"
    ckpt = root / f"checkpoint-{epoch}"
    check_finite_parameters(run.peft, f"checkpoint at epoch {epoch}")
    if run.acc.is_main_process:  # the adapters are written before the checkpoint is published
        ckpt = save_checkpoint(root, epoch, state=checkpoint_state(run), keep_last=run.cfg.train.keep_last,
                               write_files=lambda folder: export_adapters(run, folder))
    run.acc.wait_for_everyone()
    return ckpt


def export_adapters(run: Run, out: Path) -> None:
    export_lora(run.peft, out / "lora")
    with run.ema.swapped():
        export_lora(run.peft, out / "lora_ema")


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
    with TrainProgress(t.epochs, initial=run.start_epoch, accelerator=acc) as bar:
        for epoch in range(run.start_epoch, t.epochs):
            if cfg.eval.every and epoch % cfg.eval.every == 0 and acc.is_main_process:
                with run.timer("eval"):
                    logger.log(epoch, {f"eval/{k}": v for k, v in evaluate(run, epoch).items()})
            acc.wait_for_everyone()
            metrics = one_epoch(run, epoch)
            logger.log(epoch + 1, metrics)
            bar.update(epoch + 1, metrics)
            if (epoch + 1) % t.save_freq == 0 or epoch + 1 == t.epochs:
                with run.timer("checkpoint"):
                    save(run, epoch + 1)
    if cfg.eval.every and acc.is_main_process:
        evaluate(run, t.epochs)
    if acc.is_main_process:
        export_adapters(run, run.run_dir / "checkpoint-final")
        plot_reward_curve(run.run_dir)
    acc.wait_for_everyone()
    acc.end_training()
    return run.run_dir


def one_epoch(run: Run, epoch: int) -> dict[str, float]:
    run.model.eval()
    run.first_ratio, version = math.nan, run.optimizer_steps  # the weights this epoch samples with
    with run.timer("rollout"):
        batch = collect(run, epoch)
    images = [image for traj in batch.trajectories for image in to_pil(traj.images)]
    with run.timer("reward"):
        rewards, parts = score(run, images, batch.records, run.run_dir / "rollouts" / f"epoch_{epoch}")
    adv, metrics = advantages(run, rewards, batch.group_ids)
    kept = run.acc.gather(torch.tensor([int((adv != 0).sum())], device=run.acc.device)).sum().item()
    train_metrics: dict[str, float] = {}
    if kept:  # an epoch where every group has equal rewards carries no signal: skip the update
        with run.timer("train"):
            train_metrics = train_epoch(run, batch, adv, epoch)
    times = run.timer.pop()
    num_images = len(images) * run.acc.num_processes
    return {**metrics, **parts, **train_metrics, **times, "optimizer_steps": run.optimizer_steps,
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
