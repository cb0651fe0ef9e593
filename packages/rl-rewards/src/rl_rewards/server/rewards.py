"""Which rewards a server serves, built the same way in the server process, a worker process or
a Ray actor.

- every `[rewards.NAME]` table of the TOML config is a `RewardSpec` (see `rl_rewards.spec`);
- with none configured, the rule scorers are served under their registry names
  (`timestamp_format`, `length` counted in whitespace words) plus `ocr` when `rl-rewards[ocr]`
  is installed — a useful embedded default with no model;
- `REWARD_MODEL` adds the CapRL judge for `score_mode`: `caption_qa` (qa) or `vl_judge`, built
  lazily through the registry (needs `rl-rewards[hf]`), and `timestamp_format` for the video
  format reward.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping

import msgspec

from rl_rewards import registry
from rl_rewards.composition import build_reward, score_isolated, spec_keys
from rl_rewards.registry import build_scorer, scorer_component_keys
from rl_rewards.samples import AsyncScorer, Sample, Scorer, ScoreResult
from rl_rewards.server.settings import ServerSettings
from rl_rewards.spec import spec_from_dict

Served = Mapping[str, Scorer | AsyncScorer]
log = logging.getLogger("rl_rewards.server")

CAPRL_QA = "caption_qa"
CAPRL_VL_JUDGE = "vl_judge"
CAPRL_FORMAT = "timestamp_format"


def judge_name(settings: ServerSettings) -> str | None:
    """The served name of the CapRL judge, or None when no `REWARD_MODEL` is configured."""
    if settings.model is None:
        return None
    return CAPRL_QA if settings.score_mode == "qa" else CAPRL_VL_JUDGE


ENGINE_KEY = "--engine / REWARD_ENGINE"


def resolve_judge_engine(settings: ServerSettings) -> tuple[ServerSettings, str | None]:
    """The settings with the CapRL judge's `engine` resolved once, in the server process, and
    the log line saying which engine and why (None when there is nothing to resolve here).

    `auto` becomes `vllm` on a CUDA machine where vLLM imports, else `hf`, so every worker runs
    the same engine and `/health` reports it (`judge_engine`); `vllm` where it cannot run is a
    ValueError naming `--engine / REWARD_ENGINE` and the reason. Left as given:
    with `--ray` (each actor resolves `auto` on its own node, logged there), and without
    rl-rewards[hf] (loading the judge then fails naming that install command)."""
    judge = judge_name(settings)
    if judge is None or settings.ray:
        return settings, None
    try:
        from rl_core.errors import UserError
        from rl_rollout import (
            resolve_judge_engine as resolve_kind,  # imports torch: only with a judge configured
        )
    except ImportError:
        return settings, None
    try:
        kind, why = resolve_kind(settings.engine, key=ENGINE_KEY)
    except UserError as e:  # a bad setting, as the other settings errors: `serve` exits 2 with it
        raise ValueError(str(e)) from None
    return msgspec.structs.replace(settings, engine=kind), f"{judge} judge {settings.model}: engine {why}"


def reward_names(settings: ServerSettings) -> list[str]:
    """Names of the rewards the server will try to serve, in order, without building them (the
    optional default `ocr` may drop out when it cannot be built)."""
    names = list(settings.rewards) or _default_rule_names()
    judge = judge_name(settings)
    if judge is not None:
        names += [n for n in (judge, CAPRL_FORMAT) if n not in names]
    return names


def _default_rule_names() -> list[str]:
    names = ["timestamp_format", "length"]
    if importlib.util.find_spec("rapidocr") is not None:
        names.append("ocr")
    return names


def _format_options(settings: ServerSettings) -> dict[str, object]:
    return {"variant": settings.format_reward_variant, "min_brackets": settings.format_min_brackets}


def _build_default(name: str, settings: ServerSettings) -> Scorer | AsyncScorer | None:
    """A default rule scorer; the optional OCR one is skipped (with a warning) when it cannot be
    built here, since nobody asked for it explicitly."""
    if name == "length":
        return build_scorer("length", tokenizer="whitespace")
    if name == CAPRL_FORMAT:
        return build_scorer(name, **_format_options(settings))
    if name != "ocr":
        return build_scorer(name)
    try:
        return build_scorer("ocr")
    except Exception as e:
        log.warning("default reward 'ocr' not served: %s: %s", type(e).__name__, e)
        return None


def build_served(settings: ServerSettings) -> dict[str, Scorer | AsyncScorer]:
    """Build every served reward (loads the judge model when one is configured), except those
    scored in an environment of their own (`[rewards.NAME] python`, built there: see
    `rl_rewards.server.environments`): their scorers may not even import here."""
    register_scorers(settings)
    served: dict[str, Scorer | AsyncScorer] = {}
    elsewhere = settings.interpreters()
    for name in settings.rewards:
        if name not in elsewhere:
            served[name] = build_reward(settings.reward_spec(name))
    if not settings.rewards:
        for name in _default_rule_names():
            scorer = _build_default(name, settings)
            if scorer is not None:
                served[name] = scorer
    judge = judge_name(settings)
    if judge is not None and judge not in served:
        served[judge] = _build_judge(judge, settings)
    if judge is not None and CAPRL_FORMAT not in served:
        served[CAPRL_FORMAT] = build_scorer(CAPRL_FORMAT, **_format_options(settings))
    return served


def _build_judge(name: str, settings: ServerSettings) -> Scorer | AsyncScorer:
    """The CapRL judge served as `name` (`judge_name`): caption_qa or vl_judge on `settings.model`."""
    if name == CAPRL_QA:
        # CapRL's own estimator by default (drop-in); `--judge-option estimator=exact` for training
        options = {"model": settings.model, "engine": settings.engine, "task": settings.task, "qa_num": settings.qa_num, "estimator": "sample",
                   "answer_parser": settings.answer_parser, "prompt_template": settings.qa_prompt_file}
        return build_scorer("caption_qa", **{**options, **settings.judge_options})
    return build_scorer("vl_judge", **{"model": settings.model, "engine": settings.engine, **settings.judge_options})


def build_named(settings: ServerSettings, name: str) -> Scorer | AsyncScorer:
    """Served reward `name` (one of `reward_names`) built alone, as `build_served` builds it: a
    Ray Serve replica holds its own reward only (a rule's replica loads no judge)."""
    if name in settings.rewards:  # through build_served, which reads a [rewards.NAME] table
        alone = msgspec.structs.replace(settings, rewards={name: settings.rewards[name]}, model=None)
        return build_served(alone)[name]
    register_scorers(settings)
    if name == judge_name(settings):
        return _build_judge(name, settings)
    scorer = _build_default(name, settings)
    if scorer is None:
        raise RuntimeError(f"the default reward {name!r} cannot be built here (see the warning logged above)")
    return scorer


def register_scorers(settings: ServerSettings) -> None:
    """Register the settings' own scorers (`[scorers]`, NAME = "module:Factory") in this process;
    one already registered under the same path (an earlier build here) is kept."""
    for name, path in settings.scorers.items():
        if registry.SCORERS.get(name) == registry.LazyFactory(path):
            continue
        if name in registry.SCORERS:
            raise ValueError(f"[scorers] {name} = {path!r}: {name!r} is already a scorer "
                             f"({registry.SCORERS[name]!r}); give yours another name")
        registry.register_scorer(name, path)


def served_keys(settings: ServerSettings) -> dict[str, list[str]]:
    """For each reward `reward_names` lists, the component keys every one of its results carries
    (a composed reward: `spec_keys`; a bare scorer: its declared sub-components). Computed from
    the settings alone, so the server process knows them without loading a judge; clients use
    them to report the same keys for every sample (verl, OpenRLHF)."""
    keys: dict[str, list[str]] = {}
    for name in reward_names(settings):
        if name in settings.rewards:
            keys[name] = list(spec_keys(spec_from_dict(settings.reward_spec(name), source=f"rewards.{name}")))
        elif name == CAPRL_QA:
            keys[name] = list(scorer_component_keys("caption_qa", {"estimator": "sample", **settings.judge_options}))
        else:
            keys[name] = list(scorer_component_keys(name, {}))
    return keys


def score_with(served: Served, reward: str, samples: list[Sample]) -> list[ScoreResult]:
    """Score `samples` with the served reward `reward`; a batch-level exception becomes
    per-sample errors (retried one sample at a time), never a failed batch."""
    if reward not in served:
        raise KeyError(f"unknown reward {reward!r}; served rewards: {', '.join(served)}")
    return score_isolated(served[reward], samples)
