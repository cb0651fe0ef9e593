"""rider-grm: VeRL-with-RMs on Accelerate — a text policy trained with REINFORCE++ (or GRPO/RLOO)
on a rule reward plus several generative judges plus an embedding-similarity reward.

    uv run apps/rider-grm                                    # embedded tiny CPU default
    uv run apps/rider-grm --config examples/rider-grm/verl-with-rms.toml
    accelerate launch apps/rider-grm/__main__.py --config FILE train.batch_size=128
    uv run apps/rider-grm --resume                            # continue the latest run
    uv run apps/rider-grm --help                              # every key, default, env var

One step: group sampler -> generate with the policy (the `hf` engine wraps the training model)
-> put the policy engine (and the optimizer state) to sleep -> rule reward -> each judge woken
in turn, scores the samples its gate lets through, goes back to sleep -> embedding similarity
-> fold the components -> advantages -> log-prob replay with the policy and the reference (the
engine's log-probs must match on the first step) -> clipped policy-gradient update with the k3
KL loss -> checkpoint -> validate -> log. Only one model's weights are on the accelerator while
the judges score. See README.md next to this file for the seed's launch line translated.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from judging import (
    PhaseMonitor,
    RecordingEngine,
    RuleScorer,
    SwappedJudge,
    TimedScorer,
    check_judge,
    engine_state,
    load_function,
)
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from rl_core.advantages import compute_advantages
from rl_core.kl import compute_kl
from rl_core.logprobs import token_logprobs
from rl_core.losses import aggregate, compute_policy_loss
from rl_core.train import (
    ConfigError,
    MetricsLogger,
    TrainProgress,
    config_help,
    get_rng_state,
    load_checkpoint,
    load_config,
    make_run_dir,
    parse_cli,
    resolve_resume,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from rl_data import GroupSampler, JudgeRecord, read_judge_records
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_rewards.composition import Reward, build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.judge import JudgeScorer
from rl_rewards.spec import Component, Gate, RewardSpec
from rl_rollout import Engine, Generation, SamplingParams, build_engine
from rl_rollout.hf import HFEngine

APP_DIR = Path(__file__).resolve().parent
REPO_ROOT = APP_DIR.parents[1]
DEFAULT_CONFIG = APP_DIR / "configs" / "default.toml"
Positive = Annotated[int, msgspec.Meta(ge=1)]

# ----------------------------------------------------------------------------------- config


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    path: str = "Qwen/Qwen3-1.7B"
    """Policy (actor_rollout_ref.model.path); `tiny:qwen3[:seed]` builds a tiny random checkpoint."""
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    ref_offload: bool = True  # keep the reference on CPU except while it scores (ref param_offload)
    optimizer_offload: bool = True  # optimizer state on CPU while the judges run (actor optimizer_offload)


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    train_files: list[str] = []  # verl parquet: prompt, rm_prompt_{i}, reward_model.ground_truth
    val_files: list[str] = []
    max_prompt_length: Positive = 6144
    max_response_length: Positive = 2048
    filter_overlong_prompts: bool = True  # False: an overlong prompt is an error naming its row


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    n: Positive = 4  # responses per prompt (actor_rollout_ref.rollout.n)
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    val_temperature: float = 0.0  # 0 = greedy validation
    max_batch_size: Positive = 64  # rows decoded together by the hf engine
    compile: bool = False  # compile the decode step (CUDA graphs); off: weights move on sleep/wake


class JudgeConfig(msgspec.Struct, kw_only=True, frozen=True):
    module: str
    """VeRL-with-RMs reward module (import path or .py file) with rm_preprocess/rm_postprocess."""
    model: str  # judge checkpoint, or the served model name for engine = "openai"
    name: str | None = None  # metric name (default: the module's last part)
    weight: float = 1.0
    combine: Literal["add", "mul"] = "add"  # total += w*score | total *= w*score
    temperature: float = 0.7
    max_new_tokens: Positive = 512
    engine: Literal["hf", "vllm", "openai"] = "hf"
    url: str | None = None  # OpenAI-compatible server (engine = "openai")
    engine_options: dict[str, Any] = {}  # e.g. {gpu_memory_utilization = 0.8} for vllm
    gate: float | None = None  # score only samples whose rule reward is >= gate
    fallback: float = 0.0  # score of a sample whose judge output does not parse
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
    weight: float = 1.0  # total += weight * (0.7 * mapped similarity + 0.3), REFERENCE.md §3


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    swap: bool = True
    """Wake each judge only while it scores and sleep the policy meanwhile (one model on the GPU
    at a time); false keeps the policy and every judge resident (faster when all of them fit)."""
    rule: str | None = None  # "pkg.mod:compute_score" or "file.py:compute_score"
    rule_weight: float = 1.0
    judges: list[JudgeConfig] = []
    verl: VerlJudgeLists = VerlJudgeLists()
    embedding: EmbeddingConfig = EmbeddingConfig()


class AlgoConfig(msgspec.Struct, kw_only=True, frozen=True):
    adv_estimator: str = "reinforce_pp"  # reinforce_pp | reinforce_pp_baseline | grpo | rloo
    gamma: float = 1.0  # reinforce_pp discount
    loss: str = "ppo_clip"  # ppo_clip | dual_clip | gspo
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    use_kl_loss: bool = True
    kl_loss_type: str = "k3"  # low_var_kl
    kl_loss_coef: float = 1e-4
    kl_in_reward: bool = False  # subtract kl_coef * KL from token rewards instead / as well
    kl_coef: float = 0.001  # algorithm.kl_ctrl.kl_coef
    kl_reward_type: str = "k1"
    replay_tolerance: float | None = None  # engine vs trainer |dlogp| (None: 1e-3 fp32, 5e-2 16-bit)


class TrainConfig(msgspec.Struct, kw_only=True, frozen=True):
    batch_size: Positive = 32  # prompts per step, all processes (data.train_batch_size)
    mini_batch_size: Positive = 8  # prompts per optimizer step (ppo_mini_batch_size)
    micro_batch_size: Positive = 4  # sequences per forward/backward (log_prob_micro_batch_size)
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: Positive = 15
    max_steps: int | None = None
    save_freq: Positive = 30
    keep_last: Positive = 2
    test_freq: int = 0  # validate every N steps and at the end; 0 = only at the end
    val_before_train: bool = False
    output_dir: str = "runs/rider-grm"
    run_name: str | None = None
    seed: int = 0
    samples_to_log: int = 4  # generations (with each judge's raw output) written per step
    log_with: list[str] = []  # accelerate trackers (trainer.logger)
    print_summary: bool = True


class Config(msgspec.Struct, kw_only=True, frozen=True):
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
    """`reward.judges`, or the seed's parallel lists expanded; unequal lengths are rejected."""
    lists = msgspec.structs.asdict(reward.verl)
    given = {k: v for k, v in lists.items() if v}
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


