"""The policy's rollout engines as Ray actors (`rl_rollout.ray_pool`), for a trainer that keeps
rollout out of its own process: `build_policy_engine(..., workers=N)`.

Each actor builds the policy's engine (`hf` or `vllm`) from the checkpoint the trainer loaded and
samples on a GPU of its own (or the CPU). Its whole Python work, vLLM's client included, then runs
in the actor's process, not beside the trainer's kernel launches. The trainer pushes each
version's weights (a LoRA merged, Hugging Face names); every actor reports the version it
sampled with, and the pool refuses a rollout from another.

How the weights travel: where the actors are on this machine's GPUs (a local Ray instance), the
trainer copies each version onto the actor's GPU (GPU to GPU) and sends only CUDA IPC handles
(`rl_rollout.cuda_ipc`); the actor copies from them into its engine. Elsewhere (other nodes, or
no CUDA), as host copies through Ray's object store, which for a policy of a few GB takes many
times longer than by handle (benchmarks/RESULTS.md, "caption-rl on 2 GPUs with vLLM rollouts: the
engine in a Ray actor").

A LoRA policy may push its adapter alone (`weight_push="adapter"`): each actor reads the adapted
weights once from the checkpoint and merges every version's adapter over them itself
(`load_adapter_merged`), so a version carries megabytes instead of the whole model, and the
engine still decodes merged weights. Choose it where versions travel through the object store
(other nodes); on one machine the pushes by handle are fast already.

Choose it where the rollout should not share the trainer's process or GPU: the engines on GPUs of
their own, or on other nodes of a Ray cluster (`ray_address`). Several training processes each
drive actors of their own, on a running cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import torch

from rl_rollout.protocol import Continuation, Generation, Prompt, SamplingParams

__all__ = ["PoolEngine", "build_worker_engine", "load_adapter_merged", "local_worker_devices", "worker_gpu_ids"]


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


def load_adapter_merged(engine: Any, state: Mapping[str, torch.Tensor], *, path: str, dtype: str) -> None:
    """`EngineSpec.load_weights` for adapter pushes: `state` is a version's LoRA
    (`rl_models.lora.adapter_tensors`); the weights it adapts are kept once in host memory, as
    the checkpoint at `path` loads them in `dtype` (`_adapted_base`), and each version's merge is
    computed one weight at a time on this actor's GPU (or the CPU) and loaded into the engine."""
    from rl_models.lora import merge_adapter

    names = sorted({key.rpartition(":")[0] for key in state})
    base = getattr(engine, "adapted_base", None)
    if base is None or sorted(base) != names:
        base = engine.adapted_base = _adapted_base(engine, path, names, dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    engine.load_weights(merge_adapter(base, dict(state), device))


def _adapted_base(engine: Any, path: str, names: list[str], dtype: str) -> dict[str, torch.Tensor]:
    """The weights `names` as the checkpoint loads them, copied to host memory: an `hf` engine's
    own (before any push changed them), else those of a CPU load by transformers (its weight names
    and dtype cast, as the trainer's)."""
    from rl_rollout.hf import load_checkpoint

    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        model, _ = load_checkpoint(path, None if dtype == "auto" else getattr(torch, dtype))
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [name for name in names if name not in params]
    if missing:
        raise KeyError(f"{path}: the model has no {missing[:3]} ({len(missing)} of the weights the pushed LoRA adapts)")
    return {name: params[name].detach().to("cpu", copy=True) for name in names}


def _generate_one(engine: Any, item: tuple[Prompt, SamplingParams]) -> list[Generation]:
    """One request from its own seed, inside an actor (`RolloutPool.map`)."""
    request, params = item
    return list(engine.generate([request], params))


def _generate_rows(engine: Any, item: tuple[list[Prompt], SamplingParams, list[int] | None, list[int]]) -> list[Generation]:
    """One actor's shard of seeded requests, each with its own seed and budget, in one engine call
    (an engine with `row_budgets = "seeded"`, `vllm`); `request_index` counts within the shard."""
    requests, params, lengths, seeds = item
    return list(engine.generate(requests, params, max_new_tokens=lengths, seeds=seeds))


def _score(engine: Any, item: tuple[list[int], Sequence[list[int]], Sequence[int], float]) -> torch.Tensor:
    """`Engine.score_next_tokens` inside an actor (`RolloutPool.map`)."""
    prefix, suffixes, candidates, temperature = item
    return engine.score_next_tokens(prefix, suffixes, candidates, temperature=temperature)


class PoolEngine:
    """The `Engine` protocol over a `RolloutPool`: requests sharded over the actors, results in
    request order. `load_weights` takes a whole version at once (`takes_whole_versions`: not in
    buckets) and pushes it to every actor."""

    takes_whole_versions = True

    def __init__(self, pool: Any, *, devices: Sequence[torch.device] | None = None,
                 row_budgets: str | None = None) -> None:
        self.pool = pool
        # "seeded" when the actors' engines take each request's seed and budget in one call (`vllm`):
        # seeded requests and partial rollouts' rounds then cost one call per actor, not one per request
        self.row_budgets = row_budgets
        # worker i's GPU as this process numbers it (`local_worker_devices`): pushes by CUDA IPC; None: host copies
        self.devices = list(devices) if devices else None
        self.weight_version = 0
        self._state = "awake"
        self._pushes = 0  # the pool's own version counter: strictly increasing, whatever the caller numbers
        self._shared: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}  # the last push's tensors, kept alive

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

    def generate(self, requests: Sequence[Prompt | Continuation], params: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None, seeds: Sequence[int] | None = None) -> list[Generation]:
        """`Engine.generate` over the actors. `max_new_tokens`, `seeds`: each request's own budget and
        seed, as partial rollouts give their rounds; only where `row_budgets == "seeded"`."""
        if max_new_tokens is None and seeds is None:
            return list(self.pool.generate(list(requests), params).outputs)
        if self.row_budgets != "seeded" or seeds is None:
            raise ValueError("per-request budgets go to actors whose engines take them with a seed each "
                             "(row_budgets='seeded', vllm)")
        return self._seeded_rows(list(requests), params, None if max_new_tokens is None else list(max_new_tokens), list(seeds))

    def generate_seeded(self, requests: Sequence[Prompt], params: SamplingParams,
                        seeds: Sequence[int]) -> list[Generation]:
        """`rl_rollout.generate_seeded` with the requests spread over the actors: the same
        samples as one engine gives, whatever the number of actors. One call per actor where its
        engine takes a seed per request (`row_budgets == "seeded"`), else one per request."""
        if len(seeds) != len(requests):
            raise ValueError(f"got {len(seeds)} seeds for {len(requests)} requests")
        if self.row_budgets == "seeded":
            return self._seeded_rows(list(requests), params, None, list(seeds))
        items = [(request, msgspec.structs.replace(params, seed=seed)) for request, seed in zip(requests, seeds, strict=True)]
        rollout = self.pool.map(_generate_one, items)
        return [msgspec.structs.replace(g, request_index=i) for i, gens in enumerate(rollout.outputs) for g in gens]

    def _seeded_rows(self, requests: list[Prompt | Continuation], params: SamplingParams, lengths: list[int] | None,
                     seeds: list[int]) -> list[Generation]:
        """The requests cut into one contiguous shard per actor, each shard one engine call."""
        spans = self.pool.shard_spans(len(requests))
        items = [(requests[a:b], params, None if lengths is None else lengths[a:b], seeds[a:b]) for a, b in spans]
        rollout = self.pool.map(_generate_rows, items)  # one item per actor: each gets its shard
        return [msgspec.structs.replace(g, request_index=g.request_index + a)
                for (a, _), gens in zip(spans, rollout.outputs, strict=True) for g in gens]

    @property
    def weight_device(self) -> torch.device:
        """Where a caller should make each version's copy so that a push copies nothing more:
        the first worker's GPU (pushes by CUDA IPC), else host memory."""
        return self.devices[0] if self.devices else torch.device("cpu")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        self._pushes += 1
        if self.devices is None:
            self.pool.load_weights({name: tensor.detach().to("cpu") for name, tensor in named_tensors}, self._pushes)
        else:
            self._push_shared([(name, tensor.detach()) for name, tensor in named_tensors], self.devices)
        self.weight_version = self.weight_version + 1 if version is None else version

    def _push_shared(self, named: list[tuple[str, torch.Tensor]], devices: list[torch.device]) -> None:
        """One version by CUDA IPC: the tensors on each worker's GPU (copied there unless they
        are), the copies finished, then only their handles sent. They stay alive until the next
        push, for a restarted worker to reload, so tensors already on a worker's GPU must not
        change until then: a `WeightChannel`'s versions do not, and `build_policy_engine` never
        puts an actor on the trainer's GPU, where a synchronous push sends live parameters."""
        from rl_rollout.cuda_ipc import ipc_payload

        shared = {device: [(name, t if t.device == device else t.to(device)) for name, t in named]
                  for device in dict.fromkeys(devices)}
        for device in {t.device for _, t in named if t.is_cuda} | set(shared):  # sources and targets
            torch.cuda.synchronize(device)
        payloads = {device: ipc_payload(tensors) for device, tensors in shared.items()}
        self.pool.load_shared_weights([payloads[device] for device in devices], self._pushes)
        self._shared = shared  # the previous version's copies go now that every worker holds this one

    def sleep(self) -> None:  # the actors' GPUs are their own: nothing to make room for
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        if self._state != "closed":
            self.pool.close()
        self._state = "closed"


