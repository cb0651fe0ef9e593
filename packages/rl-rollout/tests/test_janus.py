"""JanusEngine on the tiny random Janus (rl_models.tiny, real from_pretrained): CFG image-token
sampling, per-sample seeds, log-probs equal to the trainer's teacher-forced ones, and the
same greedy tokens as transformers' `generate(generation_mode="image")`."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rl_models import tiny
from rl_models.janus import JanusImagePolicy, generate_image_tokens, load_janus
from rl_models.lora import add_lora
from rl_rollout import build_image_engine
from rl_rollout.janus import JanusEngine, draw

PROMPTS = ['a sign that says "open"', "red", 'a poster reading "rl"']


@pytest.fixture(scope="module")
def lora_engine() -> JanusEngine:
    """A float32 CPU engine whose model carries random LoRA adapters (B != 0)."""
    model, processor = load_janus(tiny.build("janus"), dtype="float32")
    torch.manual_seed(0)
    add_lora(model, r=4, alpha=8, init_lora_weights=False)
    return JanusEngine(model, processor, device="cpu")


def test_rollout_shapes_and_ranges(lora_engine: JanusEngine) -> None:
    out = lora_engine.sample(PROMPTS, seeds=[1, 2, 3])
    vocab = lora_engine.model.config.vq_config.num_embeddings
    assert out.tokens.image_ids.shape == (3, 16) and out.log_probs.shape == (3, 16)
    assert out.tokens.image_ids.min() >= 0 and out.tokens.image_ids.max() < vocab
    assert out.log_probs.dtype == torch.float32 and bool((out.log_probs < 0).all())
    assert out.images.shape == (3, 3, 32, 32) and 0 <= float(out.images.min()) <= float(out.images.max()) <= 1
    assert out.tokens.prompt_mask[1, 0] == 0  # the short prompt is left-padded
    assert out.seeds == (1, 2, 3) and out.guidance_scale == 5.0


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_first_replay_is_bit_identical_with_lora(lora_engine: JanusEngine, guidance_scale: float) -> None:
    """The trainer's forward (with gradients, through the policy module) over the rows of one
    sampled batch gives exactly the rollout's log-probs: importance ratio 1 in float32."""
    out = lora_engine.sample(PROMPTS, guidance_scale=guidance_scale, temperature=0.9, seeds=[4, 5, 6])
    policy = JanusImagePolicy(lora_engine.model)
    logp = policy(out.tokens, guidance_scale=guidance_scale, temperature=0.9, use_cfg=guidance_scale > 1)
    assert logp.requires_grad
    assert torch.equal(logp.detach(), out.log_probs)
    assert float(torch.exp(logp.detach() - out.log_probs).max()) == 1.0


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_decode_logprobs_equal_teacher_forced(lora_engine: JanusEngine, guidance_scale: float) -> None:
    """The sampling forward's own log-probs (KV cache, one token at a time, the cache read in
    blocks of 8 slots: 32, 40, 48 of 64 for 28 prompt + 16 image tokens) equal the
    teacher-forced recomputation within float32 rounding, with and without CFG."""
    decoding = JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", logprobs="decode", kv_block=8)
    out = decoding.sample(PROMPTS, guidance_scale=guidance_scale, seeds=[7, 8, 9])
    again = lora_engine.sample(PROMPTS, guidance_scale=guidance_scale, seeds=[7, 8, 9])  # "rescore"
    assert torch.equal(out.tokens.image_ids, again.tokens.image_ids)
    torch.testing.assert_close(out.log_probs, again.log_probs, rtol=0, atol=2e-5)
    recomputed = decoding.replay(out.tokens, guidance_scale=guidance_scale, temperature=1.0)  # [B, N]
    torch.testing.assert_close(out.log_probs, recomputed, rtol=0, atol=2e-5)


def test_reading_the_cache_to_the_filled_length_draws_what_the_full_read_does(lora_engine: JanusEngine) -> None:
    """Decode attention bounded to the filled length (blocks of 8) and over the 64-slot cache
    (block 4096: 63 slots, all but the one no token reaches): the same tokens, and the same
    log-probs (the empty slots add exact zeros; bitwise on the CPUs we ran, asserted to 1e-6)."""
    out = {}
    for block in (8, 4096):
        engine = JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", logprobs="decode", kv_block=block)
        out[block] = engine.sample(PROMPTS, seeds=[7, 8, 9])
        assert engine._cache is not None and engine._cache.get_max_length() == 64
    assert torch.equal(out[8].tokens.image_ids, out[4096].tokens.image_ids)
    torch.testing.assert_close(out[8].log_probs, out[4096].log_probs, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="kv_block must be >= 1, got 0"):
        JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", kv_block=0)


