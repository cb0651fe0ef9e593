"""rider-grm: VeRL-with-RMs on the shared trainer loop — a text policy trained with REINFORCE++
(or GRPO/RLOO) on a rule reward plus several generative judges plus an embedding-similarity reward.

    uv run apps/rider-grm                                    # embedded tiny CPU default
    uv run apps/rider-grm --config examples/rider-grm/verl-with-rms.toml   # the verl-with-rms preset
    accelerate launch apps/rider-grm/__main__.py --config FILE train.batch_size=128
    uv run apps/rider-grm --resume                            # continue the latest run

The loop (`rl_core.train.loop`) owns the step. rollout: the policy's engine samples, then the old
and reference log-probs, then the policy sleeps as the swap plan says (`rl_policy.swap`). reward: the
rule, each judge woken in turn for what its gate lets through, the similarity, folded (`rewarding`,
`judging`) into token rewards. update: the policy wakes; clipped policy gradient + k3 KL loss (the
loop syncs the engine after each optimizer step); the swap plan decided from the measured peaks.
`__main__.py` reads the command line and the config (`rider_config.py`) before this module and
torch load.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import rewarding
import torch
from judging import Judge, JudgeLog, build_judge, check_served
from rider_config import (
    DEFAULT_CONFIG,
    ENV,
    NAME,
    Config,
    check_config,
    judge_configs,
    resolve_model,
)

from rl_core.kl import compute_kl
from rl_core.train import GroupAdvantages, isolated_rng, sample_seed
from rl_core.train.config import ConfigError
from rl_core.train.offload import PinnedOffload, park_frozen, visiting
from rl_core.train.recipe import Checkpoint, MergesRounds, Recipe, RunContext, Schedule, Scores
from rl_core.train.sharding import sharded_state
from rl_data import GroupSampler, JudgeRecord
from rl_models.text import load_causal_lm
from rl_policy import training
from rl_policy.engine import PolicyEngine
from rl_policy.setup import TrainedPolicy, engine_for, prepare_token_policy
from rl_policy.swap import PolicySwap, initial_plan
from rl_rewards.composition import Reward
from rl_rewards.samples import Sample, ScoreResult
from rl_rollout import Drawn, Generation, SamplingParams
from rl_rollout.streaming import ChunkScorer, ScoredRollout

Scored = tuple[ScoreResult, dict[str, JudgeLog]]  # a sample's reward; a chunk's first row carries its judges' logs


@dataclass
class State:
    cfg: Config
    run: RunContext
    trained: TrainedPolicy  # the prepared `Policy` (DDP-wrapped, or sharded by FSDP2), its optimizer and warm-up
    model: torch.nn.Module  # the transformers model inside it
    ref: torch.nn.Module  # the frozen KL reference
    ref_offload: PinnedOffload | None  # its weights between uses (CUDA, model.ref_offload)
    engine: PolicyEngine
    judges: list[Judge]
    reward: Reward
    swap: PolicySwap
    sampler: GroupSampler
    train: list[JudgeRecord]
    val: list[JudgeRecord]
    stream: bool = False  # reward.stream in effect: every judge served
    # One scoring at a time (the composed reward and the pop of its judges' logs). With
    # reward.stream and train.max_staleness >= 1 the rollout thread's samples are scored on a
    # worker thread while this one may score too (an evaluation; a dynamic-sampling round, whose
    # own worker scores it). The served judges' clients would take both at once (httpx.Client is
    # documented as shareable between threads; RewardClient keeps no state per call), but each
    # `Judge` records into one `JudgeLog` that `pop` hands out whole: two scorings at once would
    # count one's samples and raw outputs in the other's step. The rule (a user's compute_score)
    # and an in-process similarity model are not known to be thread-safe either.
    scoring: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Batch:
    """One step's samples on this process, request-major (a prompt's n samples together)."""

    records: list[JudgeRecord]  # [B] the row of each sample
    gens: list[Generation]  # [B]
    old: list[torch.Tensor] | None  # [B] x [C_i] the policy's log-probs before the update (None: the update's own)
    ref: list[torch.Tensor] | None  # [B] x [C_i] the reference's (KL loss or KL in the reward), else None
    judges_awake: int  # judge engines awake while the policy generated (0 when swapping)
    scored: ScoredRollout[Scored] | None = None  # reward.stream: scored while the batch sampled
    prompt_ids: tuple[int, ...] = ()  # [B / n] the data index of each prompt (`RunContext.record_prompts`)


@dataclass(frozen=True)
class Sampled:
    """One step's samples before the trainer's log-probs (`RiderGRM.sample`)."""

    records: list[JudgeRecord]  # [B]
    gens: list[Generation]  # [B]
    judges_awake: int
    scored: ScoredRollout[Scored] | None = None
    prompt_ids: tuple[int, ...] = ()  # [B / n]


class RiderGRM(Recipe[Config, State, Batch, Sampled], MergesRounds[State, Batch]):
    name, config, default_config, env, partial_rollouts = NAME, Config, DEFAULT_CONFIG, ENV, True

    def check(self, cfg: Config, world_size: int) -> None:
        check_config(cfg, world_size)
        if cfg.reward.spec is None:
            check_served(judge_configs(cfg.reward))  # servers down, unknown specs

    def setup(self, cfg: Config, run: RunContext) -> State:
        acc, t, r = run.accelerator, cfg.train, cfg.rollout
        path = resolve_model(cfg.model.path)
        model, tokenizer = load_causal_lm(path, dtype=cfg.model.dtype)
        ref, _ = load_causal_lm(path, dtype=cfg.model.dtype)
        ref_offload = park_frozen(ref, acc.device, offload=cfg.model.ref_offload)  # in host memory between uses
        judge_cfgs = judge_configs(cfg.reward) if cfg.reward.spec is None else []
        reads = max((i + 1 for i, j in enumerate(judge_cfgs) if j.prompt == "rm_prompt"), default=0)
        train = rewarding.load_records(cfg.data.train_files, tokenizer, cfg, reads)
        val = rewarding.load_records(cfg.data.val_files or cfg.data.train_files, tokenizer, cfg, reads)
        trained = prepare_token_policy(run, model, t)
        # nothing to make room for without a judge in this process; a sharded policy stays where it is
        mode = cfg.reward.swap if any(j.engine != "server" for j in judge_cfgs) and trained.full is None else "never"
        # the judges first: a vLLM engine core in this process (the policy's) fixes vLLM's
        # environment for every engine built after it (`rl_rollout.colocated.vllm_engine_core`)
        sleep = initial_plan(mode).sleep_judges
        judges = [build_judge(i, j, acc.device, run.timer, sleep, run.world_size) for i, j in enumerate(judge_cfgs)]
        engine = engine_for(r, run, model=model, processor=tokenizer, path=path, dtype=cfg.model.dtype, full=trained.full,
                            seed=sample_seed(t.seed, run.rank) % 2**31, compile=r.compile,
                            engine_options={"max_model_len": r.max_prompt_length + r.max_new_tokens})  # verl's context length, not the model's
        for judge in judges:
            judge.policy = engine  # counts the judge's calls made with the policy's engine awake
        swap = PolicySwap(engine, model, trained.optimizer, acc.device, mode=mode, memory_fraction=cfg.reward.swap_memory_fraction,
                          offload_optimizer=cfg.model.optimizer_offload,
                          measurable=all(j.offload is not None for j in judges if j.engine is not None))
        if t.max_staleness:  # the policy stays resident: the rollout thread samples while the judges score
            if cfg.reward.swap == "always" and swap.plan.offload_policy:
                raise ConfigError(f"train.max_staleness={t.max_staleness}: reward.swap=always moves the policy off "
                                  "the GPU while the judges score, but asynchronous rollouts sample meanwhile; set "
                                  "reward.swap=never (or auto)")
            swap.keep_resident(judges)
        reward = rewarding.compose_reward(cfg, judges, judge_cfgs, run.timer, acc.device)
        if cfg.algo.reward_aggregation == "normalize_then_sum" and reward.spec.combine != "sum":
            raise ConfigError("algo.reward_aggregation=normalize_then_sum needs a reward that sums its weighted "
                              "components: give reward.spec with combine = \"sum\" (the reward.judges shorthand "
                              "folds them in order)")
        sampler = GroupSampler(len(train), r.n, seed=t.seed, rank=run.rank, world_size=run.world_size)
        stream = cfg.reward.stream and bool(judges) and all(j.engine is None for j in judges) and not t.partial_rollouts.steps
        return State(cfg, run, trained, model, ref, ref_offload, engine, judges, reward, swap, sampler,
                     train, val, stream)

    def policy(self, state: State) -> PolicyEngine:
        return state.engine

    def start(self, state: State) -> None:
        # every judge scores one sample now: a module whose lists do not match the batch, or a
        # server that is down or does not know its spec, fails here, not hours into a run
        answer = Generation(request_index=0, prompt_ids=[], completion_ids=[], text=str(state.val[0].ground_truth),
                            logprobs=[], finish_reason="stop")
        sample = rewarding.make_samples(state.val[:1], [answer], 0)[0]
        with isolated_rng():
            for judge in state.judges:
                judge.check(sample)

    def schedule(self, state: State) -> Schedule:
        t = state.cfg.train
        steps = t.epochs * -(-state.sampler.prompts_per_rank // (t.batch_size // state.run.world_size))
        return Schedule(min(steps, t.max_steps) if t.max_steps is not None else steps, eval_every=t.eval_freq,
                        eval_at_start=t.val_before_train, eval_at_end=True)

    def checkpoint(self, state: State) -> Checkpoint:
        return Checkpoint(state={"sampler": state.sampler,
                                 **sharded_state(state.trained.policy, state.trained.optimizer)},
                          trained=state.run.accelerator.unwrap_model(state.trained.policy))

    def rollout(self, state: State, step: int) -> Batch:
        state.swap.wake(state.run.timer)  # a dynamic-sampling round rolls out again after the last round's offload
        batch = self.prepare(state, step, self.sample(state, step))
        state.swap.offload(state.run.timer)
        return batch

    def sample(self, state: State, step: int) -> Sampled:
        """The step's samples (train.max_staleness >= 1: on the rollout thread, from the engine's
        own weights); reproducible with rollout.per_prompt_seeds."""
        cfg, run, r, n = state.cfg, state.run, state.cfg.rollout, state.cfg.rollout.n
        if cfg.train.partial_rollouts.steps:  # the first groups to finish of those in flight
            def draw(count: int) -> Drawn:
                picked = state.sampler.next_prompts(count)
                return picked, [rewarding.messages(state.train[i]) for i in picked], [sample_seed(cfg.train.seed, step, i) for i in picked]
            params = SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)
            awake = sum(j.state() == "awake" for j in state.judges)
            picked, gens = state.engine.sample_groups(draw, cfg.train.batch_size // run.world_size, params)
            return Sampled([state.train[i] for i in picked for _ in range(n)], gens, awake, None, tuple(picked))
        indices = next(iter(state.sampler.batches(cfg.train.batch_size // run.world_size)))[::n]  # one per group
        records = [state.train[i] for i in indices]
        seeds = [sample_seed(cfg.train.seed, step, i) for i in indices] if cfg.rollout.per_prompt_seeds else None
        score = _chunk_scorer(state, records, len(records) * n) if state.stream else None
        gens, awake, scored = generate(state, records, n, cfg.rollout.temperature, seeds, score)
        return Sampled([r for r in records for _ in range(n)], gens, awake, scored, tuple(indices))

    def prepare(self, state: State, step: int, sampled: Sampled) -> Batch:
        """The trainer's log-probs of the samples (the PPO ratio's old ones: with staleness, the
        weights the trainer holds now, and the engine's gap is `algo.rollout_correction`'s), and
        the reference's."""
        cfg, run, gens = state.cfg, state.run, sampled.gens
        a, t = cfg.algo, cfg.train
        old = None  # algo.old_logprobs = auto: the update's own forward gives them
        if a.old_logprobs == "replay" or a.kl_in_reward or t.mini_batch_size not in (None, t.batch_size):
            with run.timer("logprob"):  # through the Policy: a sharded one gathers its weights in its forward
                old = logprobs(state, run.accelerator.unwrap_model(state.trained.policy), gens)
        ref = None
        if a.use_kl_loss or a.kl_in_reward:
            with run.timer("ref_logprob"), visiting(state.ref_offload):  # with model.ref_offload: on the GPU for this
                ref = logprobs(state, state.ref, gens)
        return Batch(sampled.records, gens, old, ref, sampled.judges_awake, sampled.scored, sampled.prompt_ids)

    def score(self, state: State, step: int, batch: Batch) -> Scores:
        """Token rewards `[B, C]`: each sample's score on its last token (NaN: failed), minus
        `kl_reward_coef` x KL(old || ref) per token with `algo.kl_in_reward` (verl's `apply_kl_penalty`)."""
        cfg, run = state.cfg, state.run
        samples = rewarding.make_samples(batch.records, batch.gens, offset=run.rank * len(batch.gens))
        if batch.scored is not None:  # scored while it sampled (on the rollout thread's worker, asynchronous)
            scored = batch.scored.results()
            results, logs = [r for r, _ in scored], rewarding.merge_logs(state.judges, [log for _, log in scored])
        else:
            results, logs = score_now(state, samples)
        run.samples.write("train", step, rewarding.sample_rows(samples, results, logs, cfg.train.samples_to_log))
        kl = [compute_kl(cfg.algo.kl_reward_type, old[None], ref[None])[0] for old, ref in zip(batch.old, batch.ref,
              strict=True)] if cfg.algo.kl_in_reward and batch.ref is not None and batch.old is not None else None
        rewards, mask = training.token_rewards(batch.gens, [x.score for x in results], kl=kl,
                                               kl_coef=cfg.algo.kl_reward_coef)  # [B, C] x2
        groups = run.rank * len(batch.gens) + torch.arange(len(batch.gens)) // cfg.rollout.n  # [B]
        gamma = {"gamma": cfg.algo.gamma} if cfg.algo.advantage == "reinforce_pp" else {}
        components, metrics = [x.components for x in results], rewarding.reward_metrics(results, logs)
        if cfg.algo.reward_aggregation == "normalize_then_sum":  # each judge normalised per group: sequence scores
            return Scores(torch.tensor([math.nan if x.score is None else x.score for x in results]), groups,
                          cfg.algo.advantage, options=gamma, components=components, metrics=metrics,
                          aggregation="normalize_then_sum", weights=state.reward.sum_weights())
        return Scores(rewards, groups, cfg.algo.advantage, mask=mask, options=gamma, components=components,
                      metrics=metrics)  # reward/mean: the scores', not KL-shaped

    def merge(self, state: State, groups: Sequence[tuple[Batch, Sequence[int]]]) -> Batch:
        """The kept groups' samples of several rounds (dynamic sampling), in order."""
        picks = [(batch, i) for batch, rows in groups for i in rows]
        refs = [b.ref[i] for b, i in picks if b.ref is not None]
        ref = refs if groups[0][0].ref is not None else None
        ids = tuple(b.prompt_ids[rows[0] // state.cfg.rollout.n] for b, rows in groups)
        old = None if groups[0][0].old is None else [b.old[i] for b, i in picks if b.old is not None]
        return Batch([b.records[i] for b, i in picks], [b.gens[i] for b, i in picks], old,
                     ref, max(b.judges_awake for b, _ in groups), prompt_ids=ids)

    def update(self, state: State, step: int, batch: Batch, advantages: GroupAdvantages) -> dict[str, float]:
        """Clipped PG + KL-loss minibatch updates (`train.mini_batch_size` prompts each), after the
        engine-vs-trainer check of the old log-probs within `algo.replay_tolerance` (default 1e-3
        for a float32 policy, 5e-2 for 16-bit kernels): the first step raises on a mismatch."""
        cfg, run, acc, a, t = state.cfg, state.run, state.run.accelerator, state.cfg.algo, state.cfg.train
        run.record_prompts(step, batch.prompt_ids)
        state.swap.wake(run.timer)
        rollouts = training.to_rollouts(batch.gens, advantages.valid)
        tolerance = training.replay_tolerance(a.replay_tolerance, state.model, state.cfg.rollout.precision)
        with run.timer("update_actor"):
            first = tolerance if run.first_step(step) else None
            out = {} if batch.old is None else training.engine_check(rollouts, batch.old).verify(
                acc, math.inf if first is None else first, "first replay")
            out |= training.token_update(
                acc, state.trained.policy, state.trained.optimizer, rollouts, advantages.advantages,
                options=training.LossOptions(kl=a.kl, kl_coef=a.kl_coef if a.use_kl_loss else 0.0,
                                             temperature=cfg.rollout.temperature,
                                             norm_length=cfg.rollout.max_new_tokens, **training.loss_fields(a)),
                old=batch.old, ref=batch.ref if a.use_kl_loss else None,
                num_minibatches=t.batch_size // (t.mini_batch_size or t.batch_size), micro_batch_size=t.micro_batch_size,
                ppo_epochs=1, grad_clip=t.grad_clip, guard=run.guard, pad_id=state.engine.pad_id,
                scheduler=state.trained.scheduler, check_tolerance=first if batch.old is None else None)
        awake = acc.reduce(torch.tensor(float(batch.judges_awake), device=acc.device), reduction="sum")
        return {**out, **training.response_metrics(acc, batch.gens),
                "check/judges_awake_during_rollout": int(awake.item()),
                **state.swap.decide(run.timer, state.judges), **(state.trained.full.pop_metrics() if state.trained.full else {})}

    def evaluate(self, state: State, step: int) -> dict[str, float]:
        """Greedy (`rollout.val_temperature`) rollouts on the val rows, one per row, scored by the
        same reward; each process takes every world_size-th row (the first, when there are fewer)."""
        run = state.run
        shard = state.val[run.rank :: run.world_size] or state.val[:1]
        with run.timer("rollout"):
            gens, _, _ = generate(state, shard, 1, state.cfg.rollout.val_temperature)
            state.swap.offload(run.timer)
        samples = rewarding.make_samples(shard, gens, offset=10**9 + run.rank * len(gens))
        with run.timer("reward"):
            results, logs = score_now(state, samples)
        state.swap.wake(run.timer)
        run.samples.write("eval", step, rewarding.sample_rows(samples, results, logs, state.cfg.train.samples_to_log))
        return rewarding.reward_metrics(results, logs)

    def close(self, state: State) -> None:
        for judge in state.judges:
            judge.close()
        state.engine.close()


def generate(state: State, records: list[JudgeRecord], n: int, temperature: float, seeds: list[int] | None = None,
             score: ChunkScorer[Scored] | None = None,
             ) -> tuple[list[Generation], int, ScoredRollout[Scored] | None]:
    """`n` samples per record from the policy's engine, how many judge engines were awake
    meanwhile, and with `score` their rewards, scored as they finish (`generate_scored`).
    `seeds`: one engine call per prompt with its own seed (`rollout.per_prompt_seeds`)."""
    awake = sum(j.state() == "awake" for j in state.judges)
    r = state.cfg.rollout
    params = SamplingParams(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                            max_new_tokens=r.max_new_tokens)
    gens, scored = state.engine.sample([rewarding.messages(x) for x in records], params, seeds=seeds, score=score,
                                       timer=state.run.timer)
    return gens, awake, scored


def score_now(state: State, samples: list[Sample]) -> tuple[list[ScoreResult], dict[str, JudgeLog]]:
    """The rewards of `samples` and what each judge did for them, alone (`State.scoring`)."""
    with state.scoring:
        return rewarding.score(state.reward, state.judges, samples)


def _chunk_scorer(state: State, records: list[JudgeRecord], width: int) -> ChunkScorer[Scored]:
    """The reward of a chunk of this process's `width` samples (`records`: one per prompt), with
    the sample ids `score` gives them (rank * width + row); the chunk's judge logs on its first row."""
    def score(first: int, gens: list[Generation]) -> list[Scored]:
        chunk = [records[g.request_index] for g in gens]
        results, logs = score_now(state, rewarding.make_samples(chunk, gens, offset=state.run.rank * width + first))
        return [(result, logs if i == 0 else {}) for i, result in enumerate(results)]
    return score


def logprobs(state: State, model: Any, gens: list[Generation]) -> list[torch.Tensor]:
    """No-grad log-probs `[C_i]` of each completion under `model` (the policy or the reference)."""
    return training.rollout_logprobs(model, training.to_rollouts(gens), pad_id=state.engine.pad_id,
                                     micro_batch_size=state.cfg.train.micro_batch_size,
                                     temperature=state.cfg.rollout.temperature, device=state.run.device)


RECIPE = RiderGRM()
