"""The policy's engine as Ray actors (`build_policy_engine(workers=N)`, `rl_rollout.policy_pool`)
on a real local Ray instance started by the builder, hf engines on CPU: the actors sample what
the in-process engine samples from the same weights, before and after a push, synchronous
(`stepped`) and by version (`weight_channel`), whatever the number of actors."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import msgspec
import pytest
import torch

from rl_core.errors import UserError
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.engine import build_policy_engine
from rl_rollout import PartialRollouts, SamplingParams, generate_seeded
from rl_rollout.hf import HFEngine
from rl_rollout.partial import round_generator

PROMPTS = ["Hi", "The sky is", "One two", "A cat"]
SEEDS = [11, 12, 13, 14]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)


def budgets(key: int, j: int) -> int:
    """Partial rollouts' per-sample budgets: odd keys 9 tokens, even keys 2."""
    return 2 + 7 * (key % 2)


def draw_from(taken: list[int]):
    """A `draw` for partial rollouts: the next `count` prompt keys from `taken[0]`, each its own seed."""
    def draw(count: int):
        keys = list(range(taken[0], taken[0] + count))
        taken[0] += count
        return keys, [PROMPTS[k % len(PROMPTS)] for k in keys], keys
    return draw


def _samples(engine) -> list[tuple[int, list[int], list[float]]]:
    with engine.session() as sampler:
        gens = generate_seeded(sampler, PROMPTS, PARAMS, SEEDS)
    return [(g.request_index, g.completion_ids, [round(x, 4) for x in g.logprobs]) for g in gens]


def _build(model, tokenizer, path: str, workers: int):
    return build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                               device=torch.device("cpu"), seed=0, compile=False, workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_ray_actors_sample_what_the_in_process_engine_samples(workers: int) -> None:
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    local = _build(model, tokenizer, path, workers=0)
    remote = _build(model, tokenizer, path, workers=workers)
    try:
        assert remote.kind == "hf" and remote.remote and not remote.shares_weights
        assert remote.engine.pool.num_workers == workers
        before = _samples(local)
        assert _samples(remote) == before  # the actors loaded the same checkpoint
        scored = remote.engine.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12], temperature=0.7)
        assert torch.equal(scored, local.engine.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12], temperature=0.7))
        with torch.no_grad():  # an "optimizer step": the actors see it only after the push
            model.get_output_embeddings().weight.mul_(-1)
        assert _samples(remote) == before
        remote.stepped()
        after = _samples(local)
        assert after != before and _samples(remote) == after
        assert remote.weight_version == 1 and remote.engine.pool.version == 1
        # asynchronous runs: versions published by the trainer, loaded by the rollout thread
        channel = remote.weight_channel()
        channel.publish(1)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(-1)  # back to the first weights
        remote.stepped()  # only counts optimizer steps now
        channel.publish(2)
        channel.load(1)
        assert _samples(remote) == after
        channel.load(2)
        assert _samples(remote) == before and remote.engine.pool.version == 3  # the pool's own count: 3 pushes
    finally:
        remote.close()
        local.close()


def test_partial_rollouts_on_a_ray_actor_sample_what_one_engine_samples() -> None:
    """`train.partial_rollouts` over an actor: the groups in flight live in the trainer's process,
    each round's requests go to the actor as `Continuation`s, each with its budget and seed; it
    returns the groups, tokens and versions one engine returns sampling each request from its
    seed (`round_generator` of an engine without row budgets)."""
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    remote = _build(model, tokenizer, path, workers=1)
    local = HFEngine(model, tokenizer, device="cpu", compile=False)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=3)

    def summary(keys, gens):
        return keys, [(g.completion_ids, [round(x, 4) for x in g.logprobs], g.token_versions) for g in gens]

    try:
        remote.partial_rollouts(3, 1)
        draw = draw_from([0])
        got = []
        for _ in range(3):
            got.append(summary(*remote.sample_groups(draw, 2, params, budgets=budgets)))
            remote.stepped()  # a push of the same weights: the versions count on
        one = PartialRollouts(3, 1, tokenizer.decode)
        by_request, draw = round_generator(SimpleNamespace(generate=local.generate)), draw_from([0])
        want = [summary(*one.run(by_request, draw, 2, params, version=v, budgets=budgets)) for v in range(3)]
        assert got == want
        assert any(v != versions[0] for _, step in want for _, _, versions in step for v in versions)  # carried over
    finally:
        remote.close()


