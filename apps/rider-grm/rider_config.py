"""rider-grm's configuration: the msgspec Structs (TOML + dotted overrides), the seed's shell
variables and per-judge parallel lists, path resolution, and the checks that run before any model
loads (`check_config`: rules between keys, the process count, every user file the reward names).
No torch at import: `__main__.py` reads the command line and the config with it, before the recipe
(`rider_recipe.py`) loads; what `check_config` and `resolve_model` need they import when called."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from rl_core.train import (
    AdvantageName,
    AppConfig,
    ConfigError,
    DType,
    KLName,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    TokenPolicyFields,
    TokenTrainFields,
    UnitInterval,
    resolve_path,
)
from rl_core.train.entry import AppEntry
from rl_policy.placement import PolicyRolloutFields
from rl_rewards.modules import load_function, load_reward_module
from rl_rewards.spec import RewardSpec, load_spec

NAME = "rider-grm"
APP_DIR = Path(__file__).resolve().parent
REPO_ROOT = APP_DIR.parents[1]
DEFAULT_CONFIG = APP_DIR / "configs" / "default.toml"


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "Qwen/Qwen3-1.7B"
    """Policy (actor_rollout_ref.model.path); `tiny:qwen3[:seed]` builds a tiny random checkpoint."""
    dtype: DType = "bfloat16"  # the weights' dtype (auto: the checkpoint's own)
    ref_offload: bool = True  # keep the reference on CPU except while it scores (ref param_offload)
    optimizer_offload: bool = True  # optimizer state on CPU while the judges run (actor optimizer_offload)


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    train_files: list[str] = []  # verl parquet: prompt, rm_prompt_{i}, reward_model.ground_truth
    val_files: list[str] = []
    filter_overlong_prompts: bool = True  # False: a prompt over rollout.max_prompt_length is an error naming its row


class RolloutConfig(PolicyRolloutFields, kw_only=True, frozen=True):
    """`rollout.*`: the policy engine's keys (`PolicyRolloutFields`), verl's defaults."""

    n: Positive = 4  # responses per prompt (actor_rollout_ref.rollout.n)
    max_new_tokens: Positive = 2048  # response length (verl data.max_response_length)
    max_prompt_length: Positive = 6144  # longer prompts are dropped (data.filter_overlong_prompts) or refused
    temperature: PositiveFloat = 0.8
    val_temperature: NonNegativeFloat = 0.0  # 0 = greedy validation
    compile: bool = False  # hf: compile the decode step (CUDA graphs); off: weights move on sleep/wake


class JudgeConfig(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One generative judge. `omit_defaults`: unset fields (None defaults included) are left out
    when the config is written back as TOML (`config.toml` of the run), which has no null."""

    module: str = ""
    """VeRL-with-RMs reward module (import path or .py file) with rm_preprocess/rm_postprocess;
    not used with engine = "server" (the server holds the module)."""
    model: str = ""  # judge checkpoint, or the served model name for engine = "openai"
    name: str | None = None  # metric name (default: the module's last part, or `spec`)
    weight: float = 1.0
    combine: Literal["add", "mul"] = "add"  # total += w*score | total *= w*score
    temperature: NonNegativeFloat = 0.7
    max_new_tokens: Positive = 512
    seed: int | None = None  # judge sampling seed per call (None: drawn from the run's RNG, reproducible too)
    engine: Literal["auto", "hf", "vllm", "openai", "server"] = "auto"
    """hf: in process, swapped on and off the GPU; vllm: a vLLM engine of its own (one per judge),
    asleep (weights in host memory, KV cache freed) whenever it is not scoring; auto: vllm on a
    CUDA machine where vLLM imports, else hf (logged at start); openai: an OpenAI-compatible
    generation server at `url` (the module runs here); server: an `rl-rewards serve` reward server
    at `url` scoring with its reward named `spec` (module, model and sampling live on the server)."""
    url: str | None = None  # server URL (engine = "openai" or "server")
    spec: str | None = None  # engine = "server": the reward name configured on the server ([rewards.NAME])
    timeout_s: PositiveFloat = 600.0  # engine = "server": per-request timeout (judges generate: be generous)
    engine_options: dict[str, Any] = {}  # e.g. {gpu_memory_utilization = 0.8} for vllm
    gate: float | None = None
    """Score only samples whose rule reward is >= gate (checked before the judge is called).
    VeRL-with-RMs gates every judge on rule == 1: `gate = 1.0` is the same for rules in [0, 1]."""
    gated_out: Literal["skip", "zero"] = "skip"
    """A gated-out sample's judge term: `skip` leaves the total as it is; `zero` folds a score of
    0 (VeRL-with-RMs): the same for `add`, but a `mul` judge then makes the total 0."""
    fallback: float = 0.0  # score of a sample whose judge output does not parse
    completion_field: str | None = None
    """Judge only this field of the completion's JSON (VeRL-with-RMs: "Response"); a completion
    without it is not sent to the judge and scores `on_malformed`. Only for modules that take
    plain text: VeRL-with-RMs' own modules extract the field in rm_preprocess themselves."""
    on_malformed: float = 0.0  # score of a completion without `completion_field` (VeRL-with-RMs: 0.0)
    tokenizer: str | None = None  # judge tokenizer for rm_preprocess (default: model)
    prompt: Literal["rm_prompt", "prompt"] = "rm_prompt"
    """text_prompts given to rm_preprocess: the row's rm_prompt_{i} (VeRL-with-RMs) or the
    policy's prompt (modules that write their own instructions, e.g. rl_rewards.judges.rubric)."""


