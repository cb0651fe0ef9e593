"""The policy's rollout engine (`rollout.engine`).

`hf`: `rl_rollout.hf.HFEngine` over the training model itself: nothing to sync, it decodes with
the weights being trained (a sharded policy's full weights gathered for each rollout).
`vllm`: a colocated `vllm.LLM` per process (`rl_rollout.colocated`, the pattern of verl's and
TRL's colocated rollouts, as in caption-rl), loaded from the policy's checkpoint. It is awake
only while it generates (train and val rollouts) and asleep otherwise: while the judges score
(vLLM engines of their own, or hf models swapped onto the GPU) and while the policy trains. The
policy's weights are pushed into it after every optimizer step (`push_weights`: Hugging Face
names, a LoRA adapter would be merged; rider-grm trains the full model) and once at start-up,
since a resumed checkpoint is newer than the weights the engine loaded. `rollout/weight_version`
is the number of optimizer steps pushed. `auto` picks `vllm` on a CUDA machine where vLLM
imports, else `hf` (`rl_rollout.resolve_engine_kind`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from judging import vllm_engine_core
from rider_config import Config
from rider_parts import Parts
from transformers import PreTrainedModel

from rl_core.train import gathered, isolated_rng, sample_seed
from rl_rollout.colocated import colocated_vllm, push_weights
from rl_rollout.hf import HFEngine

__all__ = ["awake", "build", "pad_id", "push"]


def build(kind: str, model: PreTrainedModel, tokenizer: Any, cfg: Config, *, path: str, device: torch.device,
          rank: int, world_size: int) -> Any:
    """The engine for a resolved `kind`: `HFEngine` over `model` (the training model, or a
    sharded policy's full-weights copy), or a colocated `VLLMEngine` loaded from `path`, asleep."""
    r = cfg.rollout
    if kind == "hf":
        return HFEngine(model, tokenizer, device=device, compile=r.compile, max_batch_size=r.max_batch_size)
    # verl's context length: the longest prompt kept plus the response (not the model's full context)
    options = {"max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length, **r.engine_options}
    # isolated_rng: an in-process engine seeds the global RNGs with its own seed as it starts
    with vllm_engine_core(in_process=True), isolated_rng():
        engine = colocated_vllm(path, dtype=cfg.model.dtype, gpu_memory_utilization=r.gpu_memory_utilization,
                                seed=sample_seed(cfg.train.seed, rank) % 2**31, max_num_seqs=r.max_batch_size,
                                world_size=world_size, **options)
    engine.sleep()  # the judges' engines and the trainer get the memory until the first rollout
    return engine


def pad_id(engine: Any, tokenizer: Any) -> int:
    """The padding id of the replay batches: the `hf` engine's own; for vLLM the tokenizer's pad
    token, else its EOS (only masked positions carry it)."""
    if isinstance(engine, HFEngine):
        return engine.pad_id
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


@contextmanager
def awake(p: Parts) -> Iterator[Any]:
    """The engine, ready to sample: the `hf` engine with a sharded policy's full weights
    gathered (this rollout only); the vLLM engine woken (its KV cache back) and put to sleep
    again afterwards (weights to host memory, KV cache freed)."""
    if p.engine_kind == "hf":
        with gathered(p.full, p.engine.model):
            yield p.engine
        return
    p.engine.wake()
    try:
        yield p.engine
    finally:
        p.engine.sleep()


def push(p: Parts, bump: bool = True) -> None:
    """A vLLM engine samples the next rollouts from the updated policy: its weights (a sharded
    policy's gathered, and freed after) pushed in place, `weight_version` counting optimizer
    steps (`bump=False`: the start-up push). Sent while the engine sleeps, only its weights
    wake (`VLLMEngine.load_weights`); the KV cache comes back with the next rollout."""
    if p.engine_kind != "vllm":
        return
    p.weight_version += int(bump)
    with gathered(p.full, p.accelerator.unwrap_model(p.model).model) as model:
        push_weights(p.engine, model, version=p.weight_version)
