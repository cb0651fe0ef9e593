"""A LoRA policy's weights on the rollout side, for an engine the app builds itself (diffusion-grpo's
SD3 and Janus image engines): the `rl_core.train.PolicyWeights` the trainer loop drives, and the
Ray actors that sample with the trained LoRA by version. A fully fine-tuned model
(`rl_models.lora.full_finetune`) goes through the same pieces with every weight (`trained_params`).

    weights = LoraPolicyWeights(peft, sampler=engine.transformer, full=full,
                                ema=ParameterEMA(peft, decay=0.9),   # optional: stepped with the policy
                                on_copy=lambda twin: ...,            # asynchronous: the rollout engine over it
                                workers=lambda: start_lora_workers(spec, ...))   # optional Ray actors
    # Recipe.policy(state) returns it; then, each rollout:
    samples = weights.on_workers(sample_to_cpu, batches, **sampling)   # or the app's engine in process

Synchronous (`train.max_staleness = 0`): the app's engine samples with the trained LoRA model
itself, so there is nothing to copy in process; Ray workers get its LoRA before a rollout whose
version they do not hold (each refuses another). Asynchronous, `channel()` gives the rollout weights
of its own that change only by version:
- in process: a copy of the LoRA model whose frozen base is the trainer's (shared memory), or for a
  sharded policy (FSDP2) a whole copy of its own made from one gather on every process (budget
  the model once more per GPU), handed to `on_copy`, where the app builds its rollout engine over
  it; each version's LoRA is copied into it (all-gathered first when sharded, on the trainer's
  thread, where the collective belongs);
- with Ray workers: each published LoRA as a host copy, pushed by the rollout that needs it, so
  only the rollout thread talks to the workers; colocated workers then stay awake (they sample
  while the trainer updates).
The version (optimizer steps in the weights) is counted and checkpointed by `CountedWeights`;
an `ema` (`ParameterEMA`) steps with it, after every optimizer step taken (the app checkpoints
it and evaluates or exports through it). `LoraCopy` is a second LoRA over the same frozen base
that follows the trained one by an EMA step (DiffusionNFT's old policy).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rl_core.train import (
    CopyChannel,
    CountedWeights,
    FullWeights,
    ParameterEMA,
    UserError,
    WeightChannel,
    copy_sharing_frozen,
    gathered,
)

__all__ = ["LoraCopy", "LoraPolicyWeights", "build_lora_image_engine", "export_adapters", "load_lora", "lora_params", "lora_worker_spec",
           "start_lora_workers", "trained_params"]


def lora_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA weights of a peft-injected module, by name (the same names in every process)."""
    return {name: p for name, p in module.named_parameters() if ".lora_" in name}


