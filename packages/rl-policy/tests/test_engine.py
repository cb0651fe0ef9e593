"""The policy engine layer (`rl_policy.engine`) on CPU with the hf engine; the vLLM side runs in
rl-rollout's test_vllm.py and the apps' vLLM tests (GPU)."""

from __future__ import annotations

import torch

from rl_core.train import PhaseTimer
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.engine import build_policy_engine
from rl_rollout import SamplingParams
from rl_rollout.hf import HFEngine


def test_an_hf_session_samples_from_the_trained_module_and_frees_its_cache() -> None:
    model, tokenizer = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    model.train()
    engine = build_policy_engine("auto", model=model, processor=tokenizer, path="", dtype="float32",
                                 device=torch.device("cpu"), seed=0, compile=False, release_cache=True)
    assert engine.kind == "hf" and engine.shares_weights and engine.state == "awake"
    assert engine.pad_id == tokenizer.pad_token_id and engine.optimizer_offload is None  # CPU: nothing to offload
    with engine.session() as sampler:
        assert not model.training  # decoding in eval mode
        first = sampler.generate(["Hi"], SamplingParams(max_new_tokens=4, seed=1))
    assert isinstance(engine.engine, HFEngine) and engine.engine._cache_released
    with torch.no_grad():  # the engine decodes with the trained module: a change is seen at once
        model.get_output_embeddings().weight.mul_(-1)
    engine.stepped()
    with engine.session() as sampler:
        second = sampler.generate(["Hi"], SamplingParams(max_new_tokens=4, seed=1))
    assert engine.weight_version == 1 and first[0].logprobs != second[0].logprobs


def test_the_engine_layer_times_its_own_phases() -> None:
    """Session start/end and weight moves are phases of the trainer's timer (metrics.csv
    `time/rollout_wake`, ...), so a slow rollout says whether decoding or the engine's
    housekeeping took the time."""
    model, tokenizer = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    timer = PhaseTimer()
    engine = build_policy_engine("hf", model=model, processor=tokenizer, path="", dtype="float32",
                                 device=torch.device("cpu"), seed=0, compile=False, timer=timer)
    with timer("rollout"), engine.session() as sampler:
        sampler.generate(["Hi"], SamplingParams(max_new_tokens=2, seed=1))
    times = timer.pop()
    assert {"time/rollout", "time/rollout_wake", "time/rollout_sleep"} <= times.keys()
    assert times["time/rollout_wake"] + times["time/rollout_sleep"] <= times["time/rollout"]
    channel = engine.weight_channel()  # asynchronous: the trainer publishes versions, the rollout loads them
    channel.publish(1)
    channel.load(1)
    assert {"time/weight_publish", "time/weight_sync"} <= timer.pop().keys()
