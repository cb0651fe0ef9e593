"""A LoRA policy's weights for an app's own engine (`rl_policy.lora_weights`), in process, and its
adapters' export; the Ray workers' path runs in diffusion-grpo's test_ray_rollout.py (a real
local Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from rl_core.train import ParameterEMA
from rl_models import tiny
from rl_models.lora import add_lora
from rl_models.text import load_causal_lm
from rl_policy.lora_weights import LoraCopy, LoraPolicyWeights, export_adapters, lora_params


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


def test_the_ema_steps_with_every_optimizer_step_the_weights_count() -> None:
    """`stepped()` (each optimizer step taken) steps the EMA too: interval 2, decay 0.5, the
    LoRA weight at 1 then 3 -> after 2 steps the shadow is 0.5 x w0 + 0.5 x 3; the frozen base is
    not averaged."""
    trained = LoraToy()
    with torch.no_grad():
        trained.adapter.lora_A.weight.fill_(1.0)
    ema = ParameterEMA(trained, decay=0.5, interval=2)
    weights = LoraPolicyWeights(trained, sampler=trained, ema=ema)
    weights.start()
    assert weights.ema is ema and list(ema.shadow) == ["adapter.lora_A.weight"]
    weights.stepped()  # step 1: not a multiple of the interval
    assert (ema.steps, ema.updates) == (1, 0) and torch.equal(ema.shadow["adapter.lora_A.weight"], torch.ones(2, 4))
    with torch.no_grad():
        trained.adapter.lora_A.weight.fill_(3.0)
    weights.stepped()
    assert (weights.steps, ema.steps, ema.updates) == (2, 2, 1)
    assert torch.equal(ema.shadow["adapter.lora_A.weight"], torch.full((2, 4), 2.0))


def test_a_lora_copy_shares_the_base_and_moves_towards_the_trained_lora() -> None:
    """DiffusionNFT's old policy: copy <- 0.75 copy + 0.25 trained, by name; its checkpoint state
    is its LoRA, and another LoRA's state is refused."""
    trained = LoraToy()
    copy = LoraCopy(trained)
    assert copy.model.base.weight.data_ptr() == trained.base.weight.data_ptr()
    start = trained.adapter.lora_A.weight.detach().clone()
    with torch.no_grad():
        trained.adapter.lora_A.weight.add_(4.0)
    copy.move_towards(0.75)
    torch.testing.assert_close(copy.state_dict()["adapter.lora_A.weight"], start + 1.0)
    copy.load_state_dict({"adapter.lora_A.weight": start})
    assert torch.equal(copy.model.adapter.lora_A.weight, start)
    with pytest.raises(ValueError, match="another LoRA rank"):
        copy.load_state_dict({})


def test_the_adapters_export_the_lora_and_its_ema_each_loadable_by_peft(tmp_path: Path) -> None:
    """The tiny Qwen3 with a LoRA at 1, its EMA (decay 0.5, one step after the LoRA moved to 3)
    at 2: `lora/` holds 3, `lora_ema/` 2, and the model keeps 3 after the export."""
    model, _ = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    peft = add_lora(model, r=2, target_modules=["q_proj"])
    lora = lora_params(peft)
    with torch.no_grad():
        for p in lora.values():
            p.fill_(1.0)
    ema = ParameterEMA(peft, decay=0.5)
    with torch.no_grad():
        for p in lora.values():
            p.fill_(3.0)
    ema.step()
    export_adapters(peft, ema, tmp_path / "final")
    saved = {kind: load_file(tmp_path / "final" / kind / "adapter_model.safetensors") for kind in ("lora", "lora_ema")}
    assert len(saved["lora"]) == len(lora) and {float(t.unique()) for t in saved["lora"].values()} == {3.0}
    assert {float(t.unique()) for t in saved["lora_ema"].values()} == {2.0}
    assert all(float(p.detach().unique()) == 3.0 for p in lora.values())  # the trained weights are back
    base, _ = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "final" / "lora_ema"))
    assert {float(p.detach().unique()) for p in lora_params(loaded).values()} == {2.0}
