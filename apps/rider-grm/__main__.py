"""rider-grm: VeRL-with-RMs on Accelerate — a text policy trained with REINFORCE++ (or GRPO/RLOO)
on a rule reward plus several generative judges plus an embedding-similarity reward.

    uv run apps/rider-grm                                    # embedded tiny CPU default
    uv run apps/rider-grm --config examples/rider-grm/verl-with-rms.toml   # the verl-with-rms preset
    accelerate launch apps/rider-grm/__main__.py --config FILE train.batch_size=128
    uv run apps/rider-grm --resume                            # continue the latest run
    uv run apps/rider-grm --help                              # every key, default, env var

One step: group sampler -> generate with the policy (`rollout.engine`: the `hf` engine wraps
the training model; a colocated vLLM engine is woken for it and sleeps again) -> put the policy
(and the optimizer state) to sleep -> rule reward -> each judge woken in turn, scores the
samples its gate lets through, goes back to sleep -> embedding similarity -> fold the
components -> advantages -> log-prob replay -> clipped policy-gradient update with the k3 KL
loss (`policy_update`, on `rl_core.train` / `rl_rollout.training`; a vLLM engine gets the
weights after every optimizer step) -> validate -> log -> checkpoint. Beside this file:
`rider_config`, `policy_engine` (hf or vLLM), `rewarding` (rows, judges, the fold), `judging`,
`swapping` (the swap plan), `rider_summary`. See README.md next to this file.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, cast

import msgspec
import policy_engine
import torch
from accelerate import Accelerator
from judging import Judge, PhaseMonitor, SwappedJudge
from policy_update import advantages, logprobs, to_rollouts, update
from rewarding import (
    build_judges,
    check_served,
    close_judges,
    compose_reward,
    dry_run,
    load_records,
    make_samples,
    messages,
    reward_metrics,
    sample_rows,
    score,
)
from rider_config import (
    DEFAULT_CONFIG,
    ENV,
    Config,
    JudgeConfig,
    check_config,
    judge_configs,
    judge_name,
    resolve_model,
)
from rider_parts import Parts
from rider_summary import print_summary
from swapping import PinnedOffload, PolicySwap, initial_plan
from transformers import PreTrainedModel

from rl_core.train import (
    ConfigError,
    FullWeights,
    MetricsLogger,
    NonFiniteGuard,
    SampleLog,
    TrainProgress,
    UserError,
    accelerator_kwargs,
    check_finite_parameters,
    config_help,
    end_training,
    isolated_rng,
    load_checkpoint,
    load_config,
    make_run_dir,
    parse_cli,
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
from rl_data import GroupSampler, JudgeRecord
from rl_models.text import load_causal_lm
from rl_rollout import Generation, SamplingParams, resolve_engine_kind
from rl_rollout.training import Policy

__all__ = ["Config", "judge_configs", "judge_name", "load_config", "main"]

# ----------------------------------------------------------------------------------- one step


def generate(p: Parts, records: list[JudgeRecord], n: int, temperature: float,
             seeds: list[int] | None = None) -> tuple[list[Generation], int]:
    """Policy rollouts, then the policy goes to sleep if the swap plan says so. Returns the
    generations and how many judge engines were awake during generation. `seeds`: one engine
    call per prompt with its own seed (`rollout.per_prompt_seeds`)."""
    awake = sum(j.state() == "awake" for j in p.judges)
    params = SamplingParams(n=n, temperature=temperature, top_p=p.cfg.rollout.top_p, top_k=p.cfg.rollout.top_k,
                            max_new_tokens=p.cfg.data.max_response_length)
    with p.monitor("generate"), policy_engine.awake(p) as engine:
        if seeds is None:
            gens = engine.generate([messages(r) for r in records], params)
        else:
            gens = [msgspec.structs.replace(g, request_index=i) for i, (r, seed) in enumerate(zip(records, seeds, strict=True))
                    for g in engine.generate([messages(r)], msgspec.structs.replace(params, seed=seed))]
    if p.swap.plan.offload_policy:
        with p.monitor("offload_policy"):
            p.swap.offload()
    return gens, awake


def wake_policy(p: Parts) -> None:
    if p.swap.plan.offload_policy:
        with p.monitor("wake_policy"):
            p.swap.wake()


def reference_logprobs(p: Parts, rollouts: list) -> list[torch.Tensor]:
    """The reference's log-probs; with `model.ref_offload` its weights visit the GPU for this."""
    if p.ref_offload is not None:
        p.ref_offload.to_device()
    try:
        return logprobs(p.ref, rollouts, p.cfg, p.pad_id, p.accelerator.device)
    finally:
        if p.ref_offload is not None:
            p.ref_offload.to_host()