class VerlJudgeLists(msgspec.Struct, kw_only=True, frozen=True):
    """The seed's per-judge parallel lists (reward_model.*), expanded into `reward.judges`."""

    reward_function: list[str] = []
    model_path: list[str] = []
    reward_weight: list[float] = []
    reward_combine_func: list[Literal["add", "mul"]] = []
    temperature: list[float] = []
    gpu_memory_utilization: list[float] = []


class EmbeddingConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None  # BGE-style encoder (bge_sim.py); None = no similarity reward
    weight: float = 1.0  # total += weight * (0.7 * mapped similarity + 0.3)
    position: Literal["last", "after_rule"] = "last"
    """Where the term is folded in: after the judges (`last`) or right after the rule, before
    the judges (`after_rule`, VeRL-with-RMs: a later `mul` judge scales it too)."""
    gate: float | None = None  # add the term only where the rule reward is >= gate (VeRL-with-RMs: 1.0)
    completion_field: str | None = None  # compare this JSON field of the completion (VeRL-with-RMs: "Response")
    reference_field: str | None = None  # with this JSON field of the ground truth (VeRL-with-RMs: "Response")
    on_malformed: float = 0.0  # the term when a field is missing or does not parse (VeRL-with-RMs: 0.0)


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    swap: Literal["auto", "always", "never"] = "auto"
    """always: wake each in-process judge only while it scores and put the policy (weights and
    optimizer state) to sleep meanwhile — one model on the GPU at a time (VeRL-with-RMs' plan).
    never: the policy and every judge stay resident (fastest when all of them fit). auto: step 1
    runs as `always` and measures each phase's peak memory, then the fastest plan that fits in
    `swap_memory_fraction` of the GPU; `always` on CPU or with a vLLM judge or policy engine
    (vLLM's memory is unseen by the measurement). No judge in this process: the policy stays."""
    swap_memory_fraction: UnitInterval = 0.9  # share of the GPU's memory `auto` may plan to use
    rule: str | None = None  # "pkg.mod:compute_score" or "file.py:compute_score"
    rule_weight: float = 1.0
    judges: list[JudgeConfig] = []
    verl: VerlJudgeLists = VerlJudgeLists()
    embedding: EmbeddingConfig = EmbeddingConfig()
    spec: str | RewardSpec | None = None
    """A RewardSpec (a TOML path, or an inline `[reward.spec.components.NAME]` table) replacing
    rule, judges and embedding, its components built from the rl-rewards registry and resident
    (never swapped): for a reward the shorthand keys, which compile to a "fold" spec, cannot say."""
    stream: bool = True
    """Every judge served (`engine = "server"`): the samples are scored as the engine finishes
    them, on a thread, while the policy samples on and computes its log-probs
    (`rl_rollout.streaming`); with train.max_staleness >= 1 the rollout thread's samples are
    scored so too, while the trainer updates, and the reward phase takes their rewards. With
    rollout.per_prompt_seeds each prompt's samples go to the servers as soon as they are sampled;
    without, the batch is one engine call, scored while the log-probs run. The rewards equal the
    after-batch ones (the same samples, each scored on its own; a judge's gate reads the same rule
    score); false: score after the whole batch, in the reward phase."""


