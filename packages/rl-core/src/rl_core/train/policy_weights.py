"""The policy's weights on the rollout side, as the trainer loop drives them.

A recipe gives the loop its `PolicyWeights` (`Recipe.policy`); the loop, not the recipe, moves
the weights:

    restore the checkpoint (its `state_dict` included)
    policy.start()                     # the starting weights (initial or restored) into the engine
    each optimizer step -> policy.stepped()   # counted; synchronous: the next sample uses them
    train.max_staleness >= 1: policy.channel() -> the weights by version (`WeightChannel`):
        the loop publishes a version after each step, the rollout thread loads the one its
        step may use before it samples
    after each sample: policy.weight_version -> logged as rollout/weight_version

Synchronous training is the same path at staleness 0: the engine samples from the weights of
the last optimizer step. `rl_policy.engine.PolicyEngine` is the text policies' (hf, vLLM, Ray
actors; colocated or split); `rl_policy.lora_weights.LoraPolicyWeights` a LoRA policy's that an
app's own engine samples with (diffusion-grpo's SD3 and Janus, in process or on Ray actors);
`ModuleWeights` a module's that samples in this process; anything else subclasses
`CountedWeights` (or implements the six members).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch

from rl_core.train.pipeline import CopyChannel, WeightChannel, copy_sharing_frozen

__all__ = ["CountedWeights", "ModuleWeights", "PolicyWeights"]


@runtime_checkable
class PolicyWeights(Protocol):
    """The rollout side's copy of the policy (see the module doc).

    `weight_version`: the optimizer steps in the weights the last sample used (read by the loop
    right after each sample, on the thread that sampled). `start()`: once, after a resume's
    restore and before the first sample: put the trained weights into the engine without
    counting a step (a separate engine loaded the initial checkpoint; a resumed policy is newer).
    `stepped()`: after each optimizer step that was taken (not a skipped, non-finite one).
    `channel()`: switch to weights of the engine's own, changed only by version (asynchronous
    runs; called once, after `start`). `state_dict`/`load_state_dict`: the step count, in the
    checkpoint, so a resumed run goes on counting from it."""

    @property
    def weight_version(self) -> int: ...

    def start(self) -> None: ...

    def stepped(self) -> None: ...

    def channel(self) -> WeightChannel: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CountedWeights:
    """The counting every `PolicyWeights` does, to subclass: `steps` (the optimizer steps in the
    trained weights, in the checkpoint) and `weight_version` (those in the weights the sampler
    holds). Synchronous, `stepped()` counts a step and calls `push()` (override it to put the
    trained weights into an engine of its own; the default, for a sampler that is the trained
    module, does nothing); `start()` pushes without counting. Asynchronous, the subclass's
    `channel()` returns `self.counted(inner)` over a `WeightChannel` of its own: each published version remembers
    its step count, which becomes `weight_version` when the rollout thread loads it. `timer`
    (the trainer's `PhaseTimer`, or any `timer(name)` context manager) times the copies as the
    phases `weight_publish` (trainer's thread) and `weight_sync` (rollout thread)."""

    def __init__(self, timer: Callable[[str], AbstractContextManager[Any]] | None = None) -> None:
        self.steps = self.weight_version = 0
        self.timer = timer or (lambda name: nullcontext())
        self.versions: _CountedChannel | None = None  # set by `counted`: asynchronous

    def push(self) -> None:
        """Synchronous runs: the trained weights into the sampler, which samples with them next."""

    def start(self) -> None:
        self.weight_version = self.steps
        if self.versions is None:
            self.push()

    def stepped(self) -> None:
        self.steps += 1
        if self.versions is None:
            self.weight_version = self.steps
            self.push()

    def counted(self, inner: WeightChannel) -> WeightChannel:
        """`inner`, with each version's step count (once: later calls return the first channel)."""
        if self.versions is None:
            self.versions = _CountedChannel(self, inner)
        return self.versions

    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `channel()`, as the trainer loop restores a checkpoint before it starts."""
        if self.versions is not None:
            raise RuntimeError("restore the policy's weights before its weight channel is made")
        self.steps = self.weight_version = int(state["weight_version"])


class _CountedChannel:
    """`CountedWeights`' versions: `inner`'s copies, and the optimizer steps each holds."""

    def __init__(self, weights: CountedWeights, inner: WeightChannel) -> None:
        self.weights, self.inner = weights, inner
        self.published: dict[int, int] = {}  # loop step -> optimizer steps in its weights
        self._lock = threading.Lock()

    def publish(self, version: int) -> None:
        with self.weights.timer("weight_publish"):
            self.inner.publish(version)
        with self._lock:
            self.published[version] = self.weights.steps

    def load(self, version: int, *, prune: bool = True) -> None:
        with self.weights.timer("weight_sync"):
            self.inner.load(version, prune=prune)
        with self._lock:
            self.weights.weight_version = self.published[version]
            if prune:
                self.published = {v: n for v, n in self.published.items() if v >= version}

    def close(self) -> None:
        self.inner.close()


class ModuleWeights(CountedWeights):
    """`PolicyWeights` for a policy that samples with a torch module in this process: `sampler`
    is the trained module itself in a synchronous run, and after `channel()` a copy of it
    (`copy_sharing_frozen`: frozen weights shared) that changes only by version. Choose it when
    the recipe samples by calling the module (a bandit, a small model); an inference engine
    brings its own (`rl_policy.engine.PolicyEngine`)."""

    def __init__(self, trained: torch.nn.Module) -> None:
        super().__init__()
        self.trained, self.sampler = trained, trained

    def channel(self) -> WeightChannel:
        if self.versions is None:
            self.sampler = copy_sharing_frozen(self.trained)
        return self.counted(CopyChannel(self.trained, self.sampler))
