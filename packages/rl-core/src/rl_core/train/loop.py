"""The trainer loop every app runs. It owns the schedule; an app gives a `Recipe`.

    RECIPE = MyRecipe()

    def main(argv: list[str] | None = None) -> Path | None:   # the run directory, None after --help
        return run(RECIPE, argv)

    if __name__ == "__main__":
        sys.exit(run_app(RECIPE.name, main))

`run` is `parse_run` (`rl_core.train.app`: the command line and the config, no torch) then
`train`; the apps call the two from a `__main__.py` that imports the recipe module only in
between, so `--help` and config errors answer before torch is imported.

What the loop does, in order, so no app writes it:

    start  --help, or the config (defaults < --config FILE < env < key=value; registry names checked)
           and the resume point (`--resume`; a train.run_name naming another run is refused)
           -> the accelerator -> `Recipe.check` (rules between keys, the process count) -> the run directory
           -> seeding -> `Recipe.setup` -> the checkpoint restored -> `Recipe.start` -> trackers
    step k rollout -> reward -> advantages (group statistics over every process) -> update
           -> eval (when due) -> log (metrics.csv, trackers, progress) -> checkpoint (when due) -> plot
    end    `Recipe.finish` (exports) -> `end_training` -> the closing summary

Every step is logged before its checkpoint, so a resume never loses a logged step, and a
resumed run cuts metrics.csv and samples/ back to its checkpoint, so they read as one
uninterrupted run. Evaluations run on a saved-and-restored RNG state: evaluating or not never
changes the training run. A run in which no step trained (every step skipped) ends with an
error naming why.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, cast

import msgspec
import torch

from rl_core.errors import UserError
from rl_core.train.app import parse_run
from rl_core.train.checkpoint import load_checkpoint, save_checkpoint
from rl_core.train.config import ConfigError, flat_config
from rl_core.train.console import ThirdPartyLog, third_party_output
from rl_core.train.dynamic_sampling import GroupFilter, merge_scores
from rl_core.train.groups import component_means, group_advantages
from rl_core.train.metrics import CompileWatch, MetricsLogger, PhaseTimer
from rl_core.train.pipeline import PendingRollouts, RolloutPipeline, Sampled
from rl_core.train.plots import plot_reward_curve
from rl_core.train.policy_weights import PolicyWeights
from rl_core.train.progress import TrainProgress
from rl_core.train.recipe import (
    B,
    C,
    MergesRounds,
    R,
    Recipe,
    RunContext,
    S,
    Schedule,
    Scores,
    Skip,
    run_fields,
)
from rl_core.train.rundir import make_run_dir, point_latest, resume_point
from rl_core.train.samples import SampleLog
from rl_core.train.seeding import isolated_rng, seed_everything
from rl_core.train.sharding import accelerator_kwargs
from rl_core.train.shutdown import end_training
from rl_core.train.trackers import mlflow_store, tracker_dirs, tracker_init_kwargs
from rl_core.train.update import NonFiniteGuard, check_finite_parameters

__all__ = ["run", "train"]

def run(recipe: Recipe[C, S, B, R], argv: Sequence[str] | None = None) -> Path | None:
    """Parse `argv` (`--config FILE`, `--resume [PATH]`, `--help`, `key=value`), load the config
    and train; returns the run directory (None after --help). An app whose recipe module imports
    torch calls `rl_core.train.parse_run` from its `__main__` and then `train`, so `--help` and
    config errors answer before torch is imported."""
    parsed = parse_run(recipe.name, recipe.config, recipe.config_path(None), recipe.env, argv)
    return None if parsed is None else train(recipe, *parsed)


def train(recipe: Recipe[C, S, B, R], cfg: C, resume: str | None = None) -> Path:
    """Train `recipe` on `cfg` (resuming from `resume`: None, "latest" or a path); returns the
    run directory."""
    t = run_fields(cfg)
    if t.dynamic_sampling.enable and not isinstance(recipe, MergesRounds):
        raise ConfigError(f"train.dynamic_sampling.enable: {recipe.name} cannot merge rollout rounds "
                          "(its recipe is no `MergesRounds`); set it to false")
    if t.partial_rollouts.steps and not recipe.partial_rollouts:
        raise ConfigError(f"train.partial_rollouts.steps={t.partial_rollouts.steps}: {recipe.name} samples whole "
                          "groups only (its recipe does not sample through PolicyEngine.sample_groups); set it to 0")
    acc = _accelerator(t.sharding, t.fsdp_cpu_offload)
    recipe.check(cfg, acc.num_processes)
    ckpt, name = resume_point(resume, t.output_dir, t.run_name)
    start = int(msgspec.json.decode((ckpt / "meta.json").read_bytes())["step"]) if ckpt is not None else 0
    run_dir = make_run_dir(t.output_dir, name, config=cfg, accelerator=acc, latest=False)
    seed_everything(t.seed, rank=acc.process_index if recipe.seed_by_rank else 0)
    pending = PendingRollouts(acc.process_index, acc.num_processes)
    if ckpt is not None and (ckpt / PIPELINE).is_dir():  # an asynchronous run's rollouts in flight
        pending.load(ckpt / PIPELINE)
    carried = ckpt is not None and (ckpt / PARTIAL).is_dir()  # partial rollouts in flight: older tokens
    context = RunContext(acc, run_dir, start, PhaseTimer(), SampleLog(run_dir, main=acc.is_main_process, start_step=start),
                         NonFiniteGuard(t.max_nonfinite_steps), stale_start=bool(pending.items) or carried)
    with third_party_output(run_dir, verbose=t.verbose, rank=acc.process_index) as notes, mlflow_store(run_dir, t.log_with):
        state = recipe.setup(cfg, context)
        try:
            policy = recipe.policy(state)
            context.guard.after_step(policy.stepped)  # every optimizer step taken, whichever hook takes it
            if t.partial_rollouts.steps:  # a PolicyEngine's (rl_policy.engine)
                enable = getattr(policy, "partial_rollouts", None)
                if enable is None:
                    raise ConfigError(f"train.partial_rollouts.steps={t.partial_rollouts.steps}: {recipe.name}'s policy "
                                      f"({type(policy).__name__}) cannot keep groups in flight; set it to 0")
                enable(t.partial_rollouts.chunk_tokens, t.partial_rollouts.steps, rank=acc.process_index,
                       world_size=acc.num_processes)
            if ckpt is not None:
                spec = recipe.checkpoint(state)
                partial = _in_flight(policy) if carried else {}
                load_checkpoint(ckpt, state={**spec.state, POLICY: policy, **partial},
                                accelerator=acc if spec.accelerator else None)
                acc.print(f"resumed from {ckpt} at step {start}")
            policy.start()
            recipe.start(state)
            trackers = _trackers(acc, t.log_with, run_dir, recipe.name, cfg)
            point_latest(run_dir, acc)  # only a run that started: a failed start leaves `latest` alone
            return _Loop(recipe, state, policy, context, recipe.schedule(state), cfg, pending.items, notes=notes,
                         tracker_dirs=trackers).fit()
        finally:
            recipe.close(state)


# reward_curve.png is redrawn after a step at most this often, and after the last step (a
# drawing costs about half a second of CPU)
PLOT_EVERY_S = 30.0
PIPELINE = "pipeline"  # the checkpoint folder of an asynchronous run's rollouts in flight
PARTIAL = "partial_rollouts"  # the checkpoint folder of the partial rollouts' groups in flight


def _in_flight(policy: PolicyWeights) -> dict[str, Any]:
    """The policy's partial rollouts in flight as a checkpoint entry (each process its own)."""
    groups = getattr(policy, "in_flight", lambda: None)()
    return {PARTIAL: groups} if groups is not None else {}
