"""The policy's rollout engine as a trainer drives it, whatever the engine kind: the layer that
owns weight sync (verl's engine layer), so no app asks which engine it has.

    engine = build_policy_engine("auto", model=trained, processor=processor, path=checkpoint, ...)
    with engine.session() as sampler:        # ready to sample
        generations = sampler.generate(prompts, params)

It is the text policies' `rl_core.train.PolicyWeights`: give it to the trainer loop
(`Recipe.policy`), which calls `start()`, `stepped()` after each optimizer step (the next session
samples from the new weights) and, for an asynchronous run, `channel()`. A trainer of your own
calls `stepped()` after each optimizer step itself.

- `hf` (`rl_rollout.hf.HFEngine`): decodes with the very module being trained. A session puts
  it in eval mode, moves the optimizer state to pinned host memory while it decodes (making
  room for the KV cache; `offload_optimizer`), gathers a sharded policy's full weights
  (`rl_core.train.FullWeights`), and frees the KV cache afterwards (`release_cache`). A step
  has nothing to copy.
- `vllm`: a colocated `vllm.LLM` in this process (`rl_rollout.colocated`), asleep outside
  sessions (weights in host memory, KV cache freed) so the trainer has the GPU; each step
  pushes the trained weights (a LoRA merged, a sharded policy's gathered) into it while it sleeps.
  With `rollout_device` (split placement) it lives on a GPU of its own, its engine core in a
  process of its own (weights pushed as CUDA IPC handles), and never sleeps.

`weight_version` counts `stepped` calls: the optimizer steps in the weights the next session
samples with (log it as `rollout/weight_version`). The count goes into checkpoints
(`state_dict`), so a resumed run goes on from it.

`timer` (the trainer's `rl_core.train.PhaseTimer`, or any `timer(name)` context manager) times
the engine layer's own work as phases: `rollout_wake` and `rollout_sleep` (a session's start and
end: vLLM's wake and sleep, the optimizer state's trips to host memory), and `weight_sync` (a
push after an optimizer step; an asynchronous run's version loads on the rollout thread, and
`weight_publish` is the trainer's copy of each version). Inside
the app's `rollout` phase, generation is what the first two leave.

Asynchronous runs (`train.max_staleness >= 1`): `channel()` switches the engine to weights
of its own, which change only by version (`rl_core.train.WeightChannel`): the trainer publishes
a copy after each step, the rollout thread loads the one its step needs. `hf` then decodes with
a copy of the model (trainable weights its own, frozen ones shared: a LoRA's base is not
duplicated); `vllm` stays awake and takes each version as a weight push. `stepped` only counts
optimizer steps then; sessions neither sleep nor offload. On a rollout GPU of its own (split
placement) `hf` decodes with a whole copy of the model there, and `vllm` keeps each published
version's merged weights there until the rollout thread pushes them. A sharded policy (`full`, FSDP2)
publishes whole weights, gathered by every process on the trainer's thread (the rollout thread
runs no collective): `hf` decodes with a whole copy of the model of its own on every process
(built from one `FullWeights` gather; its frozen weights too, as the sharded ones cannot be
shared), each version the trainable parameters all-gathered; `vllm` gets each version from
`FullWeights`, as a synchronous push does. That whole copy stays for the run, where a
synchronous run fills `FullWeights` for each session only: budget the model once more per GPU.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
from transformers import PreTrainedModel, ProcessorMixin

from rl_core.train import (
    ConfigError,
    CopyChannel,
    CountedWeights,
    FullWeights,
    OptimizerOffload,
    ProcessState,
    WeightChannel,
    copy_sharing_frozen,
    finish_copies,
    gathered,
    isolated_rng,
)
from rl_rollout.partial import Drawn, PartialRollouts, round_generator
from rl_rollout.protocol import Engine, Generation, Prompt, SamplingParams, generate_seeded
from rl_rollout.registry import resolve_engine
from rl_rollout.streaming import ChunkScorer, ScoredRollout, generate_scored
from rl_rollout.streaming import PhaseTimer as ScoringTimer

__all__ = ["PolicyEngine", "build_policy_engine", "rollout_device"]

OffloadOptimizer = Literal["auto", "always", "never"]
PhaseTimer = Callable[[str], AbstractContextManager[Any]]
R = TypeVar("R")


def _untimed(name: str) -> AbstractContextManager[Any]:
    return nullcontext()


class PolicyEngine(CountedWeights):
    """A rollout engine bound to the policy it samples for (see the module doc).

    `shares_weights`: the engine decodes with the trained module itself (`hf`), so moving that
    module off the accelerator moves the engine's weights too (rider-grm's swap puts the engine
    to sleep with it). `pad_id`: the padding of the trainer's replay batches. `release_cache`:
    called after each session (the `hf` engine's KV cache freed)."""

    def __init__(self, engine: Engine, *, kind: str, trained: torch.nn.Module, pad_id: int,
                 full: FullWeights | None = None, optimizer_offload: OptimizerOffload | None = None,
                 release_cache: Callable[[], None] | None = None,
                 rebuild: Callable[[torch.nn.Module, torch.device], Engine] | None = None,
                 timer: PhaseTimer = _untimed, rollout_device: torch.device | None = None,
                 remote: bool = False, channel_device: torch.device | None = None, tokenizer: Any = None,
                 adapter_root: Path | None = None, adapter_push: bool = False) -> None:
        super().__init__(timer)
        self.engine, self.kind, self.trained, self.pad_id = engine, kind, trained, pad_id
        self.rollout_device = rollout_device  # vllm: the GPU of its own it was built on (split placement)
        self.channel_device = channel_device  # hf: where `channel()` moves its copy (split placement)
        self.remote = remote  # Ray actors (`rl_rollout.policy_pool`): weights of their own, pushed by version
        self.full, self.optimizer_offload, self.release_cache = full, optimizer_offload, release_cache
        self.rebuild = rebuild  # hf: an engine over another copy of the model (asynchronous runs)
        self.shares_weights = kind == "hf" and not remote
        self.tokenizer = tokenizer  # the policy's (partial rollouts decode their samples' text with it)
        self.adapter_root = adapter_root  # vllm with rollout.weight_push=adapter: where each version's adapter is written
        self.adapter_push = adapter_push  # Ray actors with rollout.weight_push=adapter: each version's LoRA alone
        self.partial: PartialRollouts | None = None  # `partial_rollouts`
        self.sampled_versions: tuple[int, float] | None = None  # the last partial sample's oldest and mean token version

    @property
    def state(self) -> str:
        """"awake" | "asleep" | "closed" (the engine's)."""
        return self.engine.state

    def channel(self) -> WeightChannel:
        """`weight_channel` on the rollout's own device (`build_policy_engine`'s `rollout_device`)."""
        return self.weight_channel(self.rollout_device if self.kind != "hf" else self.channel_device)

    def weight_channel(self, device: torch.device | None = None) -> WeightChannel:
        """Switch to weights of the engine's own, changed only by version (asynchronous runs;
        see the module doc); returns the `WeightChannel` the trainer loop drives. `device`: a
        GPU of the rollout's own (split placement): `hf`'s engine and its copy of the whole
        model move there; `vllm` must have been built there (`build_policy_engine`'s
        `rollout_device`). The trainer keeps its GPU."""
        if self.versions is not None:
            return self.versions
        from rl_models.logprobs import unwrap_peft

        trained = unwrap_peft(self.trained)
        if self.adapter_root is not None:
            raise ConfigError("rollout.weight_push=adapter pushes synchronously only (train.max_staleness=0) for now")
        if self.remote:  # each version a copy where the pool takes it (an actor's GPU, or host memory), pushed
            where = getattr(self.engine, "weight_device", torch.device("cpu"))  # by the rollout thread
            return self.counted(_PushChannel(self.engine, self.trained if self.adapter_push else trained, self.full, where,
                                             adapter=self.adapter_push))
        if self.kind == "hf":
            if self.rebuild is None:
                raise ValueError("this hf policy engine cannot be rebuilt over a copy of the model")
            if self.full is not None:  # sharded: a whole copy of its own, from one gather on every process
                where = torch.device(device) if device is not None else next(self.full.model.parameters()).device
                with self.full.gathered() as whole:
                    twin = cast(torch.nn.Module, copy.deepcopy(unwrap_peft(whole))).to(where).requires_grad_(False).eval()
            else:
                where = torch.device(device) if device is not None else next(trained.parameters()).device
                twin = copy_sharing_frozen(trained, where)
            self.engine, self.shares_weights = self.rebuild(twin, where), False
            return self.counted(CopyChannel(trained, twin))
        else:
            wanted = torch.device(device) if device is not None else None
            if wanted != self.rollout_device:
                raise ValueError(f"this vLLM policy engine was built on {self.rollout_device or 'the trainer GPU'}, "
                                 f"not on {wanted or 'the trainer GPU'}: pass the rollout device to build_policy_engine")
            self.engine.wake()  # awake for the whole run: the rollout thread samples while the trainer updates
            return self.counted(_PushChannel(self.engine, trained, self.full, self.rollout_device))

    @contextmanager
    def session(self) -> Iterator[Engine]:
        """The engine, ready to sample, for the block; afterwards the trainer has the memory."""
        if self.versions is not None or self.rollout_device is not None or self.remote:  # weights of its own, awake
            with _on(self.rollout_device):
                yield self.engine
            return
        if not self.shares_weights:
            with self.timer("rollout_wake"):
                if self.optimizer_offload is not None:
                    self.optimizer_offload.to_host()
                self.engine.wake()
            try:
                yield self.engine
            finally:
                with self.timer("rollout_sleep"):
                    self.engine.sleep()
                    if self.optimizer_offload is not None:
                        self.optimizer_offload.to_device()
            return
        model = self.full.model if self.full is not None else self.trained
        model.eval()
        with self.timer("rollout_wake"):
            if self.optimizer_offload is not None:
                self.optimizer_offload.to_host()
        try:
            with gathered(self.full, model):  # a sharded policy's full weights, this session only
                yield self.engine
        finally:
            with self.timer("rollout_sleep"):
                if self.release_cache is not None:
                    self.release_cache()
                if self.optimizer_offload is not None:
                    self.optimizer_offload.to_device()

    def sample(self, prompts: Sequence[Prompt], params: SamplingParams, *, seeds: Sequence[int] | None = None,
               score: ChunkScorer[R] | None = None, timer: ScoringTimer | None = None,
               ) -> tuple[list[Generation], ScoredRollout[R] | None]:
        """`params.n` samples of each prompt in a session (request-major). `seeds`: each prompt
        from its own seed (`generate_seeded`: the same samples whatever the process count and
        batch split); `score`: scored chunk by chunk on a thread as they finish
        (`rl_rollout.streaming.generate_scored`, its `timer` phases), returned with them."""
        with self.session() as engine:
            if score is not None:
                scored = generate_scored(engine, prompts, params, score, seeds=seeds, timer=timer)
                return scored.generations, scored
            if seeds is not None:
                return generate_seeded(engine, prompts, params, seeds), None
            return engine.generate(prompts, params), None

    def sample_groups(self, draw: Callable[[int], Drawn], take: int, params: SamplingParams, *,
                      budgets: Callable[[Any, int], int] | None = None) -> tuple[list[Any], list[Generation]]:
        """A step's `take` groups of `params.n` samples: their keys and generations
        (request-major, `request_index` into the keys). `draw(count)` gives the next `count`
        groups: keys (the recipe's prompt ids), prompts and seeds. Without partial rollouts
        these are `take` groups drawn now, sampled to the end from their seeds (`sample`); with
        them (`partial_rollouts`), the first `take` to finish of the groups in flight
        (`rl_rollout.partial`), each token tagged with the weight version that sampled it.
        `budgets(key, j)`: sample j's own `max_new_tokens` (partial rollouts only)."""
        if self.partial is None:
            if budgets is not None:
                raise ValueError("per-sample budgets need partial rollouts (partial_rollouts)")
            keys, prompts, seeds = draw(take)
            return list(keys), self.sample(prompts, params, seeds=seeds)[0]
        with self.session() as engine:
            keys, gens = self.partial.run(round_generator(engine), draw, take, params, self.weight_version,
                                          budgets=budgets)
        versions = [v for g in gens for v in g.token_versions]
        self.sampled_versions = (min(versions), sum(versions) / len(versions)) if versions else None
        return keys, gens

    def partial_rollouts(self, chunk_tokens: int, steps: int, *, rank: int = 0, world_size: int = 1) -> None:
        """Sample groups as partial rollouts (`rl_rollout.partial`: `steps` = K >= 1 steps a
        group may wait, `chunk_tokens` per round) from now on; K = 0 leaves them off."""
        if steps < 1:
            self.partial = None
            return
        tokenizer = self.tokenizer or getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"partial rollouts decode the samples' text: the {self.kind} engine has no tokenizer")
        self.partial = PartialRollouts(chunk_tokens, steps, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                       rank=rank, world_size=world_size)

    def in_flight(self) -> ProcessState | None:
        """The partial rollouts' groups in flight, for the checkpoint (each process its own)."""
        return None if self.partial is None else _InFlight(self.partial)

    def push(self) -> None:
        """Synchronous: the trained weights into the engine (after each optimizer step, and at
        start-up, when a resumed checkpoint is newer than the weights the engine loaded)."""
        if self.shares_weights:
            return
        from rl_rollout.colocated import push_adapter, push_weights

        if self.adapter_root is not None:  # the LoRA adapter alone, over the base vLLM loaded
            with self.timer("weight_sync"):
                push_adapter(self.engine, self.trained, self.weight_version, self.adapter_root)
            return
        if self.adapter_push:  # Ray actors merge the LoRA over base weights of their own
            from rl_models.lora import adapter_tensors

            with self.timer("weight_sync"):
                self.engine.load_weights(adapter_tensors(self.trained).items(), version=self.weight_version)
            return

        with self.timer("weight_sync"), gathered(self.full, self.trained) as model, _on(self.rollout_device):
            push_weights(self.engine, model, version=self.weight_version)  # a sharded policy's gathered, freed after

    def sleep(self) -> None:
        if self.rollout_device is not None or self.remote:  # a GPU of its own: nothing to make room for
            return
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        if self.versions is not None:
            self.versions.close()
        self.engine.close()
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)