def train_step(p: Parts, step: int, indices: list[int], records: list[JudgeRecord], first: bool) -> dict[str, float]:
    cfg, acc = p.cfg, p.accelerator
    n = cfg.rollout.n
    seeds = [sample_seed(cfg.train.seed, step, i) for i in indices] if cfg.rollout.per_prompt_seeds else None
    version = p.weight_version  # optimizer steps in the weights this rollout samples from (vllm)
    gens, judges_awake = generate(p, records, n, cfg.rollout.temperature, seeds)
    repeated = [r for r in records for _ in range(n)]
    samples = make_samples(repeated, gens, offset=acc.process_index * len(gens))
    with p.monitor("reward"):
        results, logs = score(p.reward, p.judges, samples)
    wake_policy(p)
    scores = torch.tensor([math.nan if r.score is None else r.score for r in results])  # [B] NaN: failed
    everything = to_rollouts(gens, torch.ones(len(gens), dtype=torch.bool))
    model = acc.unwrap_model(p.model).model
    with p.monitor("old_logp"):  # through the Policy: a sharded one gathers its weights in its forward
        old = logprobs(acc.unwrap_model(p.model), everything, cfg, p.pad_id, acc.device)
    ref = None
    if cfg.algo.use_kl_loss or cfg.algo.kl_in_reward:
        with p.monitor("ref_logp"):
            ref = reference_logprobs(p, everything)
    with p.monitor("advantages"):
        adv = advantages(cfg, acc, gens, scores, old, ref)
    with p.monitor("update"):
        actor = update(cfg, acc, p.model, p.optimizer, to_rollouts(gens, adv.valid), adv.advantages, old, ref,
                       p.guard, p.pad_id, first=first, model_dtype=next(model.parameters()).dtype,
                       after_step=lambda: policy_engine.push(p))
    metrics = adv.metrics | reward_metrics(results, logs, "") | actor  # the reward/* of the scores themselves
    metrics["rollout/weight_version"] = float(version)
    lengths = acc.gather(torch.tensor([float(len(g.completion_ids)) for g in gens], device=acc.device))  # [W*B]
    metrics |= {"response_length/mean": lengths.mean().item(),
                "check/judges_awake_during_generate": acc.reduce(torch.tensor(judges_awake, device=acc.device),
                                                                  reduction="sum").item()}
    p.samples.write("train", step, sample_rows(samples, results, logs, cfg.train.samples_to_log))
    return metrics


def plan_swaps(p: Parts, metrics: dict[str, float]) -> None:
    """`reward.swap = "auto"`: after a measured step, keep resident what fits (see `swapping`)."""
    judges = {j.name: j.offload.nbytes / 2**30 for j in p.judges if isinstance(j, SwappedJudge) and j.offload}
    plan = p.swap.decide(metrics, judges)
    if plan is not None:
        for judge in p.judges:
            if isinstance(judge, SwappedJudge):
                judge.swap = plan.sleep_judges
    metrics["swap/offload_policy"] = float(p.swap.plan.offload_policy)
    metrics["swap/sleep_judges"] = float(p.swap.plan.sleep_judges)


def validate(p: Parts, step: int, records: list[JudgeRecord]) -> dict[str, float]:
    """Greedy (val_temperature) rollouts on the val rows, scored by the same reward. Runs on a
    saved-and-restored RNG state, so validating or not never changes the training run (and a
    resumed run repeats the uninterrupted one exactly)."""
    with isolated_rng(), p.monitor.scope("val_"):
        return _validate(p, step, records)


def _validate(p: Parts, step: int, records: list[JudgeRecord]) -> dict[str, float]:
    acc = p.accelerator
    shard = records[acc.process_index :: acc.num_processes]
    if not shard:  # fewer val rows than ranks: this rank repeats the first one, still collects
        shard = records[:1]
    gens, _ = generate(p, shard, 1, p.cfg.rollout.val_temperature)
    samples = make_samples(shard, gens, offset=10**9 + acc.process_index * len(gens))
    results, logs = score(p.reward, p.judges, samples)
    wake_policy(p)
    p.samples.write("val", step, sample_rows(samples, results, logs, p.cfg.train.samples_to_log))
    return reward_metrics(results, logs, "val/")


# ----------------------------------------------------------------------------------- main


