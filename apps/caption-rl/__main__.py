"""caption-rl: CapRL++ caption RL on Accelerate.

A Qwen-VL captioner samples `rollout.n` captions per image/video; a judge LLM answers the row's
multiple-choice questions from each caption alone (CapRL's QA reward), plus 0.2 x timestamp
format (videos) and 0.2 x length; group advantages (GRPO/RLOO); clipped policy-gradient updates.

    uv run apps/caption-rl                                  # embedded tiny CPU default
    uv run apps/caption-rl --config examples/caption-rl/caprl-plus-plus.toml
    accelerate launch apps/caption-rl/__main__.py --config FILE train.batch_size=64
    uv run apps/caption-rl --resume                          # continue the latest run
    uv run apps/caption-rl --help                            # every key, default, env var

The loop, one step: group sampler -> generate (the policy itself, through the `hf` engine, which
shares the training module's weights) -> reward (in process, or a running `rl-rewards serve`)
-> advantages -> recompute log-probs with the training model (the engine's must match on the
first step) -> minibatch clipped PG updates, gradient accumulation over micro-batches with the
global valid-token count -> log -> checkpoint -> periodic eval. See README.md next to this file.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from caption_parts import (
    Dataset,
    LocalReward,
    Policy,
    RemoteReward,
    RewardUnavailable,
    Rollout,
    append_jsonl,
    batched,
    collate,
    encode_rollout_prompt,
    load_records,
    make_sample,
    pad_rows,
    placeholder_ids,
    plot_reward_curve,
    replay_logprobs,
    resolve_model,
    to_device,
    to_messages,
)
from peft import PeftModel

from rl_core.advantages import compute_advantages
from rl_core.kl import compute_kl
from rl_core.losses import aggregate, compute_policy_loss
from rl_core.train import (
    MetricsLogger,
    PhaseTimer,
    TrainProgress,
    config_help,
    load_checkpoint,
    load_config,
    make_run_dir,
    parse_cli,
    resolve_resume,
    save_checkpoint,
    seed_everything,
)
from rl_data import CaptionQARecord, GroupSampler
from rl_models.logprobs import token_logprobs, unwrap_peft
from rl_models.lora import add_lora, disabled_adapter, export_lora, merge_and_export
from rl_models.vl import load_vl_model
from rl_rewards import ScoreResult
from rl_rollout import SamplingParams
from rl_rollout.hf import HFEngine

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.toml"
Positive = Annotated[int, msgspec.Meta(ge=1)]


# ----------------------------------------------------------------------------------- config


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "Qwen/Qwen3-VL-4B-Instruct"
    """Caption model (local folder or hub id); `tiny:<family>` builds a tiny random checkpoint."""
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16 | auto
    lora_rank: int = 0  # 0 = full fine-tuning (CapRL++); > 0 trains a LoRA adapter
    lora_alpha: int = 32
    lora_targets: list[str] | None = None  # peft target_modules; None = rl_models' family default
    gradient_checkpointing: bool = False


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    train: list[str] = []
    """CapRL caption-QA JSONL/parquet files (image and/or video rows)."""
    eval: list[str] = []  # held-out files; empty = hold out `eval_size` train records
    eval_size: int = 0
    task: Literal["auto", "image", "video"] = "auto"  # keep only image or video rows
    video_fps: float = 2.0  # frames sampled per second (CapRL: ~2)
    video_max_frames: int = 64
    max_pixels: int = 448 * 448  # per image / video frame


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    engine: Literal["hf"] = "hf"
    n: Positive = 8  # captions sampled per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: Positive = 4096  # response length
    max_prompt_length: Positive = 13000  # longer prompts (media tokens included) are skipped
    max_batch_size: Positive = 64  # rows decoded together by the engine


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    url: str | None = None
    """Running reward server (`rl-rewards serve` or CapRL's), e.g. http://host:18889/get_reward;
    unset = score in process."""
    port: int = 18889  # with host: url = http://host:port/get_reward
    host: str | None = None
    judge: str = "Qwen/Qwen3-4B-Instruct-2507"  # in-process QA judge (text LLM)
    qa_estimator: Literal["exact", "sample"] = "exact"  # see rl_rewards.scorers.caption_qa
    qa_num: int = 8  # questions drawn per caption (estimator=sample)
    format_weight: float = 0.2  # x timestamp-format reward, video rows
    length_tokenizer: str | None = None  # default: the caption model's tokenizer
    length_l1: int = 2048
    length_l2: int = 3072
    length_weight: float = 0.2
    spec: str | None = None  # a RewardSpec TOML replacing QA + format + length (in process)
    retries: Positive = 5  # attempts per server call; then the step is skipped
    timeout: float = 180.0  # seconds per server call


class AlgoConfig(msgspec.Struct, kw_only=True, frozen=True):
    advantage: str = "grpo"  # rl_core advantage estimator: grpo | rloo | dr_grpo | ...
    loss: str = "ppo_clip"  # ppo_clip | dual_clip | gspo
    agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | ...
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher; = clip_low for symmetric PPO
    kl: str = "k3"  # KL-to-reference estimator (only used when kl_coef > 0)
    kl_coef: float = 0.0  # CapRL++: no KL
    ppo_epochs: Positive = 1
    replay_tolerance: float | None = None
    """Max mean |engine logp - trainer logp| on the first step (None: 1e-3 fp32, 5e-2 16-bit)."""


class TrainConfig(msgspec.Struct, kw_only=True, frozen=True):
    batch_size: Positive = 128  # prompts per step, all processes together
    mini_batch_size: int | None = None  # prompts per optimizer step (None = batch_size)
    micro_batch_size: Positive = 4  # captions per forward/backward on one process
    epochs: Positive = 3
    max_steps: int | None = None  # stop earlier than `epochs`
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    save_freq: Positive = 50  # checkpoint every N steps (and at the end)
    keep_last: Positive = 2
    eval_freq: int = 10  # 0 = no eval
    output_dir: str = "runs/caption-rl"
    run_name: str | None = None
    seed: int = 0
    export: bool = True  # save the final HF model (or LoRA adapter) in run_dir/export
    log_with: list[str] = []  # accelerate trackers: tensorboard, wandb, ...
    samples_to_log: int = 4  # example captions written per step/eval


class Config(msgspec.Struct, kw_only=True, frozen=True):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()


# CapRL++'s train_caprl.sh variables, so its launch lines keep working.
ENV = {
    "CAPTION_MODEL": "model.path",
    "DATASET": "data.train",
    "SAVE_DIR": "train.output_dir",
    "REWARD_REMOTE_URL": "reward.url",
    "REWARD_NODE_IP": "reward.host",
    "REWARD_PORT": "reward.port",
    "BATCH_SIZE": "train.batch_size",
    "ROLLOUT_N": "rollout.n",
    "TOTAL_EPOCHS": "train.epochs",
    "SAVE_FREQ": "train.save_freq",
    "ACTOR_LR": "train.lr",
    "ROLLOUT_RESPONSE_LENGTH": "rollout.max_new_tokens",
    "ROLLOUT_PROMPT_LENGTH": "rollout.max_prompt_length",
    "REWARD_LENGTH_TOKENIZER_PATH": "reward.length_tokenizer",
    "REWARD_LENGTH_L1": "reward.length_l1",
    "REWARD_LENGTH_L2": "reward.length_l2",
    "REWARD_LENGTH_WEIGHT": "reward.length_weight",
    "FORMAT_REWARD_WEIGHT": "reward.format_weight",
    "REWARD_QA_NUM": "reward.qa_num",
    "RUN_NAME": "train.run_name",
}


def parse_config(argv: list[str]) -> tuple[Config, str | None] | None:
    """argv -> (config, resume spec); None after printing --help.

    No `--config`: the embedded tiny default, unless `CAPTION_MODEL` is set (a CapRL++ launch
    line), which starts from the full-size CapRL++ defaults instead.
    """
    cli = parse_cli(argv)
    if cli.help:
        print(config_help(Config, env=ENV, prog="caption-rl"))
        return None
    path = cli.config
    if path is None and "CAPTION_MODEL" not in os.environ:
        path = DEFAULT_CONFIG
    return load_config(Config, path, cli.overrides, env=ENV), cli.resume



# ------------------------------------------------------------------------------------- setup


@dataclass
class Run:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    acc: Accelerator
    run_dir: Path
    policy: torch.nn.Module  # `Policy` (model -> completion log-probs), prepared: DDP/FSDP-wrapped
    processor: Any
    engine: HFEngine  # generates with the training model's own weights (no copy, no sync)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reward: LocalReward | RemoteReward
    sampler: GroupSampler
    data: Dataset
    prompts_per_rank: int  # prompts per step on this process
    total_steps: int
    start_step: int
    reference: torch.nn.Module | None  # frozen initial policy (full fine-tuning with a KL term)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    placeholders: frozenset[int] = frozenset()  # vision placeholder token ids (see caption_parts)


def load_policy(cfg: ModelConfig) -> tuple[torch.nn.Module, Any, str]:
    path = resolve_model(cfg.path)
    model, processor = load_vl_model(path, dtype=cfg.dtype)
    if cfg.lora_rank > 0:
        model = add_lora(model, r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, processor, path


def build_reward_backend(cfg: Config, policy_path: str) -> LocalReward | RemoteReward:
    r = cfg.reward
    url = r.url or (f"http://{r.host}:{r.port}/get_reward" if r.host else None)
    length = {"length_tokenizer": r.length_tokenizer or policy_path, "length_l1": r.length_l1,
              "length_l2": r.length_l2, "length_weight": r.length_weight}
    if url is not None:
        return RemoteReward(url, retries=r.retries, timeout=r.timeout, **length)
    judge = None if r.spec is not None else resolve_model(r.judge)
    return LocalReward(judge=judge, spec=r.spec, qa_estimator=r.qa_estimator, qa_num=r.qa_num,
                       format_weight=r.format_weight, seed=cfg.train.seed, **length)


def setup(cfg: Config, resume: str | None) -> Run:
    t = cfg.train
    # cpu=True without CUDA: `accelerate launch --multi_gpu --num_processes N` then gives N gloo
    # processes on a CPU machine (its `--cpu` flag alone starts one process unless MPI is set up)
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=list(t.log_with) or None)
    world = acc.num_processes
    mini = t.mini_batch_size or t.batch_size
    if t.batch_size % world or t.batch_size % mini:
        raise ValueError(f"train.batch_size={t.batch_size} must divide by the {world} processes and by "
                         f"train.mini_batch_size={mini}")
    ckpt = resolve_resume(resume, t.output_dir)
    name = ckpt.parent.parent.name if ckpt is not None else t.run_name
    run_dir = make_run_dir(t.output_dir, name, config=cfg, accelerator=acc)
    seed_everything(t.seed, rank=acc.process_index)
    d = cfg.data
    data = load_records(d.train, d.eval, eval_size=d.eval_size, task=d.task, seed=t.seed)
    model, processor, policy_path = load_policy(cfg.model)
    reward = build_reward_backend(cfg, policy_path)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))
    policy, optimizer, scheduler = acc.prepare(Policy(model), optimizer, scheduler)
    # the engine decodes with the very modules being trained (LoRA layers included): no weight sync
    engine = HFEngine(unwrap_peft(acc.unwrap_model(policy).model), processor, max_batch_size=cfg.rollout.max_batch_size)
    sampler = GroupSampler(len(data.train), cfg.rollout.n, seed=t.seed, rank=acc.process_index, world_size=world)
    start = 0
    if ckpt is not None:
        start = load_checkpoint(ckpt, state={"sampler": sampler}, accelerator=acc)["step"]
        acc.print(f"resumed from {ckpt} at step {start}")
    per_rank = t.batch_size // world
    total = t.epochs * math.ceil(sampler.prompts_per_rank / per_rank)
    total = min(total, t.max_steps) if t.max_steps is not None else total
    if t.log_with:
        acc.project_configuration.logging_dir = str(run_dir / "logs")
        acc.init_trackers("caption-rl", config=_flat(msgspec.to_builtins(cfg)))
    reference = None
    if cfg.algo.kl_coef > 0 and cfg.model.lora_rank == 0:
        reference = load_policy(msgspec.structs.replace(cfg.model, gradient_checkpointing=False))[0]
        reference = reference.to(acc.device).eval().requires_grad_(False)
    return Run(cfg, acc, run_dir, policy, processor, engine, optimizer, scheduler, reward, sampler, data,
               per_rank, total, start, reference, placeholders=placeholder_ids(unwrap_peft(model).config))


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value if isinstance(value, int | float | str | bool) else str(value)
    return out


# ------------------------------------------------------------------------------- the step


def take(sampler: GroupSampler, count: int) -> list[int]:
    """The next `count` sampler indices, crossing into the next epoch when one runs out."""
    out: list[int] = []
    while len(out) < count:
        for index in sampler:
            out.append(index)
            if len(out) == count:
                break
    return out


def generate(run: Run, records: list[CaptionQARecord], params: SamplingParams) -> tuple[list, list]:
    """Encode prompts (dropping over-long ones) and sample; returns (encoded prompts, generations)."""
    d = run.cfg.data
    messages = [to_messages(r, fps=d.video_fps, max_frames=d.video_max_frames, max_pixels=d.max_pixels)
                for r in records]
    encoded = [encode_rollout_prompt(m, run.processor, i) for i, m in enumerate(messages)]
    keep = [i for i, e in enumerate(encoded) if len(e.ids) <= run.cfg.rollout.max_prompt_length]
    run.engine.model.eval()
    generations = run.engine.generate([messages[i] for i in keep], params)
    generations = [msgspec.structs.replace(g, request_index=keep[g.request_index]) for g in generations]
    for g in generations:
        if g.prompt_ids != encoded[g.request_index].ids:
            raise RuntimeError(f"prompt {g.request_index}: the engine encoded it differently from the trainer")
    return encoded, generations


def advantages_for(run: Run, scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Advantages `[B_local]`: rewards of every process gathered first (whole groups, global
    statistics), failed samples (NaN) left out of their group's statistics."""
    acc = run.acc
    all_scores, all_groups = acc.gather(scores), acc.gather(groups)  # [B_global]
    ok = ~torch.isnan(all_scores)
    adv = torch.zeros_like(all_scores)  # [B_global]
    if ok.any():
        adv[ok] = compute_advantages(run.cfg.algo.advantage, rewards=all_scores[ok], mask=torch.ones_like(
            all_scores[ok])[:, None], group_ids=all_groups[ok])[:, 0]
    start = acc.process_index * scores.numel()
    return adv[start : start + scores.numel()]


def step_once(run: Run, step: int) -> dict[str, Any]:
    cfg, acc, n = run.cfg, run.acc, run.cfg.rollout.n
    r = cfg.rollout
    params = SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)
    with run.timer("generate"):
        records = [run.data.train[i] for i in take(run.sampler, run.prompts_per_rank * n)[::n]]
        encoded, generations = generate(run, records, params)
    with run.timer("reward"):
        samples = [make_sample(records[g.request_index], g.text) for g in generations]
        try:
            results, error = run.reward.score(samples), ""
        except RewardUnavailable as e:
            results, error = [], f"rank {acc.process_index}: {e}"
    if not error and results and all(x.score is None for x in results):
        error = f"rank {acc.process_index}: every sample failed to score; first error: {results[0].error}"
    failed = acc.reduce(torch.tensor([float(bool(error) or not generations)], device=acc.device), "max")
    if failed.item() > 0:
        message = error or "no rollouts on some process (every prompt over rollout.max_prompt_length?)"
        print(f"step {step} skipped: {message}", file=sys.stderr)
        return {"skipped": 1, "error": message[:300]}
    bad = [any(tok in run.placeholders for tok in g.completion_ids) for g in generations]
    scores = torch.tensor([x.score if x.score is not None and not b else math.nan
                           for x, b in zip(results, bad, strict=True)])  # [B] NaN: left out of the update
    groups = torch.tensor([acc.process_index * run.prompts_per_rank + g.request_index for g in generations])  # [B]
    adv = advantages_for(run, scores.to(acc.device), groups.to(acc.device)).cpu()  # [B]
    rollouts = [Rollout(encoded[g.request_index], g.completion_ids, g.logprobs, valid=not math.isnan(scores[i]))
                for i, g in enumerate(generations)]  # failed samples stay as rows with weight 0
    with run.timer("logprob"):
        old, ref, stats = replay(run, rollouts, check=step == run.start_step + 1)
    with run.timer("update"):
        update_stats = update(run, rollouts, adv, old, ref)
    metrics = {"skipped": 0, **rollout_metrics(run, generations, results, adv), **stats, **update_stats,
               "response/placeholder_rows": acc.reduce(torch.tensor(float(sum(bad)), device=acc.device), "sum").item()}
    if acc.is_main_process:
        append_jsonl(run.run_dir / "samples" / "train.jsonl", [
            {"step": step, "prompt": s.prompt, "caption": s.completion, "reward": x.score, "components": x.components,
             "error": x.error} for s, x in list(zip(samples, results, strict=True))[: cfg.train.samples_to_log]])
    return metrics


