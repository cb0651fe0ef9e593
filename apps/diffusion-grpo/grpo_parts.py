"""Pieces of the diffusion-grpo recipe that are not its hooks: the LoRA state and its EMA, image
statistics, the brightness scorer and contact sheets."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor
from torch.distributed.tensor import DTensor

from rl_rewards import Sample, ScoreResult
from rl_rewards.scorers.media import load_image


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters (the only ones with `requires_grad`), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class LoraState:
    """Checkpointable LoRA weights of `model` (a `Stateful` for `rl_core.train.save_checkpoint`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = trainable(model)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        missing = sorted(set(self.params) - set(state))
        if missing:
            raise KeyError(f"checkpoint LoRA state lacks {missing[:3]} (+{len(missing)}); same lora_rank/targets?")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])


def whole(p: Tensor) -> Tensor:
    """A parameter's whole value: a sharded one (FSDP2's DTensor) all-gathered, which is a
    collective (every process calls it), else `p` itself."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class LoraEMA:
    """EMA of the LoRA weights, Flow-GRPO's `EMAModuleWrapper`: every `interval` optimizer steps,
    `ema = decay * ema + (1 - decay) * weights` (0.9 every 8 steps in the SD3 recipe). The EMA
    weights are used for eval and exported next to the raw ones.

    The EMA is whole (fp32) on every process, also for sharded LoRA weights (`train.sharding =
    "fsdp2"`: each update gathers them; a LoRA is small): its state is the same on every process,
    saved by the main one and loaded by all, and it is applied to a sharded policy's gathered
    copy (`swapped(copy)`), bit for bit what an unsharded run has. It counts the optimizer
    steps (`steps`, saved with it): the version of the weights a rollout samples with."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], *, decay: float, interval: int) -> None:
        if not 0 <= decay < 1 or interval < 1:
            raise ValueError(f"need 0 <= ema decay < 1 and interval >= 1, got {decay}, {interval}")
        self.params, self.decay, self.interval = dict(params), decay, interval
        self.shadow = {name: whole(p.detach()).float().clone() for name, p in self.params.items()}
        self.updates, self.steps = 0, 0

    @torch.no_grad()
    def step(self) -> None:
        """Call after each optimizer step that was taken, on every process."""
        self.steps += 1
        if self.steps % self.interval:
            return
        for name, p in self.params.items():
            self.shadow[name].lerp_(whole(p.detach()).float(), 1 - self.decay)
        self.updates += 1

    @contextmanager
    def swapped(self, model: torch.nn.Module) -> Iterator[None]:
        """Run `model` with the EMA weights inside the block; the raw weights come back after.
        `model` is the trained PeftModel, or a sharded policy's gathered copy (`FullWeights`,
        the same parameter names)."""
        params = {name: p for name, p in model.named_parameters() if name in self.shadow}
        if len(params) != len(self.shadow):
            missing = sorted(set(self.shadow) - set(params))
            raise KeyError(f"{type(model).__name__} lacks the LoRA weights {missing[:3]} (+{len(missing)})")
        saved = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": {k: v.cpu() for k, v in self.shadow.items()}, "updates": self.updates, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self.shadow:
            self.shadow[name].copy_(state["shadow"][name])
        self.updates, self.steps = int(state["updates"]), int(state["steps"])


# ----------------------------------------------------------------------------- images


def to_pil(images: Tensor) -> list[Image.Image]:
    """`[B, 3, H, W]` floats in [0, 1] -> RGB PIL images."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
    return [Image.fromarray(a.permute(1, 2, 0).cpu().numpy()) for a in arrays]


def image_stats(images: Sequence[Image.Image]) -> dict[str, float]:
    """Mean brightness (grey level in [0, 1]) and colour entropy (bits of the 8x8x8 RGB histogram,
    0..9) averaged over `images`. Collapsing either is a classic reward-hacking signature (blank,
    saturated or single-colour images that fool a scorer)."""
    brightness, entropy = [], []
    for image in images:
        rgb = np.asarray(image.convert("RGB"), dtype=np.int64)  # [H, W, 3]
        brightness.append(float(np.asarray(image.convert("L"), dtype=np.float64).mean() / 255))
        bins = (rgb // 32) @ np.array([64, 8, 1])  # [H, W] index into 512 colour bins
        p = np.bincount(bins.ravel(), minlength=512) / bins.size
        p = p[p > 0]
        entropy.append(float(-(p * np.log2(p)).sum()))
    return {"image/brightness": float(np.mean(brightness)), "image/colour_entropy": float(np.mean(entropy))}


class BrightnessScorer:
    """Mean grey level of `Sample.metadata["image"]` in [0, 1]: a cheap reward the tiny model can
    learn (the app's learning test), and a check that the loop optimizes what it is told to."""

    name = "brightness"

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results = []
        for sample in samples:
            try:
                grey = np.asarray(load_image(sample.metadata).convert("L"), dtype=np.float64)
                results.append(ScoreResult(score=float(grey.mean() / 255)))
            except (ValueError, OSError) as e:
                results.append(ScoreResult.failed(f"brightness: {e}"))
        return results


def contact_sheet(images: Sequence[Image.Image], captions: Sequence[str], path: Path, *,
                  columns: int = 4, cell: int = 256) -> Path:
    """A grid of `images` (scaled to `cell` px), each with its caption (prompt, reward) under it."""
    rows = math.ceil(len(images) / columns)
    font = ImageFont.load_default()
    text_h = 4 * 12
    sheet = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_h)
        sheet.paste(image.resize((cell, cell), Image.Resampling.NEAREST), (x, y))
        for line_no, line in enumerate(textwrap.wrap(caption, width=cell // 6)[:4]):
            draw.text((x + 2, y + cell + 1 + 12 * line_no), line, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
