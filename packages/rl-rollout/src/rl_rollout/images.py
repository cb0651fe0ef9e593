"""Image engines: text-to-image samplers whose samples carry the per-unit log-probs an RL trainer
replays, behind their own small protocol (not the text `Engine`'s).

- `sd3` (`rl_rollout.diffusion.DiffusionEngine`): SD3/SD3.5 with the Flow-GRPO SDE sampler; a
  unit is a stochastic denoising step. `sample(...)` returns a `Trajectory`;
  `replay(trajectory, step, rows=, model=)` re-scores one step under the current weights.
- `wan` (`rl_rollout.wan.WanEngine`): the same over Wan 2.1 videos; `images` are frames
  `[B, F, 3, H, W]`.
- `cosmos` (`rl_rollout.cosmos.CosmosEngine`): the same over Cosmos-Predict2.5 text-to-world
  videos (frames `[B, F, 3, H, W]`), with no guardrail run.
- `janus` (`rl_rollout.janus.JanusEngine`): Janus / Janus-Pro image tokens with CFG; a unit is
  an image token. `sample(...)` returns an `ImageRollout`; `replay(tokens, guidance_scale=,
  temperature=, model=)` re-scores the tokens.

    engine = build_image_engine("sd3", path=tiny.build("sd3"), device="cpu")
    samples = engine.sample(["a red cube"], seeds=[0])
    samples.images.shape, samples.log_probs.shape      # [1, 3, H, W], [1, steps]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["IMAGE_ENGINES", "ImageEngine", "ImageSamples", "build_image_engine"]


class ImageSamples(Protocol):
    """What every image engine's `sample` returns (with its own replay data beside)."""

    @property
    def prompts(self) -> tuple[str, ...]: ...

    @property
    def images(self) -> Tensor:
        """`[B, 3, H, W]` float in [0, 1]."""
        ...

    @property
    def log_probs(self) -> Tensor:
        """`[B, U]` log-prob of each trained unit when it was sampled."""
        ...


@runtime_checkable
class ImageEngine(Protocol):
    """Sample images with a seed each (the same seed redraws the same sample, whatever the
    batch), and give the accelerator back between rollouts."""

    def sample(self, prompts: Sequence[str], *, seeds: Sequence[int] | None = None) -> ImageSamples: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    @property
    def is_asleep(self) -> bool: ...


def _build_sd3(**kwargs: Any) -> ImageEngine:
    from rl_rollout.diffusion import DiffusionEngine

    return DiffusionEngine.from_pretrained(kwargs.pop("path"), **kwargs)


def _build_wan(**kwargs: Any) -> ImageEngine:
    from rl_rollout.wan import WanEngine

    return WanEngine.from_pretrained(kwargs.pop("path"), **kwargs)


def _build_cosmos(**kwargs: Any) -> ImageEngine:
    from rl_rollout.cosmos import CosmosEngine

    return CosmosEngine.from_pretrained(kwargs.pop("path"), **kwargs)


def _build_janus(**kwargs: Any) -> ImageEngine:
    from rl_rollout.janus import JanusEngine

    return JanusEngine.from_pretrained(kwargs.pop("path"), **kwargs)


IMAGE_ENGINES: dict[str, Callable[..., ImageEngine]] = {"sd3": _build_sd3, "wan": _build_wan, "cosmos": _build_cosmos,
                                                       "janus": _build_janus}


def build_image_engine(kind: str, *, path: str, **options: Any) -> ImageEngine:
    """The image engine `kind` (`sd3`, `wan`, `cosmos`, `janus`) loaded from checkpoint `path`;
    `options` go to its `from_pretrained` (dtype, device, compile, ...)."""
    if kind not in IMAGE_ENGINES:
        raise KeyError(f"unknown image engine {kind!r}; valid: {', '.join(sorted(IMAGE_ENGINES))}")
    return IMAGE_ENGINES[kind](path=path, **options)
