from __future__ import annotations

import torch
from helpers import image

from rl_models.janus import load_janus
from rl_models.lora import add_lora


def test_janus_understanding_generates_text(janus_path):
    model, processor = load_janus(janus_path, dtype="float32")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == "<|User|>: <image_placeholder>\nWhat?\n\n<|Assistant|>:"
    inputs = processor(text=[prompt], images=[image()], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image_placeholder>")
    assert (inputs["input_ids"] == image_id).sum() == 16
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)


def test_janus_image_generation_decodes_pixels(janus_path):
    model, processor = load_janus(janus_path, dtype="float32")
    inputs = processor(
        text=['a sign that says "open"'], generation_mode="image", return_tensors="pt"
    )
    torch.manual_seed(0)
    tokens = model.generate(
        **inputs, generation_mode="image", do_sample=True, guidance_scale=5.0
    )  # [1, 16]
    assert tokens.shape == (1, 16)
    assert tokens.min() >= 0 and tokens.max() < model.config.vq_config.num_embeddings
    pixels = model.decode_image_tokens(tokens)
    assert pixels.shape[0] == 1 and 32 in pixels.shape and torch.isfinite(pixels).all()


def test_janus_lora_targets_language_model(janus_path):
    model, _ = load_janus(janus_path, dtype="float32")
    peft_model = add_lora(model, r=2, alpha=4)
    names = [n for n, _ in peft_model.named_parameters() if ".lora_A" in n]
    assert names and all("language_model" in n for n in names)
