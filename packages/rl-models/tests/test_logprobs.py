from __future__ import annotations

import pytest
import torch
from helpers import image, naive_logprobs, video

from rl_models.logprobs import TokenBatch, completion_logprobs
from rl_models.text import load_causal_lm
from rl_models.vl import load_vl_model


def _text_batch(tok) -> TokenBatch:
    prompt = tok(["Hello world, tell me", "The answer is"], return_tensors="pt", padding=True)
    completion = tok(
        ["A) red", " B"], return_tensors="pt", padding=True, padding_side="right"
    )
    return TokenBatch.from_prompt_completion(
        prompt.input_ids, prompt.attention_mask, completion.input_ids, completion.attention_mask
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_text_equals_naive_full_softmax(qwen3_path, temperature):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _text_batch(tok)
    assert batch.attention_mask[1, 0] == 0  # left-padded prompt row
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    expected = naive_logprobs(model, batch, temperature, position_ids=positions)
    got = completion_logprobs(model, batch, temperature=temperature, chunk_size=3)
    assert got.shape == batch.completion_ids.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got[batch.completion_mask == 0] == 0).all()
    assert (got[batch.completion_mask == 1] < 0).all()


def test_text_matches_generate_scores(qwen3_path):
    """Log-probs of a greedy continuation equal those `generate()` reports for it."""
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    prompt = tok(["Hi", "What is the answer?"], return_tensors="pt", padding=True)
    out = model.generate(
        **prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    completion = out.sequences[:, prompt.input_ids.shape[1] :]  # [B, 4]
    batch = TokenBatch.from_prompt_completion(
        prompt.input_ids, prompt.attention_mask, completion, torch.ones_like(completion)
    )
    logits = torch.stack(out.logits, dim=1)  # [B, 4, V]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
    torch.testing.assert_close(completion_logprobs(model, batch), expected, rtol=1e-4, atol=1e-4)


def test_gradient_flows(qwen3_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    completion_logprobs(model, _text_batch(tok)).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_vision_inputs_on_text_model_named(qwen3_path):
    model, tok = load_causal_lm(qwen3_path)
    batch = _text_batch(tok)
    bad = TokenBatch(
        batch.input_ids, batch.attention_mask, batch.prompt_length, image_grid_thw=torch.ones(1, 3)
    )
    with pytest.raises(ValueError, match=r"image_grid_thw.*text model"):
        completion_logprobs(model, bad)


def test_bad_prompt_length_named():
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt_length=4"):
        TokenBatch(ids, torch.ones_like(ids), prompt_length=4)


def _vl_batch(processor, kind: str, swap: bool) -> TokenBatch:
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Go."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    if kind == "image":
        pair = [image(0), image(1)]
        media = {"images": pair[::-1] if swap else pair}
    else:
        frames, meta = video()
        pair = [frames, frames[::-1].copy()]
        media = {"videos": pair[::-1] if swap else pair, "video_metadata": [meta, meta]}
        media["do_sample_frames"] = False
    inputs = processor(text=[text, text], return_tensors="pt", padding=True, **media)
    completion = processor.tokenizer(
        ["A cat [00:01]", " B"], return_tensors="pt", padding=True, padding_side="right"
    )
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return TokenBatch.from_prompt_completion(
        inputs["input_ids"],
        inputs["attention_mask"],
        completion.input_ids,
        completion.attention_mask,
        **vision,
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_vl_equals_naive_full_softmax(vl_paths, family, kind):
    model, processor = load_vl_model(vl_paths[family], dtype="float32")
    batch = _vl_batch(processor, kind, swap=False)
    got = completion_logprobs(model, batch, temperature=0.7, chunk_size=5)
    expected = naive_logprobs(model, batch, 0.7, **batch.vision_kwargs())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The pixels matter: swapping the two rows' media changes the log-probs.
    swapped = completion_logprobs(model, _vl_batch(processor, kind, swap=True), temperature=0.7)
    assert not torch.allclose(got, swapped)