class SeededRows:
    """An `hf` engine that takes each request's budget and seed in one call, as `vllm` does
    (`row_budgets = "seeded"`), sampling request by request: the actors' side of `PoolEngine`'s
    one-call-per-actor path on a CPU. `calls` counts the calls that carried seeds."""

    row_budgets = "seeded"

    def __init__(self, path: str) -> None:
        self.inner, self.calls = HFEngine.from_pretrained(path, dtype=torch.float32), 0

    def __getattr__(self, name: str):
        return getattr(self.__dict__["inner"], name)

    def generate(self, requests, params, *, max_new_tokens=None, seeds=None):
        if seeds is None:
            return self.inner.generate(requests, params)
        self.calls += 1
        lengths = max_new_tokens or [params.max_new_tokens] * len(requests)
        return [msgspec.structs.replace(g, request_index=i)
                for i, (request, length, seed) in enumerate(zip(requests, lengths, seeds, strict=True))
                for g in self.inner.generate([request], msgspec.structs.replace(params, max_new_tokens=length, seed=seed))]


def test_seeded_rounds_cost_one_call_per_actor_and_sample_what_one_engine_samples() -> None:
    """Actors whose engines take a seed and budget per request (`vllm`'s `row_budgets`): seeded
    requests and partial rollouts' rounds go to each actor as one call for its contiguous shard,
    not one call per request, and return what one engine returns request by request."""
    from rl_rollout.policy_pool import PoolEngine
    from rl_rollout.ray_pool import EngineSpec, RolloutPool, ship_module

    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    local = HFEngine(model, tokenizer, device="cpu", compile=False)
    ship_module(sys.modules[__name__])  # SeededRows: this test module is not importable in the actors
    pool = RolloutPool(EngineSpec(factory=SeededRows, kwargs={"path": path}), 2, num_cpus=0)
    engine = PoolEngine(pool, row_budgets="seeded")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=3)
    try:
        summary = lambda gens: [(g.request_index, g.completion_ids, [round(x, 4) for x in g.logprobs])  # noqa: E731
                                for g in gens]
        want = summary(generate_seeded(SimpleNamespace(generate=local.generate), PROMPTS * 2, PARAMS, SEEDS * 2))
        assert summary(generate_seeded(engine, PROMPTS * 2, PARAMS, SEEDS * 2)) == want
        assert pool.map(lambda e, _: e.calls, [0, 1]).outputs == [1, 1]  # 4 requests each, one call
        runs = []
        for generate in (round_generator(engine), round_generator(SimpleNamespace(generate=local.generate))):
            partial, draw = PartialRollouts(3, 1, tokenizer.decode), draw_from([0])
            runs.append([(keys, summary(gens), [g.token_versions for g in gens])
                         for keys, gens in (partial.run(generate, draw, 2, params, version=v, budgets=budgets)
                                            for v in range(3))])
        assert runs[0] == runs[1]
    finally:
        pool.close()


def test_ray_actors_for_several_training_processes_need_a_cluster(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    with pytest.raises(UserError, match="Ray actors for 2 training processes need a running Ray cluster"):
        build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                            device=torch.device("cpu"), seed=0, world_size=2, workers=1)


def _pushed_by_handles(remote, local, model) -> None:
    """What the IPC tests below check: a push (`stepped`), then versions by the channel, then an
    actor killed and restarted from the last push's handles, each sampling as `local` does."""
    import ray

    before = _samples(local)
    assert _samples(remote) == before
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(-1)
    remote.stepped()
    after = _samples(local)
    assert after != before and _samples(remote) == after
    channel = remote.weight_channel()  # each version copied onto the actor's GPU by the trainer
    channel.publish(1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(-1)
    remote.stepped()
    channel.publish(2)
    channel.load(1)
    assert _samples(remote) == after
    channel.load(2)
    assert _samples(remote) == before
    ray.kill(remote.engine.pool.actors[0])  # restarted on the next rollout, its weights reopened from the handles
    assert _samples(remote) == before and remote.engine.pool.version == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_actor_on_this_machines_gpu_takes_pushes_by_cuda_ipc() -> None:
    """A local Ray instance's actor on this machine's GPU (here the trainer's own, half each, so
    one GPU is enough) takes each version as CUDA IPC handles of a copy on its GPU, not as host
    copies through Ray's object store."""
    from rl_policy.engine import PolicyEngine
    from rl_rollout.policy_pool import PoolEngine, build_worker_engine, local_worker_devices
    from rl_rollout.ray_pool import EngineSpec, RolloutPool

    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    model.to("cuda")
    local = build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                                device=torch.device("cuda", 0), seed=0, compile=False)
    spec = EngineSpec(factory=build_worker_engine, kwargs={
        "kind": "hf", "path": path, "dtype": "float32", "seed": 0, "max_batch_size": 64,
        "gpu_memory_utilization": 0.0, "engine_options": {}})
    pool = RolloutPool(spec, 1, num_gpus=0.5, gpu_ids=["0"])
    devices = local_worker_devices(pool.health())
    assert devices == [torch.device("cuda", 0)]  # Ray's GPU id "0", as this process numbers it
    remote = PolicyEngine(PoolEngine(pool, devices=devices), kind="hf", trained=model,
                          pad_id=int(tokenizer.pad_token_id or tokenizer.eos_token_id), remote=True)
    try:
        assert remote.engine.weight_device == torch.device("cuda", 0)
        _pushed_by_handles(remote, local, model)
    finally:
        remote.close()
        local.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for the actor")
