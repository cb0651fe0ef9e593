"""The `train.*` tables the trainer loop reads, named the same in every app: `RunFields` (an
app's `TrainConfig` subclasses it) with its sharding keys (`ShardingFields`) and DAPO's dynamic
sampling (`DynamicSampling`). Torch-free, so an app's config module imports them and the app
reads its command line before torch is imported; `rl_core.train.sharding`,
`rl_core.train.dynamic_sampling` and `rl_core.train.recipe` use them and give the same names.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rl_core.train.config import NonNegative, NonNegativeFloat, Positive, PositiveFloat

__all__ = ["CompileMode", "DType", "DynamicSampling", "MixedPrecision", "PartialRolloutFields", "RunFields", "Sharding",
           "ShardingFields", "TokenTrainFields", "TrackerName", "run_fields"]

Sharding = Literal["none", "fsdp2"]
MixedPrecision = Literal["none", "bf16"]
# The closed sets of strings the apps' keys take, as Literals so a typo (`model.dtype=float8`) stops
# when the config loads, in a line naming the key and the choices, not when the model loads.
# Each mirrors a list in a torch-side library, and a test keeps them equal: rl-core's test_train_config.py,
# and caption-rl's test_failure_rules.py for DType (rl-core does not import rl-models).
DType = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
"""A model's weights dtype: `rl_models.loading.DTYPES` or `auto` (the checkpoint's own)."""
CompileMode = Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite"]
"""A `torch.compile` mode (`torch._inductor.list_mode_options()`), or `auto` (the app chooses)."""
TrackerName = Literal["all", "aim", "tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive",
                      "swanlab"]
"""An Accelerate tracker (`accelerate.utils.LoggerType`)."""


class ShardingFields(msgspec.Struct, kw_only=True, frozen=True):
    """The `train.*` settings of sharding, shared by the apps: an app's `TrainConfig` subclasses
    this (`rl_core.train.config_help` reads the documentation below from here)."""

    sharding: Sharding = "none"
    """`none`: DDP, every GPU holds the whole trained model and its optimizer state (fastest
    while that fits). `fsdp2`: weights, gradients and optimizer state sharded over the processes
    (`torch.distributed.fsdp.fully_shard`, one unit per decoder layer or transformer block plus
    the root; `rl_core.train.sharding`), for a model that with Adam (~16 bytes/parameter) does
    not fit one GPU; the rollout (and eval, export) gathers the full weights
    (`time/weight_gather`). Also turned on by an `accelerate launch` FSDP config (fsdp_version: 2)."""
    fsdp_cpu_offload: bool = False
    """fsdp2: keep the weight shards and optimizer state in host memory (the optimizer steps on
    the CPU, Adam/AdamW with torch's fused kernel): slower; for when even 1/N of the model with
    Adam does not fit."""
    fsdp_mixed_precision: MixedPrecision = "none"
    """fsdp2: `bf16` keeps fp32 master weights, computes in bf16 and reduces gradients in fp32
    (load the model in float32 or bfloat16); `none` trains in the loaded dtype."""
    fsdp_activation_checkpointing: bool = False
    """fsdp2: recompute each decoder layer's (transformer block's) activations in backward (less
    memory, ~1/3 more compute)."""


class DynamicSampling(msgspec.Struct, kw_only=True, frozen=True):
    """`train.dynamic_sampling`: DAPO's dynamic sampling (see `rl_core.train.dynamic_sampling`)."""

    enable: bool = False
    """Drop groups whose samples all scored the same `metric` and refill the batch with more
    rollout rounds (DAPO; verl filter_groups). Choose it when many groups saturate (all right or
    all wrong): each step then trains on informative groups only."""
    metric: str = "reward"
    """What must differ within a group: `reward` (the total) or a reward component's name (its
    unweighted value); prefer the raw task metric when the total has shaping terms."""
    max_rounds: Positive = 3
    """Rollout rounds per step at most (the first included); a process still short then fills
    its batch with uniform groups (counted in dynamic_sampling/filled_groups)."""