def worker_gpu_ids(trainer_device: torch.device, *, colocated: bool = False) -> list[str] | None:
    """The GPUs a local Ray instance may give the actors (as `CUDA_VISIBLE_DEVICES` names them):
    every visible one but the trainer's, or with `colocated` the trainer's alone; None without
    CUDA."""
    if trainer_device.type != "cuda" or not torch.cuda.is_available():
        return None
    ids = _visible_gpus()
    mine = ids[trainer_device.index or 0]
    return [mine] if colocated else [g for g in ids if g != mine]


def local_worker_devices(health: Sequence[Any]) -> list[torch.device] | None:
    """Each worker's GPU as this process numbers it, where every worker (`RolloutPool.health()`)
    runs on this machine with one GPU that this process sees: the pool then takes pushes by CUDA
    IPC (`PoolEngine(devices=...)`). None otherwise: host copies. Call it only for a local Ray
    instance started with this process's `CUDA_VISIBLE_DEVICES` names (`worker_gpu_ids`)."""
    if not torch.cuda.is_available():
        return None
    import ray

    here, visible = ray.util.get_node_ip_address(), _visible_gpus()
    devices = []
    for worker in health:
        if worker.node != here or len(worker.gpu_ids) != 1 or worker.gpu_ids[0] not in visible:
            return None
        devices.append(torch.device("cuda", visible.index(worker.gpu_ids[0])))
    return devices


def _visible_gpus() -> list[str]:
    """This process's GPUs by the names `CUDA_VISIBLE_DEVICES` gives them (Ray's GPU ids)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return visible.split(",")
