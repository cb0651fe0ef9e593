"""The reward of a rider-grm step: rows -> samples, the judges built from the config (in
process and swapped, or served), the VeRL-with-RMs fold of rule, judges and similarity, the
reward metrics, and the sample generations written with each judge's raw output."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import torch
from accelerate.utils import gather_object
from judging import (
    Judge,
    JudgeLog,
    PhaseMonitor,
    RecordingEngine,
    RuleScorer,
    ServedJudge,
    SwappedJudge,
    TimedScorer,
    check_server,
    load_function,
    vllm_engine_core,
)
from rider_config import (
    Config,
    DataConfig,
    JudgeConfig,
    judge_configs,
    judge_name,
    resolve_model,
    resolve_path,
)
from swapping import make_offload
from transformers import AutoTokenizer

from rl_core.train import ConfigError, UserError, isolated_rng
from rl_data import JudgeRecord, open_source
from rl_rewards.client import RemoteScorer
from rl_rewards.composition import Reward, build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample, Scorer, ScoreResult
from rl_rewards.scorers.judge import JudgeScorer
from rl_rewards.spec import Component, Gate, RewardSpec
from rl_rollout import Engine, Generation, build_engine, resolve_engine_kind
from rl_rollout.hf import HFEngine

# ----------------------------------------------------------------------------------- rows


def messages(record: JudgeRecord) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in record.prompt]


def load_records(files: list[str], tokenizer: Any, data: DataConfig, rm_prompts: int = 0) -> list[JudgeRecord]:
    """Judge rows of `files`; prompts longer than max_prompt_length are dropped or rejected.
    Every row must carry the `rm_prompt_{i}` columns of the `rm_prompts` judges that read them
    (a row without one would silently get the judge's fallback)."""
    records = []
    for file in files:
        try:  # a parquet/JSONL file, a save_to_disk directory, or a Hub id in the local cache
            reader = open_source(resolve_path(file), kind="judge")
        except FileNotFoundError as e:
            detail = "" if str(e).startswith("data file not found") else f": {e}"  # why a dir / Hub id failed
            raise UserError(f"data file not found: {file} (data.train_files / data.val_files){detail}") from None
        except ValueError as e:  # an unsupported file type, a dataset with several splits
            raise UserError(f"{e} (data.train_files / data.val_files)") from None
        for where, record in reader.located():
            at = f"{where.path or file}: {where.unit} {where.line}"  # a Hub id has no path: name it
            if len(record.rm_prompts) < rm_prompts:
                raise UserError(f"{at}: no rm_prompt_{len(record.rm_prompts)} "
                                f"column, but {rm_prompts} judges read rm_prompt_0..{rm_prompts - 1}")
            ids = tokenizer.apply_chat_template(messages(record), add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
            if len(ids) <= data.max_prompt_length:
                records.append(record)
            elif not data.filter_overlong_prompts:
                raise UserError(f"{at}: prompt has {len(ids)} tokens > "
                                f"data.max_prompt_length={data.max_prompt_length}")
    if not records:
        raise UserError(f"no usable rows in {files} (all over data.max_prompt_length?)")
    return records


def make_samples(records: list[JudgeRecord], gens: list[Generation], offset: int) -> list[Sample]:
    return [Sample(completion=g.text, prompt=r.prompt[-1].content, reference=r.ground_truth,
                   metadata={"uid": offset + i, "data_source": r.data_source, "extra_info": r.extra_info,
                             "rm_prompts": r.rm_prompts})
            for i, (r, g) in enumerate(zip(records, gens, strict=True))]


# ----------------------------------------------------------------------------------- judges


def build_judge(i: int, judge: JudgeConfig, device: torch.device, monitor: PhaseMonitor,
                policy: Engine | None, sleep: bool) -> Judge:
    """One judge: served (`engine = "server"`), or an engine + scorer here, put to sleep right
    after loading when `sleep` (so only one model is on the accelerator)."""
    use_rm_prompt = judge.prompt == "rm_prompt"
    key = f"reward.judges[{i}].model"
    if judge.engine == "server":
        remote = RemoteScorer(str(judge.url), str(judge.spec), timeout=judge.timeout_s)
        return ServedJudge(judge_name(judge), i, remote, monitor, use_rm_prompt=use_rm_prompt)
    kind, why = resolve_engine_kind(judge.engine, key=f"reward.judges[{i}].engine")
    if judge.engine == "auto":
        print(f"judge {judge_name(judge)}: engine {why}")
    if kind == "hf":
        inner: Engine = HFEngine.from_pretrained(resolve_model(judge.model, key), device=device, **judge.engine_options)
    elif kind == "openai":
        inner = build_engine("openai", base_url=judge.url, model=judge.model, **judge.engine_options)
    else:
        # each judge's engine core in its own process (several vLLM engines cannot share one), started
        # by spawn: the trainer has initialised CUDA, which a forked child cannot use
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        with vllm_engine_core(in_process=False):
            inner = build_engine("vllm", model=resolve_model(judge.model, key), **judge.engine_options)
    engine = RecordingEngine(inner)
    tokenizer = judge.tokenizer or (judge.model if judge.engine == "openai" else resolve_model(judge.model, key))
    scorer = JudgeScorer(engine, AutoTokenizer.from_pretrained(resolve_path(tokenizer)), resolve_path(judge.module),
                         temperature=judge.temperature, max_new_tokens=judge.max_new_tokens, seed=judge.seed,
                         completion_field=judge.completion_field, on_malformed=judge.on_malformed)
    swapped = SwappedJudge(judge_name(judge), i, scorer, engine, monitor, policy, use_rm_prompt=use_rm_prompt,
                           swap=sleep, offload=make_offload(engine, device))
    if sleep:
        swapped.sleep()
    return swapped


def check_served(judges: list[JudgeConfig]) -> None:
    """Every `engine = "server"` judge's server answers and serves its spec (before any model loads)."""
    for judge in judges:
        if judge.engine == "server":
            check_server(str(judge.url), str(judge.spec), judge_name(judge))


def build_judges(judges: list[JudgeConfig], device: torch.device, monitor: PhaseMonitor,
                 policy: Engine | None, n_rm_prompts: int, sleep: bool) -> list[Judge]:
    for i, judge in enumerate(judges):
        if judge.prompt == "rm_prompt" and i >= n_rm_prompts:
            where = judge.module or f"spec {judge.spec!r}"
            raise ConfigError(f"reward.judges[{i}] ({where}) has no rm_prompt_{i} column in the data")
    return [build_judge(i, judge, device, monitor, policy, sleep) for i, judge in enumerate(judges)]


def compose_reward(cfg: Config, judges: list[Judge], monitor: PhaseMonitor, device: torch.device) -> Reward:
    """VeRL-with-RMs' left fold: the rule, then each judge in order (add/mul, each gated on the
    rule where it has a gate), with the similarity term last or right after the rule
    (`reward.embedding.position`)."""
    components: dict[str, Component] = {}
    scorers: dict[str, Any] = {}
    if cfg.reward.rule is not None:
        components["rule"] = Component(scorer="rule", weight=cfg.reward.rule_weight)
        scorers["rule"] = RuleScorer(load_function(resolve_path(cfg.reward.rule)), monitor)
    emb = cfg.reward.embedding
    if emb.model is not None and emb.position == "after_rule":
        _add_similarity(cfg, components, scorers, monitor, device)
    for judge, jc in zip(judges, judge_configs(cfg.reward), strict=True):
        # options name the sub-components the judge reports (`malformed` with a completion_field)
        components[judge.name] = Component(scorer="judge", weight=jc.weight, op=jc.combine, fallback=jc.fallback,
                                           gate=_rule_gate(components, jc.gate, jc.gated_out, f"judge {judge.name!r}"),
                                           options={"completion_field": jc.completion_field})
        scorers[judge.name] = judge
    if emb.model is not None and emb.position == "last":
        _add_similarity(cfg, components, scorers, monitor, device)
    if not components:
        raise ConfigError("no reward: set reward.rule, reward.judges or reward.embedding.model")
    return build_reward(RewardSpec(components=components, combine="fold"), scorers)


def _rule_gate(components: dict[str, Component], threshold: float | None, gated_out: Literal["skip", "zero"],
               what: str) -> Gate | None:
    if threshold is None:
        return None
    if "rule" not in components:
        raise ConfigError(f"{what} has a gate but reward.rule is not set")
    return Gate(component="rule", threshold=threshold, gated_out=gated_out)


def _add_similarity(cfg: Config, components: dict[str, Component], scorers: dict[str, Any], monitor: PhaseMonitor,
                    device: torch.device) -> None:
    """total += weight * (0.7 * mapped similarity + 0.3), as VeRL-with-RMs adds its BGE term; a
    gated-out sample adds nothing (VeRL-with-RMs adds weight * 0)."""
    emb = cfg.reward.embedding
    fields = {"completion_field": emb.completion_field, "reference_field": emb.reference_field}
    components["similarity"] = Component(scorer="embedding_similarity", weight=emb.weight, op="add", options=fields,
                                         gate=_rule_gate(components, emb.gate, "zero", "reward.embedding"))
    inner = build_scorer("embedding_similarity", model=resolve_model(str(emb.model), "reward.embedding.model"), scale=0.7, offset=0.3,
                         device=str(device), on_malformed=emb.on_malformed, **fields)
    if not isinstance(inner, Scorer):  # embedding_similarity scores synchronously
        raise TypeError(f"embedding_similarity built a {type(inner).__name__}, not a synchronous Scorer")
    scorers["similarity"] = TimedScorer(inner, monitor, "similarity")


# ----------------------------------------------------------------------------------- scoring


def score(reward: Reward, judges: list[Judge], samples: list[Sample]) -> tuple[list[ScoreResult], dict[str, JudgeLog]]:
    """Combined scores (a failed sample scores 0 and is counted) and the judges' logs."""
    results = reward.score(samples)
    logs = {judge.name: judge.pop() for judge in judges}
    return results, logs


def reward_metrics(results: list[ScoreResult], logs: dict[str, JudgeLog], prefix: str) -> dict[str, float]:
    """Mean/std of the combined reward over the samples that scored, and of each component,
    over all ranks; failed samples (`reward/failed`) and judge counters."""
    everything = gather_object([(r.score, r.components) for r in results])
    totals = torch.tensor([s for s, _ in everything if s is not None])
    out = {f"{prefix}reward/mean": totals.mean().item() if totals.numel() else math.nan,
           f"{prefix}reward/std": totals.std(unbiased=False).item() if totals.numel() else 0.0,
           f"{prefix}reward/failed": sum(s is None for s, _ in everything)}
    keys = sorted({k for _, comps in everything for k in comps})
    for key in keys:
        vals = torch.tensor([comps[key] for _, comps in everything if key in comps])
        out[f"{prefix}score/{key}_mean"] = vals.mean().item()
        out[f"{prefix}score/{key}_std"] = vals.std(unbiased=False).item()
    for name, log in logs.items():
        counts = gather_object([(log.scored, log.failures, log.policy_awake, log.request_failures)])
        out[f"{prefix}judge_{name}/scored"] = sum(c[0] for c in counts)
        out[f"{prefix}judge_{name}/parse_failures"] = sum(c[1] for c in counts)
        out[f"{prefix}judge_{name}/request_failures"] = sum(c[3] for c in counts)
        out[f"{prefix}check/policy_awake_during_{name}"] = sum(c[2] for c in counts)
    return out


def sample_rows(samples: list[Sample], results: list[ScoreResult], logs: dict[str, JudgeLog],
                limit: int) -> list[dict[str, Any]]:
    """`limit` samples for `samples/<split>.jsonl`: prompt, completion, reward (null when it
    failed, with the error), components, and per judge its score, raw output (`null` when gated
    out, or for a served judge whose server returns no text), parse error, and whether the
    sample was sent to it (`judged`)."""
    rows = []
    for sample, result in list(zip(samples, results, strict=True))[:limit]:
        uid = sample.metadata["uid"]
        judges = {name: {"score": result.components.get(name), "raw": log.raw.get(uid),
                         "error": log.errors.get(uid), "judged": uid in log.judged}
                  for name, log in logs.items()}
        rows.append({"prompt": sample.prompt, "completion": sample.completion, "reward": result.score,
                     "error": result.error, "components": result.components, "judges": judges})
    return rows


def dry_run(judges: list[Judge], record: JudgeRecord) -> None:
    """Score one sample with every judge before training, so a judge module whose lists do not
    match the batch fails now, naming the module and the function (not hours into a run), and a
    served judge whose server is down or does not know its spec fails now too."""
    answer = Generation(request_index=0, prompt_ids=[], completion_ids=[], text=str(record.ground_truth),
                        logprobs=[], finish_reason="stop")
    sample = make_samples([record], [answer], 0)[0]
    with isolated_rng():
        for judge in judges:
            judge.check(sample)


def close_judges(judges: list[Judge]) -> None:
    for judge in judges:
        judge.close()
