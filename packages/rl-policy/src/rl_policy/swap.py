"""Moving the policy on and off the accelerator while other models on it (reward judges) score,
and deciding when not to (rider-grm's `reward.swap`).

VeRL-with-RMs keeps one model on the GPU at a time. The copies go through page-locked host buffers
allocated once and reused (`rl_core.train.offload`, far cheaper than `model.to("cpu")`); the
engines' own sleep/wake then find the weights moved. `compute_swap_plan` decides from one
measured step whether to swap at all (`auto`). Choose it when a policy and in-process judges
share one GPU; judges served elsewhere need none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from rl_core.train import OptimizerOffload, PhaseTimer, PinnedOffload
from rl_policy.engine import PolicyEngine

__all__ = ["PLANS", "Judge", "PolicySwap", "SwapPlan", "compute_swap_plan", "initial_plan"]

PlanName = Literal["always", "judges", "never"]


class Judge(Protocol):
    """A model that takes turns with the policy: its `name` (its scoring is timed as the phase
    `judge_<name>_score`), its weights' offloader (None: not in this process, nothing to
    measure) and whether it sleeps after scoring (`swap`, set by the plan)."""

    name: str
    offload: PinnedOffload | None
    swap: bool


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

    Measured on a step run with `always` (so each phase saw only its own model): `policy_peak`,
    the largest peak of the policy's phases (rollout with its log-probs, update); `policy_resident`,
    what it keeps between them (weights, optimizer state); `judge_weights[j]`, and `judge_peaks[j]`
    the peak while judge j scored, the policy asleep. `never` needs the policy's peak plus every
    judge's weights, and each judge's scoring peak plus the policy and the other judges' weights;
    `judges` each judge's scoring peak plus the resident policy. Example: capacity 80, policy peak
    30 (resident 20), judges of 10 and 10 scoring at 25 each: never = max(30 + 20, 25 + 20 + 10) = 55.
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
    after, as the plan says (mode "always"/"never": fixed; "auto": `always` until `decide()`).

    An engine that decodes with the training model itself (`PolicyEngine.shares_weights`: `hf`)
    sleeps with it (KV cache freed). A vLLM engine sleeps after every generation whatever the
    plan; the swap then moves the training model and the optimizer state, so with `always` a
    judge scores with nothing of the policy on the GPU. `auto` keeps `always` with a vLLM engine
    or a judge whose memory cannot be measured (`measurable=False`): vLLM maps its memory itself,
    outside the allocator statistics the plan is computed from."""

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
        self.offloaded = False  # between `offload` and `wake`

    def keep_resident(self, judges: Sequence[Judge]) -> None:
        """Never swap from now on (`never`): asynchronous rollouts sample while the judges score."""
        self.plan, self.pending = PLANS["never"], False
        for judge in judges:
            judge.swap = self.plan.sleep_judges

    def offload(self, timer: PhaseTimer) -> None:
        if not self.plan.offload_policy or self.offloaded:
            return
        self.offloaded = True
        with timer("offload_policy"):
            if self.weights is not None:
                self.weights.to_host()
            if self.engine is not None:
                self.engine.sleep()
            if self.optimizer is not None:
                self.optimizer.to_host()

    def wake(self, timer: PhaseTimer) -> None:
        """Back on the device after `offload` (nothing to do otherwise: a second call, or a
        dynamic-sampling round that rolls out again before the update)."""
        if not self.offloaded:
            return
        self.offloaded = False
        with timer("wake_policy"):
            if self.weights is not None:
                self.weights.to_device()
            if self.engine is not None:
                self.engine.wake()
            if self.optimizer is not None:
                self.optimizer.to_device()

    def decide(self, timer: PhaseTimer, judges: Sequence[Judge]) -> dict[str, float]:
        """`auto`: from this step's measured peaks (run as `always`: `rollout` and `update_actor`
        for the policy, `judge_<name>_score` for each judge), the plan of the next steps, once
        every in-process judge has scored. Returns the plan in effect (`swap/*`)."""
        weights = {j.name: j.offload.nbytes / 2**30 for j in judges if j.offload is not None}
        peaks = [timer.peak_gib(f"judge_{name}_score") for name in weights]
        if self.pending and all(p is not None for p in peaks):
            # step 1 generates before Adam's state exists; later steps generate with it resident
            optimizer = self.optimizer.nbytes / 2**30 if self.optimizer is not None else 0.0
            policy = max((timer.peak_gib("rollout") or 0.0) + optimizer, timer.peak_gib("update_actor") or 0.0)
            capacity = torch.cuda.get_device_properties(self.device).total_memory / 2**30 * self.memory_fraction
            resident = sum(part.nbytes for part in (self.weights, self.optimizer) if part is not None) / 2**30
            self.plan = PLANS[compute_swap_plan(policy, resident, list(weights.values()), [p or 0.0 for p in peaks],
                                                capacity)]
            self.pending = False
            for judge in judges:
                judge.swap = self.plan.sleep_judges
        return {"swap/offload_policy": float(self.plan.offload_policy), "swap/sleep_judges": float(self.plan.sleep_judges)}