def test_a_samples_tokens_depend_on_its_seed_not_the_batch(lora_engine: JanusEngine) -> None:
    together = lora_engine.sample(PROMPTS, seeds=[11, 12, 13])
    alone = lora_engine.sample(PROMPTS[1:2], seeds=[12])
    chunked = JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", max_batch_size=2)
    split = chunked.sample(PROMPTS, seeds=[11, 12, 13])
    assert torch.equal(alone.tokens.image_ids[0], together.tokens.image_ids[1])
    assert torch.equal(split.tokens.image_ids, together.tokens.image_ids)
    other = lora_engine.sample(PROMPTS, seeds=[21, 22, 23])
    assert not torch.equal(other.tokens.image_ids, together.tokens.image_ids)


def test_greedy_limit_matches_transformers_generate() -> None:
    """At a vanishing temperature the engine's draw is the argmax of the CFG logits, so it must
    reproduce `generate(generation_mode="image", do_sample=False, guidance_scale=5)` token for
    token: same unconditional prompt, positions, cache and guidance."""
    engine = build_image_engine("janus", path=str(tiny.build("janus")), dtype="float32", device="cpu", kv_block=8)
    assert isinstance(engine, JanusEngine)
    prompt = PROMPTS[0]
    text = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": prompt}]}], add_generation_prompt=True)
    inputs = engine.processor(text=[text], generation_mode="image", return_tensors="pt")
    reference = generate_image_tokens(engine.model, **inputs, do_sample=False, guidance_scale=5.0)  # [1, 16]
    ours = engine.sample([prompt], guidance_scale=5.0, temperature=1e-4, seeds=[0])
    assert torch.equal(ours.tokens.prompt_ids.cpu(), inputs["input_ids"])
    assert torch.equal(ours.tokens.image_ids.cpu(), reference)
    pixels = engine.model.decode_image_tokens(reference)  # [1, H, W, 3] in [-1, 1]
    torch.testing.assert_close(ours.images, ((pixels.clamp(-1, 1) + 1) / 2).permute(0, 3, 1, 2))


def test_draw_is_an_inverse_cdf_draw() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.0, 0.25, 0.25]]))  # token 1 has probability 0
    picks = [int(draw(logits, torch.tensor([u]), 1.0)[0]) for u in (0.0, 0.49, 0.5, 0.74, 0.75, 0.999)]
    assert picks == [0, 0, 2, 2, 3, 3]
    _, logp = draw(logits, torch.tensor([0.6]), 1.0)
    torch.testing.assert_close(logp, torch.log(torch.tensor([0.25])))
    sharp, _ = draw(torch.tensor([[1.0, 1.2, 0.0]]), torch.tensor([0.99]), 1e-4)  # T -> 0: the argmax
    assert int(sharp) == 1


@pytest.mark.slow
def test_compiled_decode_step_draws_the_same_tokens(lora_engine: JanusEngine) -> None:
    """The compiled step (inductor on CPU; CUDA adds graphs) samples what the eager one does,
    reading the cache in blocks of 8: three lengths (32, 40, 48), one compiled graph."""
    compiled = JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", compile=True,
                           compile_mode="default", logprobs="decode", kv_block=8)
    eager = JanusEngine(lora_engine.model, lora_engine.processor, device="cpu", logprobs="decode")
    graphs = counters["stats"]["unique_graphs"]
    a, b = compiled.sample(PROMPTS, seeds=[1, 2, 3]), eager.sample(PROMPTS, seeds=[1, 2, 3])
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert torch.equal(a.tokens.image_ids, b.tokens.image_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-4)
    again = compiled.sample(PROMPTS, seeds=[1, 2, 3])  # the cache is reused, nothing recompiles
    assert torch.equal(again.tokens.image_ids, a.tokens.image_ids)
    assert counters["stats"]["unique_graphs"] == graphs + 1
