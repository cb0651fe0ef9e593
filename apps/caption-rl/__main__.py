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
shares the training module's weights; or a colocated vLLM engine that gets the weights pushed after
every optimizer step, caption_sync.py) -> reward (in process, or a running `rl-rewards serve`)
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
from typing import Any

import msgspec
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from caption_config import Config, ModelConfig, flat_config, parse_config
from caption_metrics import reduce_update_stats, rollout_metrics
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
from caption_sync import build_engine, push_weights
from peft import PeftModel

from rl_core.advantages import compute_advantages
from rl_core.kl import compute_kl
from rl_core.losses import aggregate, compute_policy_loss
from rl_core.train import (
    MetricsLogger,
    OptimizerOffload,
    PhaseTimer,
    TrainProgress,
    load_checkpoint,
    make_run_dir,
    resolve_resume,
    save_checkpoint,
    seed_everything,
)
from rl_data import CaptionQARecord, GroupSampler
from rl_models.compiled import compile_decoder_layers
from rl_models.logprobs import token_logprobs, unwrap_peft
from rl_models.lora import add_lora, disabled_adapter, export_lora, merge_and_export
from rl_models.shared_media import share_identical_media
from rl_models.vl import load_vl_model
from rl_rewards import ScoreResult
from rl_rollout import SamplingParams

# ------------------------------------------------------------------------------------- setup


@dataclass
class Run:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    acc: Accelerator
    run_dir: Path
    policy: torch.nn.Module  # `Policy` (model -> completion log-probs), prepared: DDP/FSDP-wrapped
    processor: Any
    engine: Any  # rollout.engine: HFEngine over the training modules, or a colocated VLLMEngine
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
    pad_id: int = 0
    weight_version: int = 0  # optimizer steps pushed into a vllm engine
    optimizer_offload: OptimizerOffload | None = None  # Adam moments to host while the policy decodes

    @property
    def on_policy(self) -> bool:
        """Each rollout batch makes exactly one optimizer step: old log-probs = the update's own."""
        t = self.cfg.train
        return self.cfg.algo.ppo_epochs == 1 and (t.mini_batch_size or t.batch_size) == t.batch_size


def check_sharding(acc: Accelerator) -> None:
    """Refuse launches whose weight sharding the recipe cannot serve, instead of running something else.

    The rollout engine (`hf`) and the log-prob replay read the policy's weights outside the
    wrapped module's forward, where FSDP and ZeRO-3 keep them sharded: use DDP or ZeRO-1/2.
    Accelerate turns FSDP on only on GPUs/accelerators; on a CPU machine it silently falls back
    to plain data parallelism, which is refused here too so a sharded launch never runs unsharded.
    """
    asked_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    zero3 = acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 3
    if asked_fsdp and acc.distributed_type != DistributedType.FSDP:
        raise ValueError(f"the accelerate config asks for FSDP, but accelerate enables it only on GPUs/accelerators: "
                         f"this {acc.distributed_type.value} run would not shard anything. Launch with --multi_gpu (DDP).")
    if acc.distributed_type == DistributedType.FSDP or zero3:
        raise ValueError("caption-rl does not run with sharded weights (FSDP, DeepSpeed ZeRO-3): the rollout engine and "
                         "the log-prob replay read the full weights outside the wrapped forward. Use DDP or ZeRO-1/2 "
                         "(examples/caption-rl/accelerate/).")


