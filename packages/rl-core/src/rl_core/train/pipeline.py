"""Asynchronous rollouts with bounded staleness (`train.max_staleness = N`, N >= 1).

With N = 0 the loop runs each step in series: rollout, reward, update. With N >= 1 a rollout
thread samples ahead while the trainer updates: the rollouts of step j come from the weights
after step `max(start, j - 1 - N)` (`version_for`), so the trainer of step j, which holds the
weights after step j - 1, trains on samples at most N steps old. The thread waits for those
weights; a rollout can never be older than the bound, so none is dropped. The schedule is
fixed, not "whatever weights are newest": two runs of the same config sample the same
rollouts from the same weights, and 2 processes still equal 1 process with twice the batch.

    step j:   trainer  ......[wait]  prepare j  reward j  update j -> publish(j)
              rollout thread:  load(j - N) sample j + N  |  load(j + 1 - N) sample j + N + 1 ...

The recipe gives the two halves of its rollout (`Recipe.sample` on the thread, `Recipe.prepare`
on the trainer) and a `WeightChannel` (the engine's weights by version: `publish(v)` on the
trainer after the update of step v, `load(v)` on the thread before it samples). The thread runs
no collective: everything across processes (gathers, reductions, a sharded policy's weight
gather) stays on the trainer's thread, in the same order on every process.

A checkpoint at step k first waits for the rollouts of steps k + 1 .. k + N (they need weights
up to k - 1, already published) and saves them (`PendingRollouts`, each process its own); the
rollout of step k + N + 1 needs the weights of step k, which the checkpoint holds. A resume
feeds the saved rollouts first and starts the thread at k + N + 1: the resumed run is the
uninterrupted one, bit for bit.

Choose N = 1 when rollout and update take about the same time (one-step off-policy: each
waits for the other least); larger N only helps when rollout times vary a lot from step to
step, and costs more off-policy error (correct it with `algo.rollout_correction`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rl_core.train.process_state import ProcessState

__all__ = ["CopyChannel", "PendingRollouts", "RolloutPipeline", "Sampled", "WeightChannel", "compile_across_threads",
           "copy_sharing_frozen", "version_for"]


@runtime_checkable
class WeightChannel(Protocol):
    """The rollout engine's weights by version, for an asynchronous run (see the module doc).

    `publish(version)` runs on the trainer's thread after the update of step `version` (and
    once at the start with the starting step): keep a copy of the trained weights under that
    number. `load(version, prune=True)` runs on the rollout thread before it samples (and on
    the trainer's, with the thread paused, before an evaluation): put that copy into the
    engine; `prune` drops the copies older than `version` (never needed again). `close()`
    releases the copies."""

    def publish(self, version: int) -> None: ...

    def load(self, version: int, *, prune: bool = True) -> None: ...

    def close(self) -> None: ...


class CopyChannel:
    """A `WeightChannel` between the trained module and a copy of it that the rollout samples
    with (the same parameter names): `publish` keeps a copy of the trainable parameters on
    `store` (default: where each parameter is; N + 1 copies live at most, for N =
    max_staleness; pass "cpu" where device memory is short), `load` copies one into `rollout`. Frozen parameters (a LoRA's base) are shared, never copied: build
    `rollout` with `copy_sharing_frozen`.

    A sharded `trained` (FSDP2: DTensor parameters) publishes whole weights: each trainable
    parameter all-gathered (`full_tensor`, a collective: every process publishes each version,
    as the loop does) into the rollout copy's dtype (bf16 rollout weights from fp32 master
    weights); `rollout` is then a whole copy of its own (`rl_policy.engine` builds it from
    `FullWeights`)."""

    def __init__(self, trained: torch.nn.Module, rollout: torch.nn.Module, *,
                 store: str | torch.device | None = None) -> None:
        self.trained, self.rollout = trained, rollout
        self.store = torch.device(store) if store is not None else None
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: int | None = None
        self._lock = threading.Lock()
        self._dtypes = {name: p.dtype for name, p in rollout.named_parameters()}

    def publish(self, version: int) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            copy = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(  # [*shape] whole
                        self.store or p.device, self._dtypes[name], copy=True)
                    for name, p in self.trained.named_parameters() if p.requires_grad}
        finish_copies(copy.values())
        with self._lock:
            self.versions[version] = copy

    def load(self, version: int, *, prune: bool = True) -> None:
        with self._lock:
            if version not in self.versions:
                raise KeyError(f"weights of step {version} were not published (held: {sorted(self.versions)})")
            copy = self.versions[version]
            if prune:
                self.versions = {v: w for v, w in self.versions.items() if v >= version}
        targets = dict(self.rollout.named_parameters())
        with torch.no_grad():
            for name, tensor in copy.items():
                targets[name].copy_(tensor, non_blocking=False)
        self.loaded = version

    def close(self) -> None:
        with self._lock:
            self.versions.clear()


def finish_copies(tensors: Any) -> None:
    """Wait for the copies just made on this thread's CUDA streams: the rollout thread reads them
    on a stream of its own, which would not wait for them."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def copy_sharing_frozen(module: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
    """A deep copy of `module` in eval mode whose frozen parameters are the original's (shared
    memory) and whose trainable ones are its own: the rollout's copy for a `CopyChannel`. With a
    `device` other than the module's (a rollout GPU of its own), everything is copied there."""
    import copy

    here = next(module.parameters()).device
    if device is not None and torch.device(device) != here:
        twin = copy.deepcopy(module).to(device)  # nothing shared: the frozen weights must live there too
    else:
        shared = {id(p): p for p in module.parameters() if not p.requires_grad}
        twin = copy.deepcopy(module, memo=dict(shared))
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin.eval()


def compile_across_threads() -> Any:
    """torch._dynamo settings for two threads that both run `torch.compile`d code (a context
    manager). A trace marks the whole process as "FX tracing" (`torch.fx._symbolic_trace`'s
    flag is a module global), and a compiled function called on the other thread meanwhile would
    raise or, with `error_on_nested_fx_trace` off, run its uncompiled code: for flex attention
    (vLLM's kernel for small heads) that materialises the whole score matrix, tens of GiB. With
    `force_compile_during_fx_trace` the call takes its compiled code (or compiles, which dynamo's
    compile lock serialises with the other thread's trace)."""
    import torch._dynamo

    return torch._dynamo.config.patch(error_on_nested_fx_trace=False, force_compile_during_fx_trace=True)


def version_for(step: int, start: int, max_staleness: int) -> int:
    """The step whose weights sample the rollouts of `step` (`start`: the step the run began
    or resumed at, whose weights are the first published)."""
    return max(start, step - 1 - max_staleness)


@dataclass(frozen=True)
class Sampled:
    """One step's rollouts from the thread: what `Recipe.sample` returned, the version that
    sampled it, and the thread's own phase times (`time/rollout` and what the recipe timed)."""

    step: int
    version: int
    value: Any
    times: dict[str, float] = field(default_factory=dict)


class PendingRollouts(ProcessState):
    """The rollouts sampled for steps after a checkpoint (each process its own `rank<r>.pt`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.items: list[Sampled] = []

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"world_size": self.world_size, "items": self.items}, folder / f"rank{self.rank}.pt")

    def load(self, folder: Path) -> None:
        from rl_core.errors import UserError

        path = folder / f"rank{self.rank}.pt"
        if not path.is_file():
            raise UserError(f"cannot resume from {folder.parent}: it holds no rollouts in flight for process "
                            f"{self.rank}; resume an asynchronous run (train.max_staleness >= 1) with as many "
                            "processes as it ran with")
        # our own file, written by save() above: the recipe's rollout objects need pickle
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved["world_size"] != self.world_size:
            raise UserError(f"cannot resume from {folder.parent}: it ran asynchronously on {saved['world_size']} "
                            f"processes, this run has {self.world_size}; resume with the same number")
        self.items = list(saved["items"])


class RolloutPipeline:
    """The rollout thread of an asynchronous run (see the module doc).

    `sample(step)` is the recipe's `sample` hook; `channel` its `WeightChannel`. The thread
    samples steps `start + 1 + len(pending) .. total`; `pending` are rollouts restored from a
    checkpoint. `timer` is the run's `PhaseTimer`: the thread's phases are popped per sample."""

    def __init__(self, sample: Callable[[int], Any], channel: WeightChannel, *, start: int, total: int,
                 max_staleness: int, pending: list[Sampled], timer: Any = None,
                 device: torch.device | None = None) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for a rollout thread, got {max_staleness}")
        self.sample, self.channel, self.timer, self.device = sample, channel, timer, device
        self.start, self.total, self.max_staleness = start, total, max_staleness
        self._ready: dict[int, Sampled] = {p.step: p for p in pending}
        self._first = start + 1 + len(pending)
        self._published = -1
        self._cond = threading.Condition()
        self._busy = threading.Lock()  # held while the thread loads weights and samples; `paused` takes it
        self._error: BaseException | None = None
        self._stop = False
        self._warm = False  # set by `warmed` after the trainer's first update
        self._compile_config: Any = None  # `compile_across_threads`, from begin to close
        self._thread = threading.Thread(target=self._work, name="rollout", daemon=True)

    def begin(self) -> None:
        """Publish the starting weights and start the thread."""
        self._compile_config = compile_across_threads()
        self._compile_config.__enter__()
        self.publish(self.start)
        self._thread.start()

    def publish(self, version: int) -> None:
        """After the update of step `version` (trainer thread): the thread may use its weights."""
        self.channel.publish(version)
        with self._cond:
            self._published = max(self._published, version)
            self._cond.notify_all()

    def warmed(self) -> None:
        """The trainer's first update is done (its kernels compiled): the thread may sample on."""
        with self._cond:
            self._warm = True
            self._cond.notify_all()

    def get(self, step: int) -> Sampled:
        """The rollouts of `step`, waiting for the thread (an error on the thread is raised here)."""
        with self._cond:
            while step not in self._ready:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout thread ended without the rollouts of step {step}")
                self._cond.wait(timeout=1.0)
            return self._ready.pop(step)

    def pending(self, after: int) -> list[Sampled]:
        """Wait for the rollouts of steps `after + 1 .. after + N` (those the thread can sample
        before the weights of step `after` are published) and return them, kept for `get`."""
        last = min(after + self.max_staleness, self.total)
        with self._cond:
            while not all(s in self._ready for s in range(after + 1, last + 1)):
                self._raise_if_failed()
                self._cond.wait(timeout=1.0)
            return [self._ready[s] for s in range(after + 1, last + 1)]

    def fresh(self, step: int, sample: Callable[[int], Any]) -> Sampled:
        """One more rollout round of `step` (dynamic sampling), sampled on the trainer's thread
        from the trainer's weights, those after step `step - 1` (staleness 0). It first waits
        for the thread's rollouts of steps `step + 1 .. step + N` (those it may sample before
        the weights of `step` are out): the recipe's sampler then draws the round's prompts at a
        fixed place in its sequence, after those steps' and before step `step + N + 1`'s,
        whatever the timing, so the run stays reproducible and a resume exact."""
        with self._cond:
            self._warm = True  # the trainer waits for this round: no first update to keep apart from
            self._cond.notify_all()
        self.pending(step)
        with self.paused():
            self.channel.load(step - 1, prune=False)
            value = sample(step)
        return Sampled(step, step - 1, value)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The thread neither loads weights nor samples inside the block (an evaluation uses
        the engine)."""
        with self._busy:
            yield

    def close(self) -> None:
        """Stop the thread after its current sample and release the weight copies."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self.channel.close()
        if self._compile_config is not None:
            self._compile_config.__exit__(None, None, None)
            self._compile_config = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout thread failed: {self._error!r}") from self._error

    def _work(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device is not None and self.device.type == "cuda" else None
        try:
            for step in range(self._first, self.total + 1):
                version = version_for(step, self.start, self.max_staleness)
                with self._cond:
                    # the first update compiles the trainer's kernels as the first sample compiled
                    # the engine's: the second sample waits for it (the same weights either way)
                    while (self._published < version or (step > self._first and not self._warm)) and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                with self._busy:
                    began = time.perf_counter()
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            value = self._sample(step, version)
                        stream.synchronize()
                    else:
                        value = self._sample(step, version)
                    times = self.timer.pop() if self.timer is not None else {}
                    times["time/rollout"] = time.perf_counter() - began
                with self._cond:
                    self._ready[step] = Sampled(step, version, value, times)
                    self._cond.notify_all()
        except BaseException as e:  # handed to the trainer's thread by get/pending
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _sample(self, step: int, version: int) -> Any:
        self.channel.load(version)
        return self.sample(step)
