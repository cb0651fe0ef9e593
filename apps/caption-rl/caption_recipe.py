"""caption-rl: CapRL++ caption RL, a recipe on the shared trainer loop (`rl_core.train.loop`).

A Qwen-VL captioner samples `rollout.n` captions per image/video; a judge LLM answers the row's
multiple-choice questions from each caption alone (CapRL's QA reward), plus 0.2 x timestamp
format (videos) and 0.2 x length; group advantages (GRPO/RLOO); clipped policy-gradient updates.
The loop owns the schedule; the hooks below say what only captioning knows. `uv run
apps/caption-rl` runs the embedded tiny default (`__main__.py` reads the command line and the
config before this module and torch load); see README.md next to this file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from caption_config import DEFAULT_CONFIG, ENV, NAME, Config, default_config
from caption_data import Dataset, Encoded, encode_records, load_records, make_sample
from caption_model import load_policy, reference_model

from rl_core.train import (
    Checkpoint,
    ConfigError,
    FullWeights,
    GroupAdvantages,
    MergesRounds,
    Recipe,
    RunContext,
    Schedule,
    Scores,
    Skip,
    UserError,
    check_finite_parameters,
    component_means,
    gathered,
    sample_seed,
    sharded_state,
)
from rl_data import GroupSampler, ReadStats
from rl_models.lora import export_model
from rl_models.vl import placeholder_ids
from rl_policy.engine import PolicyEngine
from rl_policy.setup import check_token_config, engine_for, prepare_token_policy
from rl_policy.training import (
    LossOptions,
    engine_check,
    loss_fields,
    regroup,
    replay_tolerance,
    response_metrics,
    rollout_logprobs,
    to_rollouts,
    token_update,
)
from rl_rewards import ScoreResult
from rl_rewards.caprl import (
    JUDGE_ENGINE_KEY,
    CaprlLocalReward,
    CaprlServerReward,
    RewardUnavailable,
    build_caprl_reward,
)
from rl_rewards.client import RewardClientError
from rl_rollout import Drawn, Generation, SamplingParams, resolve_judge_engine
from rl_rollout.streaming import ScoredRollout


@dataclass
class State:
    """Everything the hooks use, built once by `setup`."""

    cfg: Config
    run: RunContext
    data: Dataset
    model: torch.nn.Module  # the trained transformers model (a PeftModel with LoRA)
    policy: torch.nn.Module  # `Policy(model)` prepared: DDP-wrapped or FSDP2-sharded
    processor: Any
    engine: PolicyEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reward: CaprlLocalReward | CaprlServerReward
    sampler: GroupSampler
    frozen_reference: torch.nn.Module | None  # full fine-tuning with a KL term: the initial policy
    full: FullWeights | None  # a sharded policy's full weights, for the engine and the export
    placeholders: frozenset[int]  # vision placeholder tokens a drifted policy can sample
    bad_records: ReadStats = field(default_factory=ReadStats)  # records that failed to become model input
    prompts_per_rank: int = 0  # train.batch_size / processes
    stream: bool = False  # reward.stream in effect: a served reward


@dataclass(frozen=True)
class Batch:
    """This process's rollouts of one step."""

    encoded: Encoded  # the step's records as model input
    generations: list[Generation]  # rollout.n per kept record, request-major
    scored: ScoredRollout[Scored] | None = None  # reward.stream: the rewards, scored while the batch sampled
    prompt_ids: tuple[int, ...] = ()  # the data index of each kept record (`RunContext.record_prompts`)


Scored = tuple[ScoreResult, str]  # a caption's reward, and the error of a server down after its retries ("" if up)


def _score(s: State, encoded: Encoded, gens: list[Generation]) -> list[Scored]:
    """The rewards of `gens` (one server request; `generate_scored` calls it per chunk).

    Called from two threads at once in an asynchronous run with reward.stream: the rollout
    thread's scoring worker, and this thread (an evaluation; a dynamic-sampling round's own
    worker). `CaprlServerReward` takes that unlocked: its `RewardClient` keeps no state per call over
    one `httpx.Client`, which httpx documents as shareable between threads; the length reward's
    composition keeps its state per call, and its tokenizer is only read (the same arguments every
    call, so transformers never reconfigures the Rust tokenizer, what raises tokenizers' "Already
    borrowed" when another thread encodes)."""
    samples = [make_sample(encoded.records[g.request_index], g.text, len(g.completion_ids)) for g in gens]
    try:
        return [(result, "") for result in s.reward.score(samples)]
    except RewardUnavailable as e:
        return [(ScoreResult.failed(str(e)), f"rank {s.run.rank}: {e}") for _ in samples]