def replay(run: Run, rollouts: list[Rollout], *, check: bool) -> tuple[list, list | None, dict[str, float]]:
    """Log-probs of every rollout under the training model before the update (PPO's old_logp),
    and under the reference when the KL term is on. On the first step of a run the engine's
    sampling log-probs must match them (the importance ratio is 1 on the first replay): a
    mismatch means the engine and the trainer see different prompts, media or weights."""
    cfg, acc = run.cfg, run.acc
    model = acc.unwrap_model(run.policy).model  # no-grad forwards need no DDP collectives
    old, diffs, ents = [], [torch.zeros(0)], [torch.zeros(0)]
    ref: list | None = [] if cfg.algo.kl_coef > 0 else None
    with torch.no_grad():
        for chunk in batched(rollouts, cfg.train.micro_batch_size):
            batch = to_device(collate(chunk, run.engine.pad_id, run.placeholders), acc.device)
            lp, ent = replay_logprobs(model, batch, cfg.rollout.temperature)  # [B, C], [B, C]
            for row, r in enumerate(chunk):
                length = len(r.completion_ids)
                old.append(lp[row, :length].cpu())
                if r.valid:  # rows with a failed reward or a sampled placeholder are never trained on
                    ents.append(ent[row, :length].cpu())
                    diffs.append((old[-1] - torch.tensor(r.engine_logprobs)).abs())
            if ref is not None:
                with reference_model(run) as reference:
                    ref_lp = token_logprobs(reference, batch, temperature=cfg.rollout.temperature)  # [B, C]
                ref += [ref_lp[row, : len(r.completion_ids)].cpu() for row, r in enumerate(chunk)]
    diff = torch.cat(diffs)
    ent = torch.cat(ents)
    totals = acc.reduce(torch.tensor([diff.sum(), diff.numel(), ent.sum()], device=acc.device), "sum").tolist()
    diff_max = acc.reduce(diff.max().to(acc.device) if diff.numel() else torch.zeros((), device=acc.device), "max").item()
    mean_diff = totals[0] / max(totals[1], 1.0)
    tolerance = cfg.algo.replay_tolerance
    if tolerance is None:
        tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    if check and mean_diff > tolerance:
        raise RuntimeError(f"first replay: mean |engine logp - trainer logp| = {mean_diff:.3g} > algo.replay_tolerance="
                           f"{tolerance} (max {diff_max:.3g}): the rollout engine and the training model disagree")
    return old, ref, {"logprob/engine_diff_mean": mean_diff, "logprob/engine_diff_max": diff_max,
                      "entropy": totals[2] / max(totals[1], 1.0)}


