"""caption-rl's configuration: one msgspec Struct per TOML table, read by the trainer loop from a
TOML file, CapRL++'s environment variables (`ENV`) and dotted overrides. No torch: `__main__.py`
reads the command line and the config with it, before the recipe (`caption_recipe.py`) loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

import msgspec

from rl_core.train import (
    AppConfig,
    CompileMode,
    DType,
    KLName,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    TokenPolicyFields,
    TokenTrainFields,
)
from rl_core.train.entry import AppEntry
from rl_policy.placement import PolicyRolloutFields
from rl_rewards.caprl import CaprlRewardConfig

NAME = "caption-rl"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.toml"


def default_config() -> Path | None:
    """The config a run without `--config` reads: the embedded tiny default, unless `CAPTION_MODEL`
    is set (a CapRL++ launch line), which starts from the full-size CapRL++ defaults instead."""
    return None if "CAPTION_MODEL" in os.environ else DEFAULT_CONFIG


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "Qwen/Qwen3-VL-4B-Instruct"
    """Caption model (local folder or hub id); `tiny:<family>` builds a tiny random checkpoint."""
    dtype: DType = "bfloat16"  # the weights' dtype (auto: the checkpoint's own)
    lora_rank: NonNegative = 0  # 0 = full fine-tuning (CapRL++); > 0 trains a LoRA adapter
    lora_alpha: Positive = 32
    lora_targets: list[str] | None = None  # peft target_modules; None = rl_models' family default
    gradient_checkpointing: bool = False
    share_media: bool = True
    """Encode each distinct image/video once per forward (`rl_models.share_identical_media`): a
    group's n rollouts repeat their prompt's media, so the vision tower does 1/n of the work in
    prefill, replay and update, with the same results."""
    compile_layers: Literal["auto", "on", "off"] = "auto"
    """`torch.compile` each text decoder layer (`rl_models.compile_decoder_layers`): fuses the
    elementwise kernels (RMSNorm, rotary, SwiGLU) that dominate a short-row update's GPU time,
    at the same memory. `auto`: on with CUDA only (on a CPU the compile costs more than it saves)."""


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    train_files: list[str] = []
    """CapRL caption-QA JSONL/parquet files (image and/or video rows)."""
    val_files: list[str] = []  # held-out files; empty = hold out `eval_size` training records
    eval_size: NonNegative = 0
    task: Literal["auto", "image", "video"] = "auto"  # keep only image or video rows
    video_fps: PositiveFloat = 2.0  # frames sampled per second (CapRL: ~2)
    video_max_frames: Positive = 64
    max_pixels: Positive = 448 * 448  # per image / video frame


class RolloutConfig(PolicyRolloutFields, kw_only=True, frozen=True):
    """`rollout.*`: the policy engine's keys (`PolicyRolloutFields`), CapRL++'s lengths."""

    max_new_tokens: Positive = 4096  # response length
    max_prompt_length: Positive = 13000  # longer prompts (media tokens included) are skipped
    eval_temperature: NonNegativeFloat = 0.0
    """The eval's sampling temperature (verl's `val_kwargs.temperature`): 0 = greedy. Sample (e.g.
    at `temperature`) where the greedy caption of a policy repeats one token, as a tiny one's does."""
    compile_mode: CompileMode = "auto"
    """hf engine on CUDA: torch.compile mode of the decode step. `default` (fused kernels) lets
    the KV cache be freed during the update; `reduce-overhead` (CUDA graphs) pins the cache's
    addresses, so keep it allocated (`release_cache = false`): faster decode, more memory. auto:
    `default`, and `reduce-overhead` with train.max_staleness >= 1 (the rollout engine keeps its
    cache then; fewer launches leave the trainer's thread more of the interpreter)."""
    release_cache: bool = True  # hf: free the KV cache before the update (memory for training)
    offload_optimizer: Literal["auto", "always", "never"] = "auto"
    """Move the optimizer state (Adam moments: 2x the trained weights) to pinned host memory while
    the policy decodes, making room for the KV cache (`rl_core.train.OptimizerOffload`, copies at
    full PCIe bandwidth). auto: on CUDA with the hf engine."""


