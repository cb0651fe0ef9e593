"""Training plumbing every app needs once (install with `pip install "rl-core[train]"`): the
trainer loop that owns the schedule (`loop`) and the `Recipe` an app gives it (`recipe`), one
table of metric names (`metric_names`), config loading, run directories, metric and sample
logs, progress, atomic checkpoints, seeding, pinned-buffer offloading of weights or optimizer
state, FSDP2 sharding (`sharding`), trainable weights as checkpoint state and their EMA
(`ema`), and the training phases the apps share: group advantages
over processes (`groups`), the accumulated optimizer step with its non-finite guard and
first-replay check (`update`), the update over replayed samples that image apps share
(`replay_update`), the `main()` contract with user errors (`app`), and the end of a
multi-process run (`shutdown`).

Accelerate is imported only where an accelerator is used, never at import time.
"""

from rl_core.train.algo_fields import PolicyLossFields, check_loss_options
from rl_core.train.app import UserError, run_app
from rl_core.train.checkpoint import (
    Stateful,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from rl_core.train.config import (
    AdvantageName,
    AggregationName,
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
)
from rl_core.train.dynamic_sampling import DynamicSampling
from rl_core.train.ema import ParameterEMA, TrainableState, trainable_parameters
from rl_core.train.groups import GroupAdvantages, component_means, gather_rows, group_advantages
from rl_core.train.loop import run, train
from rl_core.train.metric_names import METRIC_NAMES, unknown_metric_names
from rl_core.train.metrics import MetricsLogger, PhaseTimer
from rl_core.train.offload import OptimizerOffload, PinnedOffload
from rl_core.train.plots import plot_reward_curve
from rl_core.train.progress import TrainProgress
from rl_core.train.recipe import (
    Checkpoint,
    Recipe,
    RunContext,
    RunFields,
    Schedule,
    Scores,
    Skip,
    check_batch_split,
    check_group_size,
)
from rl_core.train.replay_update import Replay, replay_update
from rl_core.train.rundir import latest_run, make_run_dir
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
    ShardingFields,
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

__all__ = [
    "METRIC_NAMES",
    "SHARDINGS",
    "AdvantageName",
    "AggregationName",
    "Checkpoint",
    "CliArgs",
    "ConfigError",
    "DynamicSampling",
    "FullWeights",
    "GroupAdvantages",
    "KLName",
    "MetricsLogger",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonNegative",
    "NonNegativeFloat",
    "OptimizerOffload",
    "ParameterEMA",
    "PhaseTimer",
    "PinnedOffload",
    "PolicyLossFields",
    "PolicyLossName",
    "Positive",
    "PositiveFloat",
    "Recipe",
    "Replay",
    "ReplayCheck",
    "RewardAggregationName",
    "RolloutCorrectionName",
    "RunContext",
    "RunFields",
    "SampleLog",
    "Schedule",
    "Scores",
    "ShardedState",
    "ShardingFields",
    "ShardingPlan",
    "Skip",
    "Stateful",
    "StepStats",
    "TrainProgress",
    "TrainableState",
    "UnitInterval",
    "UpdateStats",
    "UserError",
    "accelerator_kwargs",
    "check_batch_split",
    "check_finite_parameters",
    "check_group_size",
    "check_loss_options",
    "component_means",
    "config_help",
    "dump_config",
    "end_training",
    "flat_config",
    "full_state_dict",
    "gather_rows",
    "gathered",
    "get_rng_state",
    "group_advantages",
    "is_sharded",
    "isolated_rng",
    "latest_checkpoint",
    "latest_run",
    "load_checkpoint",
    "load_config",
    "make_run_dir",
    "optimizer_step",
    "parse_cli",
    "plot_reward_curve",
    "prepare_policy",
    "replay_update",
    "resolve_resume",
    "resolve_sharding",
    "run",
    "run_app",
    "sample_seed",
    "save_checkpoint",
    "seed_everything",
    "set_rng_state",
    "shard_model",
    "sharded_state",
    "train",
    "trainable_parameters",
    "unknown_metric_names",
]
