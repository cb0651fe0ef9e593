"""FSDP2 for policies that do not fit on one GPU: sharding, the rollout's full weights, sharded
checkpoints and the plain export.

A full bf16 fine-tune with Adam holds ~16 bytes per parameter (weights, gradients, two fp32
moments, fp32 master weights with mixed precision): an 8B policy needs ~128 GB, past one 80 GB
GPU. `torch.distributed.fsdp.fully_shard` (FSDP2, per-parameter DTensor sharding; torchtitan's
recipe) splits weights, gradients and optimizer state over the processes, so each GPU holds 1/N
of them plus one decoder layer unsharded at a time.

    plan = resolve_sharding(acc, "fsdp2", cpu_offload=False, ...)
    full = FullWeights(model, device=acc.device)  # before prepare_policy: an empty copy of `model`
    policy, optimizer, scheduler = prepare_policy(acc, Policy(model), optimizer, scheduler, plan)
    with full.gathered() as weights:          # per rollout: every rank gets the whole model
        engine.generate(...)                  # the hf engine decodes from `weights`
    save_checkpoint(..., state={"sampler": s, **sharded_state(policy, optimizer)})

Choose `sharding`:
- `none` (default): DDP through Accelerate. Every GPU holds the whole model, its gradients and
  its optimizer state; fastest while that fits (up to ~4B parameters with Adam on 80 GB).
- `fsdp2`: the weights, gradients and optimizer state sharded over the processes. Each forward
  all-gathers one layer at a time and each backward reduce-scatters its gradients (both averaged,
  as DDP's all-reduce is, so `optimizer_step`'s loss scaling is unchanged). Pick it when the
  model with Adam does not fit one GPU. `cpu_offload` keeps the shards and the optimizer state in
  host memory (the optimizer steps on the CPU): slower, for when even 1/N does not fit.
  `mixed_precision="bf16"` keeps fp32 master weights and computes in bf16 with fp32 gradient
  reduction. `activation_checkpointing` recomputes each decoder layer's activations in backward.

FSDP2 runs on CUDA (NCCL) and on CPU (gloo, used by the tests). Accelerate turns its own FSDP
plugin on only on GPUs/accelerators (on a CPU it silently runs plain data parallelism), so the
sharding here is done with `fully_shard` directly on every device, one code path: an
`accelerate launch` with an FSDP config (`fsdp_version: 2`) turns `fsdp2` on, on a GPU or a
CPU, and contributes its `fsdp_offload_params` and `fsdp_activation_checkpointing`; Accelerate still launches the processes, sets the device and
steps the scheduler. The optimizer of a sharded policy is not registered with Accelerate
(its `save_state` would write rank 0's shards only): `sharded_state` saves it, with the
weights, through `torch.distributed.checkpoint` (DCP), every rank its own shards.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rl_core.errors import UserError
from rl_core.train.fields import MixedPrecision, Sharding, ShardingFields
from rl_core.train.process_state import ProcessState

__all__ = [
    "SHARDINGS",
    "FullWeights",
    "ShardedState",
    "ShardingFields",
    "ShardingPlan",
    "accelerator_kwargs",
    "full_state_dict",
    "fused_on_host",
    "gathered",
    "is_sharded",
    "layer_modules",
    "prepare_policy",
    "resolve_sharding",
    "shard_model",
    "sharded_state",
]

SHARDINGS = ("none", "fsdp2")
Opt = TypeVar("Opt", bound=torch.optim.Optimizer)


def is_sharded(module: torch.nn.Module) -> bool:
    """True for a module that `fully_shard` wrapped (its parameters are DTensor shards)."""
    return isinstance(module, FSDPModule)


def layer_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: every submodule whose class is named in a
    `_no_split_modules` list of a model inside `root` (transformers' decoder and vision blocks,
    diffusers' transformer blocks), outermost first; nested blocks are left to their parent."""
    names: set[str] = set()
    for module in root.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or type(module).__name__ not in names:
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    if not found:
        raise ValueError(f"{type(root).__name__} has no submodule named in a `_no_split_modules` list: nothing to "
                         "shard layer by layer (FSDP2 needs the repeated blocks of a transformers/diffusers model)")
    return found


