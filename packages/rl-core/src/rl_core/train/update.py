"""The accumulated policy update every app runs: one optimizer step over micro-batches.

`optimizer_step` is the one place where
- the loss denominator is the valid-unit count (tokens or sequences) of the whole optimizer
  step on every process, so splitting a batch into micro-batches or over processes does not
  change the update (the loss of a micro-batch is `sum over its units / global count`);
- the loss is multiplied by the process count, because DDP averages gradients;
- every process runs the same number of forward/backward passes (a process with fewer
  micro-batches repeats one with weight 0), so DDP/FSDP collectives always pair up;
- a non-finite loss or gradient norm skips the optimizer step (weights, optimizer state and
  whatever `on_step` updates, such as an EMA, untouched) and is counted by `NonFiniteGuard`,
  which stops the run after `max_consecutive` skips in a row.

    guard = NonFiniteGuard(max_consecutive=3)
    for part in minibatches:
        out = optimizer_step(acc, model, optimizer, part, loss_fn, units=count_tokens,
                             grad_clip=1.0, guard=guard, scheduler=scheduler)

`loss_fn(micro, num_valid)` returns `(loss, metrics)`: the loss already divided by
`num_valid` (pass it to `rl_core.losses.aggregate`/`compute_policy_loss`), and metrics that
are means over the micro-batch's units (they are weighted by `units(micro)` here); keys starting
with `loss/` are sums over micro-batches instead, keys ending in `_max`/`_min` reduce by max/min.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "NonFiniteError",
    "NonFiniteGuard",
    "ReplayCheck",
    "StepStats",
    "UpdateStats",
    "check_finite_parameters",
    "optimizer_step",
]

M = TypeVar("M")


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps, or non-finite weights about to be saved."""


class NonFiniteGuard:
    """Counts skipped optimizer steps; `max_consecutive` skips in a row stop the run.

    A single NaN/inf gradient (a rare overflow, one poisoned batch) is survivable: the step is
    skipped and the run goes on. Several in a row mean the run is broken (a NaN temperature, a
    diverged model): stopping with a clear error beats training on garbage or checkpointing it.
    """

    def __init__(self, max_consecutive: int = 3) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0
        self._after_step: list[Callable[[], None]] = []

    def after_step(self, callback: Callable[[], None]) -> None:
        """Run `callback` after every optimizer step taken (every step goes through `record`):
        the trainer loop counts the policy's steps with it (`PolicyWeights.stepped`)."""
        self._after_step.append(callback)

    def record(self, finite: bool, detail: str) -> None:
        """Note one optimizer step, after it (a finite one: the weights changed); raises
        `NonFiniteError` at the limit."""
        if finite:
            self.consecutive = 0
            for callback in self._after_step:
                callback()
            return
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(f"{self.consecutive} optimizer steps in a row had a non-finite loss or gradient "
                                 f"({detail}); stopping before training on or saving garbage. Check the data, the "
                                 "rewards and the learning rate (train.max_nonfinite_steps sets the limit)")


def check_finite_parameters(model: torch.nn.Module, what: str) -> None:
    """Raise `NonFiniteError` if any trainable parameter of `model` holds NaN/inf (before a
    checkpoint or an export, which must never hold non-finite weights). A sharded parameter is
    checked on each process's own shard (the process that holds the NaN raises)."""
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if p.requires_grad and not bool(torch.isfinite(local.detach()).all()):
            raise NonFiniteError(f"parameter {name} is not finite: {what} refused")


@dataclass
class UpdateStats:
    """Metric sums over the micro-batches of this process (see the module doc for the rules)."""

    weighted: dict[str, float] = field(default_factory=dict)  # sum of metric * units
    units: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)  # loss/* keys
    extremes: dict[str, float] = field(default_factory=dict)  # *_max / *_min keys
    grad_norms: list[float] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0

    def add(self, metrics: dict[str, float], units: float) -> None:
        for key, value in metrics.items():
            if key.startswith("loss/"):
                self.sums[key] = self.sums.get(key, 0.0) + value
            elif key.endswith(("_max", "_min")):
                pick = max if key.endswith("_max") else min
                self.extremes[key] = pick(self.extremes.get(key, value), value)
            else:
                self.weighted[key] = self.weighted.get(key, 0.0) + value * units
        self.units += units

    def reduce(self, accelerator: Any = None) -> dict[str, float]:
        """Means over every process: token-weighted metrics, loss per optimizer step, grad norm
        per stepped optimizer step, and the count of skipped steps."""
        keys = sorted(self.weighted)
        loss_keys = sorted(self.sums)
        local = [*(self.weighted[k] for k in keys), *(self.sums[k] for k in loss_keys), self.units]
        total = _reduce(accelerator, local, "sum")
        units = max(total[-1], 1e-12)
        out = {k: v / units for k, v in zip(keys, total[: len(keys)], strict=True)}
        steps = max(self.steps + self.skipped, 1)
        out.update({k: v / steps for k, v in zip(loss_keys, total[len(keys) : -1], strict=True)})
        for key in sorted(self.extremes):
            out[key] = _reduce(accelerator, [self.extremes[key]], "max" if key.endswith("_max") else "min")[0]
        finite = [g for g in self.grad_norms if math.isfinite(g)]
        out["grad_norm"] = sum(finite) / len(finite) if finite else math.nan
        out["optimizer_steps"] = float(self.steps)
        out["nonfinite/skipped_steps"] = float(self.skipped)
        return out