def trained_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The weights a policy trains, by name: its LoRA's where it has one, else every weight (full
    fine-tuning, `rl_models.lora.full_finetune`)."""
    return lora_params(module) or dict(module.named_parameters())


class LoraPolicyWeights(CountedWeights):
    """`PolicyWeights` for a LoRA policy sampled by an engine of the app's (see the module doc).

    `peft`: the trained LoRA model (unsharded, or sharded in place with `full` its whole copy);
    `sampler`: the module whose LoRA Ray workers take in a synchronous run (the engine's
    transformer; for a sharded policy the whole copy's, filled inside `gathered`); `on_copy`:
    called once with the asynchronous rollout's copy of the LoRA model; `workers`: starts the Ray
    actors (`start_lora_workers`) once the starting weights are in place; `colocated`: they share
    the trainer's GPU and sleep outside rollouts; `ema`: the trained LoRA's EMA, stepped by
    `stepped()` (after every optimizer step taken, as the loop's `NonFiniteGuard` calls it)."""

    def __init__(self, peft: torch.nn.Module, *, sampler: torch.nn.Module, full: FullWeights | None = None,
                 on_copy: Callable[[torch.nn.Module], None] | None = None,
                 workers: Callable[[], Any] | None = None, colocated: bool = False,
                 timer: Callable[[str], AbstractContextManager[Any]] | None = None,
                 ema: ParameterEMA | None = None) -> None:
        super().__init__(timer)
        self.peft, self.sampler, self.full, self.on_copy, self.ema = peft, sampler, full, on_copy, ema
        self._start_workers, self.colocated = workers, colocated
        self.pool: Any = None  # rl_rollout.ray_pool.RolloutPool, once started
        self._host: _HostVersions | None = None  # asynchronous with workers: the published LoRAs

    @property
    def asynchronous(self) -> bool:
        """Whether `channel()` was called: the rollout samples with weights of its own."""
        return self.versions is not None

    def start(self) -> None:
        if self._start_workers is not None and self.pool is None:
            self.pool = self._start_workers()
        super().start()

    def stepped(self) -> None:
        super().stepped()
        if self.ema is not None:
            self.ema.step()

    def channel(self) -> WeightChannel:
        if self.versions is not None:
            return self.versions
        inner: WeightChannel
        if self.pool is not None:
            if self.colocated:
                self.pool.wake()  # awake for the whole run: the workers sample while the trainer updates
            inner = self._host = _HostVersions(self.sampler)
        else:
            if self.full is not None:
                with gathered(self.full, self.peft) as whole:
                    twin = copy.deepcopy(whole).requires_grad_(False)
            else:
                twin = copy_sharing_frozen(self.peft)
            if self.on_copy is not None:
                self.on_copy(twin)
            inner = CopyChannel(self.peft, twin)
        return self.counted(inner)

    def on_workers(self, fn: Callable[..., Any], items: Sequence[Any], **kwargs: Any) -> list[Any]:
        """`fn(engine, item, **kwargs)` for each item on the Ray workers, holding the weights of
        `weight_version` first (pushed if they hold another). Call it on every process: a
        synchronous push of a sharded policy gathers its LoRA (a collective)."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("no Ray workers: build LoraPolicyWeights with `workers` and start it first")
        colocated = self.colocated and not self.asynchronous  # asynchronous: awake throughout
        if colocated:
            pool.wake()
        if pool.version != self.weight_version:
            if self._host is not None:
                pool.load_weights(self._host.loaded, self.weight_version)
            else:
                with gathered(self.full, self.peft) if self.full is not None else nullcontext():
                    pool.load_weights({n: p.detach() for n, p in trained_params(self.sampler).items()},
                                      self.weight_version)
        outputs = list(pool.map(fn, items, **kwargs).outputs)
        if colocated:
            pool.sleep()  # VRL colocated: the actors release the GPU before the update
        return outputs

    def close(self) -> None:
        """Stop the Ray workers (also after an error)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class LoraCopy:
    """A copy of the LoRA model `peft` whose frozen base is `peft`'s (`copy_sharing_frozen`),
    starting at the trained LoRA, that follows it only by `move_towards`: DiffusionNFT's old
    policy, which samples the rollouts and gives `v_old` in the loss. A checkpoint `Stateful`
    (its LoRA by the trained one's names)."""

    def __init__(self, peft: torch.nn.Module) -> None:
        self.model = copy_sharing_frozen(peft)
        self.trained, self.params = trained_params(peft), trained_params(self.model)  # the same names

    @torch.no_grad()
    def move_towards(self, decay: float) -> None:
        """`copy <- decay copy + (1 - decay) trained` (DiffusionNFT's order of operations)."""
        for name, p in self.params.items():
            p.copy_(p * decay + self.trained[name].detach() * (1.0 - decay))

    def state_dict(self) -> dict[str, Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        if set(state) != set(self.params):
            raise ValueError(f"its LoRA copy is not this model's ({len(state)} vs {len(self.params)} tensors): "
                             "another LoRA rank or target modules?")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])


class _HostVersions:
    """The trained LoRA by loop step as host copies, for Ray workers: `load` picks the copy that
    the next `on_workers` pushes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def publish(self, version: int) -> None:
        with torch.no_grad():
            held = {n: p.detach().to("cpu", copy=True) for n, p in trained_params(self.module).items()}
        with self._lock:
            self.versions[version] = held

    def load(self, version: int, *, prune: bool = True) -> None:
        with self._lock:
            self.loaded = self.versions[version]
            if prune:
                self.versions = {v: w for v, w in self.versions.items() if v >= version}

    def close(self) -> None:
        with self._lock:
            self.versions.clear()


def start_lora_workers(spec: Any, workers: int, *, placement: Literal["split", "colocated"], device: torch.device,
                       gpus_per_worker: float | None = None, address: str | None = None) -> Any:
    """`workers` Ray actors (`rl_rollout.ray_pool.RolloutPool` of `spec`) for this training
    process: `split` on GPUs of their own (a local Ray gets every visible GPU but the trainer's),
    `colocated` on the trainer's GPU, asleep until a rollout. `gpus_per_worker` None: split 1,
    colocated 1 / workers, 0 without CUDA. `address` (else RAY_ADDRESS) joins a running cluster."""
    from rl_rollout.policy_pool import worker_gpu_ids
    from rl_rollout.ray_pool import RolloutPool

    colocated = placement == "colocated"
    gpus = gpus_per_worker
    if gpus is None:
        gpus = 0.0 if not torch.cuda.is_available() else 1.0 / workers if colocated else 1.0
    gpu_ids = None if address else worker_gpu_ids(torch.device(device), colocated=colocated)
    if gpu_ids is not None and gpus * workers > len(gpu_ids):
        raise UserError(f"rollout.placement={placement!r}: {workers} workers x {gpus} GPUs do not fit on GPUs "
                        f"{gpu_ids} (the trainer has GPU {torch.device(device).index or 0}); lower rollout.workers "
                        "or rollout.gpus_per_worker, or use placement 'colocated'")
    pool = RolloutPool(spec, workers, num_cpus=1.0, num_gpus=gpus, address=address, gpu_ids=gpu_ids)
    if colocated:
        pool.sleep()
    return pool


def lora_worker_spec(path: str, kind: str, *, dtype: str, lora_rank: int, lora_alpha: float,
                     lora_targets: list[str] | None, **options: Any) -> Any:
    """A Ray worker's image engine (`rl_rollout.ray_pool.EngineSpec`): family `kind` (`sd3`,
    `wan`, `cosmos`, `janus`) from `path` with the trainer's LoRA layout, built by
    `build_lora_image_engine` inside the actor, weights by `load_lora`; `options` are the engine's
    (pass those the trainer's own engine was built with, so both sample alike)."""
    from rl_rollout.ray_pool import EngineSpec

    return EngineSpec(factory=build_lora_image_engine, load_weights=load_lora, kwargs={
        "path": path, "kind": kind, "dtype": dtype, "lora_rank": lora_rank, "lora_alpha": lora_alpha,
        "lora_targets": lora_targets, **options})


def build_lora_image_engine(path: str, *, dtype: str, lora_rank: int, lora_alpha: float, lora_targets: list[str] | None,
                            kind: str = "sd3", **options: Any) -> Any:
    """A Ray worker's image engine `kind` (`sd3`, `wan`, `cosmos`, `janus`:
    `rl_rollout.build_image_engine`) with the trainer's LoRA layout (`EngineSpec.factory`; weights
    by `load_lora`), on the worker's GPU (or the CPU); `options` are the engine's (`num_frames` for
    the video families, `text_encoder_dtype` for the diffusion ones)."""
    from rl_models.lora import add_lora
    from rl_rollout.images import build_image_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine: Any = build_image_engine(kind, path=path, dtype=dtype, device=device, **options)
    _lora_module(engine).requires_grad_(False)
    if lora_rank:  # 0: full fine-tuning, every weight pushed
        add_lora(_lora_module(engine), family=kind, r=lora_rank, alpha=lora_alpha, target_modules=lora_targets)
    return engine


def _lora_module(engine: Any) -> torch.nn.Module:
    """The module an image engine's LoRA is in: a diffusion engine's transformer, Janus's model."""
    return engine.transformer if hasattr(engine, "transformer") else engine.model


def load_lora(engine: Any, state: Mapping[str, torch.Tensor]) -> None:
    """A pushed LoRA into a worker's engine (`EngineSpec.load_weights`): the same names as the
    trainer's, as both add it with the same settings."""
    with torch.no_grad():
        for name, p in trained_params(_lora_module(engine)).items():
            p.copy_(state[name])


def export_adapters(model: Any, ema: ParameterEMA, out: Path) -> list[Path]:
    """A LoRA policy's adapters in PEFT format, from whole weights (a sharded policy's inside
    `gathered`): `model`'s LoRA in `out/lora` and its EMA's (`LoraPolicyWeights(ema=...)`) in
    `out/lora_ema`, each loadable with `PeftModel.from_pretrained`. `model` is the peft model; a
    fully fine-tuned one (a diffusers or transformers model) is saved whole instead, in
    `out/transformer` and `out/transformer_ema` (`save_pretrained`). Returns the folders."""
    from peft import PeftModel

    from rl_models.lora import export_lora  # peft, imported where a LoRA is used

    def save(folder: Path) -> None:
        if isinstance(model, PeftModel):
            export_lora(model, folder)
        else:
            model.save_pretrained(folder)

    folders = [out / "lora", out / "lora_ema"] if isinstance(model, PeftModel) else [out / "transformer", out / "transformer_ema"]
    save(folders[0])
    with ema.swapped(model):
        save(folders[1])
    return folders
