from __future__ import annotations

import pytest
import torch
from helpers import image, video

from rl_models.vl import load_vl_model

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


def _chat(processor, kind: str) -> str:
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe."}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_generate(vl_paths, family):
    model, processor = load_vl_model(vl_paths[family], dtype="float32")
    text = _chat(processor, "image")
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    inputs = processor(text=[text], images=[image()], return_tensors="pt")
    n_pad = (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()
    merge = processor.image_processor.merge_size
    assert n_pad == inputs["image_grid_thw"].prod() // merge**2 > 1
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_video_forward(vl_paths, family):
    model, processor = load_vl_model(vl_paths[family], dtype="float32")
    frames, meta = video(frames=4)
    inputs = processor(
        text=[_chat(processor, "video")],
        videos=[frames],
        video_metadata=[meta],
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert inputs["video_grid_thw"][0, 0].item() == 2  # 4 frames / temporal patch 2
    if family == "qwen3_vl":  # Qwen3-VL writes the source time of each temporal patch
        decoded = processor.tokenizer.decode(inputs["input_ids"][0])
        assert "<0.2 seconds>" in decoded and "<1.2 seconds>" in decoded
    with torch.no_grad():
        logits = model(**inputs).logits  # [1, T, V]
    assert logits.shape[:2] == inputs["input_ids"].shape
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholder_ids_are_the_vision_slots(vl_paths, family):
    from transformers import AutoConfig

    from rl_models.vl import placeholder_ids

    config = AutoConfig.from_pretrained(vl_paths[family])
    ids = placeholder_ids(config)
    assert ids == {config.image_token_id, config.video_token_id, config.vision_start_token_id} and len(ids) == 3
