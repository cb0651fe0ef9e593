"""A vLLM engine colocated with the trainer, and the policy -> engine weight push.

The pattern of verl's and TRL's colocated rollouts: one `vllm.LLM` per training process (one GPU
each), loaded from the policy's checkpoint, asleep while the trainer works; after every
optimizer step the policy's current weights (LoRA merged into the base weights) are copied into
it in place (`VLLMEngine.load_weights`). Apps call `colocated_vllm` once and `push_weights`
after each optimizer step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rl_models.lora import merged_named_weights

BUCKET_BYTES = 512 * 2**20
"""Bytes of tensors per `load_weights` call: bounds the merged-LoRA copies alive at once."""


def colocated_vllm(path: str, *, dtype: str, gpu_memory_utilization: float, seed: int, max_num_seqs: int,
                   world_size: int = 1, **llm_kwargs: Any) -> Any:
    """A `VLLMEngine` on this process's GPU, loaded from checkpoint `path`.

    The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight pushes
    pass tensors by reference; with several training processes each holds its own engine
    (`distributed_executor_backend="external_launcher"`, vLLM's mode for engines living inside
    torchrun/accelerate processes). `gpu_memory_utilization` is the fraction of the GPU vLLM may
    take for weights and KV cache: leave the rest to the trainer.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rl_rollout.vllm import VLLMEngine

    extra: dict[str, Any] = {"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}
    return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                      max_num_seqs=max_num_seqs, **extra, **llm_kwargs)


def push_weights(engine: Any, model: torch.nn.Module, version: int) -> None:
    """Send `rl_models.lora.merged_named_weights(model)` (Hugging Face checkpoint names, LoRA
    merged) to `engine.load_weights` in buckets of ~`BUCKET_BYTES`; the merged tensors are made
    lazily, so at most one bucket of them exists at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in merged_named_weights(model):
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            engine.load_weights(bucket, version=version)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    engine.load_weights(bucket, version=version)
