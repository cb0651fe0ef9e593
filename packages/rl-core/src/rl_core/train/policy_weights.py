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
actors; colocated or split); `ModuleWeights` a module's that samples in this process; an app
with an engine of its own implements the five members.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from rl_core.train.pipeline import CopyChannel, WeightChannel, copy_sharing_frozen

__all__ = ["ModuleWeights", "PolicyWeights"]


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


class ModuleWeights:
    """`PolicyWeights` for a policy that samples with a torch module in this process: `sampler`
    is the trained module itself in a synchronous run, and after `channel()` a copy of it
    (`copy_sharing_frozen`: frozen weights shared) that changes only by version. Choose it when
    the recipe samples by calling the module (a bandit, a small model); an inference engine
    brings its own (`rl_policy.engine.PolicyEngine`)."""

    def __init__(self, trained: torch.nn.Module) -> None:
        self.trained, self.sampler = trained, trained
        self.steps = self.weight_version = 0  # optimizer steps in the trained weights; in the sampler's
        self.published: dict[int, int] = {}  # loop step -> optimizer steps in its weights

    def start(self) -> None:
        self.weight_version = self.steps

    def stepped(self) -> None:
        self.steps += 1
        if self.sampler is self.trained:
            self.weight_version = self.steps

    def channel(self) -> WeightChannel:
        self.sampler = copy_sharing_frozen(self.trained)
        return _CountedChannel(self, CopyChannel(self.trained, self.sampler))

    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = self.weight_version = int(state["weight_version"])


class _CountedChannel:
    """`ModuleWeights`' versions: the copies, and the optimizer steps each holds."""

    def __init__(self, weights: ModuleWeights, inner: CopyChannel) -> None:
        self.weights, self.inner = weights, inner

    def publish(self, version: int) -> None:
        self.inner.publish(version)
        self.weights.published[version] = self.weights.steps

    def load(self, version: int, *, prune: bool = True) -> None:
        self.inner.load(version, prune=prune)
        self.weights.weight_version = self.weights.published[version]

    def close(self) -> None:
        self.inner.close()
