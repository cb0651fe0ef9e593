"""diffusion-grpo's reward: the RewardSpec (`reward.spec`, or compiled from `reward.components`
and `reward.kwargs`), scoring a batch of images (in process, or a reward server via `reward.url`),
and the step's `Scores`: GRPO groups (by draw, or by prompt text as Flow-GRPO) and options."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from grpo_config import RewardConfig, TrainConfig, resolve_path
from PIL import Image

from rl_core.advantages import group_ids_from_keys
from rl_core.train import Scores, UserError, gather_rows
from rl_data import OCRPrompt
from rl_rewards import Component, RewardSpec, Sample, Scorer, build_reward
from rl_rewards.client import RemoteScorer
from rl_rewards.spec import load_spec


def reward_spec(cfg: RewardConfig, *, tiny: bool) -> RewardSpec:
    """`reward.spec` (inline, or a TOML file), else the weighted sum of `reward.components` with
    `reward.kwargs` as options. `clip_score`/`aesthetic` without a `model` option get CLIP
    ViT-L/14 (the LAION aesthetic head's backbone), or the tiny CLIP when the model is tiny."""
    if isinstance(cfg.spec, RewardSpec):
        return cfg.spec
    if cfg.spec is not None:
        try:
            return load_spec(resolve_path(cfg.spec))
        except (OSError, ValueError) as e:
            raise UserError(f"reward.spec={cfg.spec!r}: {e}") from None
    clip = "tiny:clip" if tiny else "openai/clip-vit-large-patch14"
    components = {name: Component(scorer=name, weight=w, options=(
        {"model": clip} if name in ("clip_score", "aesthetic") else {}) | cfg.kwargs.get(name, {}))
        for name, w in cfg.components.items() if w != 0}
    if not components:
        raise UserError(f"reward.components {cfg.components} has no non-zero weight")
    return RewardSpec(components=components)


def build_scorer(cfg: RewardConfig, *, tiny: bool) -> Scorer:
    """The reward server at `reward.url`, else the spec's scorers built in this process."""
    return RemoteScorer(cfg.url, cfg.server_reward) if cfg.url is not None else build_reward(reward_spec(cfg, tiny=tiny))


def score_images(scorer: Scorer, images: list[Image.Image], records: list[OCRPrompt], *,
                 files: Path | None = None) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Rewards `[N]` (NaN where scoring failed) and each component's values. `files`: write the
    images there as PNGs and send their paths (a reward server reads files, not PIL objects)."""
    metadata: list[dict[str, Any]] = [{"image": image} for image in images]
    if files is not None:
        files.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(images):
            image.save(files / f"{i}.png")
            metadata[i] = {"image": str(files / f"{i}.png")}
    samples = [Sample(completion="", prompt=r.prompt, reference=r.target, metadata=md)
               for r, md in zip(records, metadata, strict=True)]
    results = scorer.score(samples)
    rewards = torch.tensor([math.nan if r.score is None else r.score for r in results])  # [N]
    parts: dict[str, list[float]] = {}
    for r in results:
        for key, value in r.components.items():
            parts.setdefault(f"reward/{key}", []).append(value)
    return rewards, parts


def means(values: Mapping[str, list[float]], accelerator: Any = None) -> dict[str, float]:
    """The mean of each list, over every process's values when `accelerator` is given."""
    merged: dict[str, list[float]] = {}
    for part in gather_object([dict(values)]) if accelerator is not None else [values]:
        for key, v in part.items():
            merged.setdefault(key, []).extend(v)
    return {key: sum(v) / len(v) for key, v in merged.items() if v}


def grpo_scores(t: TrainConfig, acc: Any, rewards: torch.Tensor, group_ids: torch.Tensor, prompts: list[str],
                metrics: Mapping[str, float]) -> Scores:
    """GRPO over every process's groups, normalised as `train.adv_*` say; `train.adv_group_by =
    "prompt"` groups by prompt text instead of `group_ids` (Flow-GRPO's per-prompt stat
    tracker: the prompts of all processes are gathered and numbered together)."""
    if t.adv_group_by == "prompt":
        parts = gather_object([prompts])  # one list per process, in rank order
        start = sum(len(part) for part in parts[: acc.process_index])
        group_ids = group_ids_from_keys([p for part in parts for p in part])[start:start + len(prompts)]  # [N]
    everything, _ = gather_rows(rewards, acc)  # [N * world]
    groups, _ = gather_rows(group_ids, acc)  # [N * world]
    stds = [everything[(groups == g) & torch.isfinite(everything)].std().item() for g in groups.unique()
            if ((groups == g) & torch.isfinite(everything)).sum() > 1]
    options = {"scale": t.adv_scale, "eps": t.adv_eps, "clip": t.adv_clip, "std": t.adv_std, "eps_mode": t.adv_eps_mode}
    return Scores(rewards, group_ids, "grpo", options=options,
                  metrics={**metrics, "reward/zero_std_group_fraction": sum(s == 0 for s in stds) / max(len(stds), 1)})