POLICY = "engine"  # the checkpoint entry of the policy's weight version (`PolicyWeights.state_dict`)


def _accelerator(sharding: Any, cpu_offload: bool) -> Any:
    from accelerate import Accelerator

    # cpu=True without CUDA: `accelerate launch --multi_gpu --num_processes N` then gives N gloo
    # processes on a CPU machine (its `--cpu` flag alone starts one process unless MPI is set up)
    return Accelerator(cpu=not torch.cuda.is_available(), **accelerator_kwargs(sharding=sharding, cpu_offload=cpu_offload))


def _trackers(acc: Any, names: Sequence[str], run_dir: Path, project: str, cfg: Any) -> dict[str, str]:
    """Accelerate's trackers logging into the run directory (checked installed with the config,
    `check_trackers`); returns where each one writes, for the summary."""
    if not names:
        return {}
    from accelerate.tracking import filter_trackers

    acc.project_configuration.set_directories(str(run_dir))
    try:
        acc.log_with = filter_trackers(list(names), acc.logging_dir)
    except ValueError as e:  # an unknown tracker name
        raise UserError(f"train.log_with: {e}") from None
    found = {str(t) for t in acc.log_with}
    missing = [n for n in names if n not in found and n != "all"]
    if missing:  # installed but would not import (check_trackers found the package)
        raise UserError(f"train.log_with={list(names)}: {', '.join(missing)} is installed but Accelerate cannot use it")
    acc.init_trackers(project, config=flat_config(cfg), init_kwargs=tracker_init_kwargs(run_dir))
    return tracker_dirs(found, run_dir, project)


