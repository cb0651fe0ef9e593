"""The reward of a rider-grm step: rows -> samples, the rule reward, the VeRL-with-RMs fold of
rule, judges (`judging`) and similarity, or a `reward.spec` instead, the reward metrics, and the
sample generations written with each judge's raw output."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from accelerate.utils import gather_object
from judging import Judge, JudgeLog
from rider_config import REPO_ROOT, Config, JudgeConfig, read_spec, resolve_model

from rl_core.train import PhaseTimer, UserError, resolve_path
from rl_data import JudgeRecord, open_source
from rl_rewards.composition import Reward, build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample, Scorer, ScoreResult, TimedScorer
from rl_rewards.scorers.rule import RuleScorer
from rl_rewards.spec import Component, Gate, RewardSpec
from rl_rollout import Generation


def messages(record: JudgeRecord) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in record.prompt]


def load_records(files: list[str], tokenizer: Any, cfg: Config, rm_prompts: int = 0) -> list[JudgeRecord]:
    """Judge rows of `files`; prompts longer than rollout.max_prompt_length are dropped or rejected.
    Every row must carry the `rm_prompt_{i}` columns of the `rm_prompts` judges that read them
    (a row without one would silently get the judge's fallback)."""
    data, limit, records = cfg.data, cfg.rollout.max_prompt_length, []
    for file in files:
        try:  # a parquet/JSONL file, a save_to_disk directory, or a Hub id in the local cache
            reader = open_source(resolve_path(file, REPO_ROOT), kind="judge")
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
            if len(ids) <= limit:
                records.append(record)
            elif not data.filter_overlong_prompts:
                raise UserError(f"{at}: prompt has {len(ids)} tokens > "
                                f"rollout.max_prompt_length={limit}")
    if not records:
        raise UserError(f"no usable rows in {files} (all over rollout.max_prompt_length?)")
    return records


def make_samples(records: list[JudgeRecord], gens: list[Generation], offset: int) -> list[Sample]:
    return [Sample(completion=g.text, prompt=r.prompt[-1].content, reference=r.ground_truth,
                   metadata={"uid": offset + i, "data_source": r.data_source, "extra_info": r.extra_info,
                             "rm_prompts": r.rm_prompts, "completion_tokens": len(g.completion_ids)})
            for i, (r, g) in enumerate(zip(records, gens, strict=True))]


def compose_reward(cfg: Config, judges: list[Judge], configs: list[JudgeConfig], timer: PhaseTimer,
                   device: torch.device) -> Reward:
    """`reward.spec` built from the registry (resident), or the shorthand's VeRL-with-RMs left
    fold: the rule, then each judge in order (add/mul, each gated on the rule where it has a
    gate), with the similarity term last or right after the rule (`reward.embedding.position`)."""
    spec = read_spec(cfg.reward)
    if spec is not None:
        return build_reward(spec)
    components: dict[str, Component] = {}
    scorers: dict[str, Any] = {}
    if cfg.reward.rule is not None:
        components["rule"] = Component(scorer="rule", weight=cfg.reward.rule_weight)
        scorers["rule"] = TimedScorer(RuleScorer(resolve_path(cfg.reward.rule, REPO_ROOT)), timer, "rule")
    emb = cfg.reward.embedding
    if emb.model is not None and emb.position == "after_rule":
        _add_similarity(cfg, components, scorers, timer, device)
    for judge, jc in zip(judges, configs, strict=True):
        # options name the sub-components the judge reports (`malformed` with a completion_field)
        components[judge.name] = Component(scorer="judge", weight=jc.weight, op=jc.combine, fallback=jc.fallback,
                                           gate=_rule_gate(jc.gate, jc.gated_out),
                                           options={"completion_field": jc.completion_field})
        scorers[judge.name] = judge
    if emb.model is not None and emb.position == "last":
        _add_similarity(cfg, components, scorers, timer, device)
    return build_reward(RewardSpec(components=components, combine="fold"), scorers)


def _rule_gate(threshold: float | None, gated_out: Literal["skip", "zero"]) -> Gate | None:
    return None if threshold is None else Gate(component="rule", threshold=threshold, gated_out=gated_out)


def _add_similarity(cfg: Config, components: dict[str, Component], scorers: dict[str, Any], timer: PhaseTimer,
                    device: torch.device) -> None:
    """total += weight * (0.7 * mapped similarity + 0.3), as VeRL-with-RMs adds its BGE term; a
    gated-out sample adds nothing (VeRL-with-RMs adds weight * 0)."""
    emb = cfg.reward.embedding
    fields = {"completion_field": emb.completion_field, "reference_field": emb.reference_field}
    components["similarity"] = Component(scorer="embedding_similarity", weight=emb.weight, op="add", options=fields,
                                         gate=_rule_gate(emb.gate, "zero"))
    inner = build_scorer("embedding_similarity", model=resolve_model(str(emb.model), "reward.embedding.model"), scale=0.7,
                         offset=0.3, device=str(device), on_malformed=emb.on_malformed, **fields)
    scorers["similarity"] = TimedScorer(cast(Scorer, inner), timer, "similarity")  # it scores synchronously


def score(reward: Reward, judges: list[Judge], samples: list[Sample]) -> tuple[list[ScoreResult], dict[str, JudgeLog]]:
    """Combined scores (a failed sample has none and an error) and what each judge did."""
    return reward.score(samples), {judge.name: judge.pop() for judge in judges}


def merge_logs(judges: list[Judge], logs: Sequence[dict[str, JudgeLog]]) -> dict[str, JudgeLog]:
    """One step's judge logs from its chunks' (`reward.stream`), each judge's counted once per chunk."""
    out = {judge.name: JudgeLog() for judge in judges}
    for chunk in logs:
        for name, log in chunk.items():
            out[name].add(log)
    return out


def reward_metrics(results: list[ScoreResult], logs: dict[str, JudgeLog]) -> dict[str, float]:
    """Over every process: the combined reward's mean and std over the samples that scored (the
    raw scores, before `algo.kl_in_reward` shapes them), the failed samples, each component's mean (`reward/<component>`, unweighted) and each judge's counters."""
    everything = gather_object([(r.score, r.components) for r in results])
    totals = torch.tensor([s for s, _ in everything if s is not None])
    out = {"reward/mean": totals.mean().item() if totals.numel() else math.nan,
           "reward/std": totals.std().item() if totals.numel() > 1 else 0.0,  # (n - 1), as every app's
           "reward/failed": float(sum(s is None for s, _ in everything))}
    for key in sorted({k for _, comps in everything for k in comps}):
        out[f"reward/{key}"] = torch.tensor([comps[key] for _, comps in everything if key in comps]).mean().item()
    for name, log in logs.items():
        counts = gather_object([(log.scored, log.failures, log.request_failures, log.policy_awake)])
        for i, key in enumerate(("scored", "parse_failures", "request_failures")):
            out[f"judge/{name}/{key}"] = sum(c[i] for c in counts)
        out[f"check/policy_awake_during_{name}"] = sum(c[3] for c in counts)
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