def load_policy(cfg: ModelConfig) -> tuple[torch.nn.Module, Any, str]:
    path = resolve_model(cfg.path)
    model, processor = load_vl_model(path, dtype=cfg.dtype)
    if cfg.share_media:
        share_identical_media(model)
    if cfg.lora_rank > 0:
        model = add_lora(model, r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.compile_layers == "on" or (cfg.compile_layers == "auto" and torch.cuda.is_available()):
        compile_decoder_layers(model)
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
    check_sharding(acc)
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
    r = cfg.rollout  # hf: decodes with the very modules being trained (LoRA layers included), no sync
    engine = build_engine(r.engine, acc.unwrap_model(policy).model, processor, path=policy_path, dtype=cfg.model.dtype,
                          max_batch_size=r.max_batch_size, compile_mode=r.compile_mode,
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          rank=acc.process_index, world_size=world)
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
        acc.init_trackers("caption-rl", config=flat_config(cfg))
    reference = None
    if cfg.algo.kl_coef > 0 and cfg.model.lora_rank == 0:
        reference = load_policy(msgspec.structs.replace(cfg.model, gradient_checkpointing=False))[0]
        reference = reference.to(acc.device).eval().requires_grad_(False)
    tokenizer = processor.tokenizer
    pad_id = engine.pad_id if r.engine == "hf" else tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
    offload = r.offload_optimizer == "always" or (r.offload_optimizer == "auto" and r.engine == "hf")
    run = Run(cfg, acc, run_dir, policy, processor, engine, optimizer, scheduler, reward, sampler, data, per_rank,
              total, start, reference, placeholders=placeholder_ids(unwrap_peft(model).config), pad_id=pad_id,
              optimizer_offload=OptimizerOffload(optimizer, acc.device) if offload and acc.device.type == "cuda" else None)
    if r.engine == "vllm":  # the checkpoint it loaded may be older than the policy (--resume)
        push_weights(engine, acc.unwrap_model(policy).model, version=run.weight_version)
    return run


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
    with awake_engine(run) as engine:
        generations = engine.generate([messages[i] for i in keep], params)
    generations = [msgspec.structs.replace(g, request_index=keep[g.request_index]) for g in generations]
    for g in generations:
        if g.prompt_ids != encoded[g.request_index].ids:
            raise RuntimeError(f"prompt {g.request_index}: the engine encoded it differently from the trainer")
    return encoded, generations


@contextmanager
def awake_engine(run: Run) -> Iterator[Any]:
    """The rollout engine, ready to sample: the `hf` engine's model in eval mode, with the Adam
    moments on the host while it decodes and its KV cache freed afterwards (`rollout.
    offload_optimizer`, `rollout.release_cache`), so decoding and training take turns with the
    same memory; a colocated vLLM engine woken for the rollout and put back to sleep (weights to
    CPU, KV cache freed) so the trainer has the GPU memory."""
    if run.cfg.rollout.engine == "hf":
        run.engine.model.eval()
        if run.optimizer_offload is not None:
            run.optimizer_offload.to_host()
        try:
            yield run.engine
        finally:
            if run.cfg.rollout.release_cache:
                run.engine.release_cache()
            if run.optimizer_offload is not None:
                run.optimizer_offload.to_device()
        return
    run.engine.wake()
    try:
        yield run.engine
    finally:
        run.engine.sleep()


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
    first = step == run.start_step + 1
    with run.timer("logprob"):
        old, ref, stats = replay(run, rollouts, check=first)
    with run.timer("update"):
        update_stats = update(run, rollouts, adv, old, ref, check=first and old is None)
    metrics = {"skipped": 0, **rollout_metrics(generations, results, adv), **stats, **update_stats,
               "response/placeholder_rows": acc.reduce(torch.tensor(float(sum(bad)), device=acc.device), "sum").item()}
    if acc.is_main_process:
        append_jsonl(run.run_dir / "samples" / "train.jsonl", [
            {"step": step, "prompt": s.prompt, "caption": s.completion, "reward": x.score, "components": x.components,
             "error": x.error} for s, x in list(zip(samples, results, strict=True))[: cfg.train.samples_to_log]])
    return metrics


def replay(run: Run, rollouts: list[Rollout], *, check: bool) -> tuple[list | None, list | None, dict[str, float]]:
    """Log-probs of every rollout under the training model before the update (PPO's old_logp),
    and under the reference when the KL term is on. On the first step of a run the engine's
    sampling log-probs must match them (the importance ratio is 1 on the first replay): a
    mismatch means the engine and the trainer see different prompts, media or weights.

    On-policy runs (`algo.old_logprobs = "auto"`, one optimizer step per batch) skip the old
    log-probs (None): the update takes them from its own forward and checks the engine there."""
    cfg = run.cfg
    want_old = cfg.algo.old_logprobs == "replay" or not run.on_policy
    want_ref = cfg.algo.kl_coef > 0
    if not want_old and not want_ref:
        return None, None, {}
    model = run.acc.unwrap_model(run.policy).model  # no-grad forwards need no DDP collectives
    old: list = []
    diff, ents = EngineCheck(), [torch.zeros(0)]
    ref: list | None = [] if want_ref else None
    with torch.no_grad():
        for chunk in batched(rollouts, cfg.train.micro_batch_size):
            batch = to_device(collate(chunk, run.pad_id, run.placeholders), run.acc.device)
            if want_old:
                lp, ent = replay_logprobs(model, batch, cfg.rollout.temperature)  # [B, C], [B, C]
                for row, r in enumerate(chunk):
                    old.append(lp[row, : len(r.completion_ids)].cpu())
                    if r.valid:  # rows with a failed reward or a sampled placeholder are never trained on
                        ents.append(ent[row, : len(r.completion_ids)].cpu())
                        diff.add(old[-1], r.engine_logprobs)
            if ref is not None:
                with reference_model(run) as reference:
                    ref_lp = token_logprobs(reference, batch, temperature=cfg.rollout.temperature)  # [B, C]
                ref += [ref_lp[row, : len(r.completion_ids)].cpu() for row, r in enumerate(chunk)]
    if not want_old:
        return None, ref, {}
    ent = torch.cat(ents)
    stats = diff.reduce(run, check=check)
    totals = run.acc.reduce(torch.tensor([ent.sum(), float(ent.numel())], device=run.acc.device), "sum").tolist()
    return old, ref, {**stats, "entropy": totals[0] / max(totals[1], 1.0)}


class EngineCheck:
    """|engine logp - trainer logp| over the trained tokens, reduced over processes; on the
    first step its mean must be within `algo.replay_tolerance`."""

    def __init__(self) -> None:
        self.total, self.count, self.max = 0.0, 0, 0.0

    def add(self, trainer: torch.Tensor, engine: list[float]) -> None:
        d = (trainer.detach().float().cpu() - torch.tensor(engine)).abs()  # [C]
        self.total += float(d.sum())
        self.count += d.numel()
        self.max = max(self.max, float(d.max())) if d.numel() else self.max

    def reduce(self, run: Run, *, check: bool) -> dict[str, float]:
        acc = run.acc
        total, count = acc.reduce(torch.tensor([self.total, float(self.count)], device=acc.device), "sum").tolist()
        peak = acc.reduce(torch.tensor(self.max, device=acc.device), "max").item()
        mean = total / max(count, 1.0)
        tolerance = run.cfg.algo.replay_tolerance
        if tolerance is None:
            model = acc.unwrap_model(run.policy).model
            tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
        if check and mean > tolerance:
            raise RuntimeError(f"first replay: mean |engine logp - trainer logp| = {mean:.3g} > algo.replay_tolerance="
                               f"{tolerance} (max {peak:.3g}): the rollout engine and the training model disagree")
        return {"logprob/engine_diff_mean": mean, "logprob/engine_diff_max": peak}


@contextmanager
def reference_model(run: Run) -> Iterator[torch.nn.Module]:
    """The KL reference: the same model with its LoRA adapter disabled (no second copy of the
    weights), or a frozen copy of the initial policy for full fine-tuning."""
    if run.reference is not None:
        yield run.reference
        return
    with disabled_adapter(run.acc.unwrap_model(run.policy).model) as model:
        yield model


def update(run: Run, rollouts: list[Rollout], adv: torch.Tensor, old: list | None, ref: list | None, *,
           check: bool) -> dict[str, float]:
    """`ppo_epochs` passes over `batch_size / mini_batch_size` minibatches; each is one optimizer
    step accumulated over micro-batches. Every micro-batch loss is divided by the valid-token
    (or sequence) count of the whole minibatch on all processes, and scaled by the process count
    because DDP averages gradients: accumulation and data parallelism do not change the update.
    Processes run the same number of backward passes (padding with zero-weight ones).

    `old=None` (on-policy, see `replay`): each micro-batch's own log-probs are its old ones, and
    the engine's sampling log-probs are compared with them before the first optimizer step
    (`check`: the first step of the run raises on a mismatch, before any weight changes)."""
    cfg, acc, a = run.cfg, run.acc, run.cfg.algo
    t = cfg.train
    num_minibatches = t.batch_size // (t.mini_batch_size or t.batch_size)
    parts = [p.tolist() for p in torch.arange(len(rollouts)).tensor_split(num_minibatches)]
    sums: dict[str, float] = defaultdict(float)
    engine = EngineCheck() if old is None else None
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
                    loss, metrics = micro_loss(run, [rollouts[i] for i in rows], adv[rows],
                                               [old[i] for i in rows] if old is not None else None,
                                               [ref[i] for i in rows] if ref is not None else None, num_valid,
                                               engine if j < real else None)
                    acc.backward(loss * acc.num_processes * weight)
                for key, value in metrics.items():
                    if key == "ratio_max":
                        sums[key] = max(sums[key], value * weight)
                    else:
                        sums[key] += value * weight
            if engine is not None and not sums["optimizer_steps"]:  # before any weight changes
                engine_stats = engine.reduce(run, check=check)
            sums["grad_norm"] += float(acc.clip_grad_norm_(run.policy.parameters(), t.grad_clip))
            sums["optimizer_steps"] += 1
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            if cfg.rollout.engine == "vllm":  # the next rollouts sample from the updated policy
                run.weight_version += 1
                push_weights(run.engine, acc.unwrap_model(run.policy).model, version=run.weight_version)
    run.policy.eval()
    stats = reduce_update_stats(acc, sums)
    return stats if engine is None else {**stats, **engine_stats}


def micro_loss(run: Run, rows: list[Rollout], adv: torch.Tensor, old: list | None, ref: list | None,
               num_valid: torch.Tensor, engine: EngineCheck | None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss (already divided by the minibatch's global `num_valid`) and its
    metric sums. `old=None`: on-policy, old log-probs are this forward's own (detached), and the
    entropy and the engine comparison (`engine`, real micro-batches only) come from it too."""
    a, acc = run.cfg.algo, run.acc
    batch = to_device(collate(rows, run.pad_id, run.placeholders), acc.device)
    valid = torch.tensor([r.valid for r in rows], device=acc.device)[:, None]  # [B, 1]
    mask = batch.completion_mask * valid  # [B, C] failed samples contribute nothing
    logp, ent = run.policy(batch, run.cfg.rollout.temperature)  # [B, C], [B, C]
    old_logp = logp.detach() if old is None else pad_rows(old, logp.shape[1]).to(acc.device)  # [B, C]
    advantages = adv.to(acc.device, logp.dtype)[:, None] * mask  # [B, C]
    loss, metrics = compute_policy_loss(a.loss, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                                        agg=a.agg, clip_low=a.clip_low, clip_high=a.clip_high, num_valid=num_valid)
    tokens = float(mask.sum())
    out = {"loss/policy": float(loss.detach()), "tokens": tokens, **{k: float(v) * tokens for k, v in metrics.items()
                                                             if k in ("clip_fraction", "approx_kl", "ratio_mean")}}
    out["ratio_max"] = float(metrics["ratio_max"]) if tokens else 1.0
    if old is None:
        out["entropy"] = float((ent * mask).sum())  # token-weighted; reduce_update_stats takes the mean
        if engine is not None:
            for row, r in enumerate(rows):
                if r.valid:
                    engine.add(logp[row, : len(r.completion_ids)], r.engine_logprobs)
    if ref is not None:
        kl = compute_kl(a.kl, logp, pad_rows(ref, logp.shape[1]).to(acc.device))  # [B, C]
        kl_loss = aggregate(kl, mask, a.agg, num_valid=num_valid)
        loss = loss + a.kl_coef * kl_loss
        out["loss/kl"] = float(kl_loss.detach())
    return loss, out

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