def judge_name(judge: JudgeConfig) -> str:
    return judge.name or judge.module.removesuffix(".py").replace("/", ".").split(".")[-1]


# ----------------------------------------------------------------------------------- data & models


def resolve_path(path: str) -> str:
    """Relative paths are tried against the working directory, then the repository root."""
    if Path(path).exists() or Path(path).is_absolute() or not (REPO_ROOT / path).exists():
        return path
    return str(REPO_ROOT / path)


def resolve_model(spec: str) -> str:
    """`tiny:<family>[:seed]` -> a tiny random checkpoint folder (`rl_models.tiny`)."""
    if not spec.startswith("tiny:"):
        return resolve_path(spec)
    family, _, seed = spec.removeprefix("tiny:").partition(":")
    return str(tiny.build(family, seed=int(seed or 0)))


def messages(record: JudgeRecord) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in record.prompt]


def load_records(files: list[str], tokenizer: Any, data: DataConfig) -> list[JudgeRecord]:
    """Judge rows of `files`; prompts longer than max_prompt_length are dropped or rejected."""
    records = []
    for file in files:
        for row, record in enumerate(read_judge_records(resolve_path(file))):
            ids = tokenizer.apply_chat_template(messages(record), add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
            if len(ids) <= data.max_prompt_length:
                records.append(record)
            elif not data.filter_overlong_prompts:
                raise ValueError(f"{file} row {row}: prompt has {len(ids)} tokens > data.max_prompt_length")
    if not records:
        raise ValueError(f"no usable rows in {files}")
    return records


def build_judges(judges: list[JudgeConfig], device: torch.device, monitor: PhaseMonitor,
                 policy: Engine | None, n_rm_prompts: int, swap: bool) -> list[SwappedJudge]:
    """One engine + scorer per judge, each put to sleep right after loading (one on the GPU)."""
    out = []
    for i, judge in enumerate(judges):
        if judge.prompt == "rm_prompt" and i >= n_rm_prompts:
            raise ConfigError(f"reward.judges[{i}] ({judge.module}) has no rm_prompt_{i} column in the data")
        if judge.engine == "hf":
            inner: Engine = HFEngine.from_pretrained(resolve_model(judge.model), device=device,
                                                     **judge.engine_options)
        elif judge.engine == "openai":
            if judge.url is None:
                raise ConfigError(f"reward.judges[{i}].url is required with engine = 'openai'")
            inner = build_engine("openai", base_url=judge.url, model=judge.model, **judge.engine_options)
        else:
            inner = build_engine("vllm", model=resolve_model(judge.model), **judge.engine_options)
        engine = RecordingEngine(inner)
        tokenizer = judge.tokenizer or (judge.model if judge.engine == "openai" else resolve_model(judge.model))
        scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(resolve_path(tokenizer)),
                             resolve_path(judge.module), temperature=judge.temperature,
                             max_new_tokens=judge.max_new_tokens)
        if swap:
            engine.sleep()
        out.append(SwappedJudge(judge_name(judge), i, scorer, engine, monitor, policy,
                                use_rm_prompt=judge.prompt == "rm_prompt", swap=swap))
    return out


