"""Rollout engines for caption-rl.

`hf`: the `rl_rollout` HF engine decodes with the very modules being trained, so there is
nothing to sync. `vllm`: a colocated `vllm.LLM` per process (`rl_rollout.colocated`), asleep
while the trainer works, with the policy's weights pushed into it after every optimizer step.
`auto` (the default) picks `vllm` on a CUDA machine where vLLM imports, else `hf`.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_models.logprobs import unwrap_peft
from rl_rollout.colocated import colocated_vllm, push_weights
from rl_rollout.hf import HFEngine

__all__ = ["build_engine", "push_weights"]


def build_engine(kind: str, model: torch.nn.Module, processor: Any, *, path: str, dtype: str, max_batch_size: int,
                 compile_mode: str, gpu_memory_utilization: float, rank: int, world_size: int,
                 engine_options: dict[str, Any] | None = None) -> Any:
    """The rollout engine for a resolved `kind` (`hf` or `vllm`): `HFEngine` over the training
    model itself, or a colocated `VLLMEngine` loaded from the same checkpoint."""
    if kind == "hf":
        return HFEngine(unwrap_peft(model), processor, max_batch_size=max_batch_size, compile_mode=compile_mode)
    return colocated_vllm(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=rank,
                          max_num_seqs=max_batch_size, world_size=world_size, **(engine_options or {}))
