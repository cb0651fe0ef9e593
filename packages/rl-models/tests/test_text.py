from __future__ import annotations

import pytest
import torch

from rl_models.text import load_causal_lm


def test_load_causal_lm_generates(qwen3_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32", device="cpu")
    assert not model.training
    assert model.dtype == torch.float32
    enc = tok.apply_chat_template(
        [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is A or B?"}]],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        padding=True,
    )
    assert tok.padding_side == "left"
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 4)
    assert torch.equal(out[:, : enc["input_ids"].shape[1]], enc["input_ids"])


def test_load_causal_lm_bfloat16(qwen3_path):
    model, _ = load_causal_lm(qwen3_path, dtype="bf16")
    assert model.dtype == torch.bfloat16


def test_bad_dtype_names_valid_ones(qwen3_path):
    with pytest.raises(ValueError, match=r"dtype='float8'.*bfloat16"):
        load_causal_lm(qwen3_path, dtype="float8")