class _InFlight(ProcessState):
    """`PartialRollouts` as a checkpoint value that every process saves and loads."""

    def __init__(self, partial: PartialRollouts) -> None:
        self.partial = partial

    def save(self, folder: Path) -> None:
        self.partial.save(folder)

    def load(self, folder: Path) -> None:
        self.partial.load(folder)


class _PushChannel:
    """vLLM's side of a `WeightChannel`: each version a copy of the merged weights
    (`rl_models.lora.merged_named_weights`, on the trainer's device, or on the engine's GPU of
    its own, `device`; a sharded policy's gathered by `full` on every process), pushed into the
    awake engine by `load`; with `adapter`, the LoRA alone, which Ray actors merge themselves."""

    def __init__(self, engine: Engine, trained: torch.nn.Module, full: FullWeights | None = None,
                 device: torch.device | None = None, *, adapter: bool = False) -> None:
        self.engine, self.trained, self.full, self.device = engine, trained, full, device
        self.adapter = adapter  # each version the LoRA alone (`rl_models.lora.adapter_tensors`), for Ray actors
        self.versions: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def publish(self, version: int) -> None:
        from rl_models.lora import adapter_tensors, merged_named_weights

        with gathered(self.full, self.trained) as model:  # the copies outlive the gather
            named = adapter_tensors(model).items() if self.adapter else merged_named_weights(model)
            weights = [(name, t.detach().to(self.device or t.device, copy=True)) for name, t in named]
        finish_copies(t for _, t in weights)
        with self._lock:
            self.versions[version] = weights

    def load(self, version: int, *, prune: bool = True) -> None:
        with self._lock:
            weights = self.versions[version]
            if prune:
                self.versions = {v: w for v, w in self.versions.items() if v >= version}
        with _on(self.device):
            self.engine.load_weights(weights, version=version)

    def close(self) -> None:
        with self._lock:
            self.versions.clear()


