"""Moving models on and off the accelerator cheaply, and deciding when not to.

VeRL-with-RMs keeps one model on the GPU at a time: the policy sleeps while each judge wakes,
scores and sleeps again. `HFEngine.sleep()` does `model.to("cpu")`: a synchronous copy into
freshly allocated pageable memory per tensor, which on an H200 took 2-5 s for the Qwen3-1.7B
policy and its Adam moments (a third of the step). Here the copies go through **page-locked
host buffers allocated once and reused** (`PinnedOffload`, `OptimizerOffload`): all copies of a
model are queued `non_blocking` and synchronised once, at full PCIe bandwidth
(`rl_core.train.offload`). The engine's own
`sleep()`/`wake()` still run afterwards/before (dropping the KV cache, emptying the allocator,
flipping the engine state) but find the weights already where they should be, so they move
nothing. On CPU nothing moves at all.

`compute_swap_plan` picks, from one measured step, whether swapping is needed at all
(`reward.swap = "auto"`): the fastest plan whose measured memory fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rl_core.train import OptimizerOffload, PhaseTimer, PinnedOffload
from rl_rollout.policy import PolicyEngine

__all__ = ["PLANS", "OptimizerOffload", "PinnedOffload", "PolicySwap", "SwapPlan", "compute_swap_plan", "initial_plan"]

PlanName = Literal["always", "judges", "never"]


@dataclass(frozen=True)
class SwapPlan:
    """Who leaves the accelerator while others work. `always`: the policy (weights + optimizer
    state) sleeps while judges score and each judge sleeps after scoring (one model resident);
    `judges`: the policy stays, judges still take turns; `never`: everything stays resident."""

    name: PlanName
    offload_policy: bool
    sleep_judges: bool


PLANS: dict[PlanName, SwapPlan] = {
    "always": SwapPlan("always", offload_policy=True, sleep_judges=True),
    "judges": SwapPlan("judges", offload_policy=False, sleep_judges=True),
    "never": SwapPlan("never", offload_policy=False, sleep_judges=False),
}


def initial_plan(mode: Literal["auto", "always", "never"]) -> SwapPlan:
    """The plan a run starts with: `auto` runs as `always` until a step has been measured."""
    return PLANS["always" if mode == "auto" else mode]


def compute_swap_plan(policy_peak: float, policy_resident: float, judge_weights: Sequence[float],
                      judge_peaks: Sequence[float], capacity: float) -> PlanName:
    """The fastest plan whose memory fits in `capacity` (all in the same unit, e.g. GiB).

    Measured on a step run with `always` (so each phase saw only its own model):
    - `policy_peak`: the largest peak of the policy's phases (rollout with its log-probs, update), judges asleep;
    - `policy_resident`: what the policy keeps on the accelerator between its phases (weights
      and optimizer state; gradients are freed after each update);
    - `judge_weights[j]`: judge j's weights; `judge_peaks[j]`: the peak while judge j scored,
      the policy asleep (its weights + KV cache + activations + whatever else was resident).

    `never` needs the policy's peak plus every judge's weights, and each judge's scoring peak
    plus the policy and the other judges' weights; `judges` needs each judge's scoring peak
    plus the resident policy. Example: capacity 80, policy peak 30 (resident 20), judges of 10
    and 10 weights scoring at peak 25 each: never = max(30 + 20, 25 + 20 + 10) = 55 -> "never".
    """
    if len(judge_weights) != len(judge_peaks):
        raise ValueError(f"{len(judge_weights)} judge weights but {len(judge_peaks)} judge peaks")
    if not judge_peaks:
        return "never"  # nothing to swap in: keeping the policy resident costs nothing
    total = sum(judge_weights)
    never = max(policy_peak + total,
                *(peak + policy_resident + total - w for w, peak in zip(judge_weights, judge_peaks, strict=True)))
    if never <= capacity:
        return "never"
    if max(judge_peaks) + policy_resident <= capacity:
        return "judges"
    return "always"


class PolicySwap:
    """The policy's weights and optimizer state, put to sleep before the judges score and woken
    after, as the current plan says.

    mode "always"/"never" fix the plan; "auto" starts as "always" and `decide()` switches to the
    fastest plan that fits once a step has measured every in-process judge (CUDA only).

    What sleeps depends on the policy's engine. One that decodes with the training model itself
    (`PolicyEngine.shares_weights`, the `hf` engine) sleeps with the swap (its KV cache freed)
    while the swap moves that model's weights (pinned host buffers). A vLLM engine is not the
    swap's to move: it sleeps after every generation whatever the plan (its weights to host
    memory, KV cache freed), so what the policy still holds on the GPU is the training model and
    the optimizer state, which `offload_policy` moves, as for `hf`: with `always` a judge scores
    with nothing of the policy on the GPU. `auto` keeps `always` with a vLLM engine or any judge
    whose memory cannot be measured (`measurable=False`): vLLM maps and unmaps its memory itself,
    outside the torch allocator statistics the plan is computed from.
    """

    def __init__(self, engine: PolicyEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, *, mode: Literal["auto", "always", "never"], offload_optimizer: bool,
                 memory_fraction: float, measurable: bool) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.engine = engine if engine.shares_weights else None
        self.weights = PinnedOffload(model, self.device) if self.device.type != "cpu" else None
        self.optimizer = OptimizerOffload(optimizer, self.device) if offload_optimizer and cuda else None
        self.pending = mode == "auto" and cuda and engine.shares_weights and measurable
        self.plan = initial_plan(mode)
        self.memory_fraction = memory_fraction

    def offload(self) -> None:
        if not self.plan.offload_policy:
            return
        if self.weights is not None:
            self.weights.to_host()
        if self.engine is not None:
            self.engine.sleep()
        if self.optimizer is not None:
            self.optimizer.to_host()

    def wake(self) -> None:
        if not self.plan.offload_policy:
            return
        if self.weights is not None:
            self.weights.to_device()
        if self.engine is not None:
            self.engine.wake()
        if self.optimizer is not None:
            self.optimizer.to_device()

    def resident_gib(self) -> float:
        """Policy weights + optimizer state, which stay on the GPU unless offloaded."""
        weights = self.weights.nbytes if self.weights is not None else 0
        optimizer = self.optimizer.nbytes if self.optimizer is not None else 0
        return (weights + optimizer) / 2**30

    def decide(self, timer: PhaseTimer, judges: Mapping[str, float]) -> SwapPlan | None:
        """`auto`: the plan for the next steps from this step's measured peaks (run as `always`):
        `rollout` and `update_actor` for the policy, `judge_<name>_score` for each judge in
        `judges` (name -> weights GiB of each in-process judge). None while a judge has not
        scored yet (its peak is unknown) or when the plan is fixed."""
        if not self.pending:
            return None
        peaks = [timer.peak_gib(f"judge_{name}_score") for name in judges]
        if any(p is None for p in peaks):
            return None
        # step 1 generates before Adam's state exists; later steps generate with it resident
        optimizer = self.optimizer.nbytes / 2**30 if self.optimizer is not None else 0.0
        policy_peak = max((timer.peak_gib("rollout") or 0.0) + optimizer, timer.peak_gib("update_actor") or 0.0)
        capacity = torch.cuda.get_device_properties(self.device).total_memory / 2**30 * self.memory_fraction
        name = compute_swap_plan(policy_peak, self.resident_gib(), list(judges.values()),
                                 [float(p) for p in peaks if p is not None], capacity)
        self.pending, self.plan = False, PLANS[name]
        return self.plan