class AlgoConfig(TokenPolicyFields, kw_only=True, frozen=True):
    """`algo.*`: the token policy keys (`TokenPolicyFields`), verl's defaults, and the KL terms."""

    advantage: AdvantageName = "reinforce_pp"  # reinforce_pp | reinforce_pp_baseline | grpo | rloo (verl adv_estimator)
    gamma: UnitInterval = 1.0  # reinforce_pp discount
    use_kl_loss: bool = True  # the KL-to-reference loss term (verl use_kl_loss)
    kl: KLName = "k3"  # its estimator (verl kl_loss_type; low_var_kl = k3)
    kl_coef: NonNegativeFloat = 1e-4  # its weight (verl actor.kl_loss_coef)
    kl_in_reward: bool = False  # subtract kl_reward_coef * KL from token rewards instead / as well
    kl_reward_coef: NonNegativeFloat = 0.001  # verl algorithm.kl_ctrl.kl_coef (was algo.kl_coef before the rename)
    kl_reward_type: KLName = "k1"  # verl algorithm.kl_penalty
    replay_tolerance: NonNegativeFloat | None = None  # engine vs trainer |dlogp| (None: 1e-3 fp32, 5e-2 16-bit)
    old_logprobs: Literal["auto", "replay"] = "replay"
    """PPO's old log-probs. `replay` (verl's): a no-grad pass before the update. `auto` (caption-rl's): none when a
    batch makes one optimizer step and the reward has no KL; the update's own forward gives them (and the check)."""


class TrainConfig(TokenTrainFields, kw_only=True, frozen=True):
    """`train.*`: the run's keys (`TokenTrainFields`) at verl's settings."""

    output_dir: str = "runs/rider-grm"
    save_freq: Positive = 30
    batch_size: Positive = 32  # prompts per step, all processes (data.train_batch_size)
    mini_batch_size: Positive | None = 8  # prompts per optimizer step (ppo_mini_batch_size; None = batch_size)
    micro_batch_size: Positive = 4  # sequences per forward/backward (log_prob_micro_batch_size)
    epochs: Positive = 15
    max_steps: Positive | None = None  # stop earlier than `epochs`
    eval_freq: NonNegative = 0  # evaluate every N steps and at the end; 0 = only at the end (verl test_freq)
    val_before_train: bool = False  # evaluate once before the first step (logged as step 0)


class Config(AppConfig, kw_only=True, frozen=True):
    # Keys renamed to the other apps' names for the same idea (old -> new; the old is refused). The
    # reward-KL weight, formerly algo.kl_coef, is algo.kl_reward_coef: algo.kl_coef is now the KL
    # loss's weight, as in caption-rl and diffusion-grpo, so the old spelling cannot be refused.
    RENAMED: ClassVar[dict[str, str]] = {
        "algo.kl_loss_coef": "algo.kl_coef", "algo.kl_loss_type": "algo.kl", "algo.adv_estimator": "algo.advantage",
        "data.max_response_length": "rollout.max_new_tokens", "data.max_prompt_length": "rollout.max_prompt_length",
        "train.test_freq": "train.eval_freq"}
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()


# The seed's shell variables, so its launch script keeps working.
ENV = {"MODEL_PATH": "model.path", "TRAIN_FILE": "data.train_files", "SAVE_DIR": "train.output_dir",
       "LR_ACTOR": "train.lr", "NUM_EPISODES": "train.epochs", "n_samples_per_prompt": "rollout.n"}


def judge_configs(reward: RewardConfig) -> list[JudgeConfig]:
    """`reward.judges`, or the seed's parallel lists (`reward.verl.*`) expanded into judge tables."""
    given = {k: v for k, v in msgspec.structs.asdict(reward.verl).items() if v}
    if not given:
        return list(reward.judges)
    if reward.judges:
        raise ConfigError("set either reward.judges or the reward.verl.* lists, not both")
    lengths = {f"reward.verl.{k}": len(v) for k, v in given.items()}
    if len(set(lengths.values())) != 1 or "reward_function" not in given or "model_path" not in given:
        raise ConfigError(f"reward.verl lists must all have one entry per judge (reward_function and "
                          f"model_path required); got lengths {lengths}")
    out = []
    for i, (module, model) in enumerate(zip(given["reward_function"], given["model_path"], strict=True)):
        kw: dict[str, Any] = {"module": module, "model": model}
        for key, field in (("reward_weight", "weight"), ("reward_combine_func", "combine"), ("temperature", "temperature")):
            if key in given:
                kw[field] = given[key][i]
        if "gpu_memory_utilization" in given:
            kw["engine_options"] = {"gpu_memory_utilization": given["gpu_memory_utilization"][i]}
        out.append(JudgeConfig(**kw))
    return out


