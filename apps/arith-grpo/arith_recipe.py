"""arith-grpo's recipe: text GRPO on "a + b" with an exact-answer rule; `rl_core.train.loop` owns the rest."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch
from arith_config import ENTRY, Config

from rl_core import train
from rl_data import GroupSampler
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.engine import PolicyEngine, build_policy_engine
from rl_policy.evaluation import greedy_answers
from rl_policy.scoring import group_scores
from rl_policy.training import LossOptions, Policy, loss_fields, regroup, to_rollouts, token_update
from rl_rewards import Component, Reward, RewardSpec, Sample, ScoreResult, build_reward
from rl_rollout import Drawn, Generation, SamplingParams


class State(NamedTuple):
    cfg: Config
    run: train.RunContext
    policy: torch.nn.Module  # Policy(model), prepared
    optimizer: torch.optim.Optimizer
    engine: PolicyEngine
    reward: Reward
    sampler: GroupSampler
    problems: list[tuple[int, int]]
    prompts: list[list[dict[str, str]]]  # the chat message of each problem
    weights: dict[str, float]  # the reward's component weights, for algo.reward_aggregation=normalize_then_sum


class Batch(NamedTuple):
    picked: list[int]  # problem index of each prompt
    generations: list[Generation]  # n per prompt, request-major


class ArithGRPO(train.Recipe[Config, State, Batch], train.MergesRounds[State, Batch]):
    name, config, default_config, partial_rollouts = ENTRY.name, Config, ENTRY.default_path(), True

    def check(self, cfg: Config, world_size: int) -> None:
        train.check_token_step(cfg.algo, n=cfg.rollout.n, batch_size=cfg.train.batch_size, world_size=world_size)

    def setup(self, cfg: Config, run: train.RunContext) -> State:
        m, r, t = cfg.model, cfg.rollout, cfg.train
        path = tiny.resolve(m.path, key="model.path")
        model, tokenizer = load_causal_lm(path, dtype=m.dtype)
        policy, optimizer = run.accelerator.prepare(Policy(model), torch.optim.AdamW(model.parameters(), lr=t.lr))
        engine = build_policy_engine(r.engine, model=model, processor=tokenizer, path=path, dtype=m.dtype,
                                     device=run.device, seed=run.rank, world_size=run.world_size, compile=False)
        reward = build_reward(cfg.reward.spec or RewardSpec(components={"answer": Component(
            scorer="exact_answer", options={"answer": "first", "partial": cfg.reward.partial, "near": cfg.reward.near})}))
        draw = random.Random(t.seed)
        problems = [(draw.randrange(5), draw.randrange(5)) for _ in range(64)]  # "a + b", drawn from the seed
        prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}] for a, b in problems]
        sampler = GroupSampler(len(problems), r.n, seed=t.seed, rank=run.rank, world_size=run.world_size)
        weights = train.component_weights(reward, cfg.algo.reward_aggregation)
        return State(cfg, run, policy, optimizer, engine, reward, sampler, problems, prompts, weights)

    def policy(self, s: State) -> PolicyEngine:
        return s.engine

    def schedule(self, s: State) -> train.Schedule:
        return train.Schedule.periodic(s.cfg.train.max_steps, s.cfg.train.eval_freq)

    def checkpoint(self, s: State) -> train.Checkpoint:
        return train.Checkpoint(state={"sampler": s.sampler}, trained=s.policy)

    def sample(self, s: State, step: int) -> Batch:
        def draw(count: int) -> Drawn:  # the next prompts, each from its own seed (whatever the process count)
            picked = s.sampler.next_prompts(count)
            return picked, [s.prompts[i] for i in picked], [train.sample_seed(s.cfg.train.seed, step, i) for i in picked]
        r = s.cfg.rollout  # with train.partial_rollouts: the first groups to finish of those in flight
        params = SamplingParams(n=r.n, temperature=r.temperature, max_new_tokens=r.max_new_tokens)
        return Batch(*s.engine.sample_groups(draw, s.cfg.train.batch_size // s.run.world_size, params))

    def score(self, s: State, step: int, batch: Batch) -> train.Scores:
        return group_scores(s.run.accelerator, score(s, batch), batch.generations, prompts_per_rank=len(batch.picked),
                            estimator=s.cfg.algo.advantage, aggregation=s.cfg.algo.reward_aggregation, weights=s.weights)

    def merge(self, s: State, groups: Sequence[tuple[Batch, Sequence[int]]]) -> Batch:
        heads, gens = regroup(groups, lambda batch: batch.generations)  # one prompt's answers per entry
        return Batch([batch.picked[request] for batch, request in heads], gens)

    def update(self, s: State, step: int, batch: Batch, advantages: train.GroupAdvantages) -> dict[str, float]:
        s.run.record_prompts(step, batch.picked)
        return token_update(s.run.accelerator, s.policy, s.optimizer, to_rollouts(batch.generations, advantages.valid),
                            advantages.advantages,
                            options=LossOptions(temperature=s.cfg.rollout.temperature, **loss_fields(s.cfg.algo)),
                            micro_batch_size=s.cfg.train.micro_batch_size, guard=s.run.guard, pad_id=s.engine.pad_id,
                            check_tolerance=1e-3 if s.run.first_step(step) else None)

    def evaluate(self, s: State, step: int) -> dict[str, float]:
        """Greedy answers to every problem in `samples/eval.jsonl`; `reward/mean`, `accuracy` (exact)."""
        picked, gens = greedy_answers(s.engine, s.prompts, rank=s.run.rank,
                                      world_size=s.run.world_size, max_new_tokens=s.cfg.rollout.max_new_tokens)
        scores = [x.score or 0.0 for x in score(s, Batch(picked, gens))]  # a failed answer counts 0
        s.run.samples.write("eval", step, [{"problem": "{} + {}".format(*s.problems[i]), "answer": g.text, "reward": x}
                                           for i, g, x in zip(picked, gens, scores, strict=True)])
        return train.gathered_means({"reward/mean": scores, "accuracy": [float(x == 1.0) for x in scores]},
                                    s.run.accelerator)


def score(s: State, batch: Batch) -> list[ScoreResult]:
    return s.reward.score([Sample(completion=g.text, reference=sum(s.problems[batch.picked[g.request_index]]),
                                  metadata={"completion_tokens": len(g.completion_ids)}) for g in batch.generations])


RECIPE = ArithGRPO()
