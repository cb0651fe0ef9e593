"""rl_core.train.checkpoint: atomic save (a crash mid-save leaves the previous checkpoint
loadable and nothing half-written visible), exact resume with and without Accelerate."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rl_core.errors import UserError
from rl_core.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from rl_core.train.rundir import make_run_dir
from rl_core.train.seeding import seed_everything


class DataPosition:
    """A resumable data cursor: the state a real sampler checkpoints (epoch, offset)."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch, self.offset = size, 0, 0

    def next_index(self) -> int:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch))
        index = int(order[self.offset])
        self.offset += 1
        if self.offset == self.size:
            self.epoch, self.offset = self.epoch + 1, 0
        return index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]


DATA = torch.linspace(-1, 1, 5 * 6).reshape(5, 6)  # [N, D] fixed dataset


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataPosition]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=6)
    return model, optimizer, scheduler, DataPosition(len(DATA))


def _step(model: torch.nn.Module, optimizer: Any, scheduler: Any, data: DataPosition,
          backward: Any = None) -> None:
    """One update that draws from every RNG a checkpoint must restore: torch (noise, dropout),
    python `random` and numpy (a per-step target scale), plus the data cursor."""
    x = DATA[data.next_index()] + 0.1 * torch.randn(4, 6)  # [4, D]
    target = torch.full((4, 1), random.uniform(-1, 1) + float(np.random.rand()))  # [4, 1]
    loss = ((model(x) - target) ** 2).mean()
    (backward or torch.Tensor.backward)(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _state(model: Any, optimizer: Any, scheduler: Any, data: Any) -> dict[str, Any]:
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": data}


def test_resume_is_bit_identical_without_accelerator(tmp_path: Path) -> None:
    seed_everything(0)
    model, optimizer, scheduler, data = _build(0)
    for _ in range(6):
        _step(model, optimizer, scheduler, data)
    straight = _params(model)

    seed_everything(0)
    model, optimizer, scheduler, data = _build(0)
    for _ in range(3):
        _step(model, optimizer, scheduler, data)
    path = save_checkpoint(tmp_path, 3, state={**_state(model, optimizer, scheduler, data),
                                               "best_reward": 0.5})
    seed_everything(123)  # a new process: other RNG state, fresh objects
    model, optimizer, scheduler, data = _build(1)
    info = load_checkpoint(path, state=_state(model, optimizer, scheduler, data))
    assert info == {"step": 3, "best_reward": 0.5}
    for _ in range(3):
        _step(model, optimizer, scheduler, data)
    resumed = _params(model)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_resume_without_rng_restore_differs(tmp_path: Path) -> None:
    """The bit-identical test above can fail: dropping the RNG restore changes the result."""
    seed_everything(0)
    model, optimizer, scheduler, data = _build(0)
    for _ in range(3):
        _step(model, optimizer, scheduler, data)
    path = save_checkpoint(tmp_path, 3, state=_state(model, optimizer, scheduler, data))
    _step(model, optimizer, scheduler, data)
    expected = _params(model)
    (path / "rng.pt").unlink()
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, path / "rng.pt")
    model, optimizer, scheduler, data = _build(1)
    load_checkpoint(path, state=_state(model, optimizer, scheduler, data))
    _step(model, optimizer, scheduler, data)
    assert not all(torch.equal(a, b) for a, b in zip(expected, _params(model), strict=True))