def _on(device: torch.device | None) -> AbstractContextManager[Any]:
    """`device` as this thread's current CUDA device inside the block (vLLM's kernels launch on
    the current device); nothing when None."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext()


def rollout_device(placement: str, accelerator: Any, *, workers: int = 0,
                   key: str = "rollout.placement") -> torch.device | None:
    """Where an asynchronous run's rollout engine samples: `colocated` -> None (the trainer's
    GPU); `split` -> a GPU of its own, `cuda:<local rank + local process count>` (the first half
    of a node's GPUs train, the second half roll out: launch one process per trainer GPU);
    None with `workers` (Ray actors, placed by Ray)."""
    if placement == "colocated" or workers:
        return None
    local_rank = int(accelerator.local_process_index)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    wanted = local_rank + local_world
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted >= count:
        raise ConfigError(f"{key}=split: process {local_rank} of {local_world} on this node rolls out on GPU {wanted}, "
                          f"but the node has {count} GPU(s); launch one process per trainer GPU (half of them)")
    return torch.device("cuda", wanted)


def build_policy_engine(
    kind: str,
    *,
    model: torch.nn.Module,
    processor: Any,
    path: str,
    dtype: str,
    device: torch.device,
    seed: int,
    world_size: int = 1,
    full: FullWeights | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    offload_optimizer: OffloadOptimizer = "never",
    release_cache: bool = False,
    max_batch_size: int = 64,
    compile: bool | None = None,
    compile_mode: str = "auto",
    gpu_memory_utilization: float = 0.3,
    engine_options: dict[str, Any] | None = None,
    key: str = "rollout.engine",
    timer: PhaseTimer = _untimed,
    rollout_device: torch.device | None = None,
    workers: int = 0,
    gpus_per_worker: float | None = None,
    ray_address: str | None = None,
    weight_push: str = "merged",
) -> PolicyEngine:
    """The policy's engine for a configured `kind` (`auto`, `hf`, `vllm`; `auto` resolves as
    `rl_rollout.resolve_engine` says and prints why).

    `model`: the trained transformers model (a PeftModel is fine: `hf` decodes through its
    base model with the adapters active; `vllm` gets the LoRA merged). `processor`: its
    tokenizer or processor. `path`: the checkpoint `vllm` loads. `full`: a sharded policy's
    full-weights copy. `offload_optimizer`: move `optimizer`'s state (Adam: 2x the weights) to
    pinned host memory during each session, on CUDA, unsharded: `auto` with `hf` (its KV cache
    grows into that memory; the copies run at PCIe bandwidth), `always` with either
    engine (vLLM's memory fraction then has more room), `never`. `release_cache`: free `hf`'s
    KV cache after each session (the update gets that memory; a compiled decode step with
    CUDA graphs then records a new graph per session). `compile`/`compile_mode`: `hf`'s decode
    step; `compile_mode="auto"` is `default` (fused kernels) for the synchronous engine and
    `reduce-overhead` (CUDA graphs) for the asynchronous one (`channel`), which stays
    awake and keeps its KV cache anyway: one launch per token holds the interpreter lock, which
    the rollout thread shares with the trainer's, far less (RESULTS.md has the measured gain).
    `gpu_memory_utilization`,
    `engine_options` (more `vllm.LLM` arguments), `seed`: `vllm`'s. `timer`: times the engine
    layer's phases (see the module doc); pass the trainer's `run.timer`. `rollout_device`: the
    rollout's GPU of its own (split placement, `rollout_device()`): `vllm` is built there and
    never sleeps (one training process only); `hf` moves there when `weight_channel` is called.
    `workers`: N > 0 builds the engine in N Ray actors instead (`rl_rollout.policy_pool`), each
    with `gpus_per_worker` GPUs (default: 1 on CUDA, every GPU but the trainer's for a local Ray
    instance; 0 on a CPU), in the cluster at `ray_address` (or `RAY_ADDRESS`, else a local one).
    Several training processes (`world_size`) need a cluster: each process drives `workers`
    actors of its own there. A local instance's actors take each version by CUDA IPC from a copy
    on their GPU; a cluster's, as host copies (`rl_rollout.policy_pool`). `weight_push`: `merged`
    (the LoRA merged into the base, every weight) or `adapter` (a LoRA policy's adapter alone:
    with `workers`, each actor merges it over base weights of its own, `load_adapter_merged`;
    else `vllm`, synchronous and colocated: vLLM's LoRA path samples with the adapter, written to
    host memory after each step, `rl_rollout.colocated.push_adapter`)."""
    resolved, why = resolve_engine(kind, key=key)
    if kind == "auto":
        print(f"{key}: {why}")
    if workers:
        return _pool_policy_engine(resolved, workers, gpus_per_worker, ray_address, model=model, processor=processor,
                                   path=path, dtype=dtype, device=device, seed=seed, world_size=world_size, full=full,
                                   max_batch_size=max_batch_size, gpu_memory_utilization=gpu_memory_utilization,
                                   engine_options=engine_options or {}, timer=timer, adapter=weight_push == "adapter")
    if resolved == "hf":
        from rl_models.logprobs import unwrap_peft
        from rl_rollout.hf import HFEngine

        decoded = full.model if full is not None else model
        hf = HFEngine(unwrap_peft(decoded), processor, device=device, max_batch_size=max_batch_size, compile=compile,
                      compile_mode="default" if compile_mode == "auto" else compile_mode)

        def rebuild(twin: torch.nn.Module, where: torch.device) -> HFEngine:  # the asynchronous engine, over a copy
            return HFEngine(cast(PreTrainedModel, twin), processor, device=where, max_batch_size=max_batch_size,
                            compile=compile, compile_mode="reduce-overhead" if compile_mode == "auto" else compile_mode)

        return PolicyEngine(hf, kind="hf", trained=model, pad_id=hf.pad_id, full=full,
                            optimizer_offload=_offload(optimizer, device, offload_optimizer in ("auto", "always"), full),
                            release_cache=hf.release_cache if release_cache else None, rebuild=rebuild, timer=timer,
                            channel_device=rollout_device, tokenizer=hf.tokenizer)
    from rl_rollout.colocated import colocated_vllm, vllm_engine_core

    if rollout_device is not None and world_size > 1:
        raise ConfigError(f"{key}=vllm on a rollout GPU of its own serves one training process, this run has "
                          f"{world_size}: use rollout.engine=hf, or one process")
    adapter_root = None
    if weight_push == "adapter":
        engine_options = {**(engine_options or {}), **_adapter_options(model, rollout_device, full)}
        shm = Path("/dev/shm")
        adapter_root = Path(tempfile.mkdtemp(prefix="rl-adapter-", dir=shm if shm.is_dir() else None))
    # in this process when colocated (pushes by reference while it sleeps); on a GPU of its own, a
    # process of its own (its loop does not share the trainer's interpreter lock; pushes by CUDA IPC)
    with vllm_engine_core(in_process=rollout_device is None), isolated_rng():  # vLLM seeds the global RNGs
        engine = colocated_vllm(path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                                max_num_seqs=max_batch_size, world_size=world_size, device=rollout_device,
                                **(engine_options or {}))
    if rollout_device is None:
        engine.sleep()  # the trainer has the memory until the first session
    tokenizer = processor.tokenizer if isinstance(processor, ProcessorMixin) else processor
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PolicyEngine(engine, kind="vllm", trained=model, pad_id=int(pad), full=full,
                        optimizer_offload=_offload(optimizer, device, offload_optimizer == "always", full), timer=timer,
                        rollout_device=rollout_device, tokenizer=tokenizer, adapter_root=adapter_root)


def _adapter_options(model: torch.nn.Module, rollout_device: torch.device | None, full: FullWeights | None) -> dict[str, Any]:
    """vLLM's LoRA settings for `weight_push=adapter`: one adapter of the policy's rank (rounded up
    to a rank vLLM takes), or a `ConfigError` where adapter pushes do not apply."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ConfigError("rollout.weight_push=adapter pushes a LoRA adapter: the policy trains every weight "
                          "(set a LoRA rank, or rollout.weight_push=merged)")
    if rollout_device is not None or full is not None:
        raise ConfigError("rollout.weight_push=adapter works with a colocated, unsharded policy for now "
                          "(rollout.placement=colocated, train.sharding=none)")
    config: Any = model.peft_config[model.active_adapter]  # a LoraConfig
    rank = int(config.r)
    return {"enable_lora": True, "max_loras": 1,
            "max_lora_rank": next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)}