def test_ray_actors_on_a_gpu_of_their_own_take_pushes_by_cuda_ipc() -> None:
    """`build_policy_engine(workers=1)` on GPU 0: its local Ray instance gets GPU 1, and every
    version crosses to it GPU to GPU, then by handle."""
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    model.to("cuda:0")
    local = build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                                device=torch.device("cuda", 0), seed=0, compile=False)
    remote = build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                                 device=torch.device("cuda", 0), seed=0, compile=False, workers=1)
    try:
        assert remote.engine.devices == [torch.device("cuda", 1)]
        _pushed_by_handles(remote, local, model)
    finally:
        remote.close()
        local.close()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or torch.cuda.device_count() < 2,
                    reason="needs vLLM and a second GPU for the actor")
def test_a_vllm_actor_merging_pushed_adapters_samples_as_with_merged_pushes() -> None:
    """`weight_push=adapter` to vLLM in a Ray actor on GPU 1: each version crosses as the LoRA
    alone and the actor merges it over base weights of its own; its samples equal, token for
    token, those of an actor that took the trainer's merged weights, before and after a push."""
    from rl_models.lora import add_lora

    path = str(tiny.build("qwen3_vllm"))  # 64-wide heads, as vLLM's attention wants
    model, tokenizer = load_causal_lm(path, dtype="bfloat16")
    model = add_lora(model.to("cuda:0"), family="qwen3", r=8)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    sampled = {}
    for push in ("merged", "adapter"):
        with torch.no_grad():  # the same starting adapter for both runs
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.zero_()
        engine = build_policy_engine("vllm", model=model, processor=tokenizer, path=path, dtype="bfloat16",
                                     device=torch.device("cuda", 0), seed=0, workers=1, weight_push=push,
                                     gpu_memory_utilization=0.3,
                                     engine_options={"max_model_len": 1024, "enforce_eager": True})
        try:
            assert engine.remote and engine.engine.devices == [torch.device("cuda", 1)]
            runs = []
            for version in (1, 2):
                with torch.no_grad():  # an optimizer step of the adapter alone
                    for name, param in model.named_parameters():
                        if "lora_B" in name:
                            param.normal_(std=0.1, generator=torch.Generator("cuda").manual_seed(version))
                engine.stepped()
                with engine.session() as sampler:
                    gens = generate_seeded(sampler, PROMPTS, params, SEEDS)
                runs.append([(g.request_index, g.completion_ids) for g in gens])
            sampled[push] = runs
        finally:
            engine.close()
    assert sampled["adapter"] == sampled["merged"]
    assert sampled["merged"][0] != sampled["merged"][1]  # each version's adapter changed the samples


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or torch.cuda.device_count() < 2,
                    reason="needs vLLM and a second GPU for the actor")
# vLLM 0.26's in-process engine client closes its sockets, not its ZeroMQ context: its __del__ warns
@pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")
def test_partial_rollouts_on_a_vllm_actor_sample_what_vllm_in_process_samples() -> None:
    """`train.partial_rollouts` over vLLM in a Ray actor on GPU 1: each round reaches the actor as
    one call with every request's seed and budget, and the groups, tokens and versions equal those
    of vLLM in this process on GPU 0 running the same rounds."""
    from rl_rollout.vllm import VLLMEngine

    path = str(tiny.build("qwen3_vllm"))
    model, tokenizer = load_causal_lm(path, dtype="bfloat16")
    options = {"max_model_len": 1024, "enforce_eager": True}
    remote = build_policy_engine("vllm", model=model.to("cuda:0"), processor=tokenizer, path=path, dtype="bfloat16",
                                 device=torch.device("cuda", 0), seed=0, workers=1, gpu_memory_utilization=0.3,
                                 engine_options=options)
    local = VLLMEngine(path, dtype="bfloat16", gpu_memory_utilization=0.3, seed=0, enable_sleep_mode=False, **options)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3)
    try:
        assert remote.engine.row_budgets == "seeded"
        remote.partial_rollouts(8, 1)
        draw, got = draw_from([0]), []
        for _ in range(3):
            keys, gens = remote.sample_groups(draw, 2, params, budgets=budgets)
            got.append((keys, [(g.completion_ids, g.token_versions) for g in gens]))
            remote.stepped()  # the same weights again: the versions count on
        one, draw = PartialRollouts(8, 1, tokenizer.decode), draw_from([0])
        want = [one.run(round_generator(local), draw, 2, params, version=v, budgets=budgets) for v in range(3)]
        assert got == [(keys, [(g.completion_ids, g.token_versions) for g in gens]) for keys, gens in want]
    finally:
        remote.close()
        local.close()