def _reduce(accelerator: Any, values: list[float], op: str) -> list[float]:
    if accelerator is None or accelerator.num_processes == 1:
        return values
    if op == "min":
        return [-v for v in _reduce(accelerator, [-v for v in values], "max")]
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(tensor, reduction=op).tolist()


@dataclass(frozen=True)
class StepStats:
    stepped: bool  # False: skipped for a non-finite loss or gradient norm
    grad_norm: float


def optimizer_step(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[M],
    loss_fn: Callable[[M, torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    *,
    units: Callable[[M], float],
    grad_clip: float | None,
    guard: NonFiniteGuard,
    stats: UpdateStats,
    scheduler: Any = None,
    before_step: Callable[[], None] | None = None,
    filler: M | None = None,
) -> StepStats:
    """Accumulate gradients over `micro_batches` (this process's share of one optimizer step)
    and step once; see the module doc. `units(micro)` counts the micro-batch's valid loss units
    (tokens for token-mean, sequences otherwise) before its forward. `before_step` runs after
    the last backward and before the weights change (the first-replay check goes there).
    `filler` is run with weight 0 by a process that has no micro-batch at all this step (its
    collectives must still pair up with the other processes')."""
    device = accelerator.device
    local = float(sum(units(m) for m in micro_batches))
    num_valid = accelerator.reduce(torch.tensor(local, device=device), reduction="sum").clamp(min=1)
    count = int(accelerator.reduce(torch.tensor(len(micro_batches), device=device), reduction="max"))
    world = accelerator.num_processes
    loss_total = torch.zeros((), device=device)
    for j in range(count):
        real = j < len(micro_batches)
        micro = micro_batches[j] if real else micro_batches[0] if micro_batches else filler
        if micro is None:
            raise ValueError("a process has no micro-batch for this optimizer step: pass `filler` (a micro-batch "
                             "it runs with weight 0 so the collectives pair up)")
        sync = nullcontext() if j == count - 1 else accelerator.no_sync(model)
        with sync:
            loss, metrics = loss_fn(micro, num_valid)
            accelerator.backward(loss * (world * (1.0 if real else 0.0)))
        if real:
            loss_total += loss.detach()
            stats.add(metrics, units(micro))
    finite_loss = bool(torch.isfinite(accelerator.reduce(loss_total, reduction="sum")))
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip else math.inf)
    grad_norm = float(grad_norm)
    finite = finite_loss and math.isfinite(grad_norm)
    stats.grad_norms.append(grad_norm)
    if finite:
        if before_step is not None:
            before_step()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        stats.steps += 1
    else:
        stats.skipped += 1
    optimizer.zero_grad(set_to_none=True)
    guard.record(finite, f"loss finite: {finite_loss}, grad norm {grad_norm}")
    return StepStats(finite, grad_norm)


class ReplayCheck:
    """|engine log-prob - trainer log-prob| over trained units, reduced over processes.

    On the first replay of a run (or of a rollout batch, for off-policy-free samplers such as
    diffusion), the policy has not changed since sampling, so the importance ratio must be 1:
    a mean difference above `tolerance` means the rollout engine and the trainer compute
    different distributions (other prompts, media, weights, dtype or step function)."""

    def __init__(self) -> None:
        self.total, self.count, self.max, self.kl = 0.0, 0, 0.0, 0.0

    def add(self, trainer: torch.Tensor, engine: torch.Tensor) -> None:
        """Same-shape log-probs of the trained units (padding already removed)."""
        signed = trainer.detach().float().cpu() - engine.detach().float().cpu()  # [N] log(trainer / engine)
        self.kl += float((torch.expm1(signed) - signed).sum())  # k3 of KL(engine || trainer), on engine samples
        d = signed.abs()  # [N]
        self.total += float(d.sum())
        self.count += d.numel()
        self.max = max(self.max, float(d.max())) if d.numel() else self.max

    def reduce(self, accelerator: Any = None) -> tuple[float, float]:
        """(mean, max) over every process."""
        total, count = _reduce(accelerator, [self.total, float(self.count)], "sum")
        return total / max(count, 1.0), _reduce(accelerator, [self.max], "max")[0]

    def kl_mean(self, accelerator: Any = None) -> float:
        """The k3 KL(engine || trainer) per unit over every process."""
        kl, count = _reduce(accelerator, [self.kl, float(self.count)], "sum")
        return kl / max(count, 1.0)

    def verify(self, accelerator: Any, tolerance: float, what: str) -> dict[str, float]:
        """Raise when the mean difference exceeds `tolerance`; returns the metrics."""
        mean, peak = self.reduce(accelerator)
        kl = self.kl_mean(accelerator)
        if not mean <= tolerance:
            raise RuntimeError(f"{what}: mean |engine logp - trainer logp| = {mean:.3g} > tolerance {tolerance} "
                               f"(max {peak:.3g}): the rollout engine and the training model disagree (prompts, "
                               "media, weights, dtype or step function differ)")
        return {"replay/engine_diff_mean": mean, "replay/engine_diff_max": peak, "replay/engine_kl": kl}