def _objectives(scores: Scores) -> dict[str, Any]:
    """`group_advantages`' multi-reward arguments: for `normalize_then_sum`, each sample's
    unweighted component values `[B_r, K]` (NaN where missing) and their weights."""
    if scores.aggregation == "sum_then_normalize":
        return {}
    names = sorted(scores.weights)
    if not names:
        raise UserError(f"reward aggregation {scores.aggregation!r} normalises each reward component, but the "
                        "reward reports no component weights")
    rows = scores.components if len(scores.components) == scores.rewards.shape[0] else [{}] * scores.rewards.shape[0]
    objectives = torch.tensor([[float(row.get(n, math.nan)) for n in names] for row in rows],
                              dtype=torch.float32).reshape(-1, len(names))  # [B_r, K]
    return {"aggregation": scores.aggregation, "objectives": objectives, "weights": [scores.weights[n] for n in names]}


def _samples_to_trackers(trackers: Sequence[Any], step: int, samples: Mapping[str, list[dict[str, Any]]]) -> None:
    """The step's sample rows (what samples/*.jsonl got) as a table where the tracker shows one:
    a wandb Table, a Markdown table in tensorboard's text tab."""
    for split, rows in samples.items():
        if not rows:
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        for tracker in trackers:
            if tracker.name == "wandb":
                tracker.log_table(f"samples/{split}", columns=columns, data=data, step=step)
            elif tracker.name == "tensorboard":
                lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
                lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |"
                          for row in data]
                tracker.writer.add_text(f"samples/{split}", "\n".join(lines), global_step=step)


def _cell(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool) or value is None else msgspec.json.encode(value).decode()


def _check_metric(metric: str, scores: Scores, acc: Any) -> None:
    """A dynamic-sampling metric that no sample of any process reports is a typo: stop."""
    if metric == "reward":
        return
    found = acc.reduce(torch.tensor(float(any(metric in row for row in scores.components)), device=acc.device),
                       "max").item()
    if not found:
        names = sorted({k for row in scores.components for k in row})
        raise UserError(f"train.dynamic_sampling.metric={metric!r}: no sample reports this reward component; "
                        f"use 'reward' or one of {names}")


# the phases whose slowest process a run of several processes logs (`time_max/<phase>`)
PROFILED_PHASES = ("rollout", "rollout_wait", "prepare", "rank_wait", "reward", "advantages", "logprob", "update",
                   "weight_sync", "weight_gather")


def slowest_phases(acc: Any, metrics: dict[str, Any]) -> dict[str, float]:
    """`time_max/<phase>`: the most seconds any process spent in each phase of `PROFILED_PHASES`
    that this process logged (one all-reduce of a fixed-size tensor, on every process): beside
    rank 0's `time/<phase>`, how far the processes drift apart, and which one a step waits for."""
    mine = torch.tensor([float(metrics.get(f"time/{phase}", 0.0)) for phase in PROFILED_PHASES], dtype=torch.float64,
                        device=acc.device)  # float64: the max of equal values is the value itself
    most = acc.reduce(mine, "max").tolist()
    return {f"time_max/{phase}": value for phase, value in zip(PROFILED_PHASES, most, strict=True)
            if f"time/{phase}" in metrics}