@contextmanager
def reference_model(run: Run) -> Iterator[torch.nn.Module]:
    """The KL reference: the same model with its LoRA adapter disabled (no second copy of the
    weights), or a frozen copy of the initial policy for full fine-tuning."""
    if run.reference is not None:
        yield run.reference
        return
    with disabled_adapter(run.acc.unwrap_model(run.policy).model) as model:
        yield model


def update(run: Run, rollouts: list[Rollout], adv: torch.Tensor, old: list, ref: list | None) -> dict[str, float]:
    """`ppo_epochs` passes over `batch_size / mini_batch_size` minibatches; each is one optimizer
    step accumulated over micro-batches. Every micro-batch loss is divided by the valid-token
    (or sequence) count of the whole minibatch on all processes, and scaled by the process count
    because DDP averages gradients: accumulation and data parallelism do not change the update.
    Processes run the same number of backward passes (padding with zero-weight ones)."""
    cfg, acc, a = run.cfg, run.acc, run.cfg.algo
    t = cfg.train
    num_minibatches = t.batch_size // (t.mini_batch_size or t.batch_size)
    parts = [p.tolist() for p in torch.arange(len(rollouts)).tensor_split(num_minibatches)]
    sums: dict[str, float] = defaultdict(float)
    run.policy.train()
    for _ in range(a.ppo_epochs):
        for part in parts:
            chunks = [part[i : i + t.micro_batch_size] for i in range(0, len(part), t.micro_batch_size)] or [[0]]
            real = len(chunks) if part else 0
            count = int(acc.reduce(torch.tensor(len(chunks), device=acc.device), "max"))
            local = sum(len(rollouts[i].completion_ids) if a.agg == "token-mean" else 1 for i in part if rollouts[i].valid)
            num_valid = acc.reduce(torch.tensor(float(local), device=acc.device), "sum").clamp(min=1)
            for j in range(count):
                rows = chunks[j] if j < real else chunks[0]
                weight = 1.0 if j < real else 0.0
                sync = nullcontext() if j == count - 1 else acc.no_sync(run.policy)
                with sync:
                    loss, metrics = micro_loss(run, [rollouts[i] for i in rows], adv[rows], [old[i] for i in rows],
                                               [ref[i] for i in rows] if ref is not None else None, num_valid)
                    acc.backward(loss * acc.num_processes * weight)
                for key, value in metrics.items():
                    if key == "ratio_max":
                        sums[key] = max(sums[key], value * weight)
                    else:
                        sums[key] += value * weight
            sums["grad_norm"] += float(acc.clip_grad_norm_(run.policy.parameters(), t.grad_clip))
            sums["optimizer_steps"] += 1
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
    run.policy.eval()
    return reduce_update_stats(acc, sums)


