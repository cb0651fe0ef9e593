from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModel, AutoTokenizer

from rl_models.encoders import compute_text_embeddings, load_clip, load_embedding_model


def test_embedding_loads_with_plain_transformers(embedding_path):
    model = AutoModel.from_pretrained(embedding_path)
    tok = AutoTokenizer.from_pretrained(embedding_path)
    assert model.config.model_type == "bert"
    assert tok("a cat").input_ids[0] == tok.cls_token_id
    assert (embedding_path / "1_Pooling" / "config.json").is_file()


def test_text_embeddings_are_normalized_and_discriminate(embedding_path):
    encoder = load_embedding_model(embedding_path, dtype="float32")
    texts = ["a red circle", "a photo of a cat sitting on a mat", "a red circle"]
    emb = compute_text_embeddings(encoder, texts)
    assert emb.shape == (3, encoder.model.config.hidden_size)
    assert emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    sims = emb @ emb.T  # [3, 3]
    assert sims[0, 2].item() == pytest.approx(1.0, abs=1e-5)
    assert sims[0, 1].item() < 0.999
    # Mean pooling by hand over the unpadded tokens of sentence 1.
    enc = encoder.tokenizer(texts[1], return_tensors="pt")
    hidden = encoder.model(**enc).last_hidden_state[0]  # [T, H]
    manual = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
    torch.testing.assert_close(compute_text_embeddings(encoder, texts, pooling="mean")[1], manual)


def test_bad_pooling_is_named(embedding_path):
    encoder = load_embedding_model(embedding_path)
    with pytest.raises(ValueError, match="pooling='max'"):
        compute_text_embeddings(encoder, ["x"], pooling="max")


def test_clip_scores_image_against_texts(clip_path):
    model, processor = load_clip(clip_path, dtype="float32")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8))
    inputs = processor(
        text=["a photo of a cat", "a red circle"], images=[image], return_tensors="pt", padding=True
    )
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits_per_image.shape == (1, 2)
    image_emb = torch.nn.functional.normalize(out.image_embeds, dim=-1)
    text_emb = torch.nn.functional.normalize(out.text_embeds, dim=-1)
    expected = model.logit_scale.exp() * image_emb @ text_emb.T  # [1, 2]
    torch.testing.assert_close(out.logits_per_image, expected)
    assert out.logits_per_image[0, 0] != out.logits_per_image[0, 1]
