"""A vLLM engine colocated with the trainer, and the policy -> engine weight push.

The pattern of verl's and TRL's colocated rollouts: one `vllm.LLM` per training process (one GPU
each), loaded from the policy's checkpoint, asleep while the trainer works; after every
optimizer step the policy's current weights (LoRA merged into the base weights) are copied into
it in place (`VLLMEngine.load_weights`). Apps call `colocated_vllm` once and `push_weights`
after each optimizer step.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rl_models.lora import merged_named_weights

BUCKET_BYTES = 512 * 2**20
"""Bytes of tensors per `load_weights` call: bounds the merged-LoRA copies alive at once."""


def colocated_vllm(path: str, *, dtype: str, gpu_memory_utilization: float, seed: int, max_num_seqs: int,
                   world_size: int = 1, device: torch.device | None = None, **llm_kwargs: Any) -> Any:
    """A `VLLMEngine` on this process's GPU, loaded from checkpoint `path`.

    The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight pushes
    pass tensors by reference; with several training processes each holds its own engine
    (`distributed_executor_backend="external_launcher"`, vLLM's mode for engines living inside
    torchrun/accelerate processes). `gpu_memory_utilization` is the fraction of the GPU vLLM may
    take for weights and KV cache: leave the rest to the trainer.

    `device`: a GPU of the engine's own instead (split placement; one training process): vLLM's
    `device_ids` puts the engine there, without sleep mode (it never sleeps) and with
    `gpu_memory_utilization` of that GPU. Build it inside `vllm_engine_core(in_process=False)`:
    its engine core then runs in a process of its own, so vLLM's scheduling loop does not take
    turns with the trainer's kernel launches for this process's interpreter lock, and weight
    pushes send CUDA IPC handles of tensors already on that GPU (`rl_rollout.vllm_ipc`). Built in
    this process instead, it works too, slower. This thread's current CUDA device, which vLLM's
    start-up may move to the engine's GPU, is put back afterwards.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rl_rollout.vllm import VLLMEngine

    extra: dict[str, Any] = {"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}
    if device is None:
        return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                          max_num_seqs=max_num_seqs, **extra, **llm_kwargs)
    if world_size > 1:
        raise ValueError("a vLLM engine on a GPU of its own serves one training process (world_size 1)")
    index = torch.device(device).index
    if index is None:
        raise ValueError(f"device={device}: name the engine's GPU by index (cuda:N)")
    with torch.cuda.device(index):  # vLLM sets the current device to its own: put back on exit
        return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                          max_num_seqs=max_num_seqs, device_ids=[index], ipc_weights=True,
                          **({"enable_sleep_mode": False} | llm_kwargs))


@contextmanager
def vllm_engine_core(in_process: bool) -> Iterator[None]:
    """Build a vLLM engine inside this block with its engine core in this process (`in_process`:
    a colocated policy engine, whose weight pushes then pass tensors by reference) or in a
    process of its own (a judge: two engine cores cannot share one process; started by spawn,
    since a trainer has initialised CUDA, which a forked child cannot use).

    vLLM reads `VLLM_ENABLE_V1_MULTIPROCESSING` when an engine is built, and an engine core built
    in this process freezes vLLM's view of the environment (`vllm.envs.enable_envs_cache` at the
    end of its start-up): build every out-of-process engine (judges) before an in-process one.
    The variable is set for each build and put back after it."""
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "0" if in_process else "1"
    if not in_process:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def push_weights(engine: Any, model: torch.nn.Module, version: int) -> None:
    """Send `rl_models.lora.merged_named_weights(model)` (Hugging Face checkpoint names, LoRA
    merged) to `engine.load_weights` in buckets of ~`BUCKET_BYTES`; the merged tensors are made
    lazily, so at most one bucket of them exists at a time. An engine that `takes_whole_versions`
    (Ray actors: one push per version) gets them all in one call."""
    if getattr(engine, "takes_whole_versions", False):
        engine.load_weights(merged_named_weights(model), version=version)
        return
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in merged_named_weights(model):
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            engine.load_weights(bucket, version=version)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    engine.load_weights(bucket, version=version)


def push_adapter(engine: Any, model: torch.nn.Module, version: int, root: str | Path) -> Path:
    """A LoRA policy's push of its adapter alone (`rollout.weight_push=adapter`): the adapter's
    tensors and config in PEFT's format under `root/v<version>` (host memory: put `root` on a
    tmpfs), handed to `engine.load_adapter`, which samples with it over the base weights it
    loaded. A push of megabytes instead of the merged model's gigabytes. Older versions' folders
    are removed once a newer one is handed over. Returns the folder."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    if not isinstance(model, PeftModel):
        raise ValueError("an adapter-only push needs a LoRA (peft) policy; a fully trained one pushes merged weights")
    folder = Path(root) / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[model.active_adapter].save_pretrained(str(folder))
    state = get_peft_model_state_dict(model)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in state.items()}, str(folder / "adapter_model.safetensors"))
    engine.load_adapter(folder, version=version)
    for old in Path(root).glob("v*"):
        if old != folder and old.name[1:].isdigit() and int(old.name[1:]) < version:
            shutil.rmtree(old, ignore_errors=True)
    return folder
