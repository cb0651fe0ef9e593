"""Rollout workers as Ray actors on a real local Ray cluster (2 CPUs), each holding a tiny SD3
`DiffusionEngine`: sharding and order, versioned weight sync, stale versions rejected, a worker
killed mid-rollout restarted and its shard retried."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from rl_models import tiny
from rl_rollout.ray_pool import (
    EngineSpec,
    RolloutPool,
    StaleWeightsError,
    WorkerDiedError,
    ship_module,
)

SAMPLING = {"num_steps": 2, "height": 32, "width": 32, "max_sequence_length": 8, "guidance_scale": 3.0}
ITEMS = [(("a red sign",), (0,)), (("a cat", "a dog"), (1, 2)), (("sky",), (3,)),
         (("a shop sign", "blue"), (4, 5)), (("green",), (6,))]  # (prompts, seeds) per call


def build_engine(path: str):
    from rl_rollout.diffusion import DiffusionEngine

    return DiffusionEngine.from_pretrained(path)


def load_proj_out(engine, state: Mapping[str, torch.Tensor]) -> None:
    """The weights a trainer would push: here the transformer's output projection."""
    engine.transformer.proj_out.load_state_dict(state)


def sample_item(engine, item, **kwargs):
    prompts, seeds = item
    return engine.sample(list(prompts), seeds=list(seeds), **kwargs)


def _ray():
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def sd3_path() -> str:
    return str(tiny.build("sd3"))


@pytest.fixture(scope="module")
def cluster():
    ray = _ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ship_module(sys.modules[__name__])  # this test module is not importable in the workers
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster, sd3_path: str):
    spec = EngineSpec(factory=build_engine, kwargs={"path": sd3_path}, load_weights=load_proj_out)
    with RolloutPool(spec, num_workers=2) as pool:
        yield pool


@pytest.fixture(scope="module")
def local(sd3_path: str):
    return build_engine(sd3_path)


@pytest.mark.slow  # two more engines to start (~30 s); first, while the cluster's 2 CPUs are free
def test_generate_shards_requests_with_global_request_indexes(cluster) -> None:
    from rl_rollout import SamplingParams
    from rl_rollout.hf import HFEngine

    path = str(tiny.build("qwen3"))
    spec = EngineSpec(factory=HFEngine.from_pretrained, kwargs={"path": path, "dtype": torch.float32})
    requests = ["The cat", "A dog", [1, 2, 3]]
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    with RolloutPool(spec, num_workers=2) as pool:
        rollout = pool.generate(requests, params)
    local = HFEngine.from_pretrained(path, dtype=torch.float32)
    expected = local.generate(requests[:2], params) + local.generate(requests[2:], params)  # one call per shard
    assert [g.request_index for g in rollout.outputs] == [0, 0, 1, 1, 2, 2]
    assert rollout.workers == [0, 0, 0, 0, 1, 1]
    assert [g.completion_ids for g in rollout.outputs] == [g.completion_ids for g in expected]


def _assert_same(remote, reference) -> None:
    assert remote.prompts == reference.prompts
    for name in ("latents", "log_probs", "images"):
        torch.testing.assert_close(getattr(remote, name), getattr(reference, name), rtol=0, atol=1e-6, msg=name)


def test_items_are_sharded_and_gathered_in_order(pool: RolloutPool, local) -> None:
    rollout = pool.map(sample_item, ITEMS, **SAMPLING)
    assert rollout.workers == [0, 0, 0, 1, 1]  # contiguous shards, sizes differing by at most 1
    assert rollout.versions == [pool.version] * len(ITEMS)
    for item, traj in zip(ITEMS, rollout.outputs, strict=True):
        _assert_same(traj, sample_item(local, item, **SAMPLING))  # same seeds -> same trajectory
    assert len({h.pid for h in pool.health()} | {os.getpid()}) == 3  # two worker processes


def test_weights_are_synced_by_version(pool: RolloutPool, local) -> None:
    before = pool.map(sample_item, ITEMS[:2], **SAMPLING).outputs
    state = {k: v * 0.5 for k, v in local.transformer.proj_out.state_dict().items()}
    version = (pool.version or 0) + 1
    pool.load_weights(state, version)
    assert [h.version for h in pool.health()] == [version, version]
    rollout = pool.map(sample_item, ITEMS[:2], **SAMPLING)
    assert rollout.versions == [version, version]
    assert not torch.equal(rollout.outputs[0].latents[:, -1], before[0].latents[:, -1])  # new weights used
    saved = {k: v.clone() for k, v in local.transformer.proj_out.state_dict().items()}
    load_proj_out(local, state)
    try:
        _assert_same(rollout.outputs[1], sample_item(local, ITEMS[1], **SAMPLING))
    finally:
        load_proj_out(local, saved)


