"""`hf` engine on tiny Qwen-VL checkpoints: images and videos through the processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rl_models import tiny
from rl_rollout import SamplingParams
from rl_rollout.hf import HFEngine
from rl_rollout.protocol import Generation

IMAGE = Image.fromarray(np.random.RandomState(0).randint(0, 255, (56, 56, 3), dtype=np.uint8))
VIDEO = np.random.RandomState(1).randint(0, 255, (4, 56, 56, 3), dtype=np.uint8)  # [T, H, W, C]
REQUESTS = [
    [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "Describe."}]}],
    [{"role": "user", "content": [{"type": "video", "video": VIDEO}, {"type": "text", "text": "What happens?"}]}],
    [{"role": "user", "content": "No picture here."}],
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_engine(request: pytest.FixtureRequest) -> HFEngine:
    return HFEngine.from_pretrained(tiny.build(request.param), dtype=torch.float32, device="cpu")


def teacher_forced(engine: HFEngine, request: list[dict], gen: Generation, temperature: float) -> torch.Tensor:
    """Completion log-probs from one uncached forward over the processed prompt + completion,
    letting the model compute its own M-RoPE positions."""
    inputs = engine.processor.apply_chat_template(
        request, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert inputs["input_ids"][0].tolist() == gen.prompt_ids
    extra = torch.tensor([gen.completion_ids])  # [1, N]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], 1)
    with torch.no_grad():
        logits = engine.model(**inputs).logits[0].float()  # [T, V]
    lps = torch.log_softmax(logits / temperature, -1)[len(gen.prompt_ids) - 1 : -1]
    return lps.gather(-1, extra[0][:, None])[:, 0]


def test_image_and_video_generation_matches_teacher_forcing(vl_engine: HFEngine) -> None:
    gens = vl_engine.generate(REQUESTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=0))
    assert [g.request_index for g in gens] == [0, 0, 1, 1, 2, 2]
    tok = vl_engine.tokenizer
    assert tok.convert_tokens_to_ids("<|image_pad|>") in gens[0].prompt_ids
    assert tok.convert_tokens_to_ids("<|video_pad|>") in gens[2].prompt_ids
    for gen in gens:
        ref = teacher_forced(vl_engine, REQUESTS[gen.request_index], gen, 0.8)
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4), gen.request_index


def test_mixed_batch_equals_requests_alone(vl_engine: HFEngine) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    together = vl_engine.generate(REQUESTS, params)
    for i, request in enumerate(REQUESTS):
        alone = vl_engine.generate([request], params)[0]
        assert alone.completion_ids == together[i].completion_ids
        assert alone.logprobs == pytest.approx(together[i].logprobs, abs=1e-5)


def test_media_without_processor_is_a_clear_error(vl_engine: HFEngine) -> None:
    text_only = HFEngine(vl_engine.model, vl_engine.tokenizer)
    with pytest.raises(ValueError, match="request 0: holds images/videos but the engine has no processor"):
        text_only.generate(REQUESTS[:1], SamplingParams(max_new_tokens=2))
