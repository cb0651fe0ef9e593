"""Rollout as sampling chunks, in process or on Ray actors (`rollout.workers > 0`).

A chunk is one sampling call (`rollout.sample_batch_size` images, one seed each); the same
`sample_chunk` runs in the trainer's engine or in a worker's, so both paths draw the same
trajectories for the same seeds. With workers, each actor holds its own SD3 pipeline with the
same LoRA (`build_lora_engine`); before a rollout the trainer pushes its LoRA weights tagged with
its optimizer-step count (`rl_rollout.ray_pool.RolloutPool.load_weights`), and every trajectory
comes back with the version it was sampled with, which must equal the trainer's.

VRL's presets (`rollout.placement`):
- `split`: actors on their own GPUs (`rollout.gpus_per_worker`, default 1); a local Ray instance
  is given every visible GPU except the trainer's. Pick it when GPUs are spare: rollout memory
  never meets training memory.
- `colocated`: actors share the trainer's GPU (default `1 / workers` each) and are put to sleep
  (weights to CPU, cache freed) after each rollout, so replay/backward has the memory: VRL's
  `ray_rollout_colocated_single_gpu`.
`RAY_ADDRESS` / `rollout.ray_address` joins a running cluster instead (placement is then the
cluster's: actors ask for `gpus_per_worker` each); several trainer processes need one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from grpo_config import ModelConfig, RolloutConfig

from rl_models.lora import add_lora
from rl_rollout.diffusion import DiffusionEngine, PromptEmbeddings, Trajectory
from rl_rollout.ray_pool import EngineSpec, RolloutPool, connect, ship_module


@dataclass(frozen=True)
class Chunk:
    """One sampling call: a prompt and a seed per image (`rl_core.train.sample_seed`)."""

    prompts: tuple[str, ...]
    seeds: tuple[int, ...]


def sample_chunk(engine: DiffusionEngine, chunk: Chunk, *, max_sequence_length: int, **sampling: Any) -> Trajectory:
    """Encode the chunk's distinct prompts once, then sample one image per row with its seed."""
    unique = list(dict.fromkeys(chunk.prompts))
    conditioning = engine.encode(unique, max_sequence_length=max_sequence_length)
    rows = [unique.index(p) for p in chunk.prompts]
    return engine.sample(list(chunk.prompts), conditioning=conditioning.index(rows), seeds=list(chunk.seeds), **sampling)


def sample_chunk_to_cpu(engine: DiffusionEngine, chunk: Chunk, **kwargs: Any) -> Trajectory:
    """`sample_chunk` in a worker: tensors come back on CPU (the trainer moves them to its device)."""
    return to_device(sample_chunk(engine, chunk, **kwargs), torch.device("cpu"))


def to_device(traj: Trajectory, device: torch.device) -> Trajectory:
    """The per-sample tensors on `device` (the schedule stays on CPU, as the engine returns it)."""
    cond = PromptEmbeddings(traj.conditioning.embeds.to(device), traj.conditioning.pooled.to(device))
    return replace(traj, conditioning=cond, latents=traj.latents.to(device), log_probs=traj.log_probs.to(device),
                   images=traj.images.to(device))


def lora_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA weights of a peft-injected transformer, by name (the same names in every process)."""
    return {name: p for name, p in module.named_parameters() if ".lora_" in name}


def build_lora_engine(path: str, *, dtype: str, text_encoder_dtype: str | None, lora_rank: int,
                      lora_alpha: float, lora_targets: list[str] | None, compile: bool = False) -> DiffusionEngine:
    """A worker's engine: the pipeline on the GPU Ray gave the actor (else CPU) with the
    trainer's LoRA layout; its weights arrive by `load_lora` before the first rollout."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = DiffusionEngine.from_pretrained(path, dtype=dtype, device=device, text_encoder_dtype=text_encoder_dtype,
                                             compile=compile)  # model.compile, as the trainer's engine
    engine.transformer.requires_grad_(False)
    add_lora(engine.transformer, family="sd3", r=lora_rank, alpha=lora_alpha, target_modules=lora_targets)
    return engine


