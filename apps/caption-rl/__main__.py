"""caption-rl: CapRL++ caption RL on Accelerate.

A Qwen-VL captioner samples `rollout.n` captions per image/video; a judge LLM answers the row's
multiple-choice questions from each caption alone (CapRL's QA reward), plus 0.2 x timestamp
format (videos) and 0.2 x length; group advantages (GRPO/RLOO); clipped policy-gradient updates.

    uv run apps/caption-rl                                  # embedded tiny CPU default
    uv run apps/caption-rl --config examples/caption-rl/caprl-plus-plus.toml
    accelerate launch apps/caption-rl/__main__.py --config FILE train.batch_size=64
    uv run apps/caption-rl --resume                          # continue the latest run
    uv run apps/caption-rl --help                            # every key, default, env var

The recipe, one step: setup -> rollout (the `hf` engine decodes with the training model itself;
a colocated vLLM engine gets the weights after every optimizer step) -> reward (in process or a
running `rl-rewards serve`) -> advantages (`rl_core.train.group_advantages`: every process's
groups, failed samples left out) -> update (`rl_rollout.training.token_update`) -> checkpoint
-> eval. The shared phases live in `rl_core.train` and `rl_rollout.training`; what is here is
what only captioning knows. See README.md next to this file.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from accelerate import Accelerator
from caption_config import Config, flat_config, parse_config
from caption_metrics import response_metrics
from caption_parts import load_records, placeholder_ids
from caption_phases import evaluate, sample_rows, score
from caption_rollout import encode_records, take
from caption_setup import (
    Run,
    awake_engine,
    build_reward_backend,
    check_sharding,
    export,
    load_policy,
    reference_model,
)
from caption_sync import build_engine, push_weights

from rl_core.train import (
    FullWeights,
    MetricsLogger,
    NonFiniteGuard,
    OptimizerOffload,
    SampleLog,
    TrainProgress,
    UserError,
    accelerator_kwargs,
    check_finite_parameters,
    end_training,
    gathered,
    group_advantages,
    load_checkpoint,
    make_run_dir,
    plot_reward_curve,
    prepare_policy,
    resolve_resume,
    resolve_sharding,
    run_app,
    sample_seed,
    save_checkpoint,
    seed_everything,
    sharded_state,
)
from rl_data import GroupSampler
from rl_models.logprobs import unwrap_peft
from rl_rollout import SamplingParams, resolve_engine_kind
from rl_rollout.training import (
    LossOptions,
    Policy,
    Rollout,
    engine_check,
    rollout_logprobs,
    token_update,
)

# ------------------------------------------------------------------------------------- setup


def setup(cfg: Config, resume: str | None) -> Run:
    t, r = cfg.train, cfg.rollout
    # cpu=True without CUDA: `accelerate launch --multi_gpu --num_processes N` then gives N gloo processes
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=list(t.log_with) or None,
                      **accelerator_kwargs(sharding=t.sharding, cpu_offload=t.fsdp_cpu_offload))
    check_sharding(acc)
    plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision, cpu_offload=t.fsdp_cpu_offload,
                            activation_checkpointing=t.fsdp_activation_checkpointing)
    engine_kind, why = resolve_engine_kind(r.engine, key="rollout.engine")  # before anything loads
    acc.print(f"rollout engine: {why}")
    world, mini = acc.num_processes, t.mini_batch_size or t.batch_size
    if t.batch_size % world or t.batch_size % mini:
        raise UserError(f"train.batch_size={t.batch_size} must divide by the {world} processes and by "
                        f"train.mini_batch_size={mini}")
    ckpt = resolve_resume(resume, t.output_dir)
    name = ckpt.parent.parent.name if ckpt is not None else t.run_name
    if ckpt is not None and t.run_name not in (None, name):
        raise UserError(f"--resume continues run {name!r}, but train.run_name={t.run_name!r} names another run: "
                        "drop train.run_name, or resume that run's directory")
    run_dir = make_run_dir(t.output_dir, name, config=cfg, accelerator=acc)
    seed_everything(t.seed, rank=acc.process_index)
    d = cfg.data
    data = load_records(d.train, d.eval, eval_size=d.eval_size, task=d.task, seed=t.seed)
    model, processor, policy_path = load_policy(cfg.model)
    reward = build_reward_backend(cfg, policy_path)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))
    full = FullWeights(model, device=acc.device) if plan.sharded else None  # the engine's (and export's) copy, filled when used
    policy, optimizer, scheduler = prepare_policy(acc, Policy(model), optimizer, scheduler, plan)
    engine = build_engine(engine_kind, full.model if full is not None else acc.unwrap_model(policy).model, processor,
                          path=policy_path, dtype=cfg.model.dtype,
                          max_batch_size=r.max_batch_size, compile_mode=r.compile_mode,
                          gpu_memory_utilization=r.gpu_memory_utilization, rank=acc.process_index, world_size=world,
                          engine_options=r.engine_options)
    sampler = GroupSampler(len(data.train), r.n, seed=t.seed, rank=acc.process_index, world_size=world)
    start = 0
    if ckpt is not None:
        start = load_checkpoint(ckpt, state={"sampler": sampler, **sharded_state(policy, optimizer)},
                                accelerator=acc)["step"]
        acc.print(f"resumed from {ckpt} at step {start}")
    per_rank = t.batch_size // world
    total = t.epochs * math.ceil(sampler.prompts_per_rank / per_rank)
    if t.max_steps is not None and t.max_steps > total:
        acc.print(f"train.max_steps={t.max_steps} is more than train.epochs={t.epochs} give ({total} steps): "
                  f"the run stops after {total}; raise train.epochs for more")
    total = min(total, t.max_steps) if t.max_steps is not None else total
    if t.log_with:
        acc.project_configuration.logging_dir = str(run_dir / "logs")
        acc.init_trackers("caption-rl", config=flat_config(cfg))
    reference = None
    if cfg.algo.kl_coef > 0 and cfg.model.lora_rank == 0:
        reference = load_policy(cfg.model, trainable=False)[0].to(acc.device)
    pad_id = processor.tokenizer.pad_token_id
    pad_id = processor.tokenizer.eos_token_id if pad_id is None else pad_id
    offload = (r.offload_optimizer == "always" or (r.offload_optimizer == "auto" and engine_kind == "hf")) and not plan.sharded
    run = Run(cfg, acc, run_dir, policy, processor, engine, optimizer, scheduler, reward, sampler, data, per_rank,
              total, start, reference, SampleLog(run_dir, main=acc.is_main_process, start_step=start),
              guard=NonFiniteGuard(t.max_nonfinite_steps), pad_id=pad_id,
              placeholders=placeholder_ids(unwrap_peft(model).config),
              optimizer_offload=OptimizerOffload(optimizer, acc.device) if offload and acc.device.type == "cuda" else None,
              full=full)
    run.engine_kind = engine_kind
    if engine_kind == "vllm":  # the checkpoint it loaded may be older than the policy (--resume)
        sync_vllm(run, bump=False)
    return run


# ------------------------------------------------------------------------------- the step


def rollout(run: Run, step: int) -> tuple[list, list, list]:
    """This process's prompts for the step, encoded (bad records skipped and counted), and their
    generations; returns (records, encoded prompts, generations)."""
    r = run.cfg.rollout
    n = r.n
    picked = take(run.sampler, run.prompts_per_rank * n)[::n]  # one index per group
    records, encoded, messages, positions = encode_records(run, [run.data.train[i] for i in picked],
                                                           [run.data.train_where[i] for i in picked])
    params = SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)
    with awake_engine(run) as engine:
        if not r.per_prompt_seeds:
            generations = engine.generate(messages, params)
        else:  # each group from its own seed: independent of the process count and the batch split
            generations = [msgspec.structs.replace(g, request_index=i) for i, position in enumerate(positions)
                           for g in engine.generate([messages[i]], msgspec.structs.replace(
                               params, seed=sample_seed(run.cfg.train.seed, step, picked[position])))]
    for g in generations:
        if g.prompt_ids != encoded[g.request_index].ids:
            raise RuntimeError(f"prompt {g.request_index}: the engine encoded it differently from the trainer")
    return records, encoded, generations


def step_once(run: Run, step: int) -> dict[str, Any]:
    cfg, acc, a = run.cfg, run.acc, run.cfg.algo
    version = run.weight_version  # optimizer steps the vllm engine's weights hold (hf: always current)
    with run.timer("generate"):
        records, encoded, generations = rollout(run, step)
    with run.timer("reward"):
        results, error = score(run, records, generations)
    if error:
        print(f"step {step} skipped: {error}", file=sys.stderr)
        return {"skipped": 1, "error": error[:300]}
    placeholder = [any(tok in run.placeholders for tok in g.completion_ids) for g in generations]
    scores = torch.tensor([x.score if x.score is not None and not bad else math.nan
                           for x, bad in zip(results, placeholder, strict=True)])  # [B] NaN: left out
    groups = torch.tensor([acc.process_index * run.prompts_per_rank + g.request_index for g in generations])  # [B]
    adv = group_advantages(a.advantage, scores, groups, accelerator=acc)
    rollouts = [Rollout(encoded[g.request_index], g.completion_ids, g.logprobs, valid=bool(adv.valid[i]))
                for i, g in enumerate(generations)]
    first = step == run.start_step + 1
    tolerance = a.replay_tolerance if a.replay_tolerance is not None else (
        1e-3 if next(run.model.parameters()).dtype == torch.float32 else 5e-2)
    options = dict(micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
                   pad_id=run.pad_id, device=acc.device, placeholders=run.placeholders)
    stats: dict[str, float] = {}
    with run.timer("logprob"):
        old = None if a.old_logprobs == "auto" and run.on_policy else rollout_logprobs(
            acc.unwrap_model(run.policy), rollouts, **options)  # through the Policy: a sharded one gathers in its forward
        if old is not None:
            stats = engine_check(rollouts, old).verify(acc, tolerance if first else math.inf, "first replay")
        ref = None
        if a.kl_coef > 0:
            with reference_model(run) as reference:
                ref = rollout_logprobs(reference, rollouts, **options)
    with run.timer("update"):
        t = cfg.train
        update = token_update(
            acc, run.policy, run.optimizer, rollouts, [adv.advantages[i].expand(len(r.completion_ids))
                                                       for i, r in enumerate(rollouts)],
            options=LossOptions(a.loss, a.agg, a.clip_low, a.clip_high, a.kl, a.kl_coef, cfg.rollout.temperature,
                                norm_length=cfg.rollout.max_new_tokens),
            old=old, ref=ref, num_minibatches=t.batch_size // (t.mini_batch_size or t.batch_size),
            micro_batch_size=t.micro_batch_size, ppo_epochs=a.ppo_epochs, grad_clip=t.grad_clip, guard=run.guard,
            pad_id=run.pad_id, placeholders=run.placeholders, scheduler=run.scheduler,
            check_tolerance=tolerance if first else None, after_step=lambda: sync_vllm(run))
    run.samples.write("train", step, [
        {"prompt": s["prompt"], "caption": s["caption"], "reward": s["reward"], "components": s["components"],
         "error": s["error"]} for s in sample_rows(records, generations, results)[: cfg.train.samples_to_log]])
    return {"skipped": 0, "rollout/weight_version": float(version), **adv.metrics, **response_metrics(acc, generations, results), **stats, **update,
            **{k: v for k, v in zip(("response/placeholder_rows", "rollout/dropped_long"), acc.reduce(torch.tensor(
                [float(sum(placeholder)), float(run.dropped_long)], device=acc.device), "sum").tolist(), strict=True)}}


def sync_vllm(run: Run, bump: bool = True) -> None:
    """A colocated vLLM engine samples the next rollouts from the updated policy (a sharded
    policy's full weights gathered for the push and freed after)."""
    if run.engine_kind == "vllm":
        run.weight_version += bump
        with gathered(run.full, run.model) as model:
            push_weights(run.engine, model, version=run.weight_version)


# ------------------------------------------------------------------------------ eval, main


def checkpoint(run: Run, step: int) -> None:
    check_finite_parameters(run.model, f"checkpoint at step {step}")
    save_checkpoint(run.run_dir / "checkpoints", step,
                    state={"sampler": run.sampler, **sharded_state(run.policy, run.optimizer)}, accelerator=run.acc,
                    keep_last=run.cfg.train.keep_last)


def train(cfg: Config, resume: str | None = None) -> Path:
    """The recipe: setup, then per step rollout -> reward -> advantages -> update -> log ->
    eval -> checkpoint; export at the end. Returns the run directory."""
    run = setup(cfg, resume)
    acc, t = run.acc, cfg.train
    logger = MetricsLogger(run.run_dir, accelerator=acc, start_step=run.start_step)
    with TrainProgress(run.total_steps, initial=run.start_step, show=("reward/mean", "eval/reward/mean"),
                       accelerator=acc) as bar:
        for step in range(run.start_step + 1, run.total_steps + 1):
            began = time.perf_counter()
            metrics = step_once(run, step)
            seconds = time.perf_counter() - began
            metrics.update(run.timer.pop() | (run.full.pop_metrics() if run.full is not None else {}))
            tokens = metrics.pop("tokens", 0.0)
            metrics.update({"time/step": seconds, "throughput/tokens_per_s": tokens / (seconds * acc.num_processes),
                            "lr": run.scheduler.get_last_lr()[0], "world_size": acc.num_processes,
                            "data/skipped_records": run.data.skipped + acc.reduce(torch.tensor(
                                float(run.bad_records.skipped), device=acc.device), "sum").item()})
            if t.eval_freq > 0 and run.data.eval and (step % t.eval_freq == 0 or step == run.total_steps):
                with run.timer("eval"):
                    metrics.update(evaluate(run, step))
                metrics.update(run.timer.pop())
            logger.log(step, metrics)  # logged before the checkpoint: a resume never loses a logged step
            bar.update(step, metrics)
            if step % t.save_freq == 0 or step == run.total_steps:
                checkpoint(run, step)
            if acc.is_main_process:
                plot_reward_curve(run.run_dir)
    acc.wait_for_everyone()
    if t.export:
        check_finite_parameters(run.model, "export")
        with gathered(run.full, run.model) as model:  # a sharded policy: its full weights, on every process
            if acc.is_main_process:
                export(model, run.processor, run.run_dir / "export")
    end_training(acc)  # every process waits for rank 0's export
    d = run.run_dir
    capped = (f"; train.epochs={t.epochs} ended the run before train.max_steps={t.max_steps}"
              if t.max_steps is not None and t.max_steps > run.total_steps else "")
    acc.print(f"\ncaption-rl finished: {run.total_steps} steps{capped} "
              f"({run.data.skipped} malformed/QA-less records skipped)\n"
              f"  run directory   {d}\n  metrics         {d / 'metrics.csv'}\n  reward curve    {d / 'reward_curve.png'}\n"
              f"  sample captions {d / 'samples'}\n  checkpoints     {d / 'checkpoints'}\n"
              f"  exported model  {d / 'export' if t.export else '(train.export = false)'}")
    return d


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_config(sys.argv[1:] if argv is None else argv)
    return None if parsed is None else train(*parsed)


if __name__ == "__main__":
    sys.exit(run_app("caption-rl", main))
