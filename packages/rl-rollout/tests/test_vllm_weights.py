"""`VLLMEngine` weight pushes, sleep states and image prompts, against a fake that stands in for
`vllm.LLM` (vLLM needs CUDA; the real engine is covered by the opt-in `vllm` test)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from rl_models import tiny


class FakeLLM:
    """Records what `VLLMEngine` asks of `vllm.LLM`; `collective_rpc` runs the function on a
    worker whose model's `load_weights` keeps what it receives."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model, self.kwargs, self.calls, self.received = model, kwargs, [], []

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model)

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        model = types.SimpleNamespace(load_weights=lambda weights: self.received.append(list(weights)))
        return [method(types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model)), *args)]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")


@pytest.fixture
def engine_cls(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, dict
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delitem(sys.modules, "rl_rollout.vllm", raising=False)
    from rl_rollout.vllm import VLLMEngine

    yield VLLMEngine
    sys.modules.pop("rl_rollout.vllm", None)


def test_load_weights_with_fake_vllm_llm_versions_and_wakes_only_the_weights(engine_cls):
    engine = engine_cls(str(tiny.build("qwen3")), dtype="float32")
    assert engine.llm.kwargs["enable_sleep_mode"] and engine.processor is None  # text model
    w = torch.ones(2, 3)
    engine.load_weights([("model.norm.weight", w)])
    assert engine.weight_version == 1 and engine.llm.received == [[("model.norm.weight", w)]]
    engine.sleep()
    engine.load_weights(iter([("lm_head.weight", w)]), version=7)  # a generator is fine
    engine.load_weights([("lm_head.weight", w)], version=7)  # a second bucket of the same update
    assert engine.weight_version == 7 and engine.is_asleep
    engine.wake()
    assert not engine.is_asleep
    assert engine.llm.calls == ["reset_prefix_cache", "sleep(1)", "wake_up(['weights'])", "reset_prefix_cache",
                                "reset_prefix_cache", "wake_up(['kv_cache'])"]
    engine.sleep()
    engine.wake()  # nothing pushed while asleep: everything wakes
    assert engine.llm.calls[-2:] == ["sleep(1)", "wake_up(None)"]


def test_image_prompt_becomes_text_plus_multi_modal_data_with_fake_vllm_llm(engine_cls):
    path: Path = tiny.build("qwen2_5_vl")
    engine = engine_cls(str(path))
    image = Image.new("RGB", (56, 56), "red")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]
    prompt = engine._prompt(messages, 0)
    assert prompt["multi_modal_data"] == {"image": [image]}
    assert prompt["prompt"].count("<|image_pad|>") == 1 and prompt["prompt"].rstrip().endswith("assistant")
    text_only = engine._prompt([{"role": "user", "content": "hi"}], 1)
    assert list(text_only) == ["prompt_token_ids"]