@pytest.fixture
def two_checkpoints_then_crash(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    model, optimizer, scheduler, data = _build(0)
    first = save_checkpoint(tmp_path, 1, state=_state(model, optimizer, scheduler, data))
    yield tmp_path, first
    assert latest_checkpoint(tmp_path) == first
    assert not (tmp_path / "checkpoint-2").exists()
    fresh = _build(1)
    assert load_checkpoint(first, state=_state(*fresh))["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(fresh[0]), strict=True))


def test_crash_in_torch_save_keeps_previous(two_checkpoints_then_crash: tuple[Path, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = two_checkpoints_then_crash
    real_save = torch.save
    calls = []

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(f)
        if len(calls) == 2:  # rng.pt is written, then the disk "fills up" on model.pt
            raise OSError("No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(root, 2, state=_state(*_build(2)))
    assert (root / ".tmp-checkpoint-2" / "rng.pt").exists()  # the half-written save is hidden


class Exploding:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("boom while collecting state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def test_crash_in_state_dict_keeps_previous(two_checkpoints_then_crash: tuple[Path, Path]) -> None:
    root, _ = two_checkpoints_then_crash
    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(root, 2, state={**_state(*_build(2)), "zz": Exploding()})


def test_next_save_clears_leftovers_and_keep_last_prunes(tmp_path: Path) -> None:
    (tmp_path / ".tmp-checkpoint-9").mkdir(parents=True)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, state={"model": model}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path, 5, state={"model": model, "note": "first"})
    torch.nn.init.zeros_(model.weight)
    path = save_checkpoint(tmp_path, 5, state={"model": model, "note": "second"})
    fresh = torch.nn.Linear(2, 2)
    assert load_checkpoint(path, state={"model": fresh}) == {"step": 5, "note": "second"}
    assert torch.equal(fresh.weight, torch.zeros(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5"]


def test_latest_checkpoint_orders_by_step_number(tmp_path: Path) -> None:
    for step in (9, 10, 100):
        save_checkpoint(tmp_path, step, state={})
    (tmp_path / "checkpoint-200").mkdir()  # no meta.json: not a complete checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-100"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_bad_state_and_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Stateful or JSON-able"):
        save_checkpoint(tmp_path, 1, state={"when": object()})
    with pytest.raises(ValueError, match="'step' is reserved"):
        save_checkpoint(tmp_path, 1, state={"step": 3})
    assert not tmp_path.joinpath("checkpoint-1").exists()
    path = save_checkpoint(tmp_path, 1, state={"model": torch.nn.Linear(2, 2)})
    with pytest.raises(KeyError, match=r"no state for \['optimizer'\]; it holds \['model'\]"):
        load_checkpoint(path, state={"optimizer": torch.optim.SGD([torch.zeros(1)], lr=1)})
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path)


class Sampler(DataPosition):
    """A cursor that, like rl_data's GroupSampler, refuses a state saved with another size."""

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"sampler state has size={state['size']} but this sampler has size={self.size}")
        super().load_state_dict(state)


def test_state_saved_with_other_settings_is_a_user_error_naming_the_run_config(tmp_path: Path) -> None:
    """A resume with settings a saved state refuses is one line naming the state, the reason and
    the run's config.toml (apps print it and exit 2), not a traceback from inside the state."""
    run = make_run_dir(tmp_path, "run")
    path = save_checkpoint(run / "checkpoints", 3, state={"sampler": Sampler(8)})
    message = rf"cannot resume from .*checkpoint-3: sampler: .*size=8 but .* size=4 \(the run's settings are in {run / 'config.toml'}; pass it with --config\)"
    with pytest.raises(UserError, match=message):
        load_checkpoint(path, state={"sampler": Sampler(4)})


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="nothing to resume"):  # never a quiet fresh start
        resolve_resume("latest", tmp_path)
    run = make_run_dir(tmp_path, "exp")
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        resolve_resume("latest", tmp_path)
    for step in (2, 4):
        save_checkpoint(run / "checkpoints", step, state={})
    ckpt = run / "checkpoints" / "checkpoint-4"
    assert resolve_resume("latest", tmp_path) == ckpt
    assert resolve_resume(run, tmp_path) == ckpt
    assert resolve_resume(run / "checkpoints", tmp_path) == ckpt
    assert resolve_resume(run / "checkpoints" / "checkpoint-2", tmp_path).name == "checkpoint-2"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume(tmp_path / "nope", tmp_path)


# ---------------------------------------------------------------- with Accelerate (CPU)


def _accelerated(seed: int) -> tuple[Any, ...]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler, data = _build(seed)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, data


def test_resume_is_bit_identical_with_accelerator(tmp_path: Path) -> None:
    seed_everything(0)
    accelerator, model, optimizer, scheduler, data = _accelerated(0)
    for _ in range(6):
        _step(model, optimizer, scheduler, data, accelerator.backward)
    straight = _params(model)

    seed_everything(0)
    accelerator, model, optimizer, scheduler, data = _accelerated(0)
    for _ in range(3):
        _step(model, optimizer, scheduler, data, accelerator.backward)
    path = save_checkpoint(tmp_path, 3, state={"data": data, "tokens": 12},
                           accelerator=accelerator)
    assert (path / "model.safetensors").is_file()  # accelerate wrote the model itself

    seed_everything(77)
    accelerator, model, optimizer, scheduler, data = _accelerated(1)
    with pytest.raises(ValueError, match="saved with an accelerator"):
        load_checkpoint(path, state={"data": data})
    info = load_checkpoint(path, state={"data": data}, accelerator=accelerator)
    assert info == {"step": 3, "tokens": 12}
    for _ in range(3):
        _step(model, optimizer, scheduler, data, accelerator.backward)
    assert all(torch.equal(a, b) for a, b in zip(straight, _params(model), strict=True))


def test_accelerate_automatic_checkpoint_naming_is_refused(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        save_checkpoint(tmp_path / "ck", 1, state={}, accelerator=accelerator)
    assert not (tmp_path / "ck").exists()


def test_accelerator_for_coordination_only_writes_a_plain_checkpoint(tmp_path: Path) -> None:
    """`accelerator_state=False` (a LoRA-only trainer): no `save_state` (no model.safetensors),
    the main process's RNG in rng.pt, a `ProcessState` per process; loaded without the accelerator."""
    from accelerate import Accelerator

    from rl_core.train.process_state import ProcessState

    class PerProcess(ProcessState):
        def __init__(self, rank: int, value: int = 0) -> None:
            self.rank, self.value = rank, value

        def save(self, folder: Path) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{self.rank}.txt").write_text(str(self.value))

        def load(self, folder: Path) -> None:
            self.value = int((folder / f"rank{self.rank}.txt").read_text())

    seed_everything(0)
    model, _, _, data = _build(0)
    path = save_checkpoint(tmp_path, 1, state={"model": model, "data": data, "mine": PerProcess(0, 7)},
                           accelerator=Accelerator(cpu=True), accelerator_state=False)
    assert sorted(p.name for p in path.iterdir()) == ["data.pt", "meta.json", "mine", "model.pt", "rng.pt"]
    expected = torch.rand(3)  # the first draw after the save
    torch.rand(5)
    mine = PerProcess(0)
    info = load_checkpoint(path, state={"model": model, "data": data, "mine": mine})
    assert info == {"step": 1} and mine.value == 7
    assert torch.equal(torch.rand(3), expected)  # the RNG state came back
