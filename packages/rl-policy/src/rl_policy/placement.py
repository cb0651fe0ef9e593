"""Where the policy's engine runs, as config keys and the rules an app checks before any model
loads (no torch imported here): in the trainer's process (`colocated`), on a GPU of its own in
that process (`split`), or as Ray actors on GPUs of their own (`rollout.workers`)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Literal

import msgspec

from rl_core.train.config import (
    ConfigError,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    UnitInterval,
)

__all__ = ["PolicyRolloutFields", "RolloutWorkerFields", "check_placement", "check_ray"]

RAY_INSTALL = 'pip install "rl-policy[ray]"; in a clone of the repository: uv sync --all-packages --extra ray'


class RolloutWorkerFields(msgspec.Struct, kw_only=True, frozen=True):
    """The `rollout.*` keys of the policy's engine as Ray actors, shared by the text apps: an
    app's `RolloutConfig` subclasses this (`check_placement` has their rules,
    `rl_rollout.policy_pool` the actors)."""

    workers: NonNegative = 0
    """0: the rollout engine lives in the training process. N > 0 (with placement=split): N Ray
    actors each hold rollout.engine, built from the policy's checkpoint, on a GPU of their own (a
    local Ray instance gets every GPU but the trainer's; 0 GPUs on a CPU machine); the weights are
    pushed to them after each step (by version when asynchronous), so their decoding and vLLM's
    client do not share the trainer's process. Synchronous or asynchronous. Several training
    processes each drive N actors of their own on a running Ray cluster (ray_address or
    RAY_ADDRESS); one process may start a local instance. Needs `pip install "rl-policy[ray]"`."""
    gpus_per_worker: NonNegativeFloat | None = None  # rollout.workers: None = 1 on CUDA, 0 on a CPU
    ray_address: str | None = None  # rollout.workers: join this Ray cluster (env RAY_ADDRESS); None starts one

    def cluster_address(self) -> str | None:
        """The Ray cluster the actors join: `ray_address`, else `RAY_ADDRESS`; None starts a local one."""
        return self.ray_address or os.environ.get("RAY_ADDRESS") or None


class PolicyRolloutFields(RolloutWorkerFields, kw_only=True, frozen=True):
    """The `rollout.*` keys of a text policy's engine, one vocabulary for every app: an app's
    `RolloutConfig` subclasses this, restating a field only to change its default."""

    weight_push: Literal["merged", "adapter"] = "merged"
    """How a LoRA policy's weights reach the rollout engine after each step: `merged` (the adapter
    merged into every base weight it touches, the whole model copied) or `adapter` (only the
    adapter). With `rollout.workers`, each Ray actor merges the adapter over base weights it read
    once from the checkpoint and decodes merged weights: choose it where versions travel through
    Ray's object store (actors on other nodes). Otherwise colocated, synchronous vLLM only, through
    vLLM's LoRA path (written to host memory, decoded with LoRA kernels); keep `merged` there: in
    process the merged push moves tensors by reference, faster than the adapter's trip through host
    memory, and LoRA kernels slow the decode (benchmarks/RESULTS.md, "LoRA weight push to vLLM")."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Who samples the policy's responses (`rl_policy.engine`). hf: the training model decodes (no
    second copy of the weights, nothing to sync; the only choice on a CPU). vllm: a colocated vLLM
    engine per GPU, awake only while it generates, the weights pushed after every optimizer step
    (faster decoding for long responses; needs a GPU and `pip install "rl-rollout[vllm]"`).
    auto: vllm on a CUDA machine where vLLM imports, else hf (the run says which, and why)."""
    placement: Literal["colocated", "split"] = "colocated"
    """With train.max_staleness >= 1: colocated, the rollout engine samples on the trainer's GPU;
    split, on a GPU of its own: launch one process per trainer GPU and each rolls out on GPU
    local rank + process count (2 GPUs: 1 trains, 1 samples), so rollout and update do not share
    compute; the engine holds a whole copy of the model there. vllm on split: one training
    process, its engine on GPU 1 (gpu_memory_utilization is of that GPU, so raise it); hf: any."""
    gpu_memory_utilization: UnitInterval = 0.3  # vllm: GPU memory fraction for its weights + KV cache while awake
    engine_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """vllm: more `vllm.LLM` arguments, e.g. {enforce_eager = true} (no compile or CUDA graphs:
    starts in seconds, decodes slower) or {max_model_len = 8192}."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """vllm: `fp8` samples with vLLM's online FP8 weights, quantized again at every push, for a
    faster decode of a large policy; the gap to the trainer is algo.rollout_correction's (TIS, MIS)."""
    n: Positive = 8  # responses sampled per prompt (the group size)
    temperature: PositiveFloat = 1.0
    top_p: UnitInterval = 1.0
    top_k: NonNegative = 0  # 0: no top-k cut
    max_new_tokens: Positive = 1024  # response length
    max_prompt_length: Positive = 4096  # longer prompts (media tokens included) are skipped or refused
    max_batch_size: Positive = 64  # rows decoded together (hf engine; vllm: its max_num_seqs)
    per_prompt_seeds: bool = False
    """Sample each prompt's group with its own seed, drawn from (train.seed, step, data index):
    the same rollouts whatever the process count or batch split (the 2-process = 1-process tests
    rely on it). Slower: one engine call per prompt instead of one per batch."""


def check_placement(placement: str, engine: str, max_staleness: int, *, world_size: int = 1, workers: int = 0,
                    ray_address: str | None = None, key: str = "rollout.placement") -> None:
    """The rule for a rollout GPU of its own (`split`): in the trainer's process it samples while
    the trainer updates, so it needs asynchronous rollouts, and a `vllm` engine there serves one
    training process (`hf` serves any number). As `workers` Ray actors (`rollout.workers`) it
    runs synchronous or asynchronous; several training processes each drive `workers` actors of
    their own on a running Ray cluster (`ray_address`: the app's `rollout.ray_address`, else
    `RAY_ADDRESS`), as one process can start a local one. `engine` is the resolved engine name."""
    if workers:
        if placement != "split":
            raise ConfigError(f"rollout.workers={workers} samples in Ray actors on GPUs of their own: it needs "
                              f"{key}=split")
        if world_size > 1 and not ray_address:
            raise ConfigError(f"rollout.workers={workers} with {world_size} training processes needs a running Ray "
                              "cluster, where each process drives its own actors: `ray start --head` (with the "
                              "rollout GPUs only), then set RAY_ADDRESS or rollout.ray_address; or launch one process")
        return
    if placement != "split":
        return
    if max_staleness < 1:
        raise ConfigError(f"{key}=split samples on its own GPU while the trainer updates: it needs "
                          "train.max_staleness >= 1")
    if engine == "vllm" and world_size > 1:
        raise ConfigError(f"{key}=split with rollout.engine=vllm runs one training process (its engine on the "
                          f"second GPU), this launch has {world_size}: launch one process, or use rollout.engine=hf")


def check_ray(workers: int, *, key: str = "rollout.workers") -> None:
    """Before any model loads: Ray actors need Ray installed."""
    if workers and importlib.util.find_spec("ray") is None:
        raise ConfigError(f"{key}={workers} runs the rollout engine in Ray actors: {RAY_INSTALL}")