def setup(cfg: Config, resume: str | None) -> tuple[Parts, GroupSampler, list[JudgeRecord], list[JudgeRecord], int, MetricsLogger]:
    t = cfg.train
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=t.log_with or None,
                      **accelerator_kwargs(sharding=t.sharding, cpu_offload=t.fsdp_cpu_offload))
    plan = resolve_sharding(acc, t.sharding, mixed_precision=t.fsdp_mixed_precision, cpu_offload=t.fsdp_cpu_offload,
                            activation_checkpointing=t.fsdp_activation_checkpointing)
    engine_kind, why = resolve_engine_kind(cfg.rollout.engine, key="rollout.engine")  # before anything loads
    acc.print(f"rollout engine: {why}")
    seed_everything(cfg.train.seed, rank=acc.process_index)
    policy_path = resolve_model(cfg.model.path)
    model, tokenizer = load_causal_lm(policy_path, dtype=cfg.model.dtype)
    ref, _ = load_causal_lm(policy_path, dtype=cfg.model.dtype)
    ref.requires_grad_(False)
    ref_offload = None
    if cfg.model.ref_offload and acc.device.type != "cpu":
        ref_offload = PinnedOffload(ref, acc.device, frozen=True)
        ref_offload.to_host()  # into pinned buffers once; each step copies them in and drops them
    else:
        ref.to(acc.device)
    judge_cfgs = judge_configs(cfg.reward)
    reads = max((i + 1 for i, j in enumerate(judge_cfgs) if j.prompt == "rm_prompt"), default=0)
    train = load_records(cfg.data.train_files, tokenizer, cfg.data, reads)
    val = load_records(cfg.data.val_files or cfg.data.train_files, tokenizer, cfg.data, reads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    full = FullWeights(model, device=acc.device) if plan.sharded else None  # the engine's copy, filled per rollout (hf) or push (vllm)
    policy, optimizer, _ = prepare_policy(acc, Policy(model), optimizer, None, plan)
    monitor = PhaseMonitor(acc.device)
    engine, judges, swap = build_engines(cfg, acc, engine_kind, policy, full, tokenizer, optimizer, policy_path,
                                         judge_cfgs, len(train[0].rm_prompts), monitor, sharded=plan.sharded)
    reward = compose_reward(cfg, judges, monitor, acc.device)
    sampler = GroupSampler(len(train), cfg.rollout.n, seed=cfg.train.seed, rank=acc.process_index,
                           world_size=acc.num_processes)
    ckpt = resolve_resume(resume, cfg.train.output_dir)
    name = ckpt.parent.parent.name if ckpt is not None else cfg.train.run_name
    if ckpt is not None and cfg.train.run_name not in (None, name):
        raise UserError(f"--resume continues run {name!r}, but train.run_name={cfg.train.run_name!r} names another "
                        "run: drop train.run_name, or resume that run's directory")
    run_dir = make_run_dir(cfg.train.output_dir, name, config=cfg, accelerator=acc)
    step = 0
    if ckpt is not None:
        step = load_checkpoint(ckpt, state={"sampler": sampler, **sharded_state(policy, optimizer)},
                               accelerator=acc)["step"]
    if cfg.train.log_with:
        acc.init_trackers("rider-grm", config=msgspec.to_builtins(cfg))
    logger = MetricsLogger(run_dir, accelerator=acc, start_step=step)
    parts = Parts(cfg, acc, policy, ref, optimizer, engine, judges, reward, monitor, swap, ref_offload, run_dir,
                  SampleLog(run_dir, main=acc.is_main_process, start_step=step),
                  NonFiniteGuard(cfg.train.max_nonfinite_steps), full, engine_kind=engine_kind,
                  pad_id=policy_engine.pad_id(engine, tokenizer))
    try:
        if engine_kind == "vllm":  # the weights it loaded may be older than the policy's (--resume)
            with policy_engine.awake(parts):
                policy_engine.push(parts, bump=False)
        dry_run(parts.judges, val[0])
    except Exception:
        close_judges(parts.judges)
        raise
    return parts, sampler, train, val, step, logger


def build_engines(cfg: Config, acc: Accelerator, engine_kind: str, policy: torch.nn.Module, full: FullWeights | None,
                  tokenizer: Any, optimizer: torch.optim.Optimizer, policy_path: str, judge_cfgs: list[JudgeConfig],
                  n_rm_prompts: int, monitor: PhaseMonitor, *, sharded: bool) -> tuple[Any, list[Judge], PolicySwap]:
    """The judges, then the policy's rollout engine (`policy_engine`), then the swap plan that
    takes them on and off the accelerator. The judges come first: a vLLM engine core started in
    this process (the policy's) fixes vLLM's environment for every engine built after it
    (`judging.vllm_engine_core`)."""
    # with no judge in this process (none, or all served) there is nothing to make room for
    # (a sharded policy stays where it is: its shards are 1/N of it; train.fsdp_cpu_offload keeps them on the host)
    mode = cfg.reward.swap if any(j.engine in ("auto", "hf", "vllm") for j in judge_cfgs) and not sharded else "never"
    judges = build_judges(judge_cfgs, acc.device, monitor, None, n_rm_prompts, sleep=initial_plan(mode).sleep_judges)
    trained = acc.unwrap_model(policy).model
    engine = policy_engine.build(engine_kind, cast(PreTrainedModel, full.model if full is not None else trained),
                                 tokenizer, cfg, path=policy_path, device=acc.device, rank=acc.process_index,
                                 world_size=acc.num_processes)
    for judge in judges:
        if isinstance(judge, SwappedJudge):
            judge.policy = engine  # counts the judge's calls with the policy's engine awake
    swap = PolicySwap(engine, engine.model if engine_kind == "hf" else trained, optimizer, acc.device, mode=mode,
                      offload_optimizer=cfg.model.optimizer_offload, memory_fraction=cfg.reward.swap_memory_fraction)
    if any(isinstance(j, SwappedJudge) and j.offload is None for j in judges):
        swap.pending = False  # a vLLM judge's memory cannot be measured: keep the fixed plan
    return engine, judges, swap


def total_steps(cfg: Config, sampler: GroupSampler, world: int) -> int:
    per_rank = cfg.train.batch_size // world
    if per_rank < 1 or cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be a multiple of the {world} processes")
    steps = cfg.train.epochs * -(-sampler.prompts_per_rank // per_rank)
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps is not None else steps


def next_records(sampler: GroupSampler, train: list[JudgeRecord], prompts: int) -> tuple[list[int], list[JudgeRecord]]:
    """The next `prompts` prompts of this rank (one per group; the engine samples n each), and
    their indices in the data."""
    indices = next(iter(sampler.batches(prompts)))[:: sampler.n]
    return indices, [train[i] for i in indices]


def main(argv: list[str]) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    cli = parse_cli(argv)
    if cli.help:
        print(config_help(Config, env=ENV, prog="rider-grm", defaults=load_config(Config, DEFAULT_CONFIG),
                          defaults_from="the embedded tiny default (configs/default.toml)"))
        return None
    cfg = check_config(load_config(Config, cli.config or DEFAULT_CONFIG, cli.overrides, env=ENV))
    check_served(judge_configs(cfg.reward))  # bad lists, incomplete judges, servers down: before anything loads
    p, sampler, train, val, step, logger = setup(cfg, cli.resume)
    acc = p.accelerator
    total = total_steps(cfg, sampler, acc.num_processes)
    if cfg.train.val_before_train and step == 0:
        logger.log(0, validate(p, 0, val) | p.monitor.pop())
    start = step
    with TrainProgress(total, initial=step, show=("reward/mean",), accelerator=acc) as bar:
        while step < total:
            step += 1
            indices, records = next_records(sampler, train, cfg.train.batch_size // acc.num_processes)
            metrics = train_step(p, step, indices, records, first=step == start + 1)
            if step == total or (cfg.train.test_freq > 0 and step % cfg.train.test_freq == 0):
                metrics |= validate(p, step, val)
            metrics |= p.monitor.pop() | (p.full.pop_metrics() if p.full is not None else {})
            plan_swaps(p, metrics)
            metrics["world_size"] = acc.num_processes
            logger.log(step, metrics)  # logged before the checkpoint: a resume never loses a logged step
            bar.update(step, metrics)
            if step % cfg.train.save_freq == 0 or step == total:
                check_finite_parameters(acc.unwrap_model(p.model), f"checkpoint at step {step}")
                save_checkpoint(p.run_dir / "checkpoints", step,
                                state={"sampler": sampler, **sharded_state(p.model, p.optimizer)}, accelerator=acc,
                                keep_last=cfg.train.keep_last)
            if acc.is_main_process:
                plot_reward_curve(p.run_dir, curves=(("metrics.csv", "reward/mean", "train"),
                                                     ("metrics.csv", "val/reward/mean", "val")))
    end_training(acc)
    close_judges(p.judges)
    if acc.is_main_process and cfg.train.print_summary:
        print_summary(p.run_dir)
    return p.run_dir


if __name__ == "__main__":
    sys.exit(run_app("rider-grm", main))
