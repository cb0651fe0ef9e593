"""The trainer loop's own test recipe: a contextual bandit with a linear softmax policy.

8 prompts (contexts), 5 answers (arms, `train.answers`); the reward is 1 when the answer is the
prompt's target (`prompt % answers`). Each sample draws its answer from its own seed (train.seed, step, prompt, index),
so the samples of a step are the same whatever the process count or the micro-batch split: the
loop's invariants (2 processes = 1 process with twice the batch, accumulation = one batch,
resume = uninterrupted) can be checked with exact numbers. Run as a script, it is an app:

    accelerate launch --multi_gpu --num_processes 2 bandit_recipe.py train.output_dir=/tmp/b
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_core.losses import compute_policy_loss
from rl_core.train import (
    AdvantageName,
    Checkpoint,
    GroupAdvantages,
    MergesRounds,
    ModuleWeights,
    NonNegative,
    PolicyLossName,
    Positive,
    PositiveFloat,
    Recipe,
    ReplayCheck,
    RunContext,
    RunFields,
    Schedule,
    Scores,
    Skip,
    UpdateStats,
    check_batch_split,
    check_group_size,
    optimizer_step,
    run,
    run_app,
    sample_seed,
)

PROMPTS, ANSWERS = 8, 5


class AlgoConfig(msgspec.Struct, kw_only=True, frozen=True):
    advantage: AdvantageName = "grpo"
    loss: PolicyLossName = "ppo_clip"


class TrainConfig(RunFields, kw_only=True, frozen=True):
    output_dir: str = "runs/bandit"
    batch_size: Positive = 4  # prompts per step, all processes
    n: Positive = 4  # answers per prompt
    micro_batch_size: Positive = 8  # samples per forward/backward
    max_steps: Positive = 3
    lr: PositiveFloat = 0.5
    eval_every: NonNegative = 0
    eval_at_start: bool = False
    answers: Positive = ANSWERS  # arms: more arms, more groups that are all wrong
    skip_steps: list[int] = msgspec.field(default_factory=list)  # steps whose reward "fails" on every process (tests)


class Config(msgspec.Struct, kw_only=True, frozen=True):
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()


@dataclass
class State:
    cfg: Config
    run: RunContext
    policy: torch.nn.Module  # prepared (DDP with several processes)
    optimizer: torch.optim.Optimizer
    rounds: Rounds
    weights: ModuleWeights  # samples with the trained module, or (asynchronous) a copy by version


class Rounds:
    """The rollout rounds drawn so far per step (dynamic sampling's extra rounds draw anew), in
    the checkpoint: an asynchronous run's holds round 1 of the steps after it, already drawn."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def next(self, step: int) -> int:
        self.count[step] = self.count.get(step, -1) + 1
        return self.count[step]

    def state_dict(self) -> dict[str, Any]:
        return {"count": dict(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = dict(state["count"])


@dataclass(frozen=True)
class Batch:
    prompts: torch.Tensor  # [B] prompt of each sample
    answers: torch.Tensor  # [B] sampled answer
    logprobs: torch.Tensor  # [B] log-prob of the answer when it was sampled
    groups: torch.Tensor  # [B] global group id


class Plain(Recipe[Config, State, Batch]):
    name = "bandit"
    config = Config

    def check(self, cfg: Config, world_size: int) -> None:
        check_group_size(cfg.algo.advantage, cfg.train.n, key="algo.advantage", n_key="train.n")
        check_batch_split(cfg.train.batch_size, world_size)

    def setup(self, cfg: Config, run: RunContext) -> State:
        model = torch.nn.Linear(PROMPTS, cfg.train.answers, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
        policy, optimizer = run.accelerator.prepare(model, optimizer)
        return State(cfg, run, policy, optimizer, Rounds(), ModuleWeights(run.accelerator.unwrap_model(policy)))

    def policy(self, state: State) -> ModuleWeights:
        return state.weights

    def schedule(self, state: State) -> Schedule:
        t = state.cfg.train
        return Schedule(t.max_steps, eval_every=t.eval_every, eval_at_start=t.eval_at_start,
                        eval_at_end=t.eval_every > 0)

    def checkpoint(self, state: State) -> Checkpoint:
        return Checkpoint(state={"rounds": state.rounds}, trained=state.policy)

    def sample(self, state: State, step: int) -> Batch:  # asynchronous: the rollout thread, its own copy of the weights
        return self._draw(state, step, state.weights.sampler)

    def _draw(self, state: State, step: int, model: torch.nn.Module) -> Batch:
        t, run = state.cfg.train, state.run
        per_rank = t.batch_size // run.world_size
        again = (r,) if (r := state.rounds.next(step)) else ()  # a dynamic-sampling round draws anew
        order = torch.randperm(PROMPTS, generator=torch.Generator().manual_seed(sample_seed(t.seed, step, *again)))
        mine = order[run.rank * per_rank:(run.rank + 1) * per_rank].repeat_interleave(t.n)  # [B]
        with torch.no_grad():
            logp = torch.log_softmax(model(_onehot(mine)), dim=-1)  # [B, A]
        draws = [torch.multinomial(logp[i].exp(), 1, generator=torch.Generator().manual_seed(
            sample_seed(t.seed, step, int(p), i % t.n, *again)))[0] for i, p in enumerate(mine.tolist())]
        answers = torch.stack(draws)  # [B]
        groups = torch.arange(len(mine)) // t.n + run.rank * per_rank  # [B]
        return Batch(mine, answers, logp.gather(1, answers[:, None])[:, 0], groups)

    def score(self, state: State, step: int, batch: Batch) -> Scores | Skip:
        if step in state.cfg.train.skip_steps:
            return Skip(f"reward service unavailable at step {step}")
        rewards = (batch.answers == batch.prompts % state.cfg.train.answers).float()  # [B]
        state.run.samples.write("train", step, [{"prompt": int(p), "answer": int(a), "reward": float(r)} for p, a, r
                                                in zip(batch.prompts[:2], batch.answers[:2], rewards[:2], strict=True)])
        return Scores(rewards, batch.groups, state.cfg.algo.advantage)

    def update(self, state: State, step: int, batch: Batch, advantages: GroupAdvantages) -> dict[str, float]:
        t, run = state.cfg.train, state.run
        rows = torch.arange(len(batch.prompts))
        micro = list(rows.split(t.micro_batch_size))
        stats, check = UpdateStats(), ReplayCheck()

        def loss_fn(part: torch.Tensor, num_valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            logits = state.policy(_onehot(batch.prompts[part]))  # [b, A]
            logp = torch.log_softmax(logits, dim=-1).gather(1, batch.answers[part][:, None])  # [b, 1]
            check.add(logp[:, 0], batch.logprobs[part])
            loss, metrics = compute_policy_loss(state.cfg.algo.loss, logp=logp, old_logp=batch.logprobs[part][:, None],
                                                advantages=advantages.advantages[part][:, None],
                                                mask=torch.ones_like(logp), num_valid=num_valid)
            return loss, {"loss/policy": float(loss.detach()), "policy/clip_fraction": float(metrics["clip_fraction"])}

        def first_check() -> None:
            extra.update(check.verify(run.accelerator, 1e-6 if run.first_step(step) else float("inf"), "first replay"))

        extra: dict[str, float] = {}
        optimizer_step(run.accelerator, state.policy, state.optimizer, micro, loss_fn, units=lambda m: float(len(m)),
                       grad_clip=None, guard=run.guard, stats=stats, before_step=first_check, filler=rows[:1])
        return {**stats.reduce(run.accelerator), **extra}

    def evaluate(self, state: State, step: int) -> dict[str, float]:
        with torch.no_grad():
            best = state.policy(_onehot(torch.arange(PROMPTS))).argmax(-1)  # [P]
        return {"reward/mean": float((best == torch.arange(PROMPTS) % state.cfg.train.answers).float().mean())}

    def finish(self, state: State) -> dict[str, str]:
        weights = state.run.run_dir / "weights.pt"
        if state.run.is_main:
            torch.save(state.run.accelerator.unwrap_model(state.policy).weight.detach().clone(), weights)
        return {"weights": str(weights)}


def _onehot(prompts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(prompts, PROMPTS).float()  # [B, P]


class Bandit(Plain, MergesRounds[State, Batch]):
    """The bandit with dynamic sampling."""

    def merge(self, state: State, groups: Sequence[tuple[Batch, Sequence[int]]]) -> Batch:
        fields = [torch.cat([getattr(b, f)[list(rows)] for b, rows in groups]) for f in ("prompts", "answers", "logprobs")]
        return Batch(*fields, groups=torch.zeros_like(fields[0]))  # group ids: the loop renumbers them


RECIPE = Bandit()


def main(argv: list[str] | None = None) -> Path | None:
    return run(RECIPE, argv)


def weights(run_dir: Path) -> Any:
    return torch.load(run_dir / "weights.pt", weights_only=True)


if __name__ == "__main__":
    sys.exit(run_app(RECIPE.name, main))
