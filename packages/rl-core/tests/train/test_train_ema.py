"""`ParameterEMA` and `TrainableState` on a linear layer whose bias is frozen (a LoRA's layout:
trainable weights over a frozen base): hand-worked EMA updates, the swap, checkpoint round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.train import ParameterEMA, TrainableState, load_checkpoint, save_checkpoint


def _model(weight: float) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(weight)
        model.bias.fill_(7.0)
    model.bias.requires_grad_(False)
    return model


def _set(model: torch.nn.Linear, weight: float) -> None:
    with torch.no_grad():
        model.weight.fill_(weight)


def test_every_interval_steps_the_ema_moves_by_one_minus_decay() -> None:
    model = _model(1.0)
    ema = ParameterEMA(model, decay=0.75, interval=2)
    assert list(ema.shadow) == ["weight"]  # the frozen bias is not averaged
    _set(model, 3.0)
    ema.step()  # step 1: not a multiple of the interval
    assert ema.shadow["weight"].tolist() == [[1.0, 1.0]] and (ema.steps, ema.updates) == (1, 0)
    ema.step()  # step 2: 0.75 * 1 + 0.25 * 3
    assert ema.shadow["weight"].tolist() == [[1.5, 1.5]] and (ema.steps, ema.updates) == (2, 1)
    _set(model, 5.5)
    ema.step()
    ema.step()  # 0.75 * 1.5 + 0.25 * 5.5
    assert ema.shadow["weight"].tolist() == [[2.5, 2.5]] and (ema.steps, ema.updates) == (4, 2)
    with pytest.raises(ValueError, match="decay"):
        ParameterEMA(model, decay=1.0)


def test_swapped_runs_the_model_on_the_ema_and_gives_its_weights_back() -> None:
    model = _model(1.0)
    ema = ParameterEMA(model, decay=0.5)
    _set(model, 3.0)
    ema.step()  # 2.0
    x = torch.ones(1, 2)
    with ema.swapped(model):
        assert model(x).item() == 2.0 * 2 + 7.0
    assert model.weight.tolist() == [[3.0, 3.0]]
    with pytest.raises(RuntimeError, match="inside"), ema.swapped(model):
        raise RuntimeError("inside")
    assert model.weight.tolist() == [[3.0, 3.0]]  # back after an error too
    with pytest.raises(KeyError, match="weight"), ema.swapped(torch.nn.Sequential(torch.nn.Linear(2, 1))):
        pass


def test_trainable_state_and_the_ema_resume_from_a_checkpoint(tmp_path: Path) -> None:
    model = _model(1.0)
    ema = ParameterEMA(model, decay=0.5)
    _set(model, 3.0)
    ema.step()
    save_checkpoint(tmp_path, 1, state={"lora": TrainableState(model), "ema": ema})
    assert set(torch.load(tmp_path / "checkpoint-1" / "lora.pt", weights_only=True)) == {"weight"}
    fresh = _model(0.0)
    with torch.no_grad():
        fresh.bias.fill_(-1.0)
    fresh_ema = ParameterEMA(fresh, decay=0.5)
    load_checkpoint(tmp_path / "checkpoint-1", state={"lora": TrainableState(fresh), "ema": fresh_ema})
    assert fresh.weight.tolist() == [[3.0, 3.0]] and fresh.bias.item() == -1.0  # the frozen base is not restored
    assert fresh_ema.shadow["weight"].tolist() == [[2.0, 2.0]] and (fresh_ema.steps, fresh_ema.updates) == (1, 1)


def test_trainable_weights_of_another_layout_are_refused_by_name() -> None:
    other = torch.nn.Linear(2, 1)
    other.weight.requires_grad_(False)  # the bias trains instead
    with pytest.raises(ValueError, match=r"missing \['weight'\], unexpected \['bias'\]"):
        TrainableState(_model(0.0)).load_state_dict(TrainableState(other).state_dict())
