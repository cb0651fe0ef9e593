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
from typing import Any, Literal

import torch

from rl_core.train.offload import OptimizerOffload, PinnedOffload

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
    - `policy_peak`: the largest peak of the policy's phases (generate, replay, update), judges asleep;
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


# ------------------------------------------------------------------------------ engines


def engine_model(engine: Any) -> torch.nn.Module | None:
    """The in-process model behind an `HFEngine` (possibly wrapped), else None (remote, vLLM)."""
    inner = engine.inner if type(engine).__name__ == "RecordingEngine" else engine
    return inner.model if type(inner).__name__ == "HFEngine" else None


def make_offload(engine: Any, device: torch.device) -> PinnedOffload | None:
    """Pinned offload for an in-process HF engine on an accelerator; None where nothing moves."""
    model = engine_model(engine)
    if model is None or torch.device(device).type == "cpu":
        return None
    return PinnedOffload(model, device)


def sleep_engine(engine: Any, offload: PinnedOffload | None) -> None:
    if offload is not None:
        offload.to_host()
    engine.sleep()


def wake_engine(engine: Any, offload: PinnedOffload | None) -> None:
    if offload is not None:
        offload.to_device()
    engine.wake()


# ------------------------------------------------------------------------------ the policy


class PolicySwap:
    """The policy's weights and optimizer state, put to sleep before the judges score and woken
    after, as the current plan says.

    mode "always"/"never" fix the plan; "auto" starts as "always" and `decide()` switches to the
    fastest plan that fits once a step has measured every in-process judge (CUDA only).

    What sleeps depends on the rollout engine (`rollout.engine`). `hf`: the engine wraps the
    training model, so the swap moves that model's weights (pinned host buffers) and puts the
    engine to sleep (its KV cache freed). `vllm`: the engine is not the swap's to move. It is
    woken for each generation and put back to sleep right after it (vLLM's sleep: its copy of
    the weights to host memory, its KV cache freed), so it is asleep whenever a judge scores,
    whatever the plan; waking it here would only take its KV cache back while the policy
    trains. What the policy still holds on the GPU then is the training model (weights in torch)
    and the optimizer state, so `offload_policy` moves those, as for `hf`: with `always` a judge
    scores with nothing of the policy on the GPU, with either engine. `auto` keeps `always`
    with a vLLM engine: vLLM maps and unmaps its memory itself (sleep mode), outside the torch
    allocator statistics the plan is computed from (as with a vLLM judge).

    `model` is the training model (for `hf`, the engine's own model).
    """

    def __init__(self, engine: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 mode: Literal["auto", "always", "never"], offload_optimizer: bool, memory_fraction: float) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.engine = engine if engine_model(engine) is model else None  # hf: sleeps with the swap
        self.weights = PinnedOffload(model, self.device) if self.device.type != "cpu" else None
        self.optimizer = OptimizerOffload(optimizer, self.device) if offload_optimizer and cuda else None
        self.pending = mode == "auto" and cuda and self.engine is not None
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

    def decide(self, metrics: Mapping[str, float], judges: Mapping[str, float]) -> SwapPlan | None:
        """`auto`: the plan for the next steps from one step's `mem/<phase>_gib` (run as `always`)
        and `judges` (name -> weights GiB of each in-process judge). None while a judge has not
        scored yet (its peak is unknown) or when the plan is fixed."""
        if not self.pending:
            return None
        peaks = [metrics.get(f"mem/judge_{name}_score_gib") for name in judges]
        if any(p is None for p in peaks):
            return None
        phases = ("old_logp", "ref_logp", "advantages", "update")
        # step 1 generates before Adam's state exists; later steps generate with it resident
        optimizer = self.optimizer.nbytes / 2**30 if self.optimizer is not None else 0.0
        policy_peak = max(metrics.get("mem/generate_gib", 0.0) + optimizer,
                          *(metrics.get(f"mem/{p}_gib", 0.0) for p in phases))
        capacity = torch.cuda.get_device_properties(self.device).total_memory / 2**30 * self.memory_fraction
        name = compute_swap_plan(policy_peak, self.resident_gib(), list(judges.values()),
                                 [float(p) for p in peaks if p is not None], capacity)
        self.pending, self.plan = False, PLANS[name]
        return self.plan
