from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from rl_models.logprobs import TokenBatch, completion_logprobs
from rl_models.lora import (
    adapter_tensors,
    add_lora,
    default_target_modules,
    disabled_adapter,
    export_lora,
    full_finetune,
    merge_adapter,
    merge_and_export,
    merged_named_weights,
    reference_completion_logprobs,
    reference_of,
)
from rl_models.text import load_causal_lm
from rl_models.vl import load_vl_model


def _batch(tok) -> TokenBatch:
    prompt = tok(["Caption: a red circle.", "Q?"], return_tensors="pt", padding=True)
    completion = tok(["The answer is A", " B"], return_tensors="pt", padding=True, padding_side="right")
    return TokenBatch.from_prompt_completion(
        prompt.input_ids, prompt.attention_mask, completion.input_ids, completion.attention_mask
    )


def test_fresh_lora_starts_equal_to_base(qwen3_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _batch(tok)
    base = completion_logprobs(model, batch).detach()
    peft_model = add_lora(model, r=4, alpha=8)
    torch.testing.assert_close(completion_logprobs(peft_model, batch), base)


def test_lora_on_changes_off_equals_base(qwen3_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _batch(tok)
    base = completion_logprobs(model, batch).detach()
    peft_model = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    targeted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targeted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    on = completion_logprobs(peft_model, batch).detach()
    assert (on - base).abs().max() > 1e-3
    torch.testing.assert_close(reference_completion_logprobs(peft_model, batch), base)
    with disabled_adapter(peft_model):
        torch.testing.assert_close(completion_logprobs(peft_model, batch), base)
    torch.testing.assert_close(completion_logprobs(peft_model, batch), on)  # re-enabled after


def test_a_fully_fine_tuned_model_keeps_its_starting_weights_as_the_reference(qwen3_path):
    """`full_finetune(reference=True)`: every weight trains, and `reference_of` gives the frozen
    starting weights after an optimizer step moved the model; a LoRA model's reference is itself
    with adapters off; a model built without a reference is refused."""
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _batch(tok)
    base = completion_logprobs(model, batch).detach()
    trained = full_finetune(model, reference=True)
    assert trained is model and all(p.requires_grad for p in model.parameters())
    (-completion_logprobs(model, batch).sum()).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # one optimizer step of every weight
    assert (completion_logprobs(model, batch) - base).abs().max() > 1e-3
    with reference_of(model) as reference:
        assert reference is not model and not any(p.requires_grad for p in reference.parameters())
        torch.testing.assert_close(completion_logprobs(reference, batch), base)
    other, _ = load_causal_lm(qwen3_path, dtype="float32")
    with pytest.raises(ValueError, match=r"trains every weight and kept no reference"), \
            reference_of(full_finetune(other, reference=False)):
        pass
    lora = add_lora(load_causal_lm(qwen3_path, dtype="float32")[0], r=4, alpha=8, init_lora_weights=False)
    with reference_of(lora) as reference:
        assert reference is lora
        torch.testing.assert_close(completion_logprobs(reference, batch), base)


def test_merge_and_export_round_trip(qwen3_path, tmp_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _batch(tok)
    peft_model = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    on = completion_logprobs(peft_model, batch).detach()
    merge_and_export(peft_model, tmp_path / "merged", processor=tok)
    merged, merged_tok = load_causal_lm(tmp_path / "merged", dtype="float32")
    assert not isinstance(merged, PeftModel)
    assert merged_tok.get_vocab() == tok.get_vocab()
    torch.testing.assert_close(completion_logprobs(merged, batch), on, rtol=1e-5, atol=1e-5)
    # The live model is unmerged again: disabling the adapter still gives the base.
    with disabled_adapter(peft_model):
        off = completion_logprobs(peft_model, batch)
    assert (off - on).abs().max() > 1e-3


def test_export_lora_reloads_adapter(qwen3_path, tmp_path):
    model, tok = load_causal_lm(qwen3_path, dtype="float32")
    batch = _batch(tok)
    peft_model = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    on = completion_logprobs(peft_model, batch).detach()
    export_lora(peft_model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    fresh, _ = load_causal_lm(qwen3_path, dtype="float32")
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    torch.testing.assert_close(completion_logprobs(reloaded, batch), on)


def test_vl_lora_targets_language_model_only(vl_paths):
    model, _ = load_vl_model(vl_paths["qwen2_5_vl"], dtype="float32")
    peft_model = add_lora(model, r=2, alpha=4)
    names = [n for n, _ in peft_model.named_parameters() if ".lora_A" in n]
    assert names and all("language_model" in n for n in names)
    assert not any("visual" in n for n in names)


def test_unknown_family_lists_valid():
    with pytest.raises(KeyError, match=r"no default LoRA targets for family 'gpt9'.*qwen3"):
        default_target_modules("gpt9")


def test_merged_named_weights_equal_a_merged_checkpoint_without_touching_the_base(qwen3_path):
    model, _ = load_causal_lm(qwen3_path, dtype="float32")
    peft_model = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    base_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".base_layer." in n}
    pushed = dict(merged_named_weights(peft_model))
    for name, param in peft_model.named_parameters():
        if name in base_before:
            torch.testing.assert_close(param, base_before[name], rtol=0, atol=0, msg=name)  # base untouched
    assert not any(".lora_" in n or "base_layer" in n or n.startswith("base_model.") for n in pushed)
    reference = {n: p.detach().clone() for n, p in peft_model.merge_and_unload().named_parameters()}
    assert set(pushed) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(pushed[name], tensor, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (pushed[q] - base_before[f"base_model.model.{q.removesuffix('.weight')}.base_layer.weight"]).abs().max() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_adapter_merged_over_the_base_equals_the_trainers_merge_bit_for_bit(qwen3_path, dtype):
    """What a Ray actor does with an adapter push: the LoRA alone (a fraction of the merged
    bytes), merged over the checkpoint's weights, gives exactly `merged_named_weights`."""
    base, _ = load_causal_lm(qwen3_path, dtype=dtype)
    checkpoint = {n: p.detach().clone() for n, p in base.named_parameters()}
    peft_model = add_lora(base, r=4, alpha=8, init_lora_weights=False)
    adapter = adapter_tensors(peft_model)
    merged = dict(merge_adapter(checkpoint, adapter))
    expected = dict(merged_named_weights(peft_model))
    assert set(merged) == {n for n in expected if n.endswith("_proj.weight")} and len(merged) == 7 * 2  # 2 layers
    for name, tensor in merged.items():
        assert torch.equal(tensor, expected[name]), name
        assert not torch.equal(tensor, checkpoint[name]), name  # init_lora_weights=False: B is not zero
    assert sum(t.numel() for t in adapter.values()) < sum(expected[n].numel() for n in merged) / 4


def test_an_adapter_push_refuses_what_it_cannot_carry(qwen3_path):
    model, _ = load_causal_lm(qwen3_path, dtype="float32")
    with pytest.raises(ValueError, match="an adapter push needs a LoRA"):
        adapter_tensors(model)
    peft_model = add_lora(model, r=4, alpha=8)
    peft_model.get_base_model().lm_head.weight.requires_grad_(True)  # tied: named as the embedding
    with pytest.raises(ValueError, match=r"but the policy also trains \['model.embed_tokens.weight'\] \(1 tensors\)"):
        adapter_tensors(peft_model)