def _pool_policy_engine(kind: str, workers: int, gpus_per_worker: float | None, ray_address: str | None, *,
                        model: torch.nn.Module, processor: Any, path: str, dtype: str, device: torch.device, seed: int,
                        world_size: int, full: FullWeights | None, max_batch_size: int,
                        gpu_memory_utilization: float, engine_options: dict[str, Any],
                        timer: PhaseTimer, adapter: bool = False) -> PolicyEngine:
    """`build_policy_engine(workers=N)`: the engine in N Ray actors (`rl_rollout.policy_pool`);
    `adapter`: each version the LoRA alone, merged by every actor (`load_adapter_merged`)."""
    from rl_rollout.policy_pool import (
        PoolEngine,
        build_worker_engine,
        load_adapter_merged,
        local_worker_devices,
        worker_gpu_ids,
    )
    from rl_rollout.ray_pool import EngineSpec, RolloutPool

    if adapter:
        from rl_models.lora import adapter_tensors

        if full is not None:
            raise ConfigError("rollout.weight_push=adapter to Ray actors pushes an unsharded LoRA for now "
                              "(train.sharding=none), or set rollout.weight_push=merged")
        try:
            adapter_tensors(model)
        except ValueError as error:
            raise ConfigError(f"rollout.weight_push=adapter: {error} (rollout.weight_push=merged)") from error

    on_cluster = bool(ray_address or os.environ.get("RAY_ADDRESS"))
    if world_size > 1 and not on_cluster:
        raise ConfigError(f"rollout engines as Ray actors for {world_size} training processes need a running Ray "
                          "cluster (ray_address or RAY_ADDRESS), where each process drives actors of its own")
    on_cuda = torch.device(device).type == "cuda"
    gpus = (1.0 if on_cuda else 0.0) if gpus_per_worker is None else gpus_per_worker
    gpu_ids = None if on_cluster else worker_gpu_ids(torch.device(device))
    if gpu_ids is not None and gpus * workers > len(gpu_ids):
        raise ConfigError(f"{workers} rollout worker(s) x {gpus} GPU(s) do not fit the GPUs left by the trainer "
                          f"({gpu_ids}): lower the workers or their GPUs")
    spec = EngineSpec(factory=build_worker_engine, kwargs={
        "kind": kind, "path": path, "dtype": dtype, "seed": seed, "max_batch_size": max_batch_size,
        "gpu_memory_utilization": gpu_memory_utilization, "engine_options": engine_options},
        load_weights=functools.partial(load_adapter_merged, path=path, dtype=dtype) if adapter else None)
    pool = RolloutPool(spec, workers, num_cpus=1.0, num_gpus=gpus, address=ray_address, gpu_ids=gpu_ids)
    tokenizer = processor.tokenizer if isinstance(processor, ProcessorMixin) else processor
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    devices = local_worker_devices(pool.health()) if gpu_ids is not None else None  # pushes by CUDA IPC there
    engine = PoolEngine(pool, devices=devices, row_budgets="seeded" if kind == "vllm" else None)  # vllm: a call per actor
    return PolicyEngine(engine, kind=kind, trained=model, pad_id=int(pad), full=full, timer=timer,
                        remote=True, tokenizer=tokenizer, adapter_push=adapter)


def _offload(optimizer: torch.optim.Optimizer | None, device: torch.device, wanted: bool,
             full: FullWeights | None) -> OptimizerOffload | None:
    """The optimizer state's trip to host memory during sessions: on CUDA, for an unsharded
    policy (a sharded one's state is 1/N of it, and FSDP2 offloads it itself)."""
    if not wanted or optimizer is None or full is not None or torch.device(device).type != "cuda":
        return None
    return OptimizerOffload(optimizer, device)