def check_config(cfg: Config, world_size: int) -> None:
    """Rules between keys, against the process count, and on what the reward names (the rule and
    every judge module imported, every engine kind possible here), before any model loads."""
    # torch: imported when the recipe checks, not for --help
    from rl_policy.setup import check_token_config

    r = cfg.reward
    check_token_config(cfg.algo, cfg.rollout, cfg.train, world_size)
    if cfg.algo.reward_aggregation == "normalize_then_sum" and cfg.algo.kl_in_reward:
        raise ConfigError("algo.reward_aggregation=normalize_then_sum normalises the judges' scores per sequence; "
                          "algo.kl_in_reward shapes token rewards: use one of them (algo.use_kl_loss keeps a KL term)")
    if r.spec is not None:
        read_spec(r)
        return
    judges = judge_configs(r)
    for i, judge in enumerate(judges):
        _check_judge(i, judge, f"reward.verl.reward_function[{i}]" if r.verl.reward_function else None, world_size)
    if r.rule is not None:
        _user_code("reward.rule", r.rule, load_function)
    if r.rule is None and not judges and r.embedding.model is None:
        raise ConfigError("no reward: set reward.rule, reward.judges, reward.embedding.model or reward.spec")
    gated = [f"reward.judges[{i}]" for i, j in enumerate(judges) if j.gate is not None]
    if r.rule is None and (gated or r.embedding.gate is not None):
        raise ConfigError(f"{(gated or ['reward.embedding'])[0]} has a gate but reward.rule is not set")


def _check_judge(i: int, judge: JudgeConfig, module_key: str | None, world_size: int) -> None:
    """Judge `i` has what its engine needs, and its module imports and defines both functions."""
    from rl_rollout import (
        resolve_judge_engine,  # torch: imported when the recipe checks, not for --help
    )

    where = f"reward.judges[{i}] (engine = {judge.engine!r})"
    if judge.gated_out != "skip" and judge.gate is None:
        raise ConfigError(f"{where} has gated_out = {judge.gated_out!r} but no gate: set gate (e.g. 1.0)")
    if judge.engine == "server":
        if not judge.url or not judge.spec:
            raise ConfigError(f"{where} needs url (the rl-rewards serve address) and spec (a reward "
                              "name configured on that server)")
        if judge.completion_field is not None:
            raise ConfigError(f"{where}: completion_field is applied by the server; set it in the judge "
                              "options of the server's reward spec instead")
        return
    if not judge.module or not judge.model:
        raise ConfigError(f"{where} needs module (a VeRL-with-RMs reward module) and model")
    if judge.engine == "openai" and not judge.url:
        raise ConfigError(f"{where} needs url (the OpenAI-compatible server's base URL)")
    _user_code(module_key or f"reward.judges[{i}].module", judge.module, load_reward_module)
    if judge.engine != "openai":  # vllm where it cannot run, or for several training processes
        resolve_judge_engine(judge.engine, key=f"reward.judges[{i}].engine", world_size=world_size)


def _user_code(key: str, value: str, load: Callable[[str], object]) -> None:
    """Import a user's rule or judge module now: a missing file, a syntax or import error, or a
    missing function is one line naming the key."""
    try:
        load(resolve_path(value, REPO_ROOT))
    except Exception as e:  # anything the user's module raises on import
        raise ConfigError(f"{key}={value!r}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def read_spec(reward: RewardConfig) -> RewardSpec | None:
    """`reward.spec`: the inline table, or the TOML file it names (read, fields checked)."""
    if not isinstance(reward.spec, str):
        return reward.spec
    try:
        return load_spec(resolve_path(reward.spec, REPO_ROOT))
    except (OSError, ValueError) as e:
        raise ConfigError(f"reward.spec={reward.spec!r}: {e}") from None


def judge_name(judge: JudgeConfig) -> str:
    if judge.name:
        return judge.name
    if judge.engine == "server":
        return str(judge.spec)
    return judge.module.removesuffix(".py").replace("/", ".").split(".")[-1]


def resolve_model(spec: str, key: str = "model.path") -> str:
    """`tiny:<family>[:seed]` -> a tiny random checkpoint folder; a relative folder is tried
    against the working directory, then the repository root (`rl_models.tiny.resolve`; a missing
    one is a user error naming `key`)."""
    from rl_models import tiny  # torch and transformers

    return tiny.resolve(spec if spec.startswith("tiny:") else resolve_path(spec, REPO_ROOT), key=key)


ENTRY = AppEntry(NAME, Config, DEFAULT_CONFIG, ENV, recipe="rider_recipe")
"""The app: `__main__.py` attaches it (the command line and the config are read before the recipe
and torch load)."""