class PartialRolloutFields(msgspec.Struct, kw_only=True, frozen=True):
    """`train.partial_rollouts`: partial rollouts streamed by group (`rl_rollout.partial`)."""

    steps: NonNegative = 0
    """K >= 1: each process keeps (K + 1) x its prompts of a step in flight; a step trains on the
    groups that finish first (every group at most K steps after it was drawn), and the samples
    still running go on in the next step with the newer weights, each token tagged with the
    version that sampled it (`rollout/token_staleness_*`). Choose 1 where response lengths have a
    long tail: the slowest samples no longer hold the step. 0: off. With K >= 1 the run depends on
    its process count (each process keeps its own groups); the text apps take it, diffusion-grpo
    refuses it."""
    chunk_tokens: Positive = 64
    """Tokens each unfinished sample decodes per round; a round's samples then continue from
    their tokens so far (re-read by the engine). Smaller: a step ends closer to its groups'
    finish; larger: fewer re-reads."""


class RunFields(ShardingFields, kw_only=True, frozen=True):
    """The `train.*` keys the loop reads, named the same in every app: an app's `TrainConfig`
    subclasses this (and redefines a field to change its default, e.g. `output_dir`)."""

    output_dir: str = "runs"
    run_name: str | None = None  # default: run-<date>-<time>; --resume keeps the resumed run's name
    seed: NonNegative = 0
    save_freq: Positive = 50  # checkpoint every N steps (and at the last)
    keep_last: Positive = 2  # checkpoints kept
    log_with: list[TrackerName] = msgspec.field(default_factory=list)
    """Experiment trackers through Accelerate (tensorboard, wandb, mlflow, trackio, ...), logging
    into the run directory; the same scalars as metrics.csv."""
    dynamic_sampling: DynamicSampling = DynamicSampling()
    """DAPO's dynamic sampling: `enable`, `metric`, `max_rounds` (see the keys below)."""
    partial_rollouts: PartialRolloutFields = PartialRolloutFields()
    """Partial rollouts streamed by group: `steps`, `chunk_tokens` (see the keys below)."""
    max_staleness: NonNegative = 0
    """0: each step rolls out, scores and updates in series (synchronous). N >= 1: a rollout
    thread samples up to N steps ahead while the trainer updates, so step j trains on rollouts
    from the weights of step j - 1 - N (`rollout/staleness`); choose 1 when rollout and update
    take similar time, and correct the gap with `algo.rollout_correction` (e.g.
    `token_truncate`). Needs a recipe with the `sample`/`prepare`/`weight_channel` hooks. With
    dynamic sampling the further rounds sample the trainer's current weights (staleness 0); with
    fsdp2 every process gathers each version whole for its rollout copy (the model once more per
    GPU). A resume needs the same process count."""
    max_nonfinite_steps: Positive = 3
    """Consecutive optimizer steps with a non-finite loss or gradient (each skipped, weights
    untouched) after which the run stops with an error."""
    verbose: bool = False
    """Print the libraries' own warnings, notices and progress bars as they come (`--verbose`);
    by default they go to the run directory's third_party.log, counted in the summary."""


class TokenTrainFields(RunFields, kw_only=True, frozen=True):
    """The `train.*` keys of a text policy's run, one vocabulary for the text apps: an app's
    `TrainConfig` subclasses this, restating a field only to change its default, and adds its
    schedule's keys (`epochs`, `max_steps`). `rl_policy.setup.prepare_token_policy` builds the
    optimizer from them."""

    batch_size: Positive = 32  # prompts per step, all processes together
    mini_batch_size: Positive | None = None  # prompts per optimizer step (None = batch_size)
    micro_batch_size: Positive = 4  # sequences per forward/backward on one process
    lr: PositiveFloat = 1e-6
    weight_decay: NonNegativeFloat = 0.0  # AdamW's
    warmup_steps: NonNegative = 0  # the learning rate rises linearly over the first N optimizer steps
    grad_clip: PositiveFloat = 1.0  # max gradient norm
    samples_to_log: NonNegative = 4  # samples written to samples/ per step


def run_fields(cfg: msgspec.Struct) -> RunFields:
    """An app config's `train` table, which every app config has and which subclasses
    `RunFields` (the loop reads its keys)."""
    fields = msgspec.structs.asdict(cfg).get("train")
    if not isinstance(fields, RunFields):
        raise TypeError(f"{type(cfg).__name__}.train must be a subclass of rl_core.train.RunFields, "
                        f"got {type(fields).__name__}")
    return fields