def shard_model(root: torch.nn.Module, *, mixed_precision: MixedPrecision = "none", cpu_offload: bool = False,
                activation_checkpointing: bool = False, reshard_after_forward: bool = True) -> torch.nn.Module:
    """`fully_shard` every block of `layer_modules(root)` and then `root` (embeddings, final norm,
    LM head), in place; returns `root`. Needs an initialized process group (`accelerate launch`,
    one process is fine). Parameters become new DTensor `Parameter`s: build the optimizer after,
    or let `prepare_policy` move it over. `reshard_after_forward=False` keeps each layer gathered
    from forward to backward (faster, ~ZeRO-2 memory)."""
    if not dist.is_initialized():
        raise UserError("train.sharding='fsdp2' needs a process group: start the app with `accelerate launch` "
                        "(one process is fine)")
    layers = layer_modules(root)  # before any wrapping: fully_shard changes the classes' names
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in layers:
            checkpoint(layer)  # composable: keeps parameter names (no `_checkpoint_wrapped_module.`)
    if mixed_precision == "bf16":
        for p in root.parameters():
            if p.is_floating_point():
                p.data = p.data.float()  # fp32 master weights; the forward casts to bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision == "none":
        policy = MixedPrecisionPolicy()
    else:
        raise ValueError(f"mixed_precision={mixed_precision!r}: choose 'none' or 'bf16'")
    kwargs: dict[str, Any] = {"mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # pinned host memory (fast copies to the GPU) needs CUDA; a CPU-only run (gloo) has nothing to pin
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


@dataclass(frozen=True)
class ShardingPlan:
    """How the policy is spread over the processes (see the module doc for when to pick what)."""

    kind: Sharding = "none"
    mixed_precision: MixedPrecision = "none"
    cpu_offload: bool = False
    activation_checkpointing: bool = False

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp2"


def resolve_sharding(accelerator: Any, kind: Sharding, *, mixed_precision: MixedPrecision = "none",
                     cpu_offload: bool = False, activation_checkpointing: bool = False) -> ShardingPlan:
    """The app's `train.sharding` settings merged with an `accelerate launch` FSDP config: such a
    launch turns `fsdp2` on and adds its parameter offload and activation checkpointing. An
    FSDP1 config is refused (its flat-parameter wrapping is not what runs here), and so is
    DeepSpeed ZeRO-3. Sharded weights go through FSDP2: engines decode from gathered full weights
    and the replay runs through the sharded policy's forward."""
    from accelerate.utils import DistributedType

    if kind not in SHARDINGS:
        raise UserError(f"train.sharding={kind!r}: choose one of {SHARDINGS}")
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        # ZeRO-3's sharded weights are read by no one outside its wrapped forward: not the rollout
        # engine, not the log-prob replay of a `Policy` module
        raise UserError("DeepSpeed ZeRO-3 is not supported: rollout engines and the log-prob replay read the full "
                        "weights outside the wrapped forward. Use FSDP2 (train.sharding=\"fsdp2\" or an accelerate "
                        "FSDP config with fsdp_version: 2), DDP or ZeRO-1/2.")
    if mixed_precision not in ("none", "bf16"):
        raise UserError(f"train.fsdp_mixed_precision={mixed_precision!r}: choose 'none' or 'bf16'")
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        version, offload = plugin.fsdp_version, isinstance(plugin.cpu_offload, CPUOffloadPolicy)
        checkpointing = bool(plugin.activation_checkpointing)
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # an FSDP launch config on a machine where Accelerate does not turn FSDP on (a CPU): its
        # launcher's environment still says what was asked for, and fully_shard runs on gloo
        if os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":
            raise UserError("the accelerate FSDP config sets fsdp_cpu_ram_efficient_loading: true, which makes "
                            "transformers load empty weights on every process but the first: set it to false")
        version = int(os.environ.get("FSDP_VERSION", "1"))
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        checkpointing = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
    else:
        return ShardingPlan(kind, mixed_precision, cpu_offload, activation_checkpointing)
    if version != 2:
        raise UserError(f"the accelerate config asks for FSDP version {version}: set fsdp_version: 2 "
                         "(FSDP2, fully_shard) or launch with the DDP config and train.sharding='fsdp2'")
    return ShardingPlan("fsdp2", mixed_precision, cpu_offload or offload, activation_checkpointing or checkpointing)


def accelerator_kwargs(*, sharding: Sharding, cpu_offload: bool) -> dict[str, Any]:
    """Extra `Accelerator(...)` arguments: FSDP2 with CPU offload on CUDA needs a gloo group next
    to NCCL (the gradient norm of the host-resident shards is reduced on the CPU)."""
    if sharding == "fsdp2" and cpu_offload and torch.cuda.is_available():
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="cuda:nccl,cpu:gloo")]}
    return {}


