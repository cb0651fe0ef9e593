"""The policy engine layer (`rl_rollout.policy`) and the one builder for every kind
(`load_engine`), on CPU with the hf engine; the vLLM side runs in test_vllm.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import UserError
from rl_core.train import PhaseTimer
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_rollout import ImageEngine, SamplingParams, build_image_engine, load_engine
from rl_rollout.hf import HFEngine
from rl_rollout.policy import build_policy_engine


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
    engine.sync()
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


def test_one_builder_for_every_kind_from_a_checkpoint() -> None:
    engine = load_engine("auto", str(tiny.build("qwen3")), device="cpu")
    assert isinstance(engine, HFEngine) and engine.state == "awake"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r'judge\.engine = "vllm" needs a CUDA GPU'):
            load_engine("vllm", str(tiny.build("qwen3")), key="judge.engine")


@pytest.mark.parametrize("kind", ["sd3", "janus"])
def test_image_engines_share_one_protocol(kind: str) -> None:
    engine = build_image_engine(kind, path=str(tiny.build(kind)), dtype="float32", device="cpu")
    assert isinstance(engine, ImageEngine)
    options = {"num_steps": 2, "height": 32, "width": 32, "max_sequence_length": 8} if kind == "sd3" else {}
    samples = engine.sample(["a red cube", "a red cube"], seeds=[3, 3], **options)
    assert samples.images.shape[:2] == (2, 3) and samples.log_probs.shape[0] == 2
    torch.testing.assert_close(samples.images[0], samples.images[1])  # the same seed draws the same sample
    with pytest.raises(KeyError, match="unknown image engine 'sd4'; valid: janus, sd3"):
        build_image_engine("sd4", path="x")


def test_seeded_requests_sample_the_same_whatever_the_batch(qwen3_engine) -> None:
    from rl_rollout import generate_seeded

    params = SamplingParams(n=2, max_new_tokens=5)
    both = generate_seeded(qwen3_engine, ["Hi", "Bye"], params, seeds=[7, 8])
    alone = generate_seeded(qwen3_engine, ["Bye"], params, seeds=[8])
    assert [g.request_index for g in both] == [0, 0, 1, 1] and [g.request_index for g in alone] == [0, 0]
    assert [g.completion_ids for g in both[2:]] == [g.completion_ids for g in alone]
    with pytest.raises(ValueError, match="got 1 seeds for 2 requests"):
        generate_seeded(qwen3_engine, ["Hi", "Bye"], params, seeds=[7])