def load_lora(engine: DiffusionEngine, state: Mapping[str, torch.Tensor]) -> None:
    params = lora_params(engine.transformer)
    if set(params) != set(state):
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"LoRA weights do not match the worker's adapters: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} (same model.lora_rank / lora_targets?)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


class RayRollout:
    """The trainer's handle on its rollout workers (one pool per trainer process)."""

    def __init__(self, pool: RolloutPool, placement: str, owns_ray: bool) -> None:
        self.pool, self.placement, self._owns_ray = pool, placement, owns_ray
        if placement == "colocated":
            pool.sleep()

    def collect(self, chunks: list[Chunk], *, version: int, transformer: torch.nn.Module,
                device: torch.device, **sampling: Any) -> list[Trajectory]:
        """Sync the LoRA weights if the workers hold an older version, sample every chunk, check
        each trajectory's version, return them on `device` in chunk order."""
        if self.placement == "colocated":
            self.pool.wake()
        if self.pool.version != version:
            self.pool.load_weights({n: p.detach() for n, p in lora_params(transformer).items()}, version)
        rollout = self.pool.map(sample_chunk_to_cpu, chunks, **sampling)
        if self.placement == "colocated":
            self.pool.sleep()  # VRL colocated: actors release the GPU before replay/backward
        stale = [(i, v) for i, v in enumerate(rollout.versions) if v != version]
        if stale:
            raise RuntimeError(f"rollout chunks {stale[:3]} (index, weight version) were sampled with weights "
                               f"other than the trainer's v{version}")
        return [to_device(traj, device) for traj in rollout.outputs]

    def close(self) -> None:
        self.pool.close()
        if self._owns_ray:
            import ray

            ray.shutdown()


def start_workers(rollout: RolloutConfig, model: ModelConfig, path: str, acc: Any) -> RayRollout:
    """`rollout.workers` actors per trainer process, placed as `rollout.placement` says."""
    address = rollout.ray_address or os.environ.get("RAY_ADDRESS")
    if acc.num_processes > 1 and not address:
        raise ValueError(f"rollout.workers={rollout.workers} with {acc.num_processes} trainer processes needs a "
                         "running Ray cluster: `ray start --head`, then set RAY_ADDRESS or rollout.ray_address")
    colocated = rollout.placement == "colocated"
    gpus = rollout.gpus_per_worker
    if gpus is None:
        gpus = 0.0 if not torch.cuda.is_available() else 1.0 / rollout.workers if colocated else 1.0
    gpu_ids = None
    if torch.cuda.is_available() and not address:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        ids = visible.split(",")
        mine = ids[acc.device.index or 0]
        gpu_ids = [mine] if colocated else [g for g in ids if g != mine]
        if gpus * rollout.workers > len(gpu_ids):
            raise ValueError(f"rollout.placement={rollout.placement!r}: {rollout.workers} workers x {gpus} GPUs "
                             f"do not fit on GPUs {gpu_ids} (the trainer has GPU {mine}); lower rollout.workers "
                             "or rollout.gpus_per_worker, or use placement 'colocated'")
    owns = connect(address, num_cpus=max(os.cpu_count() or 1, rollout.workers), gpu_ids=gpu_ids)
    ship_module(sys.modules[__name__])  # workers cannot import the app folder: send this module by value
    spec = EngineSpec(factory=build_lora_engine, load_weights=load_lora, kwargs={
        "path": path, "dtype": model.dtype, "text_encoder_dtype": model.text_encoder_dtype,
        "lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha, "lora_targets": model.lora_targets,
        "compile": model.compile})
    pool = RolloutPool(spec, rollout.workers, num_cpus=1.0, num_gpus=gpus, address=address)
    return RayRollout(pool, rollout.placement, owns)