def test_stale_versions_are_rejected(pool: RolloutPool, local) -> None:
    ray = _ray()
    state = dict(local.transformer.proj_out.state_dict())
    pool.load_weights(state, (pool.version or 0) + 2)
    with pytest.raises(StaleWeightsError, match="refusing older"):
        pool.load_weights(state, pool.version - 1)
    actor = pool.actors[0]
    with pytest.raises(StaleWeightsError, match="refusing older"):  # the worker guards itself too
        ray.get(actor.load_weights.remote(state, pool.version - 1))
    with pytest.raises(StaleWeightsError, match=f"rollout expects v{pool.version - 1}"):
        ray.get(actor.map.remote(sample_item, ITEMS[:1], SAMPLING, pool.version - 1))
    assert pool.map(sample_item, ITEMS[:2], **SAMPLING).versions == [pool.version] * 2


def test_sleeping_workers_refuse_rollouts_until_woken(pool: RolloutPool) -> None:
    pool.sleep()
    assert all(h.asleep for h in pool.health())
    with pytest.raises(RuntimeError, match="asleep"):
        pool.map(sample_item, ITEMS[:1], **SAMPLING)
    pool.wake()
    assert len(pool.map(sample_item, ITEMS[:2], **SAMPLING).outputs) == 2


def test_a_worker_killed_mid_rollout_is_restarted_and_its_shard_retried(pool: RolloutPool, local, tmp_path: Path) -> None:
    marker = tmp_path / "died"

    def die_once(engine, item, **kwargs):
        if item == ITEMS[4] and not marker.exists():
            marker.touch()
            os._exit(1)  # a real crash of the worker process, mid-shard
        return sample_item(engine, item, **kwargs)

    state = {k: v * 0.25 for k, v in local.transformer.proj_out.state_dict().items()}
    pool.load_weights(state, pool.version + 1)
    pids = [h.pid for h in pool.health()]
    rollout = pool.map(die_once, ITEMS, **SAMPLING)
    untouched, restarted = pool.health()
    assert marker.exists() and untouched.pid == pids[0]
    assert restarted.pid != pids[1] and restarted.version == pool.version  # the latest weights reloaded
    assert rollout.versions == [pool.version] * len(ITEMS) and rollout.workers == [0, 0, 0, 1, 1]
    reference = pool.map(sample_item, ITEMS, **SAMPLING).outputs
    for traj, ref in zip(rollout.outputs, reference, strict=True):
        _assert_same(traj, ref)


def test_a_worker_that_dies_twice_on_its_shard_is_a_clear_error(pool: RolloutPool) -> None:
    def always_die(engine, item, **kwargs):
        if item == ITEMS[4]:
            os._exit(1)
        return sample_item(engine, item, **kwargs)

    with pytest.raises(WorkerDiedError, match=r"worker 1 died twice on its shard \(items 3\.\.4\)"):
        pool.map(always_die, ITEMS, **SAMPLING)


def broken_engine(path: str):
    raise FileNotFoundError(f"no checkpoint at {path}")


def test_a_worker_that_cannot_start_is_a_clear_error(cluster) -> None:
    spec = EngineSpec(factory=broken_engine, kwargs={"path": "/nowhere"})
    with pytest.raises(RuntimeError, match=r"(?s)rollout worker 0 failed to start.*no checkpoint at /nowhere"):
        RolloutPool(spec, num_workers=1, num_cpus=0)  # 0 CPUs: schedulable next to the pool's workers
    with pytest.raises(RuntimeError, match=r"(?s)rollout worker 0 did not start within 2 s.*resources"):
        RolloutPool(spec, num_workers=1, num_gpus=1, start_timeout_s=2)  # no GPU in this cluster


def test_without_ray_the_error_names_the_extra(monkeypatch, sd3_path: str) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "rl-rollout\[ray\]"'):
        RolloutPool(EngineSpec(factory=build_engine, kwargs={"path": sd3_path}), num_workers=1)
