"""Atomic checkpoints with exact resume.

`save_checkpoint` writes everything into a hidden sibling `.tmp-checkpoint-<step>/`, fsyncs it
and renames it to `checkpoint-<step>/` in one `os.replace`; a crash at any point leaves either
the complete new checkpoint or none, and the previous checkpoint untouched. A checkpoint holds:

- every object in `state` with `state_dict()`/`load_state_dict()` (model, optimizer, scheduler,
  data sampler, ...) as `<name>.pt`; every other value of `state` (JSON-able: ints, floats,
  strings, lists, dicts) in `meta.json`, returned by `load_checkpoint` along with `step`;
- the RNG states (python, numpy, torch CPU, every CUDA device) in `rng.pt`;
- with an `accelerate.Accelerator`: `accelerator.save_state` output instead of `rng.pt`, which
  holds the prepared models/optimizers/schedulers/dataloaders (FSDP/DeepSpeed-aware) and the
  RNG state of every process. Then put only objects that were NOT passed to
  `accelerator.prepare` (a sampler, an EMA, ...) into `state`; they are saved by the main process.

A `rl_core.train.ProcessState` value is saved by every process into `<name>/`: a sharded
policy and its optimizer (`ShardedState`, through `torch.distributed.checkpoint`, each rank its
own shards), an asynchronous run's rollouts in flight (each rank its own).

Without an accelerator a single process is assumed. `accelerator_state=False` keeps the
accelerator for coordinating the processes only: the main process writes `state` and its own
RNG states (`rng.pt`) as a single process would, every process its `ProcessState` values (a
LoRA-only trainer whose frozen base `save_state` would copy; an asynchronous run of it keeps
each process's rollouts in flight); load such a checkpoint without the accelerator.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

from rl_core.errors import UserError
from rl_core.train.process_state import ProcessState
from rl_core.train.rundir import checkpoints, latest_checkpoint, resolve_resume
from rl_core.train.seeding import get_rng_state, set_rng_state

__all__ = ["Stateful", "latest_checkpoint", "load_checkpoint", "resolve_resume", "save_checkpoint"]


@runtime_checkable
class Stateful(Protocol):
    """Anything checkpointable through `state_dict()` / `load_state_dict(sd)`."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> Any: ...


def _barrier(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _fsync_tree(path: Path) -> None:
    """Flush every file and directory under `path` to disk, so a rename never publishes a
    checkpoint whose bytes are still only in the page cache (matters on power loss)."""
    for dirpath, _, filenames in os.walk(path):
        for name in [*filenames, "."]:
            _fsync(os.path.join(dirpath, name))


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing an existing `final` of the same step."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(final.parent)


def _prune(root: Path, keep_last: int) -> None:
    for _, path in checkpoints(root)[:-keep_last]:
        trash = path.with_name(f".trash-{path.name}")
        os.replace(path, trash)  # gone from latest_checkpoint's view before the slow delete
        shutil.rmtree(trash)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    state: Mapping[str, Any],
    accelerator: Any = None,
    keep_last: int | None = None,
    write_files: Callable[[Path], object] | None = None,
    accelerator_state: bool = True,
) -> Path:
    """Atomically write `root/checkpoint-<step>` and return its path (see the module doc).

    `state` maps names to `Stateful` objects or JSON-able values (the key `step` is reserved).
    `write_files(folder)` (main process) writes more files into the checkpoint before it is
    published (an exported adapter, say), so "latest" never names a checkpoint without them.
    `keep_last=N` deletes all but the newest N checkpoints afterwards. With an accelerator, call
    it on every process; `accelerator_state=False`: without `accelerator.save_state` (module doc).
    """
    if "step" in state:
        raise ValueError("state key 'step' is reserved: the step is the `step` argument")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    own_state = accelerator is not None and accelerator_state  # accelerator.save_state writes the RNG states
    if own_state and accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("save_checkpoint names checkpoints itself: create the Accelerator "
                         "without ProjectConfiguration(automatic_checkpoint_naming=True)")
    sharded = {k: v for k, v in state.items() if isinstance(v, ProcessState)}
    stateful = {k: v for k, v in state.items() if isinstance(v, Stateful)}
    extras = {k: v for k, v in state.items() if k not in stateful and k not in sharded}
    try:
        meta = msgspec.json.encode({"step": step, "format": _format(accelerator if own_state else None),
                                    "stateful": sorted(stateful),
                                    "sharded": sorted(sharded), "extras": extras})
    except TypeError as e:
        raise TypeError(f"checkpoint state values must be Stateful or JSON-able: {e}") from e
    root = Path(root)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    main = accelerator is None or accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-checkpoint-*"):  # from a save that crashed
            shutil.rmtree(leftover)
        tmp.mkdir()
    _barrier(accelerator)
    if own_state:
        accelerator.save_state(str(tmp))
    elif main:
        torch.save(get_rng_state(), tmp / "rng.pt")
    for name, parts in sharded.items():
        parts.save(tmp / name)
    if main:
        for name, obj in stateful.items():
            torch.save(obj.state_dict(), tmp / f"{name}.pt")
        if write_files is not None:
            write_files(tmp)
        (tmp / "meta.json").write_bytes(meta)  # last: its presence marks a complete checkpoint
    _barrier(accelerator)
    if main:
        _fsync_tree(tmp)
        _publish(tmp, final)
        if keep_last is not None:
            _prune(root, keep_last)
    _barrier(accelerator)
    return final


def _format(accelerator: Any) -> str:
    return "torch" if accelerator is None else "accelerate"


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    state: Mapping[str, Any] | None = None,
    accelerator: Any = None,
) -> dict[str, Any]:
    """Restore a checkpoint in place and return `{"step": ..., **json_extras}`.

    Every `Stateful` object in `state` is loaded from the file of the same name (pass the same
    mapping you saved with; its JSON values are ignored). RNG states are restored too, so the
    run continues bit-identically. Call it on every process when using an accelerator.
    """
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
    meta = msgspec.json.decode((path / "meta.json").read_bytes())
    if meta["format"] != _format(accelerator):
        raise ValueError(f"{path} was saved {'with' if meta['format'] == 'accelerate' else 'without'}"
                         " an accelerator; load it the same way")
    wanted = {k: v for k, v in (state or {}).items() if isinstance(v, Stateful)}
    shards = {k: v for k, v in (state or {}).items() if isinstance(v, ProcessState)}
    held = [*meta["stateful"], *meta.get("sharded", [])]
    missing = sorted(set(wanted) - set(meta["stateful"]) | set(shards) - set(meta.get("sharded", [])))
    if missing:
        raise KeyError(f"{path} has no state for {missing}; it holds {held}")
    if accelerator is not None:
        accelerator.load_state(str(path))
    for name, parts in shards.items():
        parts.load(path / name)
    for name, obj in wanted.items():
        try:
            obj.load_state_dict(torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True))
        except ValueError as e:  # a state saved with other settings (a sampler's n, batch size, ...)
            raise UserError(f"cannot resume from {path}: {name}: {e} (the run's settings are in "
                            f"{path.parent.parent / 'config.toml'}; pass it with --config)") from e
    if accelerator is None:
        set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return {"step": meta["step"], **meta["extras"]}