def prepare_policy(accelerator: Any, policy: torch.nn.Module, optimizer: Opt, scheduler: Any,
                   plan: ShardingPlan) -> tuple[torch.nn.Module, Opt, Any]:
    """What `accelerator.prepare(policy, optimizer, scheduler)` is for an unsharded policy (DDP);
    for a sharded plan the policy is sharded by `shard_model`, the optimizer (built over the
    unsharded parameters, still without state) is pointed at the shards by parameter name, and
    only the scheduler goes through Accelerate (it steps as it does under DDP). With
    `plan.cpu_offload` an Adam/AdamW steps on the host through its fused kernel (`fused_on_host`).
    A `None` scheduler is allowed."""
    if not plan.sharded:
        if scheduler is None:
            return (*accelerator.prepare(policy, optimizer), None)
        return accelerator.prepare(policy, optimizer, scheduler)
    if optimizer.state:
        raise ValueError("prepare_policy needs a fresh optimizer (its state would not follow the parameters)")
    names = {id(p): n for n, p in policy.named_parameters()}
    if not plan.cpu_offload:
        policy.to(accelerator.device)
    shard_model(policy, mixed_precision=plan.mixed_precision, cpu_offload=plan.cpu_offload,
                activation_checkpointing=plan.activation_checkpointing)
    sharded = dict(policy.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    if plan.cpu_offload:
        fused_on_host(optimizer)
    if scheduler is not None:
        scheduler = accelerator.prepare_scheduler(scheduler)
    return policy, optimizer, scheduler


def fused_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a `torch.optim.Adam`/`AdamW` to its fused kernel; `prepare_policy` does this for
    `cpu_offload`, where the optimizer steps on the host. There torch's default is a loop of
    elementwise kernels per parameter, reading every moment several times. The fused kernel makes
    one pass per tensor, much faster on the host; the update is the same within float rounding.

    Returns whether it switched. Other optimizers, and a `differentiable` Adam, are left as they
    are. Call it before the first step."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    for group in [optimizer.defaults, *optimizer.param_groups]:
        group["fused"], group["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True  # as Adam(fused=True) sets it
    return True


class FullWeights:
    """An unsharded copy of a sharded model for whatever needs whole weights: the rollout engine
    (the `hf` engine decodes from it; a vLLM engine is fed from it through `load_weights`) and the
    plain export. Build it from the model BEFORE sharding: it is a structural copy whose
    parameters are empty until `gathered()`; buffers are copied. `device` is where the copy
    lives and the weights are gathered to: the rollout's device (`accelerator.device`), wherever
    the model was loaded (a policy loaded on the CPU and sharded onto a GPU must still decode on
    the GPU).

    `gathered()` all-gathers the current weights into the copy on every process (in the copy's
    dtypes: bf16 rollout weights from fp32 master weights) and empties it again on exit, so the
    update has that memory back. `pop_metrics()` returns the gathers' wall time since the last
    call as `time/weight_gather`."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str) -> None:
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=False)
            for p in model.parameters()}
        self.model = copy.deepcopy(model, memo).to(device)  # the buffers (rotary tables, ...) too
        self.source = model
        self.seconds = 0.0  # gather time not yet popped

    def pop_metrics(self) -> dict[str, float]:
        out, self.seconds = {"time/weight_gather": self.seconds}, 0.0
        return out

    @contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        start = time.perf_counter()
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, p in self.source.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p  # [*shape]
                target = params[name]
                target.data = full.detach().to(target.device, target.dtype)
        self.seconds += time.perf_counter() - start
        try:
            yield self.model
        finally:
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def gathered(full: FullWeights | None, model: torch.nn.Module) -> Any:
    """`full.gathered()` for a sharded policy, else a context yielding `model` itself (an
    unsharded policy is decoded from directly)."""
    return full.gathered() if full is not None else nullcontext(model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole `state_dict` of a sharded model, on the CPU of rank 0 (other ranks get `{}`);
    call it on every process. For the plain export (`save_pretrained` of an unsharded copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


class ShardedState(ProcessState):
    """A sharded model and its optimizer, saved and loaded by every process through
    `torch.distributed.checkpoint` (each rank writes and reads its own shards; `save_checkpoint`
    and `load_checkpoint` call `save`/`load` for state values of this type).

    `trainable_only=True` leaves the frozen parameters out (a LoRA over a frozen base: the base
    is loaded from the model path again on resume, and is not rewritten at every checkpoint)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 trainable_only: bool = False) -> None:
        self.model, self.optimizer, self.trainable_only = model, optimizer, trainable_only

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # strict=False: the frozen parameters are absent on purpose (`dcp.load` still refuses a
        # checkpoint that lacks a trainable one)
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=self._options())
        return {"model": model, "optim": optim}

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(folder))

    def load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._options())


def sharded_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                  trainable_only: bool = False) -> Mapping[str, ShardedState]:
    """`{"sharded": ShardedState(policy, optimizer)}` for a sharded policy, else `{}` (Accelerate's
    `save_state` holds an unsharded one): spread it into `save_checkpoint`'s `state`."""
    return {"sharded": ShardedState(policy, optimizer, trainable_only=trainable_only)} if is_sharded(policy) else {}