def _scored(s: State, encoded: Encoded, gens: list[Generation], scored: list[Scored] | None = None,
            ) -> tuple[list[ScoreResult], list[dict[str, Any]], str]:
    """The rewards of `gens` (`scored`: already scored, else now), their sample-log rows, and the
    error of a reward server down after its retries (its samples then failed)."""
    scored = _score(s, encoded, gens) if scored is None else scored
    results, error = [r for r, _ in scored], next((e for _, e in scored if e), "")
    prompts = [make_sample(encoded.records[g.request_index], g.text).prompt for g in gens]
    return results, [{"prompt": p, "caption": g.text, "reward": res.score, "components": res.components,
                      "error": res.error} for p, g, res in zip(prompts, gens, results, strict=True)], error


class CaptionRL(Recipe[Config, State, Batch], MergesRounds[State, Batch]):
    name = NAME
    partial_rollouts = True
    config = Config
    default_config = DEFAULT_CONFIG
    env = ENV

    def config_path(self, given: Path | None) -> Path | None:
        """No `--config`: `caption_config.default_config()` (the embedded tiny default, or none
        under a CapRL++ launch line)."""
        return given if given is not None else default_config()

    def check(self, cfg: Config, world_size: int) -> None:
        check_token_config(cfg.algo, cfg.rollout, cfg.train, world_size)
        if cfg.algo.reward_aggregation == "normalize_then_sum" and cfg.reward.server_url():
            raise ConfigError("algo.reward_aggregation=normalize_then_sum weighs the reward's components itself: it "
                              "needs the reward in process (reward.url / reward.host unset)")
        if cfg.reward.length_l1 >= cfg.reward.length_l2:
            raise ConfigError(f"reward.length_l1={cfg.reward.length_l1} must be below reward.length_l2="
                              f"{cfg.reward.length_l2} (the length reward falls from 1 at l1 to 0 at l2)")
        if isinstance(cfg.reward.spec, str) and not Path(cfg.reward.spec).is_file():
            raise ConfigError(f"reward.spec file not found: {cfg.reward.spec}")
        if not (cfg.reward.server_url() or cfg.reward.spec is not None):  # the judge in process
            resolve_judge_engine(cfg.reward.judge_engine, key=JUDGE_ENGINE_KEY, world_size=world_size)

    def setup(self, cfg: Config, run: RunContext) -> State:
        t, r, m = cfg.train, cfg.rollout, cfg.model
        acc = run.accelerator
        data = load_records(cfg.data.train_files, cfg.data.val_files, eval_size=cfg.data.eval_size, task=cfg.data.task, seed=t.seed)
        model, processor, policy_path = load_policy(m)
        try:
            reward = build_caprl_reward(cfg.reward, policy_path=policy_path, seed=t.seed, world_size=run.world_size)
        except RewardClientError as e:  # a server that does not answer at start
            raise UserError(str(e)) from None
        trained = prepare_token_policy(run, model, t)
        engine = engine_for(r, run, model=model, processor=processor, path=policy_path, dtype=m.dtype, full=trained.full,
                            optimizer=trained.optimizer, offload_optimizer=r.offload_optimizer,
                            release_cache=r.release_cache, compile_mode=r.compile_mode)
        sampler = GroupSampler(len(data.train), r.n, seed=t.seed, rank=run.rank, world_size=run.world_size)
        frozen = (load_policy(m, trainable=False)[0].to(acc.device)
                  if cfg.algo.kl_coef > 0 and m.lora_rank == 0 else None)
        return State(cfg, run, data, model, trained.policy, processor, engine, trained.optimizer, trained.scheduler,
                     reward, sampler, frozen, trained.full, placeholder_ids(model.config),
                     prompts_per_rank=t.batch_size // run.world_size,
                     stream=cfg.reward.stream and isinstance(reward, CaprlServerReward) and not t.partial_rollouts.steps)

    def policy(self, s: State) -> PolicyEngine:
        return s.engine

    def schedule(self, s: State) -> Schedule:
        t = s.cfg.train
        total = t.epochs * math.ceil(s.sampler.prompts_per_rank / s.prompts_per_rank)
        note = ""
        if t.max_steps is not None and t.max_steps > total:
            note = (f"train.max_steps={t.max_steps} is more than train.epochs={t.epochs} give ({total} steps): "
                    f"the run stops after {total}; raise train.epochs for more")
        every = t.eval_freq if s.data.eval else 0
        return Schedule(min(total, t.max_steps or total), eval_every=every, eval_at_start=every > 0, eval_at_end=every > 0,
                        note=note)

    def checkpoint(self, s: State) -> Checkpoint:
        return Checkpoint(state={"sampler": s.sampler, **sharded_state(s.policy, s.optimizer)},
                          trained=s.model)

    def sample(self, s: State, step: int) -> Batch:
        """The step's captions (train.max_staleness >= 1: on the rollout thread, from the
        engine's own weights; they are reproducible with rollout.per_prompt_seeds)."""
        r = s.cfg.rollout
        params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)
        if s.cfg.train.partial_rollouts.steps:
            return _partial_sample(s, step, params)
        picked = s.sampler.next_prompts(s.prompts_per_rank)
        enc = encode_records([s.data.train[i] for i in picked], [s.data.train_where[i] for i in picked], s.processor,
                             s.cfg.data, r.max_prompt_length, s.bad_records)
        # each group from its own seed: independent of the process count and batch split
        seeds = [sample_seed(s.cfg.train.seed, step, picked[i]) for i in enc.positions] if r.per_prompt_seeds else None
        # the server scores each prompt's captions while the next prompt samples (reward.stream)
        score = (lambda _, gens: _score(s, enc, gens)) if s.stream else None
        generations, scored = s.engine.sample(enc.messages, params, seeds=seeds, score=score)
        for g in generations:
            if g.prompt_ids != enc.prompts[g.request_index].ids:
                raise RuntimeError(f"prompt {g.request_index}: the engine encoded it differently from the trainer")
        return Batch(enc, generations, scored, tuple(picked[i] for i in enc.positions))

    def score(self, s: State, step: int, batch: Batch) -> Scores | Skip:
        """Rewards of every caption, or a reason (agreed over processes) to skip the step. A
        caption that sampled a vision placeholder token is left out like a failed reward."""
        acc, gens = s.run.accelerator, batch.generations
        results, rows, error = _scored(s, batch.encoded, gens, batch.scored.results() if batch.scored else None)
        if not error and results and all(x.score is None for x in results):
            error = f"rank {s.run.rank}: every sample failed to score; first error: {results[0].error}"
        if not gens:
            error = error or "no rollouts on some process (every prompt over rollout.max_prompt_length or a bad record?)"
        if acc.reduce(torch.tensor([float(bool(error))], device=acc.device), "max").item() > 0:
            return Skip(error or "another process failed to score")
        placeholder = [any(tok in s.placeholders for tok in g.completion_ids) for g in gens]
        rewards = torch.tensor([x.score if x.score is not None and not bad else math.nan
                                for x, bad in zip(results, placeholder, strict=True)])  # [B] NaN: left out
        groups = torch.tensor([s.run.rank * s.prompts_per_rank + g.request_index for g in gens])  # [B]
        s.run.samples.write("train", step, rows[: s.cfg.train.samples_to_log])
        counts = acc.reduce(torch.tensor([float(sum(placeholder)), float(batch.encoded.too_long),
                                          float(s.bad_records.skipped)], device=acc.device), "sum").tolist()
        return Scores(rewards, groups, s.cfg.algo.advantage, components=[x.components for x in results], metrics={
            **response_metrics(acc, gens), "response/placeholder_rows": counts[0],
            "rollout/dropped_long": counts[1], "data/skipped_records": s.data.skipped + counts[2]},
            aggregation=s.cfg.algo.reward_aggregation, weights=s.reward.weights)

    def merge(self, s: State, groups: Sequence[tuple[Batch, Sequence[int]]]) -> Batch:
        """The kept groups of several rounds (dynamic sampling) as one batch, a record per group."""
        heads, gens = regroup(groups, lambda batch: batch.generations)
        picked = [(batch.encoded, r) for batch, r in heads]
        encoded = Encoded([e.records[r] for e, r in picked], [e.prompts[r] for e, r in picked],
                          [e.messages[r] for e, r in picked], [e.positions[r] for e, r in picked],
                          sum({id(b.encoded): b.encoded.too_long for b, _ in groups}.values()))
        return Batch(encoded, gens, prompt_ids=tuple(batch.prompt_ids[r] for batch, r in heads))

    def update(self, s: State, step: int, batch: Batch, advantages: GroupAdvantages) -> dict[str, float]:
        cfg, acc, a, t = s.cfg, s.run.accelerator, s.cfg.algo, s.cfg.train
        gens = batch.generations
        s.run.record_prompts(step, batch.prompt_ids)
        rollouts = to_rollouts(gens, advantages.valid, batch.encoded.prompts)
        first, tolerance = s.run.first_step(step), replay_tolerance(a.replay_tolerance, s.model, s.cfg.rollout.precision)
        options = dict(micro_batch_size=t.micro_batch_size, temperature=cfg.rollout.temperature,
                       pad_id=s.engine.pad_id, device=acc.device, placeholders=s.placeholders)
        mini = t.mini_batch_size or t.batch_size
        on_policy = a.ppo_epochs == 1 and mini == t.batch_size  # one optimizer step per batch: old = the update's own
        stats: dict[str, float] = {}
        with s.run.timer("logprob"):
            old = None if a.old_logprobs == "auto" and on_policy else rollout_logprobs(
                acc.unwrap_model(s.policy), rollouts, **options)  # through the Policy: a sharded one gathers in its forward
            if old is not None:
                stats = engine_check(rollouts, old).verify(acc, tolerance if first else math.inf, "first replay")
            ref = None
            if a.kl_coef > 0:
                with reference_model(acc.unwrap_model(s.policy), s.model, s.frozen_reference) as reference:
                    ref = rollout_logprobs(reference, rollouts, **options)
        update = token_update(
            acc, s.policy, s.optimizer, rollouts, advantages.advantages,
            options=LossOptions(kl=a.kl, kl_coef=a.kl_coef, temperature=cfg.rollout.temperature,
                                norm_length=cfg.rollout.max_new_tokens, **loss_fields(a)),
            old=old, ref=ref, num_minibatches=t.batch_size // mini, micro_batch_size=t.micro_batch_size,
            ppo_epochs=a.ppo_epochs, grad_clip=t.grad_clip, guard=s.run.guard, pad_id=s.engine.pad_id,
            placeholders=s.placeholders, scheduler=s.scheduler, check_tolerance=tolerance if first else None)
        return {**stats, **update,
                "lr": float(s.scheduler.get_last_lr()[0]), **(s.full.pop_metrics() if s.full is not None else {})}

    def evaluate(self, s: State, step: int) -> dict[str, float]:
        """Captions at rollout.eval_temperature (greedy at 0) for the held-out records (sharded over
        processes), their reward and components; the captions go to samples/eval-step-<step>.jsonl."""
        mine = slice(s.run.rank, None, s.run.world_size)
        enc = encode_records(s.data.eval[mine], s.data.eval_where[mine], s.processor, s.cfg.data,
                             s.cfg.rollout.max_prompt_length, s.bad_records)
        held_out = range(len(s.data.eval))[mine]  # a caption's seed follows its record, not the process count
        gens, _ = s.engine.sample(enc.messages, SamplingParams(temperature=s.cfg.rollout.eval_temperature,
                                                                max_new_tokens=s.cfg.rollout.max_new_tokens),
                                  seeds=[sample_seed(s.cfg.train.seed, step, -1 - held_out[i]) for i in enc.positions])
        rows = gather_object(_scored(s, enc, gens)[1])
        s.run.samples.write(f"eval-step-{step:06d}", step, rows)
        scores = [r["reward"] for r in rows if r["reward"] is not None]
        return {"reward/mean": sum(scores) / len(scores) if scores else math.nan,
                "reward/failed": float(len(rows) - len(scores)), **component_means([r["components"] for r in rows])}

    def finish(self, s: State) -> dict[str, str]:
        out = s.run.run_dir / "export"
        if s.cfg.train.export:
            check_finite_parameters(s.model, "export")
            with gathered(s.full, s.model) as model:  # a sharded policy: its full weights, on every process
                if s.run.is_main:
                    export_model(model, out, processor=s.processor)
        skipped = s.run.accelerator.reduce(torch.tensor(float(s.bad_records.skipped), device=s.run.device), "sum")
        return {"exported model": str(out) if s.cfg.train.export else "(train.export = false)",
                "skipped records": f"{s.data.skipped} when read, {int(skipped.item())} as model input (file and line "
                                   "in the log)"}

    def close(self, s: State) -> None:
        s.engine.close()
        s.reward.close()


def _partial_sample(s: State, step: int, params: SamplingParams) -> Batch:
    """`sample` with train.partial_rollouts: the first groups to finish of those in flight
    (`PolicyEngine.sample_groups`), each prompt drawn and encoded when it joins them."""
    too_long = 0

    def draw(count: int) -> Drawn:
        nonlocal too_long
        picked = s.sampler.next_prompts(count)
        enc = encode_records([s.data.train[i] for i in picked], [s.data.train_where[i] for i in picked], s.processor,
                             s.cfg.data, s.cfg.rollout.max_prompt_length, s.bad_records)
        too_long += enc.too_long
        keys = [(picked[i], record, prompt, message) for i, record, prompt, message
                in zip(enc.positions, enc.records, enc.prompts, enc.messages, strict=True)]
        return keys, enc.messages, [sample_seed(s.cfg.train.seed, step, picked[i]) for i in enc.positions]

    keys, generations = s.engine.sample_groups(draw, s.prompts_per_rank, params)
    enc = Encoded([k[1] for k in keys], [k[2] for k in keys], [k[3] for k in keys], list(range(len(keys))), too_long)
    return Batch(enc, generations, None, tuple(k[0] for k in keys))


RECIPE = CaptionRL()
