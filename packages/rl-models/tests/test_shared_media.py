"""share_identical_media: the vision tower encodes repeated images/videos once, with the same
log-probs and gradients as encoding every copy."""

from __future__ import annotations

import pytest
import torch
from helpers import image, video

from rl_models.logprobs import TokenBatch, completion_logprobs
from rl_models.shared_media import share_identical_media
from rl_models.vl import load_vl_model


def _group_batch(processor, kind: str) -> TokenBatch:
    """Five rows like a GRPO micro-batch: media A three times, media B twice, in mixed order,
    each row with its own completion."""
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Go."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    order = [0, 1, 0, 0, 1]
    if kind == "image":
        pair = [image(0), image(1)]
        media = {"images": [pair[i] for i in order]}
    else:
        frames, meta = video()
        pair = [frames, frames[::-1].copy()]
        media = {"videos": [pair[i] for i in order], "video_metadata": [meta] * 5, "do_sample_frames": False}
    inputs = processor(text=[text] * 5, return_tensors="pt", padding=True, **media)
    completion = processor.tokenizer(["A cat", " B", "[00:01] dog", "x y z", "C"], return_tensors="pt",
                                     padding=True, padding_side="right")
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return TokenBatch.from_prompt_completion(inputs["input_ids"], inputs["attention_mask"], completion.input_ids,
                                             completion.attention_mask, **vision)


def _patches_seen(model) -> list[int]:
    """Number of patch rows each vision-tower call received (hook on its patch embedding)."""
    seen: list[int] = []
    embed = next(m for n, m in model.named_modules() if n.endswith("visual.patch_embed"))
    embed.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_same_logprobs_and_gradients_with_fewer_patches(vl_paths, family, kind):
    plain, processor = load_vl_model(vl_paths[family], dtype="float32")
    shared, _ = load_vl_model(vl_paths[family], dtype="float32")
    share_identical_media(shared)
    batch = _group_batch(processor, kind)
    seen_plain, seen_shared = _patches_seen(plain), _patches_seen(shared)

    results = []
    for model in (plain, shared):
        model.train()
        logp = completion_logprobs(model, batch, temperature=0.9)  # [5, C]
        (logp * torch.arange(1, 6)[:, None]).sum().backward()  # rows weighted differently
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "visual" in n}
        results.append((logp.detach(), grads))

    (logp_plain, grads_plain), (logp_shared, grads_shared) = results
    torch.testing.assert_close(logp_shared, logp_plain, rtol=1e-5, atol=1e-5)
    assert grads_plain.keys() == grads_shared.keys() and grads_plain
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_shared[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    rows = batch.pixel_values if kind == "image" else batch.pixel_values_videos
    assert seen_plain == [rows.shape[0]]
    assert seen_shared == [rows.shape[0] * 2 // 5]  # two distinct media out of five rows


def test_all_distinct_media_run_unchanged(vl_paths):
    model, processor = load_vl_model(vl_paths["qwen3_vl"], dtype="float32")
    share_identical_media(share_identical_media(model))  # twice is harmless
    seen = _patches_seen(model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Go."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text] * 2, images=[image(0), image(1)], return_tensors="pt", padding=True)
    with torch.no_grad():
        model(**inputs)
    assert seen == [inputs["pixel_values"].shape[0]]


def test_text_model_is_refused(qwen3_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="no Qwen-VL vision tower"):
        share_identical_media(AutoModelForCausalLM.from_pretrained(qwen3_path))