def compose_reward(cfg: Config, judges: list[SwappedJudge], monitor: PhaseMonitor,
                   device: torch.device) -> Reward:
    """rule -> judges (add/mul, gated on the rule) -> similarity, as VeRL-with-RMs' left fold."""
    components: dict[str, Component] = {}
    scorers: dict[str, Any] = {}
    if cfg.reward.rule is not None:
        components["rule"] = Component(scorer="rule", weight=cfg.reward.rule_weight)
        scorers["rule"] = RuleScorer(load_function(resolve_path(cfg.reward.rule)), monitor)
    for judge, jc in zip(judges, judge_configs(cfg.reward), strict=True):
        gate = None
        if jc.gate is not None:
            if "rule" not in components:
                raise ConfigError(f"judge {judge.name!r} has a gate but reward.rule is not set")
            gate = Gate(component="rule", threshold=jc.gate)
        components[judge.name] = Component(scorer="judge", weight=jc.weight, op=jc.combine, gate=gate,
                                           fallback=jc.fallback)
        scorers[judge.name] = judge
    emb = cfg.reward.embedding
    if emb.model is not None:
        components["similarity"] = Component(scorer="embedding_similarity", weight=emb.weight, op="add")
        # VeRL-with-RMs adds weight * (0.7 * mapped similarity + 0.3)
        inner = build_scorer("embedding_similarity", model=resolve_model(emb.model), scale=0.7, offset=0.3,
                             device=str(device))
        scorers["similarity"] = TimedScorer(inner, monitor, "similarity")
    if not components:
        raise ConfigError("no reward: set reward.rule, reward.judges or reward.embedding.model")
    return build_reward(RewardSpec(components=components, combine="fold"), scorers)


# ----------------------------------------------------------------------------------- rollout tensors


