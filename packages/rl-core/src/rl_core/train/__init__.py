"""Training plumbing every app needs once (install with `pip install "rl-core[train]"`): the
trainer loop that owns the schedule (`loop`) and the `Recipe` an app gives it (`recipe`), one
table of metric names (`metric_names`), config loading, run directories, metric and sample
logs, progress, atomic checkpoints, seeding, pinned-buffer offloading of weights or optimizer
state, FSDP2 sharding (`sharding`), trainable weights as checkpoint state and their EMA
(`ema`), and the training phases the apps share: group advantages
over processes (`groups`), the accumulated optimizer step with its non-finite guard and
first-replay check (`update`), the update over replayed samples that image apps share
(`replay_update`) and its micro-batch plan (`replay_plan`), a run's image artifacts (`images`:
contact sheets, collapse statistics), the `main()` contract with user errors (`app`), and the
end of a multi-process run (`shutdown`).

Accelerate is imported only where an accelerator is used, never at import time. The names below
are imported on first use (PEP 562), each from its module: `from rl_core.train import RunFields,
parse_run` imports no torch, which is what lets an app read its command line and config before
torch loads (`parse_run`, `rl_core.train.app`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.train.algo_fields import PolicyLossFields, TokenPolicyFields, check_loss_options
    from rl_core.train.app import UserError, parse_run, run_app
    from rl_core.train.checkpoint import Stateful, load_checkpoint, save_checkpoint
    from rl_core.train.config import (
        AdvantageName,
        AggregationName,
        AppConfig,
        CliArgs,
        ConfigError,
        KLName,
        NonNegative,
        NonNegativeFloat,
        PolicyLossName,
        Positive,
        PositiveFloat,
        RewardAggregationName,
        RolloutCorrectionName,
        UnitInterval,
        config_help,
        dump_config,
        flat_config,
        load_config,
        parse_cli,
        resolve_path,
    )
    from rl_core.train.ema import ParameterEMA, TrainableState, trainable_parameters
    from rl_core.train.entry import AppEntry
    from rl_core.train.fields import (
        CompileMode,
        DType,
        DynamicSampling,
        PartialRolloutFields,
        RunFields,
        ShardingFields,
        TokenTrainFields,
    )
    from rl_core.train.groups import (
        GroupAdvantages,
        component_means,
        component_weights,
        gather_rows,
        gathered_group_ids,
        gathered_means,
        group_advantages,
        zero_std_fraction,
    )
    from rl_core.train.images import (
        Media,
        all_frames,
        contact_sheet,
        image_stats,
        save_media,
        to_media,
        to_pil,
        write_video,
    )
    from rl_core.train.loop import run, train
    from rl_core.train.media_log import log_media
    from rl_core.train.metric_names import METRIC_NAMES, unknown_metric_names
    from rl_core.train.metrics import MetricsLogger, PhaseTimer
    from rl_core.train.offload import OptimizerOffload, PinnedOffload, park_frozen, visiting
    from rl_core.train.pipeline import (
        CopyChannel,
        PendingRollouts,
        RolloutPipeline,
        Sampled,
        WeightChannel,
        copy_sharing_frozen,
        finish_copies,
    )
    from rl_core.train.plots import plot_reward_curve
    from rl_core.train.policy_weights import CountedWeights, ModuleWeights, PolicyWeights
    from rl_core.train.process_state import ProcessState
    from rl_core.train.progress import TrainProgress
    from rl_core.train.recipe import (
        Checkpoint,
        MergesRounds,
        Recipe,
        RunContext,
        Schedule,
        Scores,
        Skip,
        check_batch_split,
        check_group_size,
        check_token_step,
    )
    from rl_core.train.replay_plan import (
        Micro,
        by_trajectory,
        chunked_steps,
        flow_grpo_steps,
        plan_micro_batches,
    )
    from rl_core.train.replay_update import Replay, RolloutCorrection, replay_update
    from rl_core.train.rundir import latest_checkpoint, latest_run, make_run_dir, resolve_resume
    from rl_core.train.samples import SampleLog
    from rl_core.train.seeding import (
        get_rng_state,
        isolated_rng,
        sample_seed,
        seed_everything,
        set_rng_state,
    )
    from rl_core.train.sharding import (
        SHARDINGS,
        FullWeights,
        ShardedState,
        ShardingPlan,
        accelerator_kwargs,
        full_state_dict,
        gathered,
        is_sharded,
        prepare_policy,
        resolve_sharding,
        shard_model,
        sharded_state,
    )
    from rl_core.train.shutdown import end_training
    from rl_core.train.update import (
        NonFiniteError,
        NonFiniteGuard,
        ReplayCheck,
        StepStats,
        UpdateStats,
        check_finite_parameters,
        optimizer_step,
    )

# module -> the names it gives this package (the imports above, for type checkers, say the same;
# tests/train/test_train_app.py checks that they agree)
_EXPORTS = {
    "algo_fields": ["PolicyLossFields", "TokenPolicyFields", "check_loss_options"],
    "app": ["UserError", "parse_run", "run_app"],
    "checkpoint": ["Stateful", "load_checkpoint", "save_checkpoint"],
    "config": ["AdvantageName", "AggregationName", "AppConfig", "CliArgs", "ConfigError", "KLName", "NonNegative",
               "NonNegativeFloat", "PolicyLossName", "Positive", "PositiveFloat", "RewardAggregationName",
               "RolloutCorrectionName", "UnitInterval", "config_help", "dump_config", "flat_config",
               "load_config", "parse_cli", "resolve_path"],
    "entry": ["AppEntry"],
    "ema": ["ParameterEMA", "TrainableState", "trainable_parameters"],
    "fields": ["CompileMode", "DType", "DynamicSampling", "PartialRolloutFields", "RunFields", "ShardingFields", "TokenTrainFields"],
    "groups": ["GroupAdvantages", "component_means", "component_weights", "gather_rows", "gathered_group_ids",
               "gathered_means", "group_advantages", "zero_std_fraction"],
    "media_log": ["log_media"],
    "images": ["Media", "all_frames", "contact_sheet", "image_stats", "save_media", "to_media", "to_pil", "write_video"],
    "loop": ["run", "train"],
    "metric_names": ["METRIC_NAMES", "unknown_metric_names"],
    "metrics": ["MetricsLogger", "PhaseTimer"],
    "offload": ["OptimizerOffload", "PinnedOffload", "park_frozen", "visiting"],
    "pipeline": ["CopyChannel", "PendingRollouts", "RolloutPipeline", "Sampled", "WeightChannel", "copy_sharing_frozen",
                 "finish_copies"],
    "plots": ["plot_reward_curve"],
    "policy_weights": ["CountedWeights", "ModuleWeights", "PolicyWeights"],
    "process_state": ["ProcessState"],
    "progress": ["TrainProgress"],
    "recipe": ["Checkpoint", "MergesRounds", "Recipe", "RunContext", "Schedule", "Scores", "Skip", "check_batch_split",
               "check_group_size", "check_token_step"],
    "replay_plan": ["Micro", "by_trajectory", "chunked_steps", "flow_grpo_steps", "plan_micro_batches"],
    "replay_update": ["Replay", "RolloutCorrection", "replay_update"],
    "rundir": ["latest_checkpoint", "latest_run", "make_run_dir", "resolve_resume"],
    "samples": ["SampleLog"],
    "seeding": ["get_rng_state", "isolated_rng", "sample_seed", "seed_everything", "set_rng_state"],
    "sharding": ["SHARDINGS", "FullWeights", "ShardedState", "ShardingPlan", "accelerator_kwargs",
                 "full_state_dict", "gathered", "is_sharded", "prepare_policy", "resolve_sharding",
                 "shard_model", "sharded_state"],
    "shutdown": ["end_training"],
    "update": ["NonFiniteError", "NonFiniteGuard", "ReplayCheck", "StepStats", "UpdateStats",
               "check_finite_parameters", "optimizer_step"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "METRIC_NAMES",
    "SHARDINGS",
    "AdvantageName",
    "AggregationName",
    "AppConfig",
    "AppEntry",
    "Checkpoint",
    "CliArgs",
    "CompileMode",
    "ConfigError",
    "CopyChannel",
    "CountedWeights",
    "DType",
    "DynamicSampling",
    "FullWeights",
    "GroupAdvantages",
    "KLName",
    "Media",
    "MergesRounds",
    "MetricsLogger",
    "Micro",
    "ModuleWeights",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonNegative",
    "NonNegativeFloat",
    "OptimizerOffload",
    "ParameterEMA",
    "PartialRolloutFields",
    "PendingRollouts",
    "PhaseTimer",
    "PinnedOffload",
    "PolicyLossFields",
    "PolicyLossName",
    "PolicyWeights",
    "Positive",
    "PositiveFloat",
    "ProcessState",
    "Recipe",
    "Replay",
    "ReplayCheck",
    "RewardAggregationName",
    "RolloutCorrection",
    "RolloutCorrectionName",
    "RolloutPipeline",
    "RunContext",
    "RunFields",
    "SampleLog",
    "Sampled",
    "Schedule",
    "Scores",
    "ShardedState",
    "ShardingFields",
    "ShardingPlan",
    "Skip",
    "Stateful",
    "StepStats",
    "TokenPolicyFields",
    "TokenTrainFields",
    "TrainProgress",
    "TrainableState",
    "UnitInterval",
    "UpdateStats",
    "UserError",
    "WeightChannel",
    "accelerator_kwargs",
    "all_frames",
    "by_trajectory",
    "check_batch_split",
    "check_finite_parameters",
    "check_group_size",
    "check_loss_options",
    "check_token_step",
    "chunked_steps",
    "component_means",
    "component_weights",
    "config_help",
    "contact_sheet",
    "copy_sharing_frozen",
    "dump_config",
    "end_training",
    "finish_copies",
    "flat_config",
    "flow_grpo_steps",
    "full_state_dict",
    "gather_rows",
    "gathered",
    "gathered_group_ids",
    "gathered_means",
    "get_rng_state",
    "group_advantages",
    "image_stats",
    "is_sharded",
    "isolated_rng",
    "latest_checkpoint",
    "latest_run",
    "load_checkpoint",
    "load_config",
    "log_media",
    "make_run_dir",
    "optimizer_step",
    "park_frozen",
    "parse_cli",
    "parse_run",
    "plan_micro_batches",
    "plot_reward_curve",
    "prepare_policy",
    "replay_update",
    "resolve_path",
    "resolve_resume",
    "resolve_sharding",
    "run",
    "run_app",
    "sample_seed",
    "save_checkpoint",
    "save_media",
    "seed_everything",
    "set_rng_state",
    "shard_model",
    "sharded_state",
    "to_media",
    "to_pil",
    "train",
    "trainable_parameters",
    "unknown_metric_names",
    "visiting",
    "write_video",
    "zero_std_fraction",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_core.train.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _Package(types.ModuleType):
    """This package: importing a submodule binds it as an attribute of its package, which would
    hide the function of the same name (`replay_update`) that `__getattr__` gives; so a submodule
    is not bound over a name the package exports (the eager imports used to rebind it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (isinstance(value, types.ModuleType) and _MODULE_OF.get(name) == name):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
