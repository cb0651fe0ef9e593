from __future__ import annotations

import msgspec
import pytest
import torch

from rl_core.errors import UserError
from rl_rollout import Engine, SamplingParams, resolve_engine
from rl_rollout.hf import HFEngine


def test_unknown_sampling_field_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match="temprature"):
        msgspec.convert({"n": 2, "temprature": 0.5}, SamplingParams)


def test_sampling_params_from_dict() -> None:
    params = msgspec.convert({"n": 3, "temperature": 0.7, "stop": ["\n"]}, SamplingParams)
    assert params.n == 3 and params.temperature == 0.7 and params.stop == ("\n",)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("n", 0, "n must be >= 1"), ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"),
     ("top_k", -2, "top_k"), ("max_new_tokens", 0, "max_new_tokens")],
)
def test_bad_sampling_values_name_the_field(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_hf_engine_satisfies_protocol(qwen3_engine: HFEngine) -> None:
    assert isinstance(qwen3_engine, Engine)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does")
def test_engine_kind_without_cuda() -> None:
    """`auto` falls back to hf and says why; `vllm` asked for here is a user error naming the
    setting; other kinds pass through."""
    assert resolve_engine("auto") == ("hf", "hf (auto: no CUDA device, vLLM needs one)")
    assert resolve_engine("hf", key="rollout.engine") == ("hf", "hf (as configured)")
    with pytest.raises(UserError, match=r'^rollout\.engine = "vllm" needs a CUDA GPU'):
        resolve_engine("vllm", key="rollout.engine")
