"""A model's trainable weights (a LoRA over a frozen base) as checkpoint state, and their
exponential moving average.

    ema = ParameterEMA(model, decay=0.9, interval=8)   # Flow-GRPO's SD3 recipe
    ...                                                # after each optimizer step that was taken:
    ema.step()
    with ema.swapped(model):                           # evaluate or export the EMA weights
        ...
    save_checkpoint(root, step, state={"lora": TrainableState(model), "ema": ema})

Both are `Stateful`s for `rl_core.train.save_checkpoint`. Pick `TrainableState` to checkpoint
an unsharded policy whose frozen base is reloaded from its model path (`accelerator.save_state`
would write the whole model); a sharded one saves through `sharded_state(..., trainable_only=True)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["ParameterEMA", "TrainableState", "trainable_parameters"]


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters with `requires_grad` (a LoRA's), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _whole(p: Tensor) -> Tensor:
    """A parameter's whole value: a sharded one (FSDP2's DTensor) all-gathered, a collective."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class TrainableState:
    """The trainable weights of an unsharded `model`, saved and restored by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = trainable_parameters(model)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        if set(state) != set(self.params):  # a ValueError: load_checkpoint names the run's config
            missing, extra = sorted(set(self.params) - set(state)), sorted(set(state) - set(self.params))
            raise ValueError(f"its trainable weights are not this model's (missing {missing[:2]}, unexpected "
                             f"{extra[:2]}): another LoRA rank or target modules?")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])


class ParameterEMA:
    """EMA of `model`'s trainable weights, Flow-GRPO's `EMAModuleWrapper`: every `interval`
    optimizer steps, `ema = decay * ema + (1 - decay) * weights`. It counts the optimizer steps
    (`steps`, checkpointed with it), which also versions the weights a rollout samples with.

    The EMA is whole (float32) on every process, also for sharded weights (each update gathers
    them: pick it for a LoRA, which is small): its state is the same everywhere, saved by the
    main process and loaded by all, and `swapped` applies it to the model or to a sharded
    model's whole copy (`FullWeights`, the same names), bit for bit what an unsharded run has."""

    def __init__(self, model: torch.nn.Module, *, decay: float, interval: int = 1) -> None:
        if not 0 <= decay < 1 or interval < 1:
            raise ValueError(f"need 0 <= decay < 1 and interval >= 1, got {decay} and {interval}")
        self.params, self.decay, self.interval = trainable_parameters(model), decay, interval
        self.shadow = {name: _whole(p.detach()).float().clone() for name, p in self.params.items()}
        self.updates, self.steps = 0, 0

    @torch.no_grad()
    def step(self) -> None:
        """Call after each optimizer step that was taken, on every process."""
        self.steps += 1
        if self.steps % self.interval == 0:
            for name, p in self.params.items():
                self.shadow[name].lerp_(_whole(p.detach()).float(), 1 - self.decay)
            self.updates += 1

    @contextmanager
    def swapped(self, model: torch.nn.Module) -> Iterator[None]:
        """`model` holds the EMA weights inside the block; its own come back after."""
        params = {name: p for name, p in model.named_parameters() if name in self.shadow}
        if len(params) != len(self.shadow):
            raise KeyError(f"{type(model).__name__} lacks the weights {sorted(set(self.shadow) - set(params))[:3]}")
        saved = {name: p.detach().clone() for name, p in params.items()}
        try:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self.shadow[name])
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
