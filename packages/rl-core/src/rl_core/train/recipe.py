"""What an app gives the trainer loop (`rl_core.train.loop`): a `Recipe` of typed hooks over its
own typed state. The loop owns the schedule; the recipe says only what is its own.

    class Arith(Recipe[Config, State, Batch]):
        name, config, default_config = "arith-grpo", Config, APP / "configs" / "default.toml"

        def setup(self, cfg, run) -> State: ...                    # models, data, engines
        def policy(self, state) -> PolicyWeights: ...              # the rollout side's weights
        def schedule(self, state) -> Schedule: ...                 # steps, eval cadence
        def checkpoint(self, state) -> Checkpoint: ...             # what a checkpoint holds
        def sample(self, state, step) -> Sampled: ...              # draw prompts, sample them (any thread)
        def prepare(self, state, step, sampled) -> Batch: ...      # the trainer's part (optional)
        def score(self, state, step, batch) -> Scores | Skip: ...  # rewards and group ids
        def update(self, state, step, batch, advantages) -> dict[str, float]: ...
        def evaluate(self, state, step) -> dict[str, float]: ...   # optional
        def finish(self, state) -> dict[str, str]: ...             # exports, optional

A step's batch is `prepare(sample(...))`: in series in a synchronous run (`rollout`), and with
`train.max_staleness >= 1` `sample` runs on the rollout thread, ahead of the trainer.

The loop owns the policy's weights (`rl_core.train.policy_weights`): it restores and saves the
weight version, puts the starting weights into the engine, counts each optimizer step, gives an
asynchronous run its versions and logs `rollout/weight_version`. No hook moves weights.

Hooks return what they measure (metrics, scores), never write results into shared state for the
loop to read back. Metric names follow one table (`rl_core.train.metric_names`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, cast

import msgspec
import torch
from torch import Tensor
from typing_extensions import TypeVar  # a default (PEP 696): typing's has one from Python 3.13

from rl_core.advantages import uses_group_baseline
from rl_core.train.algo_fields import TokenPolicyFields, check_loss_options
from rl_core.train.config import ConfigError
from rl_core.train.fields import RunFields, run_fields
from rl_core.train.groups import GroupAdvantages
from rl_core.train.metrics import PhaseTimer
from rl_core.train.policy_weights import PolicyWeights
from rl_core.train.samples import SampleLog
from rl_core.train.update import NonFiniteGuard

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["Checkpoint", "MergesRounds", "Recipe", "RunContext", "RunFields", "Schedule", "Scores", "Skip", "check_batch_split", "check_group_size", "check_token_step", "run_fields"]


def check_batch_split(batch_size: int, world_size: int, mini_batch_size: int | None = None, *,
                      key: str = "train.batch_size", mini_key: str = "train.mini_batch_size") -> None:
    """`Recipe.check`'s rule for a step of `batch_size` prompts: whole prompts per process, and
    whole optimizer steps of `mini_batch_size` prompts (None: one per step)."""
    mini = mini_batch_size or batch_size
    if batch_size % world_size or batch_size % mini:
        raise ConfigError(f"{key}={batch_size} must divide by the {world_size} processes and by {mini_key}={mini}")


def check_group_size(estimator: str, n: int, *, key: str, n_key: str) -> None:
    """`Recipe.check`'s rule for group estimators (`uses_group_baseline`): a sample is compared
    with the others of its prompt, so each prompt needs `n >= 2` samples."""
    if uses_group_baseline(estimator) and n < 2:
        raise ConfigError(f"{n_key}={n}: {key}={estimator!r} compares the samples of one prompt with each other "
                          f"and needs {n_key} >= 2")


def check_token_step(algo: TokenPolicyFields, *, n: int, batch_size: int, world_size: int,
                     mini_batch_size: int | None = None) -> None:
    """`Recipe.check`'s rules for a text policy's step, before any model loads: whole prompts per
    process and optimizer step (`check_batch_split`), `rollout.n >= 2` for a group baseline
    (`check_group_size`) and options the loss has (`check_loss_options`)."""
    check_batch_split(batch_size, world_size, mini_batch_size)
    check_group_size(algo.advantage, n, key="algo.advantage", n_key="rollout.n")
    check_loss_options(algo.loss, algo.loss_options)


C = TypeVar("C", bound=msgspec.Struct)  # the app config: a Struct whose `train` table is a RunFields
S = TypeVar("S")
B = TypeVar("B")
R = TypeVar("R", default=B)  # what `sample` returns, before `prepare`: the batch itself unless given


@dataclass(frozen=True)
class RunContext:
    """What the loop built before `Recipe.setup`, for the recipe's hooks to use."""

    accelerator: Accelerator
    run_dir: Path
    start_step: int  # 0, or the step of the checkpoint being resumed
    timer: PhaseTimer  # `with run.timer("logprob"): ...` inside a hook adds `time/logprob`
    samples: SampleLog  # `run.samples.write("train", step, rows)`: samples/train.jsonl
    guard: NonFiniteGuard  # pass to `optimizer_step`: non-finite steps skipped, too many stop the run
    stale_start: bool = False  # a resumed asynchronous run: its first steps train on rollouts sampled before it

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    @property
    def world_size(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    def record_prompts(self, step: int, ids: Sequence[int]) -> None:
        """Log the data indices of the prompts this process trains at `step` (call it from
        `update`, on every process: it gathers): one line `{"step": k, "prompts": [...]}` of
        every process's, rank by rank, in `samples/prompts.jsonl`. Written before the step's
        checkpoint and cut back to the checkpoint on resume, like the other sample logs, it says
        which prompts the run trained at each step: a resumed or faulted run can be checked for
        a prompt lost or trained twice against the uninterrupted one (`benchmarks/fault_resume.py`)."""
        from accelerate.utils import gather_object

        everyone = gather_object([[int(i) for i in ids]])  # one list a process
        self.samples.write("prompts", step, [{"prompts": [i for part in everyone for i in part]}], track=False)

    def log_media(self, step: int, folder: Path) -> None:
        """Send the images and videos an eval wrote in `folder` to the run's trackers
        (`train.log_with`; `rl_core.train.media_log`): call it from `evaluate` on the main
        process, where the trackers live. Nothing happens without trackers."""
        from rl_core.train.media_log import log_media

        if self.accelerator.is_main_process and self.accelerator.trackers:
            log_media(self.accelerator.trackers, step, folder)

    def first_step(self, step: int) -> bool:
        """Whether `step` is the first this process trains (a fresh start or a resume): where the
        rollout engine and the trainer must agree exactly (the first-replay check). Never for an
        asynchronous run resumed with rollouts in flight: they are older than its weights."""
        return step == self.start_step + 1 and not self.stale_start


@dataclass(frozen=True)
class Scores:
    """One step's rewards on this process and how they become advantages: the loop runs
    `rl_core.train.group_advantages(estimator, rewards, group_ids, mask=mask, options=options)`
    over every process's samples (failed samples and groups left with one sample get 0).
    `aggregation="normalize_then_sum"` (GDPO) normalises each component of `components` within
    its group before the `weights`-weighted sum (`rl_core.advantages.normalize_then_sum`)."""

    rewards: Tensor  # [B_r] sequence rewards, NaN where scoring failed; or [B_r, T] token rewards with `mask`
    group_ids: Tensor  # [B_r] the same id for the samples of one prompt, unique across processes
    estimator: str  # an `rl_core.advantages` name (grpo, rloo, reinforce_pp, ...)
    mask: Tensor | None = None  # [B_r, T] response mask, for token rewards only
    options: Mapping[str, float | str] = field(default_factory=dict)  # the estimator's keyword options (gamma, scale, ...)
    components: Sequence[Mapping[str, float]] = ()  # per sample, unweighted: logged as reward/<name> means
    metrics: Mapping[str, float] = field(default_factory=dict)  # over every process: response/*, counts, ...
    aggregation: str = "sum_then_normalize"  # an `rl_core.advantages.REWARD_AGGREGATIONS` name
    weights: Mapping[str, float] = field(default_factory=dict)  # component -> weight, for normalize_then_sum


@dataclass(frozen=True)
class Skip:
    """The step is skipped (no update) for `reason`, which the recipe has agreed on over every
    process (a reward server down after its retries, no rollouts anywhere): logged as
    `skipped = 1` with the reason in `error`, never scored as zero."""

    reason: str


@dataclass(frozen=True)
class Schedule:
    """How many steps the run has and when it evaluates. `eval_every=k`: after every k-th step;
    `eval_at_start`: once before the first step (logged as step 0, not on resume); `eval_at_end`:
    after the last step (once, also when k divides it)."""

    total_steps: int
    eval_every: int = 0
    eval_at_start: bool = False
    eval_at_end: bool = False
    note: str = ""  # printed once at the start (e.g. which setting ends the run)

    @classmethod
    def periodic(cls, total_steps: int, eval_every: int) -> Schedule:
        """`total_steps` steps evaluated before the first, after every `eval_every`-th and after
        the last, or never when `eval_every` is 0: what a `train.eval_freq` key says in an app
        whose evals cost little next to its steps (arith-grpo, diffusion-grpo)."""
        return cls(total_steps, eval_every=eval_every, eval_at_start=eval_every > 0, eval_at_end=eval_every > 0)


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint holds (`rl_core.train.save_checkpoint`). `state`: the `Stateful`
    objects (sampler, `sharded_state(...)`, an EMA) and JSON values; `trained`: the module whose
    trainable parameters must be finite before anything is written. `accelerator=True`: every
    process saves through `accelerator.save_state` (the prepared model and optimizer); False:
    only `state` is written, by the main process (a LoRA-only trainer), and an asynchronous
    run's rollouts in flight by each process. `write_files(folder)`
    adds files inside the checkpoint before it is published (adapters in PEFT format), run
    inside `gather`, which every process enters (a sharded policy gathers its weights there)."""

    state: Mapping[str, object]
    trained: torch.nn.Module
    accelerator: bool = True
    write_files: Callable[[Path], object] | None = None
    gather: AbstractContextManager[object] = field(default_factory=nullcontext)


class Recipe(ABC, Generic[C, S, B, R]):
    """An app for the trainer loop. Subclass it with the app's config, state and batch types
    and implement the hooks; `evaluate`, `finish`, `close`, `check` and `start` have defaults.

    Class attributes: `name` (the program name in messages and trackers), `config` (the config
    Struct type), `default_config` (the embedded default TOML a bare run uses), `env`
    (environment variable -> dotted key, for the original system's launch lines), `seed_by_rank`
    (seed each process with seed + rank, so processes draw different noise; False when the
    processes must build identical random initialisations themselves, e.g. LoRA under FSDP2,
    and sampling noise is seeded per sample instead), `partial_rollouts` (True where `sample`
    draws its groups through `rl_policy.engine.PolicyEngine.sample_groups`, which
    `train.partial_rollouts` needs)."""

    name: str = "app"
    config: type[C]
    default_config: Path | None = None
    env: Mapping[str, str] = {}
    seed_by_rank: bool = True
    partial_rollouts: bool = False  # `sample` draws through `PolicyEngine.sample_groups` (train.partial_rollouts)

    def config_path(self, given: Path | None) -> Path | None:
        """The config file a run reads: `--config FILE`, else the embedded default."""
        return given if given is not None else self.default_config

    def check(self, cfg: C, world_size: int) -> None:
        """Rules between keys and against the process count; raise `ConfigError` (runs before
        any model loads)."""

    @abstractmethod
    def setup(self, cfg: C, run: RunContext) -> S:
        """Build models, data, engines and the optimizer (the checkpoint is restored after)."""

    @abstractmethod
    def policy(self, state: S) -> PolicyWeights:
        """The policy's weights on the rollout side, which the loop drives (see the module doc):
        e.g. the `rl_policy.engine.PolicyEngine` that `setup` built."""

    def start(self, state: S) -> None:
        """Called once the state holds its starting weights (restored or initial) and the engine
        has them (`PolicyWeights.start`): start workers, check judges on one sample."""

    @abstractmethod
    def schedule(self, state: S) -> Schedule:
        """The run's length and eval cadence (after setup: it may depend on the data size)."""

    @abstractmethod
    def checkpoint(self, state: S) -> Checkpoint:
        """What to save (called for each save and once for a resume's restore)."""

    def rollout(self, state: S, step: int) -> B:
        """This process's share of the step's samples in a synchronous run (the loop times it
        as `rollout`): `prepare(sample(...))`. Override it for what only a synchronous rollout
        does around them (e.g. wake and offload models that share the GPU)."""
        return self.prepare(state, step, self.sample(state, step))

    @abstractmethod
    def score(self, state: S, step: int, batch: B) -> Scores | Skip:
        """Rewards of this process's samples (timed as `reward`), or why the step is skipped."""

    @abstractmethod
    def update(self, state: S, step: int, batch: B, advantages: GroupAdvantages) -> Mapping[str, float]:
        """The policy update from this process's samples and their advantages (timed as
        `update`); returns its metrics, reduced over every process. A `tokens` entry (prompt +
        completion tokens of every process) becomes `throughput/tokens_per_s` per process."""

    # asynchronous rollouts (`train.max_staleness >= 1`, `rl_core.train.pipeline`): both needed
    @abstractmethod
    def sample(self, state: S, step: int) -> R:
        """Draw the step's prompts and sample them with the policy's engine. With
        `train.max_staleness >= 1` it runs on the rollout thread, ahead of the trainer: it must
        not touch the trained weights or the optimizer (the trainer is updating them meanwhile)
        and must run no collective (no gather or reduce across processes)."""

    def prepare(self, state: S, step: int, sampled: R) -> B:
        """The rest of `rollout`, on the trainer's thread, just before the step's reward: what
        needs the trained weights (old and reference log-probs) or other processes. The default
        hands the sample on as the batch; a recipe whose `sample` returns another type
        (`Recipe[Config, State, Batch, Sampled]`) overrides it."""
        return cast(B, sampled)

    def evaluate(self, state: S, step: int) -> Mapping[str, float]:
        """Held-out metrics (the loop logs them under `eval/`); run on a saved-and-restored RNG
        state, so evaluating never changes the training run."""
        return {}

    def finish(self, state: S) -> Mapping[str, str]:
        """After the last step, on every process: exports; returns `{what: where}` lines for
        the closing summary."""
        return {}

    def close(self, state: S) -> None:
        """Release engines, workers and connections (also after an error)."""


class MergesRounds(ABC, Generic[S, B]):
    """A recipe that can run dynamic sampling (`train.dynamic_sampling`) says so by inheriting
    this next to `Recipe` (`class App(Recipe[C, S, B], MergesRounds[S, B])`) and implementing
    `merge`; for any other the loop refuses the option before setup."""

    @abstractmethod
    def merge(self, state: S, groups: Sequence[tuple[B, Sequence[int]]]) -> B:
        """One batch from the groups that dynamic sampling kept: each entry is a rollout round's
        batch and the sample rows of one group in it; the merged batch holds those samples in
        this order (its group ids are the loop's business)."""
