"""The reward of a rider-grm step: rows -> samples, the judges built from the config (in
process and swapped, or served), the VeRL-with-RMs fold of rule, judges and similarity, the
reward metrics, and the sample generations written with each judge's raw output."""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
from accelerate.utils import gather_object
from judging import (
    HasState,
    Judge,
    JudgeLog,
    RecordingEngine,
    RuleScorer,
    TimedScorer,
    check_server,
)
from rider_config import (
    Config,
    DataConfig,
    JudgeConfig,
    judge_configs,
    judge_name,
    load_function,
    resolve_model,
    resolve_path,
    reward_spec,
)
from swapping import PinnedOffload
from transformers import AutoTokenizer

from rl_core.train import PhaseTimer, UserError, isolated_rng
from rl_data import JudgeRecord, open_source
from rl_rewards.client import RemoteScorer
from rl_rewards.composition import Reward, build_reward
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample, Scorer, ScoreResult
from rl_rewards.scorers.judge import JudgeScorer
from rl_rewards.spec import Component, Gate, RewardSpec
from rl_rollout import Generation, load_engine, resolve_engine_kind
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


def build_judge(i: int, judge: JudgeConfig, device: torch.device, timer: PhaseTimer, sleep: bool) -> Judge:
    """One judge: served (`engine = "server"`), or an engine + scorer here, put to sleep right
    after loading when `sleep` (so only one model is on the accelerator). Only an `hf` engine's
    weights are moved by `swapping.PinnedOffload` (its module is known here, where it is built);
    a vLLM engine sleeps by itself, a remote one has nothing here to move."""
    use_rm_prompt = judge.prompt == "rm_prompt"
    if judge.engine == "server":
        remote = RemoteScorer(str(judge.url), str(judge.spec), timeout=judge.timeout_s)
        return Judge(judge_name(judge), i, remote, timer, use_rm_prompt=use_rm_prompt)
    key = f"reward.judges[{i}].engine"
    kind, why = resolve_engine_kind(judge.engine, key=key)
    if judge.engine == "auto":
        print(f"judge {judge_name(judge)}: engine {why}")
    where = {"base_url": judge.url} if kind == "openai" else {"device": device} if kind == "hf" else {}
    model = judge.model if kind == "openai" else resolve_model(judge.model, f"reward.judges[{i}].model")
    inner = load_engine(kind, model, key=key, in_process=False, **where, **judge.engine_options)
    offload = None
    if kind == "hf" and device.type != "cpu":
        offload = PinnedOffload(cast(HFEngine, inner).model, device)
    engine = RecordingEngine(inner)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(judge.tokenizer or model))
    scorer = JudgeScorer(engine, tokenizer, resolve_path(judge.module), temperature=judge.temperature,
                         max_new_tokens=judge.max_new_tokens, seed=judge.seed,
                         completion_field=judge.completion_field, on_malformed=judge.on_malformed)
    out = Judge(judge_name(judge), i, scorer, timer, engine=engine, offload=offload, use_rm_prompt=use_rm_prompt,
                swap=sleep)
    if sleep:
        out.sleep()
    return out


def check_served(judges: list[JudgeConfig]) -> None:
    """Every `engine = "server"` judge's server answers and serves its spec (before any model loads)."""
    for judge in judges:
        if judge.engine == "server":
            check_server(str(judge.url), str(judge.spec), judge_name(judge))


def watch_policy(judges: list[Judge], policy: HasState) -> None:
    """Each in-process judge counts its calls made while `policy`'s engine is awake."""
    for judge in judges:
        judge.policy = policy


def compose_reward(cfg: Config, judges: list[Judge], timer: PhaseTimer, device: torch.device) -> Reward:
    """`reward.spec` built from the registry (resident), or the shorthand's VeRL-with-RMs left
    fold: the rule, then each judge in order (add/mul, each gated on the rule where it has a
    gate), with the similarity term last or right after the rule (`reward.embedding.position`)."""
    spec = reward_spec(cfg.reward)
    if spec is not None:
        return build_reward(spec)
    components: dict[str, Component] = {}
    scorers: dict[str, Any] = {}
    if cfg.reward.rule is not None:
        components["rule"] = Component(scorer="rule", weight=cfg.reward.rule_weight)
        scorers["rule"] = RuleScorer(load_function(resolve_path(cfg.reward.rule)), timer)
    emb = cfg.reward.embedding
    if emb.model is not None and emb.position == "after_rule":
        _add_similarity(cfg, components, scorers, timer, device)
    for judge, jc in zip(judges, judge_configs(cfg.reward), strict=True):
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
    inner = build_scorer("embedding_similarity", model=resolve_model(str(emb.model), "reward.embedding.model"), scale=0.7, offset=0.3,
                         device=str(device), on_malformed=emb.on_malformed, **fields)
    if not isinstance(inner, Scorer):  # embedding_similarity scores synchronously
        raise TypeError(f"embedding_similarity built a {type(inner).__name__}, not a synchronous Scorer")
    scorers["similarity"] = TimedScorer(inner, timer, "similarity")


# ----------------------------------------------------------------------------------- scoring


def score(reward: Reward, judges: list[Judge], samples: list[Sample]) -> tuple[list[ScoreResult], dict[str, JudgeLog]]:
    """Combined scores (a failed sample scores 0 and is counted) and the judges' logs."""
    results = reward.score(samples)
    logs = {judge.name: judge.pop() for judge in judges}
    return results, logs


def reward_metrics(results: list[ScoreResult], logs: dict[str, JudgeLog]) -> dict[str, float]:
    """Over every process: the combined reward's mean over the samples that scored, the failed
    samples, each component's mean (`reward/<component>`, unweighted) and each judge's counters."""
    everything = gather_object([(r.score, r.components) for r in results])
    totals = torch.tensor([s for s, _ in everything if s is not None])
    out = {"reward/mean": totals.mean().item() if totals.numel() else math.nan,
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
