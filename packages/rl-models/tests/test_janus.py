from __future__ import annotations

import pytest
import torch
from helpers import image
from transformers.generation.logits_process import ClassifierFreeGuidanceLogitsProcessor

from rl_models.janus import (
    ImageTokenBatch,
    generate_image_tokens,
    image_size,
    image_token_logprobs,
    load_janus,
    num_image_tokens,
    reference_image_token_logprobs,
    unconditional_prompt_ids,
)
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
    tokens = generate_image_tokens(model, **inputs, do_sample=True, guidance_scale=5.0)  # [1, 16]
    assert tokens.shape == (1, 16)
    assert tokens.min() >= 0 and tokens.max() < model.config.vq_config.num_embeddings
    pixels = model.decode_image_tokens(tokens)
    assert pixels.shape[0] == 1 and 32 in pixels.shape and torch.isfinite(pixels).all()


def test_janus_lora_targets_language_model_and_generation_head(janus_path):
    model, _ = load_janus(janus_path, dtype="float32")
    peft_model = add_lora(model, r=2, alpha=4)
    names = [n for n, _ in peft_model.named_parameters() if ".lora_A" in n]
    assert names and all("language_model" in n or "generation_head.proj_out" in n for n in names)
    assert any("generation_head.proj_out" in n for n in names)
    assert not any(tower in n for n in names for tower in ("vision_model", "vqmodel", "vision_head", "aligner"))


# ---------------------------------------------------------------------- image-token log-probs


def _image_batch(model, processor, *, tokens: int = 16, seed: int = 0) -> ImageTokenBatch:
    """Two prompts of different length (the second left-padded) and random image tokens."""
    prompts = ['a sign that says "open"', "red"]
    inputs = processor(text=prompts, generation_mode="image", return_tensors="pt", padding=True)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vq_config.num_embeddings
    images = torch.randint(0, vocab, (2, tokens), generator=generator)  # [B, N]
    return ImageTokenBatch(inputs.input_ids, inputs.attention_mask, images,
                           unconditional_prompt_ids(model, inputs.input_ids))


def _naive(model, batch: ImageTokenBatch, *, scale: float, temperature: float, use_cfg: bool) -> torch.Tensor:
    """Full `[B, N, V]` logits of both rows from the generation head, CFG mixed on the logits
    (transformers' `ClassifierFreeGuidanceLogitsProcessor`), log_softmax, gather."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows = 2 if use_cfg else 1
    ids = torch.cat([batch.prompt_ids, batch.uncond_ids])[: rows * len(batch.prompt_ids)]
    mask = batch.prompt_mask.repeat(rows, 1)
    images = batch.image_ids.repeat(rows, 1)
    embeds = torch.cat([causal.get_input_embeddings()(ids),
                        causal.prepare_embeddings_for_image_generation(images)], dim=1)
    full = torch.cat([mask, torch.ones_like(images)], dim=1)
    hidden = causal.model.language_model(inputs_embeds=embeds, attention_mask=full,
                                         position_ids=(full.cumsum(-1) - 1).clamp_min(0)).last_hidden_state
    p = batch.prompt_ids.shape[1]
    logits = causal.model.generation_head(hidden[:, p - 1 : -1])  # [R, N, V]
    if use_cfg:
        logits = ClassifierFreeGuidanceLogitsProcessor(scale)(batch.image_ids, logits)  # [B, N, V]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch.image_ids[..., None]).squeeze(-1)  # [B, N]


@pytest.mark.parametrize(("use_cfg", "temperature"), [(True, 1.0), (True, 0.7), (False, 1.0)])
def test_image_token_logprobs_equal_naive_and_their_gradient(janus_path, use_cfg, temperature):
    model, processor = load_janus(janus_path, dtype="float32")
    policy = add_lora(model, r=4, alpha=8, init_lora_weights=False)  # random B: LoRA changes the output
    batch = _image_batch(model, processor)
    assert batch.prompt_mask[1, 0] == 0 and (batch.uncond_ids[0, 1:-1] == processor.tokenizer.pad_token_id).all()
    lora = [p for p in policy.parameters() if p.requires_grad]
    got = image_token_logprobs(policy, batch, guidance_scale=5.0, temperature=temperature, use_cfg=use_cfg,
                               chunk_size=5)  # [B, N] over several chunks
    want = _naive(policy, batch, scale=5.0, temperature=temperature, use_cfg=use_cfg)
    assert got.shape == (2, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, got.numel()).reshape(got.shape)  # a loss that weighs every token
    grads = torch.autograd.grad((got * weights).sum(), lora)
    expected = torch.autograd.grad((want * weights).sum(), lora)
    assert all(g.abs().sum() > 0 for g in expected)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4 * float(e.abs().max()))  # float32 rounding


def test_cfg_changes_the_logprobs_and_disabled_adapter_is_the_base(janus_path):
    model, processor = load_janus(janus_path, dtype="float32")
    batch = _image_batch(model, processor)
    with torch.no_grad():
        base = image_token_logprobs(model, batch, guidance_scale=5.0)
        cond = image_token_logprobs(model, batch, guidance_scale=5.0, use_cfg=False)
        scale_one = image_token_logprobs(model, batch, guidance_scale=1.0)
    assert (base - cond).abs().max() > 1e-3  # the unconditional row matters at s = 5
    torch.testing.assert_close(scale_one, cond, rtol=1e-5, atol=1e-5)  # s = 1 is the conditional row
    policy = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    with torch.no_grad():
        tuned = image_token_logprobs(policy, batch, guidance_scale=5.0)
    ref = reference_image_token_logprobs(policy, batch, guidance_scale=5.0)
    assert (tuned - base).abs().max() > 1e-4
    assert torch.equal(ref, base)


def test_image_geometry(janus_path):
    model, _ = load_janus(janus_path, dtype="float32")
    assert (num_image_tokens(model), image_size(model)) == (16, 32)
    pixels = model.decode_image_tokens(torch.zeros(1, 16, dtype=torch.long))  # [1, H, W, 3]
    assert pixels.shape == (1, 32, 32, 3)
