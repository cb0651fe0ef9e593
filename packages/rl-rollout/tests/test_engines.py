"""The one builder for every kind (`load_engine`), the image engines' protocol and seeded
sampling, on CPU with the hf engine; the vLLM side runs in test_vllm.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import UserError
from rl_models import tiny
from rl_rollout import (
    ImageEngine,
    SamplingParams,
    build_image_engine,
    load_engine,
    resolve_judge_engine,
)
from rl_rollout.hf import HFEngine


def test_one_builder_for_every_kind_from_a_checkpoint() -> None:
    picks: list[str] = []
    engine = load_engine("auto", "tiny:qwen3", device="cpu", report=picks.append)  # a tiny: name is built
    assert isinstance(engine, HFEngine) and engine.state == "awake"
    if not torch.cuda.is_available():
        assert picks == ["hf (auto: no CUDA device, vLLM needs one)"]
        with pytest.raises(UserError, match=r'judge\.engine = "vllm" needs a CUDA GPU'):
            load_engine("vllm", str(tiny.build("qwen3")), key="judge.engine")


@pytest.mark.parametrize("cuda", [True, False])
def test_a_judge_engine_with_several_training_processes_is_hf_and_vllm_is_refused(
        monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """A vLLM judge's engine core starts on GPU 0 whatever the rank: with 2 processes on a CUDA
    machine `auto` is hf (saying why) and `vllm` is refused naming the key; without CUDA the
    reason given is that one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)  # the machine's answer, both ways
    key = "reward.judge_engine"
    assert resolve_judge_engine("hf", key=key, world_size=2) == ("hf", "hf (as configured)")
    if cuda:
        assert resolve_judge_engine("auto", key=key, world_size=2) == (
            "hf", "hf (auto: 2 training processes, a vLLM judge serves one)")
        with pytest.raises(UserError, match=r'^reward\.judge_engine = "vllm" serves one training process and this '
                                            r"run has 2"):
            resolve_judge_engine("vllm", key=key, world_size=2)
    else:
        assert resolve_judge_engine("auto", key=key, world_size=2) == ("hf", "hf (auto: no CUDA device, vLLM needs one)")
        with pytest.raises(UserError, match=r'^reward\.judge_engine = "vllm" needs a CUDA GPU'):
            resolve_judge_engine("vllm", key=key, world_size=2)


@pytest.mark.parametrize("kind", ["sd3", "janus"])
def test_image_engines_share_one_protocol(kind: str) -> None:
    engine = build_image_engine(kind, path=str(tiny.build(kind)), dtype="float32", device="cpu")
    assert isinstance(engine, ImageEngine)
    options = {"num_steps": 2, "height": 32, "width": 32, "max_sequence_length": 8} if kind == "sd3" else {}
    samples = engine.sample(["a red cube", "a red cube"], seeds=[3, 3], **options)
    assert samples.images.shape[:2] == (2, 3) and samples.log_probs.shape[0] == 2
    torch.testing.assert_close(samples.images[0], samples.images[1])  # the same seed draws the same sample
    with pytest.raises(KeyError, match="unknown image engine 'sd4'; valid: cosmos, janus, sd3, wan"):
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