def micro_loss(run: Run, rows: list[Rollout], adv: torch.Tensor, old: list, ref: list | None,
               num_valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    a, acc = run.cfg.algo, run.acc
    batch = to_device(collate(rows, run.engine.pad_id, run.placeholders), acc.device)
    valid = torch.tensor([r.valid for r in rows], device=acc.device)[:, None]  # [B, 1]
    mask = batch.completion_mask * valid  # [B, C] failed samples contribute nothing
    logp = run.policy(batch, run.cfg.rollout.temperature)  # [B, C]
    old_logp = pad_rows(old, logp.shape[1]).to(acc.device)  # [B, C]
    advantages = adv.to(acc.device, logp.dtype)[:, None] * mask  # [B, C]
    loss, metrics = compute_policy_loss(a.loss, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                                        agg=a.agg, clip_low=a.clip_low, clip_high=a.clip_high, num_valid=num_valid)
    tokens = float(mask.sum())
    out = {"loss/policy": float(loss.detach()), "tokens": tokens, **{k: float(v) * tokens for k, v in metrics.items()
                                                             if k in ("clip_fraction", "approx_kl", "ratio_mean")}}
    out["ratio_max"] = float(metrics["ratio_max"]) if tokens else 1.0
    if ref is not None:
        kl = compute_kl(a.kl, logp, pad_rows(ref, logp.shape[1]).to(acc.device))  # [B, C]
        kl_loss = aggregate(kl, mask, a.agg, num_valid=num_valid)
        loss = loss + a.kl_coef * kl_loss
        out["loss/kl"] = float(kl_loss.detach())
    return loss, out


def reduce_update_stats(acc: Accelerator, sums: dict[str, float]) -> dict[str, float]:
    keys = sorted(k for k in sums if k != "ratio_max")
    total = dict(zip(keys, acc.reduce(torch.tensor([sums[k] for k in keys], device=acc.device), "sum").tolist(), strict=True))
    steps = total.pop("optimizer_steps") / acc.num_processes
    tokens = max(total.pop("tokens"), 1.0)
    out = {"loss/policy": total.pop("loss/policy") / steps, "grad_norm": total.pop("grad_norm") / acc.num_processes / steps}
    if "loss/kl" in total:
        out["loss/kl"] = total.pop("loss/kl") / steps
    out.update({k: v / tokens for k, v in total.items()})  # token-weighted means
    out["ratio_max"] = acc.reduce(torch.tensor(sums["ratio_max"], device=acc.device), "max").item()
    return out


def rollout_metrics(run: Run, generations: list, results: list, adv: torch.Tensor) -> dict[str, float]:
    """Reward, advantage and response statistics over the samples of every process."""
    rows = gather_object([(x.score, x.components, len(g.completion_ids), len(g.prompt_ids), g.finish_reason == "length",
                           float(a)) for g, x, a in zip(generations, results, adv, strict=True)])
    scores = torch.tensor([r[0] for r in rows if r[0] is not None])
    lengths = torch.tensor([float(r[2]) for r in rows])
    advs = torch.tensor([r[5] for r in rows if r[0] is not None])
    out = {"reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
           "reward/failed": float(len(rows) - len(scores)),
           "adv/mean": advs.mean().item(), "adv/std": advs.std().item() if len(advs) > 1 else 0.0,
           "adv/min": advs.min().item(), "adv/max": advs.max().item(),
           "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
           "response/truncation_rate": sum(r[4] for r in rows) / len(rows),
           "tokens": float(sum(r[2] + r[3] for r in rows))}
    for name in sorted({k for r in rows for k in r[1]}):
        values = [r[1][name] for r in rows if name in r[1]]
        out[f"reward/{name}"] = sum(values) / len(values)
    return out


# ------------------------------------------------------------------------------- eval, main


def evaluate(run: Run, step: int) -> dict[str, Any]:
    """Greedy captions for the held-out records (sharded over processes), their reward and
    components; the captions go to samples/eval-step-<step>.jsonl."""
    acc = run.acc
    records = run.data.eval[acc.process_index :: acc.num_processes]
    _, generations = generate(run, records, SamplingParams(temperature=0.0, max_new_tokens=run.cfg.rollout.max_new_tokens))
    samples = [make_sample(records[g.request_index], g.text) for g in generations]
    try:
        results = run.reward.score(samples)
    except RewardUnavailable as e:
        results = [ScoreResult.failed(str(e)) for _ in samples]
    rows = gather_object([{"prompt": s.prompt, "caption": s.completion, "reward": x.score, "components": x.components,
                           "error": x.error} for s, x in zip(samples, results, strict=True)])
    scores = [r["reward"] for r in rows if r["reward"] is not None]
    out: dict[str, Any] = {"eval/reward/mean": sum(scores) / len(scores) if scores else math.nan,
                           "eval/failed": float(len(rows) - len(scores))}
    for name in sorted({k for r in rows for k in r["components"]}):
        values = [r["components"][name] for r in rows if name in r["components"]]
        out[f"eval/reward/{name}"] = sum(values) / len(values)
    if acc.is_main_process:
        append_jsonl(run.run_dir / "samples" / f"eval-step-{step:06d}.jsonl", rows)
    return out


def train(cfg: Config, resume: str | None = None) -> Path:
    """The recipe: setup, then per step rollout -> reward -> advantages -> replay -> update ->
    log -> eval -> checkpoint; export at the end. Returns the run directory."""
    if cfg.rollout.temperature <= 0:
        raise ValueError("rollout.temperature must be > 0: training log-probs are taken under the sampling distribution")
    run = setup(cfg, resume)
    acc, t = run.acc, cfg.train
    logger = MetricsLogger(run.run_dir, accelerator=acc, start_step=run.start_step if run.start_step else None)
    show = ("reward/mean", "eval/reward/mean")
    with TrainProgress(run.total_steps, initial=run.start_step, show=show, accelerator=acc) as bar:
        for step in range(run.start_step + 1, run.total_steps + 1):
            began = time.perf_counter()
            metrics = step_once(run, step)
            seconds = time.perf_counter() - began
            metrics.update(run.timer.pop())
            metrics["time/step"] = seconds
            metrics["throughput/tokens_per_s"] = metrics.pop("tokens", 0.0) / (seconds * acc.num_processes)
            metrics["lr"] = run.scheduler.get_last_lr()[0]
            metrics["world_size"] = acc.num_processes
            metrics["data/skipped_records"] = run.data.skipped
            evaluating = t.eval_freq > 0 and run.data.eval and (step % t.eval_freq == 0 or step == run.total_steps)
            if evaluating:
                with run.timer("eval"):
                    metrics.update(evaluate(run, step))
                metrics.update(run.timer.pop())
            logger.log(step, metrics)
            bar.update(step, metrics)
            if step % t.save_freq == 0 or step == run.total_steps:
                save_checkpoint(run.run_dir / "checkpoints", step, state={"sampler": run.sampler},
                                accelerator=acc, keep_last=t.keep_last)
            if acc.is_main_process and (evaluating or step == run.total_steps):
                plot_reward_curve(run.run_dir / "metrics.csv", run.run_dir / "reward_curve.png")
    finish(run)
    return run.run_dir


def finish(run: Run) -> None:
    """Export the model (or the LoRA adapter) and say where every output is."""
    acc = run.acc
    acc.wait_for_everyone()
    if run.cfg.train.export and acc.is_main_process:
        model = acc.unwrap_model(run.policy).model
        if isinstance(model, PeftModel):
            export_lora(model, run.run_dir / "export" / "adapter")
            merge_and_export(model, run.run_dir / "export", processor=run.processor)
        else:
            model.save_pretrained(run.run_dir / "export")
            run.processor.save_pretrained(run.run_dir / "export")
    acc.end_training()
    d = run.run_dir
    acc.print(f"\ncaption-rl finished: {run.total_steps} steps ({run.data.skipped} malformed/QA-less records skipped)\n"
              f"  run directory   {d}\n  metrics         {d / 'metrics.csv'}\n  reward curve    {d / 'reward_curve.png'}\n"
              f"  sample captions {d / 'samples'}\n  checkpoints     {d / 'checkpoints'}\n"
              f"  exported model  {d / 'export' if run.cfg.train.export else '(train.export = false)'}")


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_config(sys.argv[1:] if argv is None else argv)
    return None if parsed is None else train(*parsed)


if __name__ == "__main__":
    main()
