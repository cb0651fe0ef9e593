"""Rollout engines for caption-rl and the policy -> engine weight sync.

`hf` (default): the `rl_rollout` HF engine decodes with the very modules being trained, so there
is nothing to sync. `vllm`: a colocated `vllm.LLM` per process (one GPU each), asleep while the
trainer works; after every optimizer step the policy's current weights are pushed into it in
place (`VLLMEngine.load_weights`), the way verl's and TRL's colocated rollouts do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor import DTensor

from rl_models.logprobs import unwrap_peft
from rl_rollout.hf import HFEngine

BUCKET_BYTES = 512 * 2**20  # tensors per load_weights call: bounds the merged-LoRA copies alive at once


def build_engine(kind: str, model: torch.nn.Module, processor: Any, *, path: str, dtype: str, max_batch_size: int,
                 gpu_memory_utilization: float, rank: int, world_size: int) -> Any:
    """The rollout engine: `HFEngine` over the training model itself, or a colocated `VLLMEngine`
    loaded from the same checkpoint (weights kept in sync by `push_weights`)."""
    if kind == "hf":
        return HFEngine(unwrap_peft(model), processor, max_batch_size=max_batch_size)
    # colocated: the worker runs in this process, so load_weights passes tensors by reference
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rl_rollout.vllm import VLLMEngine

    extra = {"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}
    return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=rank,
                      max_num_seqs=max_batch_size, **extra)


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's current weights under its Hugging Face checkpoint names, which vLLM's
    `load_weights` takes (it maps them to its own layout): PEFT's `base_model.model.` prefix and
    `.base_layer` dropped, LoRA deltas merged (W + scale * B @ A, computed: the trained base
    weights are not touched), adapter tensors left out. Tied weights come once; FSDP2-sharded
    parameters are gathered whole."""
    base = unwrap_peft(model)
    lora = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    with torch.no_grad():
        for name, param in base.named_parameters():
            if ".lora_" in name:
                continue
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            owner_name, _, leaf = name.rpartition(".")
            owner = lora.get(owner_name.removesuffix(".base_layer"))
            if owner is not None and owner_name.endswith(".base_layer"):
                name = f"{owner_name.removesuffix('.base_layer')}.{leaf}"
                if leaf == "weight" and not owner.merged:
                    for adapter in owner.active_adapters:
                        tensor = tensor + owner.get_delta_weight(adapter).to(tensor.dtype)  # [out, in]
            yield name, tensor.detach()


def push_weights(engine: Any, model: torch.nn.Module, version: int) -> None:
    """Send `named_weights(model)` to the vLLM engine in buckets of ~`BUCKET_BYTES` (tensors are
    computed lazily, so at most one bucket of merged LoRA weights exists at a time)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_weights(model):
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            engine.load_weights(bucket, version=version)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    engine.load_weights(bucket, version=version)