@dataclass(frozen=True)
class Rollout:
    """A step's sequences, right-padded. Label layout: position t predicts token t + 1."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] 1 on completion tokens
    engine_logp: torch.Tensor  # [B, L-1] the engine's sampling log-probs, 0 elsewhere
    group_ids: torch.Tensor  # [B]


def collate(gens: list[Generation], n: int, pad_id: int, device: torch.device) -> Rollout:
    width = max(len(g.prompt_ids) + len(g.completion_ids) for g in gens)
    bsz = len(gens)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros(bsz, width, dtype=torch.long)  # [B, L]
    resp = torch.zeros(bsz, width - 1)  # [B, L-1]
    elp = torch.zeros(bsz, width - 1)  # [B, L-1]
    for i, g in enumerate(gens):
        p, c = len(g.prompt_ids), len(g.completion_ids)
        ids[i, : p + c] = torch.tensor(g.prompt_ids + g.completion_ids)
        attn[i, : p + c] = 1
        resp[i, p - 1 : p + c - 1] = 1
        elp[i, p - 1 : p + c - 1] = torch.tensor(g.logprobs)
    groups = torch.arange(bsz) // n  # [B]
    return Rollout(*(t.to(device) for t in (ids, attn, resp, elp, groups)))


def sequence_logprobs(model: Any, roll: Rollout, rows: slice, temperature: float) -> torch.Tensor:
    """Per-token log-probs `[b, L-1]` of the rollout's tokens under `model` at `temperature`."""
    ids = roll.input_ids[rows]  # [b, L]
    logits = model(input_ids=ids, attention_mask=roll.attention_mask[rows]).logits[:, :-1]  # [b, L-1, V]
    return token_logprobs(logits, ids[:, 1:], temperature)  # [b, L-1]


@torch.no_grad()
def replay_logprobs(model: Any, roll: Rollout, micro: int, temperature: float) -> torch.Tensor:
    rows = [sequence_logprobs(model, roll, slice(s, s + micro), temperature)
            for s in range(0, roll.input_ids.shape[0], micro)]
    return torch.cat(rows) * roll.response_mask  # [B, L-1]


# ----------------------------------------------------------------------------------- reward


def make_samples(records: list[JudgeRecord], gens: list[Generation], offset: int) -> list[Sample]:
    return [Sample(completion=g.text, prompt=r.prompt[-1].content, reference=r.ground_truth,
                   metadata={"uid": offset + i, "data_source": r.data_source, "extra_info": r.extra_info,
                             "rm_prompts": r.rm_prompts})
            for i, (r, g) in enumerate(zip(records, gens, strict=True))]


def score(reward: Reward, judges: list[SwappedJudge], samples: list[Sample]) -> tuple[list[ScoreResult], dict[str, Any]]:
    """Combined scores (a failed sample scores 0 and is counted) and the judges' logs."""
    results = reward.score(samples)
    logs = {judge.name: judge.pop() for judge in judges}
    return results, logs


def reward_metrics(results: list[ScoreResult], logs: dict[str, Any], prefix: str) -> dict[str, float]:
    """Mean/std of the combined reward and of each component over all ranks, judge counters."""
    everything = gather_object([(r.score, r.components) for r in results])
    totals = torch.tensor([0.0 if s is None else s for s, _ in everything])
    out = {f"{prefix}reward/mean": totals.mean().item(), f"{prefix}reward/std": totals.std(unbiased=False).item(),
           f"{prefix}reward/errors": sum(s is None for s, _ in everything)}
    keys = sorted({k for _, comps in everything for k in comps})
    for key in keys:
        vals = torch.tensor([comps[key] for _, comps in everything if key in comps])
        out[f"{prefix}score/{key}_mean"] = vals.mean().item()
        out[f"{prefix}score/{key}_std"] = vals.std(unbiased=False).item()
    for name, log in logs.items():
        counts = gather_object([(log.scored, log.failures, log.policy_awake)])
        out[f"{prefix}judge_{name}/scored"] = sum(c[0] for c in counts)
        out[f"{prefix}judge_{name}/parse_failures"] = sum(c[1] for c in counts)
        out[f"{prefix}check/policy_awake_during_{name}"] = sum(c[2] for c in counts)
    return out