@dataclass
class _Record:
    """What the closing summary reports, gathered from the logged metrics."""

    began: float = field(default_factory=time.perf_counter)
    steps: int = 0
    trained: int = 0
    samples: float = 0.0
    failed: float = 0.0  # rewards that failed (NaN), placeholder captions not included
    placeholders: float | None = None  # captions that sampled a vision placeholder (apps that log them)
    reasons: list[str] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)  # steps per rollout staleness

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        if "skipped" in metrics:
            self.steps += 1
            self.trained += not metrics["skipped"]
            if metrics["skipped"]:
                self.reasons.append(f"step {step}: {metrics.get('error', '')}")
        self.add_outcomes(step, metrics)

    def add_outcomes(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Rewards, failures and staleness of one step; a resumed run adds those of the steps
        before its checkpoint (metrics.csv's rows), so the summary covers the whole run."""
        # a caption that sampled a vision placeholder gets a NaN reward, counted in reward/failed,
        # but it is the policy's sample, not the reward, that failed: the summary names it apart
        failed, placeholders = float(metrics.get("reward/failed", 0.0)), metrics.get("response/placeholder_rows")
        if placeholders is not None:
            self.placeholders = (self.placeholders or 0.0) + float(placeholders)
            failed = max(failed - float(placeholders), 0.0)  # dynamic sampling: round 1's count, not the kept rows'
        self.failed += failed
        if "rollout/staleness" in metrics:
            age = int(float(metrics["rollout/staleness"]))
            self.staleness[age] = self.staleness.get(age, 0) + 1
        for key, out in (("reward/mean", self.rewards), ("eval/reward/mean", self.evals)):
            value = metrics.get(key)
            if value is not None and math.isfinite(float(value)):
                out.append((step, float(value)))


class _Loop(Generic[C, S, B, R]):
    def __init__(self, recipe: Recipe[C, S, B, R], state: S, policy: PolicyWeights, run: RunContext, schedule: Schedule,
                 cfg: C, pending: list[Sampled], *, notes: ThirdPartyLog | None = None,
                 tracker_dirs: dict[str, str] | None = None) -> None:
        self.recipe, self.state, self.policy, self.run, self.schedule, self.cfg = recipe, state, policy, run, schedule, cfg
        self.acc, self.timer, self.fields = run.accelerator, run.timer, run_fields(cfg)
        self.logger = MetricsLogger(run.run_dir, accelerator=self.acc, start_step=run.start_step)
        self.record = _Record()
        self.notes = notes  # the libraries' messages kept off the console
        self.tracker_dirs = tracker_dirs or {}  # tracker -> where it writes
        self.plotted = time.perf_counter()  # when reward_curve.png was last drawn
        for row in self.logger.earlier:  # a resumed run: the steps before its checkpoint
            self.record.add_outcomes(int(row["step"]), {k: v for k, v in row.items() if v not in ("", None)})
        self.compiles = CompileWatch()  # from here: a compile in the recipe's setup counts in step 1 too
        # the rollouts a resumed asynchronous run had in flight: the rollout thread hands them out
        # first, or (resumed with train.max_staleness=0) the loop does
        self.pending = {} if self.fields.max_staleness else {p.step: p for p in pending}
        self.pipeline: RolloutPipeline | None = None
        if self.fields.max_staleness:
            self.pipeline = RolloutPipeline(self._sample, policy.channel(),
                                            start=run.start_step, total=schedule.total_steps,
                                            max_staleness=self.fields.max_staleness, pending=pending, timer=self.timer,
                                            device=self.acc.device)

    def fit(self) -> Path:
        sched, start, acc = self.schedule, self.run.start_step, self.acc
        if sched.note:
            acc.print(sched.note)
        if sched.eval_at_start and start == 0:
            metrics = self._evaluate(0)
            self._log(0, metrics)
        try:
            if self.pipeline is not None:
                self.pipeline.begin()
            with TrainProgress(sched.total_steps, initial=start, show=("reward/mean", "eval/reward/mean"),
                               accelerator=acc) as bar:
                for step in range(start + 1, sched.total_steps + 1):
                    self._fit_step(step, bar)
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
        outputs = dict(self.recipe.finish(self.state))
        end_training(acc)  # every process waits for the main one's exports
        if self.record.steps and not self.record.trained:
            raise UserError("no step trained; every step was skipped ("  # `run_app` prefixes the app's name
                            + "; ".join(self.record.reasons[:3]) + ")")
        self._summary(outputs)
        return self.run.run_dir

    def _fit_step(self, step: int, bar: TrainProgress) -> None:
        acc, sched, pipeline = self.acc, self.schedule, self.pipeline
        began = time.perf_counter()
        metrics = self._step(step)
        seconds = time.perf_counter() - began
        if pipeline is not None:
            pipeline.warmed()
        save = step % self.fields.save_freq == 0 or step == sched.total_steps
        # an asynchronous run: the rollouts the thread may sample before this step's weights are
        # out go into the checkpoint, and the thread waits while the engine evaluates and the
        # checkpoint is written
        pending = pipeline.pending(step) if pipeline is not None and save else []
        hold = pipeline.paused() if pipeline is not None and (save or self._eval_due(step)) else nullcontext()
        with hold:
            if pipeline is not None:
                pipeline.publish(step)
            if self._eval_due(step):
                metrics |= self._evaluate(step)
            samples, tokens = metrics.pop("samples", 0.0), metrics.pop("tokens", None)
            self.record.samples += samples
            metrics |= self.timer.pop()  # a checkpoint's time/checkpoint lands in the next step's row
            compiled = self.compiles.pop()  # the most any process compiled
            metrics |= dict(zip(compiled, acc.reduce(torch.tensor(list(compiled.values()), device=acc.device),
                                                     "max").tolist(), strict=True))
            if acc.num_processes > 1:  # every process's phases: rank 0's are time/<phase>
                metrics |= slowest_phases(acc, metrics)
            metrics |= {"time/step": seconds, "world_size": acc.num_processes,
                        "throughput/samples_per_s": samples / seconds}
            if tokens is not None:  # a text recipe's prompt + completion tokens of every process
                metrics["throughput/tokens_per_s"] = tokens / (seconds * acc.num_processes)
            self._log(step, metrics)  # logged before the checkpoint: a resume never loses a logged step
            bar.update(step, metrics)
            if save:
                with self.timer("checkpoint"):
                    self._save(step, pending)
        last = step == sched.total_steps
        if acc.is_main_process and (last or time.perf_counter() - self.plotted >= PLOT_EVERY_S):
            plot_reward_curve(self.run.run_dir, title=f"{self.recipe.name}: {self.run.run_dir.name}")
            self.plotted = time.perf_counter()

    def _sample(self, step: int) -> tuple[Any, int, tuple[int, float] | None]:
        """The recipe's `sample` and the optimizer steps in the weights it sampled with (on the
        thread that sampled: the rollout thread's, or the trainer's for an extra round)."""
        return self.recipe.sample(self.state, step), self.policy.weight_version, self._token_versions()

    def _token_versions(self) -> tuple[int, float] | None:
        """The last sample's oldest and mean token version (partial rollouts), else None."""
        return getattr(self.policy, "sampled_versions", None) if self.fields.partial_rollouts.steps else None

    def _token_staleness(self, versions: tuple[int, float] | None) -> dict[str, float]:
        """Partial rollouts: how many optimizer steps the step's tokens are older than the trained weights."""
        if versions is None:
            return {}
        steps = float(getattr(self.policy, "steps", self.policy.weight_version))
        return {"rollout/token_staleness_max": steps - versions[0], "rollout/token_staleness_mean": steps - versions[1]}

    def _rollout(self, step: int) -> tuple[B, dict[str, float], int | None]:
        """The step's batch: rolled out now (synchronous), or from the rollout thread or a
        resumed checkpoint, then prepared on this thread (asynchronous); its metrics (the
        weight version that sampled it); and the step whose weights sampled it (None: the
        trainer's own, synchronous)."""
        recipe, state = self.recipe, self.state
        sampled = self.pending.pop(step, None)
        if sampled is None and self.pipeline is None:
            with self.timer("rollout"):
                batch = recipe.rollout(state, step)
            return batch, {"rollout/weight_version": float(self.policy.weight_version),
                           **self._token_staleness(self._token_versions())}, None
        if sampled is None:
            with self.timer("rollout_wait"):
                sampled = self.pipeline.get(step)  # type: ignore[union-attr]
        value, weights, *versions = sampled.value  # (an older checkpoint's rollouts have no token versions)
        with self.timer("prepare"):
            batch = recipe.prepare(state, step, value)
        return batch, {**sampled.times, "rollout/staleness": float(step - 1 - sampled.version),
                       "rollout/weight_version": float(weights),
                       **self._token_staleness(versions[0] if versions else None)}, sampled.version

    def _extra_round(self, step: int) -> tuple[B, int, int]:
        """Dynamic sampling's next round of `step`, the step whose weights sampled it (always
        `step - 1`, the trainer's) and their optimizer steps: rolled out now (synchronous), or
        (asynchronous) sampled on this thread (`RolloutPipeline.fresh`) and prepared."""
        recipe, state = self.recipe, self.state
        if self.pipeline is None:
            with self.timer("rollout"):
                batch = recipe.rollout(state, step)
            return batch, step - 1, self.policy.weight_version
        with self.timer("rollout"):
            sampled = self.pipeline.fresh(step, self._sample)
        value, weights, *_ = sampled.value
        with self.timer("prepare"):
            return recipe.prepare(state, step, value), sampled.version, weights

    def _step(self, step: int) -> dict[str, Any]:
        recipe, state, timer = self.recipe, self.state, self.timer
        batch, sampled, version = self._rollout(step)
        if self.acc.num_processes > 1:  # this process waiting for the others' samples: apart from the reward's time
            with timer("rank_wait"):
                self.acc.wait_for_everyone()
        with timer("reward"):
            scores = recipe.score(state, step, batch)
        if isinstance(scores, Skip):
            print(f"{recipe.name}: step {step} skipped: {scores.reason}", file=sys.stderr)
            return {"skipped": 1, "error": scores.reason[:300], **sampled}
        generated, extra = float(scores.rewards.shape[0]), dict[str, float]()
        if self.fields.dynamic_sampling.enable:
            batch, scores, generated, extra = self._dynamic_sampling(step, batch, scores, version,
                                                                     int(sampled["rollout/weight_version"]))
            sampled["rollout/weight_version"] = extra.pop("rollout/weight_version")
            if version is not None:  # asynchronous: the oldest rollout trained on, of any process
                sampled["rollout/staleness"] = extra.pop("rollout/staleness")
        with timer("advantages"):
            adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=self.acc,
                                   mask=scores.mask, options=scores.options, **_objectives(scores))
        with timer("update"):
            update = recipe.update(state, step, batch, adv)
        samples = self.acc.reduce(torch.tensor(generated, device=self.acc.device), "sum").item()
        components = component_means(scores.components, self.acc)
        return {"skipped": 0, **sampled, **adv.metrics, **components, **scores.metrics, **extra, **update,
                "samples": samples}

    def _dynamic_sampling(self, step: int, batch: B, scores: Scores, version: int | None,
                          weights: int) -> tuple[B, Scores, float, dict[str, float]]:
        """DAPO's dynamic sampling (`rl_core.train.dynamic_sampling`): more rounds until every
        process holds as many informative groups as it rolled out, or `max_rounds` ran. In an
        asynchronous run round 1 is the rollout thread's (the weights of step `version`) and
        the further rounds sample the trainer's weights (`_extra_round`); the metrics then hold
        `rollout/staleness`, the age of the oldest round any process kept a group of."""
        ds, acc, recipe = self.fields.dynamic_sampling, self.acc, self.recipe
        groups = GroupFilter(ds.metric)
        batches, rounds = [batch], [scores]
        versions = [step - 1 if version is None else version]  # the step whose weights sampled each round
        steps = [weights]  # ... and the optimizer steps in them
        groups.add(0, scores)
        _check_metric(ds.metric, scores, acc)
        while len(rounds) < ds.max_rounds and acc.reduce(torch.tensor(float(groups.short), device=acc.device),
                                                          "sum").item() > 0:
            more, more_version, more_weights = self._extra_round(step)
            with self.timer("reward"):
                scored = recipe.score(self.state, step, more)
            if isinstance(scored, Skip):  # agreed over processes: train on what the earlier rounds gave
                print(f"{recipe.name}: step {step}: dynamic sampling round {len(rounds) + 1} skipped: {scored.reason}",
                      file=sys.stderr)
                break
            batches.append(more)
            rounds.append(scored)
            versions.append(more_version)
            steps.append(more_weights)
            groups.add(len(rounds) - 1, scored)
        chosen, _ = groups.selection()
        merger = cast(MergesRounds[S, B], recipe)  # checked before setup
        merged = merger.merge(self.state, [(batches[r], rows) for r, rows in chosen])
        merged_scores = merge_scores([(rounds[r], rows) for r, rows in chosen], rounds,
                                     group_offset=acc.process_index * 1_000_000)
        metrics = groups.metrics(len(rounds), acc)
        metrics["rollout/weight_version"] = float(steps[chosen[0][0]] if chosen else steps[0])  # the merge's first group's
        if version is not None:
            oldest = max((step - 1 - versions[r] for r, _ in chosen), default=0)
            metrics["rollout/staleness"] = acc.reduce(torch.tensor(float(oldest), device=acc.device), "max").item()
        return merged, merged_scores, float(sum(s.rewards.shape[0] for s in rounds)), metrics

    def _eval_due(self, step: int) -> bool:
        s = self.schedule
        return (s.eval_every > 0 and step % s.eval_every == 0) or (s.eval_at_end and step == s.total_steps)

    def _evaluate(self, step: int) -> dict[str, Any]:
        if self.pipeline is not None and step > self.run.start_step:  # with the trainer's weights (thread paused)
            self.pipeline.channel.load(step, prune=False)
        with isolated_rng(), self.timer("eval"), self.timer.scope("eval/"):
            metrics = self.recipe.evaluate(self.state, step)
        return {f"eval/{k}": v for k, v in metrics.items()}

    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        if step == 0:
            metrics |= self.timer.pop()
        self.logger.log(step, metrics)
        self.record.add(step, metrics)
        samples = self.run.samples.pop()
        if self.acc.is_main_process and self.fields.log_with:
            _samples_to_trackers(self.acc.trackers, step, samples)

    def _save(self, step: int, pending: list[Sampled]) -> None:
        spec = self.recipe.checkpoint(self.state)
        check_finite_parameters(spec.trained, f"checkpoint at step {step}")
        root, keep = self.run.run_dir / "checkpoints", self.fields.keep_last
        state = {**spec.state, POLICY: self.policy, **_in_flight(self.policy)}
        if self.pipeline is not None:
            in_flight = PendingRollouts(self.acc.process_index, self.acc.num_processes)
            in_flight.items = pending
            state[PIPELINE] = in_flight
        with spec.gather:  # every process: a sharded policy gathers its whole weights here
            if spec.accelerator:
                save_checkpoint(root, step, state=state, accelerator=self.acc, keep_last=keep,
                                write_files=spec.write_files)
            else:  # the main process writes the state; each process its rollouts in flight (asynchronous)
                save_checkpoint(root, step, state=state, accelerator=self.acc, accelerator_state=False,
                                keep_last=keep, write_files=spec.write_files)
        self.acc.wait_for_everyone()

    def _summary(self, outputs: Mapping[str, str]) -> None:
        r, d = self.record, self.run.run_dir
        seconds = time.perf_counter() - r.began
        lines = [f"\n{self.recipe.name} finished: {self.schedule.total_steps} steps"
                 f" ({r.steps} run now, {r.steps - r.trained} skipped) in {seconds:.1f} s"
                 + (f", {r.samples / seconds:.2f} samples/s" if r.samples else "")]
        for label, points in (("train reward", r.rewards), ("eval reward", r.evals)):
            if points:
                best = max(points, key=lambda p: p[1])
                lines.append(f"  {label:<16}first {points[0][1]:.4g} (step {points[0][0]})  last {points[-1][1]:.4g} "
                             f"(step {points[-1][0]})  best {best[1]:.4g} (step {best[0]})")
        lines.append(f"  {'failed rewards':<16}{r.failed:g}")
        if r.placeholders is not None:
            lines.append(f"  placeholder captions {r.placeholders:g}")
        if r.staleness:
            lines.append(f"  {'staleness':<16}" + ", ".join(f"{age}: {count} step{'s' * (count != 1)}"
                                                               for age, count in sorted(r.staleness.items())))
        notes = self.notes.summary() if self.notes is not None else None
        if notes:
            lines.append(f"  {'libraries said':<16}{notes}")
        written = {"run directory": d, "metrics": d / "metrics.csv", "reward curve": d / "reward_curve.png",
                   "samples": d / "samples", "checkpoints": d / "checkpoints"}
        for label, where in {**{k: str(v) for k, v in written.items() if v.exists()}, **outputs}.items():
            lines.append(f"  {label:<16}{where}")  # the recipe's `outputs` as given (a path or a count)
        for tracker, where in self.tracker_dirs.items():
            lines.append(f"  {tracker:<16}{where}")
        self.acc.print("\n".join(lines))