class RewardConfig(CaprlRewardConfig, kw_only=True, frozen=True):
    """`reward.*`: CapRL++'s reward (`rl_rewards.caprl`: QA + format + length, in process or served)."""

    stream: bool = True
    """A reward server (`url` / `host`): the captions go to the server as the engine finishes
    them, scored on a thread while the policy samples on (`rl_rollout.streaming`); with
    train.max_staleness >= 1 the rollout thread's captions are scored so too, while the trainer
    updates, and the reward phase takes their rewards. With rollout.per_prompt_seeds each
    prompt's captions are sent as soon as they are sampled, so the server scores prompt i while
    prompt i+1 generates; without, the batch is one engine call and one request. The rewards
    equal the after-batch ones (the same captions, each scored on its own); false: score after
    the whole batch, in the reward phase."""


class AlgoConfig(TokenPolicyFields, kw_only=True, frozen=True):
    """`algo.*`: the token policy keys (`TokenPolicyFields`; CapRL++ trains with advantage = rloo)."""

    clip_high: NonNegativeFloat = 0.28  # DAPO clip-higher; = clip_low for symmetric PPO
    kl: KLName = "k3"  # KL-to-reference estimator (only used when kl_coef > 0)
    kl_coef: NonNegativeFloat = 0.0  # CapRL++: no KL
    ppo_epochs: Positive = 1
    old_logprobs: Literal["auto", "replay"] = "auto"
    """PPO's old log-probs. `replay`: a no-grad pass over every rollout before the update.
    `auto`: skip that pass when the batch makes exactly one optimizer step (ppo_epochs = 1 and
    one minibatch): the weights cannot change before every micro-batch has been scored, so the
    update's own forward gives them (ratio exactly 1), as TRL and verl do; the first-step
    engine check and the entropy then come from that forward too."""
    replay_tolerance: NonNegativeFloat | None = None
    """Max mean |engine logp - trainer logp| on the first step (None: 1e-3 fp32, 5e-2 16-bit)."""


class TrainConfig(TokenTrainFields, kw_only=True, frozen=True):
    """`train.*`: the run's keys (`TokenTrainFields`) at CapRL++'s settings."""

    batch_size: Positive = 128  # prompts per step, all processes together
    epochs: Positive = 3
    max_steps: Positive | None = None  # stop earlier than `epochs`
    lr: PositiveFloat = 1e-5
    eval_freq: NonNegative = 10  # 0 = no eval
    output_dir: str = "runs/caption-rl"
    export: bool = True  # save the final HF model (or LoRA adapter) in run_dir/export


class Config(AppConfig, kw_only=True, frozen=True):
    # Keys renamed to the other apps' names for the same idea (old -> new; the old is refused).
    RENAMED: ClassVar[dict[str, str]] = {"data.train": "data.train_files", "data.eval": "data.val_files"}
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()


# CapRL++'s train_caprl.sh variables, so its launch lines keep working.
ENV = {
    "CAPTION_MODEL": "model.path",
    "DATASET": "data.train_files",
    "SAVE_DIR": "train.output_dir",
    "REWARD_REMOTE_URL": "reward.url",
    "REWARD_NODE_IP": "reward.host",
    "REWARD_PORT": "reward.port",
    "BATCH_SIZE": "train.batch_size",
    "ROLLOUT_N": "rollout.n",
    "TOTAL_EPOCHS": "train.epochs",
    "SAVE_FREQ": "train.save_freq",
    "ACTOR_LR": "train.lr",
    "ROLLOUT_RESPONSE_LENGTH": "rollout.max_new_tokens",
    "ROLLOUT_PROMPT_LENGTH": "rollout.max_prompt_length",
    "REWARD_LENGTH_TOKENIZER_PATH": "reward.length_tokenizer",
    "REWARD_LENGTH_L1": "reward.length_l1",
    "REWARD_LENGTH_L2": "reward.length_l2",
    "REWARD_LENGTH_WEIGHT": "reward.length_weight",
    "FORMAT_REWARD_WEIGHT": "reward.format_weight",
    "REWARD_QA_NUM": "reward.qa_num",
    "FORMAT_REWARD_VARIANT": "reward.format_variant",
    "FORMAT_MIN_BRACKETS": "reward.format_min_brackets",
    "REWARD_ANSWER_PARSER": "reward.answer_parser",
    "REWARD_QA_PROMPT_FILE": "reward.qa_prompt_file",
    "RUN_NAME": "train.run_name",
}


ENTRY = AppEntry(NAME, Config, default_config, ENV, recipe="caption_recipe")
"""The app: `__main__.py` attaches it (the command line and the config are read before the recipe
and torch load)."""
