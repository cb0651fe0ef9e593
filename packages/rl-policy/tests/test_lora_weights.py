"""A LoRA policy's weights for an app's own engine (`rl_policy.lora_weights`), in process; the Ray
workers' path runs in diffusion-grpo's test_ray_rollout.py (a real local Ray)."""

from __future__ import annotations

import pytest
import torch

from rl_policy.lora_weights import LoraPolicyWeights, lora_params


class LoraToy(torch.nn.Module):
    """A frozen base and a trainable adapter named as peft names its LoRA weights."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(4, 4).requires_grad_(False)
        self.adapter = torch.nn.Module()
        self.adapter.lora_A = torch.nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter.lora_A(x).sum(-1, keepdim=True)


def test_synchronous_weights_are_the_trained_module_and_count_its_steps() -> None:
    trained = LoraToy()
    weights = LoraPolicyWeights(trained, sampler=trained)
    weights.start()
    assert weights.weight_version == 0 and not weights.asynchronous
    weights.stepped()
    weights.stepped()
    assert weights.weight_version == 2 and weights.state_dict() == {"weight_version": 2}
    with pytest.raises(RuntimeError, match="no Ray workers"):
        weights.on_workers(lambda engine, item: item, [1])


def test_asynchronous_weights_are_a_copy_changed_only_by_version() -> None:
    """The rollout's copy shares the frozen base, holds the LoRA of the version it loaded, and
    a resumed count goes on from the checkpoint's."""
    trained, copies = LoraToy(), []
    weights = LoraPolicyWeights(trained, sampler=trained, on_copy=copies.append)
    weights.load_state_dict({"weight_version": 5})  # a resume: 5 optimizer steps in the weights
    weights.start()
    channel = weights.channel()
    assert weights.asynchronous and weights.channel() is channel and len(copies) == 1  # built once
    twin = copies[0]
    assert twin.base.weight.data_ptr() == trained.base.weight.data_ptr()  # the frozen base is shared
    assert set(lora_params(twin)) == {"adapter.lora_A.weight"}
    first = trained.adapter.lora_A.weight.detach().clone()
    channel.publish(3)  # loop step 3: the weights of 5 optimizer steps
    with torch.no_grad():
        trained.adapter.lora_A.weight.add_(1.0)
    weights.stepped()
    channel.publish(4)
    assert torch.equal(twin.adapter.lora_A.weight, first)  # nothing moves before a load
    channel.load(3)
    assert weights.weight_version == 5 and torch.equal(twin.adapter.lora_A.weight, first)
    channel.load(4)
    assert weights.weight_version == 6 and torch.equal(twin.adapter.lora_A.weight, first + 1.0)
    assert weights.state_dict() == {"weight_version": 6}
    with pytest.raises(KeyError, match="step 3 were not published"):
        channel.load(3)  # pruned: older than the version loaded last
