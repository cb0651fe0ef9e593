"""The policy's rollout engines as Ray actors (`rl_rollout.ray_pool`), for a trainer that keeps
rollout out of its own process: `build_policy_engine(..., workers=N)`.

Each actor builds the policy's engine (`hf` or `vllm`) from the checkpoint the trainer loaded and
samples on a GPU of its own (or the CPU). Its whole Python work, vLLM's client included, then runs
in the actor's process, not beside the trainer's kernel launches. The trainer pushes each
version's weights (a LoRA merged, Hugging Face names) as host copies through Ray's object store;
every actor reports the version it sampled with, and the pool refuses a rollout from another.

Choose it where the rollout should not share the trainer's process or GPU: the engines on GPUs of
their own, or on other nodes of a Ray cluster (`ray_address`). One training process for now.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import torch

from rl_rollout.protocol import Generation, Prompt, SamplingParams

__all__ = ["PoolEngine", "build_worker_engine", "check_ray", "worker_gpu_ids"]


def check_ray(workers: int, *, key: str = "rollout.workers") -> None:
    """Before any model loads: Ray actors need Ray installed."""
    if workers and importlib.util.find_spec("ray") is None:
        from rl_core.train import ConfigError
        from rl_rollout.ray_pool import INSTALL

        raise ConfigError(f"{key}={workers} runs the rollout engine in Ray actors: {INSTALL}")


def build_worker_engine(kind: str, path: str, *, dtype: str, seed: int, max_batch_size: int,
                        gpu_memory_utilization: float, engine_options: dict[str, Any]) -> Any:
    """The engine inside one actor (`EngineSpec.factory`): `hf` on the actor's GPU (or the CPU),
    or `vllm` with its engine core in the actor's process (weights pushed by reference there)."""
    if kind == "hf":
        from rl_rollout.hf import HFEngine

        return HFEngine.from_pretrained(path, dtype=None if dtype == "auto" else getattr(torch, dtype),
                                       max_batch_size=max_batch_size)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rl_rollout.vllm import VLLMEngine

    return VLLMEngine(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                      max_num_seqs=max_batch_size, **({"enable_sleep_mode": False} | engine_options))


def _generate_one(engine: Any, item: tuple[Prompt, SamplingParams]) -> list[Generation]:
    """One request from its own seed, inside an actor (`RolloutPool.map`)."""
    request, params = item
    return list(engine.generate([request], params))


def _score(engine: Any, item: tuple[list[int], Sequence[list[int]], Sequence[int], float]) -> torch.Tensor:
    """`Engine.score_next_tokens` inside an actor (`RolloutPool.map`)."""
    prefix, suffixes, candidates, temperature = item
    return engine.score_next_tokens(prefix, suffixes, candidates, temperature=temperature)


class PoolEngine:
    """The `Engine` protocol over a `RolloutPool`: requests sharded over the actors, results in
    request order. `load_weights` takes a whole version at once (`takes_whole_versions`: not in
    buckets) and pushes it to every actor."""

    takes_whole_versions = True

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.weight_version = 0
        self._state = "awake"
        self._pushes = 0  # the pool's own version counter: strictly increasing, whatever the caller numbers

    @property
    def state(self) -> str:
        return self._state

    @property
    def is_asleep(self) -> bool:
        return False

    def score_next_tokens(self, shared_prefix: list[int], suffixes: Sequence[list[int]], candidates: Sequence[int], *,
                          temperature: float = 1.0) -> torch.Tensor:
        """On one actor: `[len(suffixes), len(candidates)]` log-probs (the engine kind's own)."""
        return self.pool.map(_score, [(shared_prefix, list(suffixes), list(candidates), temperature)]).outputs[0]

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return list(self.pool.generate(list(requests), params).outputs)

    def generate_seeded(self, requests: Sequence[Prompt], params: SamplingParams,
                        seeds: Sequence[int]) -> list[Generation]:
        """`rl_rollout.generate_seeded` with the requests spread over the actors: the same
        samples as one engine gives, whatever the number of actors."""
        items = [(request, msgspec.structs.replace(params, seed=seed)) for request, seed in zip(requests, seeds, strict=True)]
        rollout = self.pool.map(_generate_one, items)
        return [msgspec.structs.replace(g, request_index=i) for i, gens in enumerate(rollout.outputs) for g in gens]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        state = {name: tensor.detach().to("cpu") for name, tensor in named_tensors}
        self._pushes += 1
        self.pool.load_weights(state, self._pushes)
        self.weight_version = self.weight_version + 1 if version is None else version

    def sleep(self) -> None:  # the actors' GPUs are their own: nothing to make room for
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        if self._state != "closed":
            self.pool.close()
        self._state = "closed"


def worker_gpu_ids(trainer_device: torch.device) -> list[str] | None:
    """The GPUs a local Ray instance may give the actors: every visible one but the trainer's
    (as `CUDA_VISIBLE_DEVICES` names them); None without CUDA."""
    if trainer_device.type != "cuda" or not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    ids = visible.split(",")
    mine = ids[trainer_device.index or 0]
    return [g for g in ids if g != mine]
