"""Rollout engines for caption-rl and the policy -> engine weight sync.

`hf` (default): the `rl_rollout` HF engine decodes with the very modules being trained, so there
is nothing to sync. `vllm`: a colocated `vllm.LLM` per process (one GPU each), asleep while the
trainer works; after every optimizer step the policy's current weights are pushed into it in
place (`VLLMEngine.load_weights`), the way verl's and TRL's colocated rollouts do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rl_models.logprobs import unwrap_peft
from rl_models.lora import merged_named_weights
from rl_rollout.hf import HFEngine

BUCKET_BYTES = 512 * 2**20  # tensors per load_weights call: bounds the merged-LoRA copies alive at once


def build_engine(kind: str, model: torch.nn.Module, processor: Any, *, path: str, dtype: str, max_batch_size: int,
                 compile_mode: str, gpu_memory_utilization: float, rank: int, world_size: int) -> Any:
    """The rollout engine: `HFEngine` over the training model itself, or a colocated `VLLMEngine`
    loaded from the same checkpoint (weights kept in sync by `push_weights`)."""
    if kind == "hf":
        return HFEngine(unwrap_peft(model), processor, max_batch_size=max_batch_size, compile_mode=compile_mode)
    # colocated: the worker runs in this process, so load_weights passes tensors by reference
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rl_rollout.vllm import VLLMEngine

    extra = {"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}
    return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=rank,
                      max_num_seqs=max_batch_size, **extra)


def push_weights(engine: Any, model: torch.nn.Module, version: int) -> None:
    """Send `rl_models.lora.merged_named_weights(model)` to the vLLM engine in buckets of ~`BUCKET_BYTES` (tensors are
    computed lazily, so at most one bucket of merged LoRA weights exists at a time)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in merged_named_weights(model):
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            engine.load_weights(bucket, version=version)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    engine.load_weights(bucket, version=version)