def write_samples(path: Path, step: int, samples: list[Sample], results: list[ScoreResult],
                  logs: dict[str, Any], limit: int, split: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        for sample, result in list(zip(samples, results, strict=True))[:limit]:
            uid = sample.metadata["uid"]
            judges = {name: {"score": result.components.get(name), "raw": log.raw.get(uid),
                             "error": log.errors.get(uid)} for name, log in logs.items()}
            row = {"step": step, "split": split, "prompt": sample.prompt, "completion": sample.completion,
                   "reward": result.score, "components": result.components, "judges": judges}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------- update


def advantages(cfg: Config, accelerator: Accelerator, roll: Rollout, scores: torch.Tensor,
               old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
    """Advantages `[B, L-1]`, computed over the global batch (REINFORCE++ whitens over all ranks)."""
    mask = roll.response_mask  # [B, L-1]
    rewards = torch.zeros_like(mask)  # [B, L-1]
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # [B] last completion position
    rewards[torch.arange(mask.shape[0]), last] = scores.to(rewards)
    if cfg.algo.kl_in_reward and ref_logp is not None:
        rewards -= cfg.algo.kl_coef * compute_kl(cfg.algo.kl_reward_type, old_logp, ref_logp) * mask
    groups = roll.group_ids + accelerator.process_index * mask.shape[0]  # [B] unique across ranks
    padded = [accelerator.pad_across_processes(t, dim=1) for t in (rewards, mask)]
    all_rewards, all_mask = (accelerator.gather(t) for t in padded)  # [W*B, L']
    adv = compute_advantages(cfg.algo.adv_estimator, rewards=all_rewards, mask=all_mask,
                             group_ids=accelerator.gather(groups),
                             **({"gamma": cfg.algo.gamma} if cfg.algo.adv_estimator == "reinforce_pp" else {}))
    rank = accelerator.process_index
    return adv[rank * mask.shape[0] : (rank + 1) * mask.shape[0], : mask.shape[1]]  # [B, L-1]


def update(cfg: Config, accelerator: Accelerator, model: Any, optimizer: Any, roll: Rollout,
           old_logp: torch.Tensor, ref_logp: torch.Tensor | None, adv: torch.Tensor,
           first: bool) -> dict[str, float]:
    """One pass of clipped PG + KL-loss minibatch updates; micro-batches accumulate gradients
    with the global count of valid tokens, so the loss does not depend on micro/DP splits."""
    bsz, world = roll.input_ids.shape[0], accelerator.num_processes
    mb_rows = max(1, cfg.train.mini_batch_size * cfg.rollout.n // world)
    micro, algo = cfg.train.micro_batch_size, cfg.algo
    sums: dict[str, float] = {}
    count = 0
    model.train()
    for mb in range(0, bsz, mb_rows):
        mask = roll.response_mask[mb : mb + mb_rows]  # [m, L-1]
        local = mask.sum() if algo.agg == "token-mean" else (mask.sum(-1) > 0).sum().to(mask)
        num_valid = accelerator.reduce(local.clone(), reduction="sum").clamp(min=1)
        starts = list(range(mb, min(mb + mb_rows, bsz), micro))
        for start in starts:
            rows = slice(start, min(start + micro, mb + mb_rows, bsz))
            ctx = accelerator.no_sync(model) if start != starts[-1] else _null()
            with ctx:
                logp = sequence_logprobs(model, roll, rows, cfg.rollout.temperature)  # [b, L-1]
                pg, metrics = compute_policy_loss(algo.loss, logp=logp, old_logp=old_logp[rows],
                                                  advantages=adv[rows], mask=roll.response_mask[rows], agg=algo.agg,
                                                  clip_low=algo.clip_low, clip_high=algo.clip_high, num_valid=num_valid)
                loss = pg
                if algo.use_kl_loss and ref_logp is not None:
                    kl = compute_kl(algo.kl_loss_type, logp, ref_logp[rows])  # [b, L-1]
                    kl_loss = aggregate(kl, roll.response_mask[rows], algo.agg, num_valid=num_valid)
                    loss = loss + algo.kl_loss_coef * kl_loss
                    metrics["kl_loss"] = kl_loss.detach()
                accelerator.backward(loss * world)  # DDP averages gradients over ranks
            ratio_tol = 1e-4 if model_dtype(model) == torch.float32 else 1e-2  # 16-bit kernels vary
            if first and mb == 0 and abs(metrics["ratio_max"].item() - 1) + abs(metrics["ratio_min"].item() - 1) > ratio_tol:
                raise RuntimeError(f"first on-policy replay: importance ratio in [{metrics['ratio_min']:.6f}, "
                                   f"{metrics['ratio_max']:.6f}], expected exactly 1: the update forward differs "
                                   "from the replay forward (dropout? non-deterministic kernels?)")
            metrics["pg_loss"] = pg.detach()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            count += 1
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(
            accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    n_mb = -(-bsz // mb_rows)
    return {f"actor/{k}": v / (n_mb if k == "grad_norm" else count) for k, v in sums.items()}


def model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def move_optimizer_state(optimizer: Any, device: torch.device | str) -> None:
    """Offload (or restore) Adam moments; 0-dim `step` counters stay where the optimizer keeps them."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)


# ----------------------------------------------------------------------------------- one step


@dataclass
class Parts:
    """Everything the loop touches, built once in `main`."""

    cfg: Config
    accelerator: Accelerator
    model: Any
    ref: Any
    optimizer: Any
    engine: HFEngine
    judges: list[SwappedJudge]
    reward: Reward
    monitor: PhaseMonitor
    run_dir: Path


def generate(p: Parts, records: list[JudgeRecord], n: int, temperature: float) -> tuple[list[Generation], int]:
    """Policy rollouts (policy engine awake, every judge asleep), then the policy goes to sleep.
    Returns the generations and how many judge engines were awake during generation."""
    awake = sum(engine_state(j.engine) == "awake" for j in p.judges)
    params = SamplingParams(n=n, temperature=temperature, top_p=p.cfg.rollout.top_p, top_k=p.cfg.rollout.top_k,
                            max_new_tokens=p.cfg.data.max_response_length)
    with p.monitor("generate"):
        gens = p.engine.generate([messages(r) for r in records], params)
    if p.cfg.reward.swap:
        with p.monitor("offload_policy"):
            p.engine.sleep()
            if p.cfg.model.optimizer_offload and p.accelerator.device.type == "cuda":
                move_optimizer_state(p.optimizer, "cpu")
    return gens, awake


def wake_policy(p: Parts) -> None:
    if not p.cfg.reward.swap:
        return
    with p.monitor("wake_policy"):
        p.engine.wake()
        if p.cfg.model.optimizer_offload and p.accelerator.device.type == "cuda":
            move_optimizer_state(p.optimizer, p.accelerator.device)


def train_step(p: Parts, step: int, records: list[JudgeRecord]) -> dict[str, float]:
    cfg, acc = p.cfg, p.accelerator
    n = cfg.rollout.n
    gens, judges_awake = generate(p, records, n, cfg.rollout.temperature)
    repeated = [r for r in records for _ in range(n)]
    samples = make_samples(repeated, gens, offset=acc.process_index * len(gens))
    with p.monitor("reward"):
        results, logs = score(p.reward, p.judges, samples)
    wake_policy(p)
    roll = collate(gens, n, p.engine.pad_id, acc.device)
    with p.monitor("old_logp"):
        old_logp = replay_logprobs(p.model, roll, cfg.train.micro_batch_size, cfg.rollout.temperature)
    ref_logp = None
    if cfg.algo.use_kl_loss or cfg.algo.kl_in_reward:
        with p.monitor("ref_logp"):
            if cfg.model.ref_offload:
                p.ref.to(acc.device)
            ref_logp = replay_logprobs(p.ref, roll, cfg.train.micro_batch_size, cfg.rollout.temperature)
            if cfg.model.ref_offload:
                p.ref.to("cpu")
    tokens = roll.response_mask.sum().clamp(min=1)
    absdiff = ((old_logp - roll.engine_logp).abs() * roll.response_mask).sum() / tokens
    tol = cfg.algo.replay_tolerance or (1e-3 if p.engine.model.dtype == torch.float32 else 5e-2)
    if step == 1 and absdiff.item() > tol:
        raise RuntimeError(f"log-prob replay: mean |engine - trainer| = {absdiff.item():.2e} > {tol:.0e} on the first "
                           "step; the engine and the trainer do not compute the same distribution")
    scores = torch.tensor([0.0 if r.score is None else r.score for r in results], device=acc.device)  # [B]
    with p.monitor("advantages"):
        adv = advantages(cfg, acc, roll, scores, old_logp, ref_logp)
    with p.monitor("update"):
        actor = update(cfg, acc, p.model, p.optimizer, roll, old_logp, ref_logp, adv, first=step == 1)
    metrics = reward_metrics(results, logs, "") | actor
    lengths = acc.gather(roll.response_mask.sum(-1)).float()  # [W*B]
    metrics |= {"replay/engine_logp_absdiff": acc.reduce(absdiff, reduction="mean").item(),
                "response_length/mean": lengths.mean().item(),
                "check/judges_awake_during_generate": acc.reduce(torch.tensor(judges_awake, device=acc.device),
                                                                  reduction="sum").item()}
    if acc.is_main_process:
        write_samples(p.run_dir / "samples.jsonl", step, samples, results, logs, cfg.train.samples_to_log, "train")
    return metrics


def validate(p: Parts, step: int, records: list[JudgeRecord]) -> dict[str, float]:
    """Greedy (val_temperature) rollouts on the val rows, scored by the same reward. Runs on a
    saved-and-restored RNG state, so validating or not never changes the training run (and a
    resumed run repeats the uninterrupted one exactly)."""
    with isolated_rng(), p.monitor.scope("val_"):
        return _validate(p, step, records)


@contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block (validation, the start-up dry run) without moving the training RNG streams."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _validate(p: Parts, step: int, records: list[JudgeRecord]) -> dict[str, float]:
    acc = p.accelerator
    shard = records[acc.process_index :: acc.num_processes]
    if not shard:  # fewer val rows than ranks: this rank repeats the first one, still collects
        shard = records[:1]
    p.engine.wake()
    gens, _ = generate(p, shard, 1, p.cfg.rollout.val_temperature)
    samples = make_samples(shard, gens, offset=10**9 + acc.process_index * len(gens))
    results, logs = score(p.reward, p.judges, samples)
    wake_policy(p)
    if acc.is_main_process:
        write_samples(p.run_dir / "samples.jsonl", step, samples, results, logs, p.cfg.train.samples_to_log, "val")
    return reward_metrics(results, logs, "val/")


# ----------------------------------------------------------------------------------- main


def setup(cfg: Config, resume: str | None) -> tuple[Parts, GroupSampler, list[JudgeRecord], list[JudgeRecord], int, MetricsLogger]:
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=cfg.train.log_with or None)
    seed_everything(cfg.train.seed, rank=acc.process_index)
    policy_path = resolve_model(cfg.model.path)
    dtype = cfg.model.dtype
    model, tokenizer = load_causal_lm(policy_path, dtype=dtype)
    ref, _ = load_causal_lm(policy_path, dtype=dtype)
    ref.requires_grad_(False)
    ref.to("cpu" if cfg.model.ref_offload else acc.device)
    train = load_records(cfg.data.train_files, tokenizer, cfg.data)
    val = load_records(cfg.data.val_files or cfg.data.train_files, tokenizer, cfg.data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    model, optimizer = acc.prepare(model, optimizer)
    engine = HFEngine(acc.unwrap_model(model), tokenizer, device=acc.device, compile=cfg.rollout.compile,
                      max_batch_size=cfg.rollout.max_batch_size)
    monitor = PhaseMonitor(acc.device)
    judges = build_judges(judge_configs(cfg.reward), acc.device, monitor, engine, len(train[0].rm_prompts),
                          cfg.reward.swap)
    reward = compose_reward(cfg, judges, monitor, acc.device)
    sampler = GroupSampler(len(train), cfg.rollout.n, seed=cfg.train.seed, rank=acc.process_index,
                           world_size=acc.num_processes)
    ckpt = resolve_resume(resume, cfg.train.output_dir)
    name = ckpt.parent.parent.name if ckpt is not None else cfg.train.run_name
    # config.json, not make_run_dir's config.toml: rl_core's dump_config cannot write None
    # inside a list of tables (reward.judges[i].gate = None)
    run_dir = make_run_dir(cfg.train.output_dir, name, accelerator=acc)
    if acc.is_main_process:
        (run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg)))
    step = 0
    if ckpt is not None:
        step = load_checkpoint(ckpt, state={"sampler": sampler}, accelerator=acc)["step"]
    if cfg.train.log_with:
        acc.init_trackers("rider-grm", config=msgspec.to_builtins(cfg))
    logger = MetricsLogger(run_dir, accelerator=acc, start_step=step if ckpt is not None else None)
    parts = Parts(cfg, acc, model, ref, optimizer, engine, judges, reward, monitor, run_dir)
    dry_run(parts, val[0])
    return parts, sampler, train, val, step, logger


def dry_run(p: Parts, record: JudgeRecord) -> None:
    """Score one sample with every judge before training, so a judge module whose lists do not
    match the batch fails now, naming the module and the function (not hours into a run)."""
    with isolated_rng():
        _dry_run(p, record)


def _dry_run(p: Parts, record: JudgeRecord) -> None:
    answer = Generation(request_index=0, prompt_ids=[], completion_ids=[], text=str(record.ground_truth),
                        logprobs=[], finish_reason="stop")
    sample = make_samples([record], [answer], 0)[0]
    for judge in p.judges:
        judge.engine.wake()
        try:
            check_judge(judge.scorer, judge.judge_prompt(sample), sample.completion)
        finally:
            if p.cfg.reward.swap:
                judge.engine.sleep()


def total_steps(cfg: Config, sampler: GroupSampler, world: int) -> int:
    per_rank = cfg.train.batch_size // world
    if per_rank < 1 or cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be a multiple of the {world} processes")
    steps = cfg.train.epochs * -(-sampler.prompts_per_rank // per_rank)
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps is not None else steps


def next_records(sampler: GroupSampler, train: list[JudgeRecord], prompts: int) -> list[JudgeRecord]:
    """The next `prompts` prompts of this rank (one per group; the engine samples n each)."""
    batch = next(iter(sampler.batches(prompts)))
    return [train[i] for i in batch[:: sampler.n]]


def main(argv: list[str]) -> Path:
    cli = parse_cli(argv)
    if cli.help:
        print(config_help(Config, env=ENV, prog="rider-grm"))
        return Path()
    cfg = load_config(Config, cli.config or DEFAULT_CONFIG, cli.overrides, env=ENV)
    judge_configs(cfg.reward)  # unequal list settings fail here, before anything loads
    p, sampler, train, val, step, logger = setup(cfg, cli.resume)
    acc = p.accelerator
    total = total_steps(cfg, sampler, acc.num_processes)
    if cfg.train.val_before_train and step == 0:
        logger.log(0, validate(p, 0, val) | p.monitor.pop())
    with TrainProgress(total, initial=step, show=("reward/mean",), accelerator=acc) as bar:
        while step < total:
            step += 1
            records = next_records(sampler, train, cfg.train.batch_size // acc.num_processes)
            metrics = train_step(p, step, records)
            if step % cfg.train.save_freq == 0 or step == total:
                with p.monitor("checkpoint"):
                    save_checkpoint(p.run_dir / "checkpoints", step, state={"sampler": sampler}, accelerator=acc,
                                    keep_last=cfg.train.keep_last)
            if step == total or (cfg.train.test_freq > 0 and step % cfg.train.test_freq == 0):
                metrics |= validate(p, step, val)
            metrics |= p.monitor.pop()
            metrics["world_size"] = acc.num_processes
            logger.log(step, metrics)
            bar.update(step, metrics)
    acc.end_training()
    if acc.is_main_process and cfg.train.print_summary:
        print_summary(p.run_dir)
    return p.run_dir


def print_summary(run_dir: Path) -> None:
    """The headline metrics per step and two sample generations with each judge's raw output."""
    import csv

    with (run_dir / "metrics.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    keys = [k for k in rows[0] if k.endswith(("_mean", "/mean", "parse_failures", "/scored"))
            or (k.startswith("time/") and not k.endswith(("_wake", "_sleep")))]
    table = Table(title=f"rider-grm: {run_dir / 'metrics.csv'}")
    table.add_column("metric")
    for row in rows:
        table.add_column(f"step {row['step']}", justify="right")
    for key in keys:
        table.add_row(key, *[_short(row.get(key, "")) for row in rows])
    console = Console()
    console.print(table)
    for line in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()[-2:]:
        sample = json.loads(line)
        console.print(f"[bold]{sample['split']} step {sample['step']}[/] prompt: {sample['prompt']!r}")
        console.print(f"  completion: {sample['completion'][:200]!r}  reward: {sample['reward']}")
        for name, judge in sample["judges"].items():
            raw = "(gated out: never sent to the judge)" if judge["raw"] is None else repr(judge["raw"][:120])
            console.print(f"  judge {name}: score={judge['score']} raw={raw}")
    console.print(f"run directory: {run_dir}")


def _short(value: str) -> str:
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"rider-grm: config error: {e}")
